"""docs/ERRORS.md, backed row by row: every bad input listed there (CLI and Python API) is a case here, run on
the CPU, and must give exactly the exit code (or exception class) and the message the table shows.

CLI rows also check the error style: MegaBake's own errors are ``error: <message>`` on stderr, click's usage
errors keep click's ``Error: ...`` form and exit 2, never a traceback, and nothing is written where the
input was refused. No case bakes (a bake takes ~20 s here); API rows that need a decoder share one tiny-llama
reference decoder (capacity 32, vocab 1024).

After changing a message on purpose, regenerate the table and review the diff:
    MEGABAKE_WRITE_ERRORS_TABLE=1 python3 -m pytest -q tests/test_errors_table.py -k current
"""

from __future__ import annotations

import inspect
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

import megabake
from megabake.cli import cli
from megabake.errors import EXIT_CANNOT_RUN, EXIT_FAILED, EXIT_USAGE
from tests.fixtures_packages import write_fixture_package

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ERRORS.md"
START, END = "<!-- errors-table:start -->", "<!-- errors-table:end -->"
WRITE = os.environ.get("MEGABAKE_WRITE_ERRORS_TABLE") == "1"
VARIANT = "megabake--tiny-llama/random-seed0/decode-b1-c128-sm90a-132sm-p8644386a"


@dataclass(frozen=True)
class Case:
    id: str
    expect: int | str  # CLI: the exit code; API: the exception class name
    cli: tuple[str, ...] | None = None  # argv after `megabake`; <tmp>, <pkg>, ... are placeholders (Tree)
    api: Callable | None = None  # fn(tree) -> the call that must raise
    shown: str | None = None  # the input as the table shows it (API rows)
    no_gpu: bool = False  # holds only on a machine without a CUDA GPU

    @property
    def input(self) -> str:
        return self.shown if self.cli is None else " ".join(["megabake", *map(_quote, self.cli)])


def C(id: str, expect: int, *argv: str, no_gpu: bool = False) -> Case:  # noqa: N802  (a table row)
    return Case(id, expect, cli=argv, no_gpu=no_gpu)


def A(id: str, expect: str, shown: str, call: Callable, no_gpu: bool = False) -> Case:  # noqa: N802
    return Case(id, expect, api=call, shown=shown, no_gpu=no_gpu)


def _quote(arg: str) -> str:
    """Shell quoting that leaves the <placeholders> readable."""
    return arg if re.fullmatch(r"[\w@%+=:,./<>-]+", arg) else shlex.quote(arg)


USAGE, FAILED, CANNOT = EXIT_USAGE, EXIT_FAILED, EXIT_CANNOT_RUN
MATRIX = ("--matrix", "<repo>/registry/bake-matrix.json")


def _api(name: str):
    """megabake.<name>, the public function (no submodule shares its name, see tests/test_bake_cli.py)."""
    value = getattr(megabake, name)
    assert not inspect.ismodule(value), name
    return value


def _decoder(tree):
    return tree.decoder()


CASES = [
    # ---------------------------------------------------------------------------------------- bake: numbers
    C("bake-seed-negative", USAGE, "bake", "--seed", "-1"),
    C("bake-seed-too-big", USAGE, "bake", "--seed", "99999999999999999999"),
    C("bake-seed-not-int", USAGE, "bake", "--seed", "abc"),
    C("bake-batch-zero", USAGE, "bake", "--batch", "0"),
    C("bake-batch-too-big", USAGE, "bake", "--batch", "65"),
    C("bake-capacity-one", USAGE, "bake", "--capacity", "1"),
    C("bake-capacity-too-big", USAGE, "bake", "--capacity", "2000000"),
    C("bake-steps-zero", USAGE, "bake", "--steps", "0"),
    C("bake-steps-over-capacity", USAGE, "bake", "--steps", "200"),
    C("bake-steps-small-bucket", USAGE, "bake", "--capacity", "8", "--steps", "5"),
    C("bake-threads", USAGE, "bake", "--threads", "100"),
    # -------------------------------------------------------------------------------- bake: model and flags
    C("bake-model-bad-id", USAGE, "bake", "--model", "no/such/model"),
    C("bake-model-empty", USAGE, "bake", "--model", ""),
    C("bake-model-missing-folder", USAGE, "bake", "--model", "./no-such-folder"),
    C("bake-model-missing-gguf", USAGE, "bake", "--model", "<tmp>/missing.gguf"),
    C("bake-revision-preset", USAGE, "bake", "--model", "tiny-llama", "--revision", "main"),
    C("bake-revision-local", USAGE, "bake", "--model", "<empty>", "--revision", "main"),
    C("bake-tiling-form", USAGE, "bake", "--tiling", "2x"),
    C("bake-tiling-balanced-empty", USAGE, "bake", "--tiling", "balanced:"),
    C("bake-tiling-flag", USAGE, "bake", "--tiling", "2x4+fast"),
    C("bake-tiling-range", USAGE, "bake", "--tiling", "0x4"),
    C("bake-tiling-ring-pipeline", USAGE, "bake", "--tiling", "2x4+pipeline+ring4"),
    C("bake-tiling-autotune", USAGE, "bake", "--tiling", "2x4", "--autotune"),
    C("bake-preload-autotune", USAGE, "bake", "--attention-preload", "--autotune"),
    C("bake-window-preload", FAILED, "bake", "--no-gpu", "--model", "tiny-mistral", "--attention-preload"),
    C("bake-autotune-no-gpu", USAGE, "bake", "--autotune", "--no-gpu"),
    C("bake-autotune-cpu", CANNOT, "bake", "--autotune", no_gpu=True),
    C("bake-gpu-class-form", USAGE, "bake", "--gpu-class", "h200"),
    C("bake-gpu-class-zero-sms", USAGE, "bake", "--gpu-class", "sm90a-0sm"),
    C("bake-gpu-class-too-many-sms", USAGE, "bake", "--gpu-class", "sm90a-5000sm"),
    # ------------------------------------------------------------------------------------------- bake: --out
    C("bake-out-proc", USAGE, "bake", "--no-gpu", "--out", "/proc/x"),
    C("bake-out-file", USAGE, "bake", "--no-gpu", "--out", "<file>"),
    C("bake-out-under-file", USAGE, "bake", "--no-gpu", "--out", "<file>/sub"),
    # ------------------------------------------------------------------------------------------------ verify
    C("verify-missing", USAGE, "verify", "<tmp>/nope"),
    C("verify-not-a-package", USAGE, "verify", "<empty>"),
    C("verify-steps-zero", USAGE, "verify", "<pkg>", "--steps", "0"),
    C("verify-steps-word", USAGE, "verify", "<pkg>", "--steps", "ten"),
    C("verify-steps-over-capacity", USAGE, "verify", "<pkg>", "--steps", "500"),
    C("verify-prefill-zero", USAGE, "verify", "<pkg>", "--prefill", "0"),
    C("verify-prefill-over-capacity", USAGE, "verify", "<pkg>", "--prefill", "128"),
    C("verify-samples-zero", USAGE, "verify", "<pkg>", "--samples", "0"),
    C("verify-samples-too-many", USAGE, "verify", "<pkg>", "--samples", "1000000"),
    C("verify-baseline", USAGE, "verify", "<pkg>", "--baselines", "bogus"),
    C("verify-device", USAGE, "verify", "<pkg>", "--device", "tpu"),
    C("verify-tampered", FAILED, "verify", "<tampered>"),
    C("verify-no-gpu", CANNOT, "verify", "<pkg>", no_gpu=True),
    # ----------------------------------------------------------------------------------------------- inspect
    C("inspect-missing", USAGE, "inspect", "<tmp>/nope"),
    C("inspect-not-a-package", USAGE, "inspect", "<empty>"),
    C("inspect-tampered", FAILED, "inspect", "<tampered>"),
    # ------------------------------------------------------------------------------------------- publish, ls
    C("publish-missing", USAGE, "publish", "<tmp>/nope", "--repo", "acme/x"),
    C("publish-no-package", USAGE, "publish", "<empty>", "--repo", "acme/x"),
    C("publish-no-repo", USAGE, "publish", "<pkg>"),
    C("publish-repo-space", USAGE, "publish", "<pkg>", "--repo", "bad id"),
    C("publish-repo-no-org", USAGE, "publish", "<pkg>", "--repo", "SmolLM-megabake"),
    C("publish-repo-double-dash", USAGE, "publish", "<pkg>", "--repo", "acme/x--y"),
    C("publish-parent-commit", USAGE, "publish", "<pkg>", "--repo", "acme/x", "--parent-commit", "abc123"),
    C("publish-endpoint", USAGE, "publish", "<pkg>", "--repo", "acme/x", "--endpoint", "ftp://hub"),
    C("publish-branch-empty", USAGE, "publish", "<pkg>", "--repo", "acme/x", "--branch", ""),
    C("publish-random-weights", FAILED, "publish", "<pkg>", "--repo", "acme/x", "--endpoint", "http://127.0.0.1:9"),
    C("ls-repo", USAGE, "ls", "--repo", "not a repo"),
    C("ls-bad-index", FAILED, "ls", "--root", "<empty>", "--registry", "<index>"),
    # ---------------------------------------------------------------------------------------------- registry
    C("registry-build-missing", USAGE, "registry", "build", "--packages", "<tmp>/nope", "--out", "<tmp>/reg"),
    C("registry-build-out", USAGE, "registry", "build", "--packages", "<pkgs>", "--out", "/proc/x"),
    C("registry-build-hub-repo", USAGE, "registry", "build", "--packages", "<pkgs>", "--out", "<tmp>/reg",
      "--hub-repo", "a b"),
    C("registry-build-tampered", FAILED, "registry", "build", "--packages", "<bad>", "--out", "<tmp>/reg-bad"),
    C("registry-matrix-model", USAGE, "registry", "matrix", *MATRIX, "--models", "nope"),
    C("registry-matrix-bucket", USAGE, "registry", "matrix", *MATRIX, "--buckets", "b0-c1"),
    C("registry-matrix-missing", USAGE, "registry", "matrix", "--matrix", "<tmp>/nope.json"),
    C("registry-matrix-output", USAGE, "registry", "matrix", *MATRIX, "--github-output", "<tmp>/no/dir/out"),
    # -------------------------------------------------------------------------------------------------- lock
    C("lock-repo-form", USAGE, "lock", "bad repo"),
    C("lock-rev-empty", USAGE, "lock", "acme/x@"),
    C("lock-repo-twice", USAGE, "lock", "acme/x", "acme/x@v1"),
    C("lock-bucket", USAGE, "lock", "acme/x", "--bucket", "b0-x"),
    C("lock-gpu-class", USAGE, "lock", "acme/x", "--gpu-class", "h200"),
    C("lock-model-revision", USAGE, "lock", "acme/x", "--model-revision", "main"),
    C("lock-endpoint", USAGE, "lock", "acme/x", "--endpoint", "ftp://hub"),
    C("lock-out-not-a-lock", USAGE, "lock", "acme/x", "--out", "<file>"),
    C("lock-out-folder", USAGE, "lock", "acme/x", "--out", "<empty>"),
    C("lock-out-no-folder", USAGE, "lock", "acme/x", "--out", "<tmp>/no/dir/megabake.lock"),
    C("lock-hub-unreachable", FAILED, "lock", "acme/x", "--endpoint", "http://127.0.0.1:9", "--out",
      "<tmp>/megabake.lock"),
    # --------------------------------------------------------------------------------------------------- run
    C("run-no-prompt", USAGE, "run", "<pkg>"),
    C("run-both-prompts", USAGE, "run", "<pkg>", "--prompt", "hi", "--prompt-ids", "1"),
    C("run-prompt-empty", USAGE, "run", "<pkg>", "--prompt", " "),
    C("run-prompt-ids-form", USAGE, "run", "<pkg>", "--prompt-ids", "1,x"),
    C("run-chat-prompt-ids", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--chat"),
    C("run-stop-prompt-ids", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--stop", "x"),
    C("run-stop-empty", USAGE, "run", "<pkg>", "--prompt", "hi", "--stop", ""),
    C("run-chat-no-tokenizer", USAGE, "run", "<pkg>", "--prompt", "hi", "--chat"),
    C("run-prompt-no-tokenizer", USAGE, "run", "<pkg>", "--prompt", "hi"),
    C("run-max-new-tokens-zero", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--max-new-tokens", "0"),
    C("run-max-new-tokens-over-capacity", USAGE, "run", "<pkg>", "--prompt-ids", "1,2,3", "--max-new-tokens", "200"),
    C("run-temperature-greedy", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--temperature", "0.5"),
    C("run-temperature-zero", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--do-sample", "--temperature", "0"),
    C("run-top-p", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--do-sample", "--top-p", "1.5"),
    C("run-device", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--device", "tpu"),
    C("run-device-cuda", CANNOT, "run", "<pkg>", "--prompt-ids", "1", "--device", "cuda", no_gpu=True),
    C("run-missing", USAGE, "run", "<tmp>/nope", "--prompt-ids", "1"),
    C("run-not-a-package", USAGE, "run", "<empty>", "--prompt-ids", "1"),
    C("run-file", USAGE, "run", "<file>", "--prompt-ids", "1"),
    C("run-bad-repo-id", USAGE, "run", "no/such/model", "--prompt-ids", "1"),
    C("run-revision-local", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--revision", "main"),
    C("run-model-path-preset", USAGE, "run", "<pkg>", "--prompt-ids", "1", "--model-path", "<tmp>"),
    C("run-endpoint", USAGE, "run", "acme/x", "--prompt-ids", "1", "--endpoint", "ftp://hub"),
    C("run-tampered", FAILED, "run", "<tampered>", "--prompt-ids", "1"),
    C("unknown-command", USAGE, "nosuch"),
    C("unknown-option", USAGE, "bake", "--no-such-option"),
    # ------------------------------------------------------------------------------- Python API: the decoder
    A("api-step-token-too-big", "InputError", "decoder.step([1024], 0)", lambda t: _decoder(t).step([1024], 0)),
    A("api-step-token-negative", "InputError", "decoder.step([-1], 0)", lambda t: _decoder(t).step([-1], 0)),
    A("api-step-position-full", "InputError", "decoder.step([1], 32)", lambda t: _decoder(t).step([1], 32)),
    A("api-step-position-negative", "InputError", "decoder.step([1], -1)", lambda t: _decoder(t).step([1], -1)),
    A("api-step-position-float", "InputError", "decoder.step([1], 1.5)", lambda t: _decoder(t).step([1], 1.5)),
    A("api-step-batch", "InputError", "decoder.step([1, 2], 0)", lambda t: _decoder(t).step([1, 2], 0)),
    A("api-step-empty", "InputError", "decoder.step([], 0)", lambda t: _decoder(t).step([], 0)),
    A("api-step-token-float", "InputError", "decoder.step(torch.tensor([1.0]), 0)",
      lambda t: _decoder(t).step(__import__("torch").tensor([1.0]), 0)),
    A("api-step-token-str", "InputError", "decoder.step(['7'], 0)", lambda t: _decoder(t).step(["7"], 0)),
    A("api-greedy-count", "InputError", "decoder.greedy_tokens([1], 0, 0)",
      lambda t: _decoder(t).greedy_tokens([1], 0, 0)),
    A("api-generate-sync-every", "InputError", "decoder.generate([1, 2], sync_every=0)",
      lambda t: _decoder(t).generate([1, 2], sync_every=0)),
    A("api-prefill-empty", "InputError", "decoder.prefill([])", lambda t: _decoder(t).prefill([])),
    A("api-prefill-token", "InputError", "decoder.prefill([1024])", lambda t: _decoder(t).prefill([1024])),
    A("api-prefill-too-long", "InputError", "decoder.prefill(list(range(1, 40)))",
      lambda t: _decoder(t).prefill(list(range(1, 40)))),
    A("api-generate-zero", "InputError", "decoder.generate([1, 2], max_new_tokens=0)",
      lambda t: _decoder(t).generate([1, 2], max_new_tokens=0)),
    A("api-generate-too-long", "InputError", "decoder.generate([1, 2], max_new_tokens=40)",
      lambda t: _decoder(t).generate([1, 2], max_new_tokens=40)),
    A("api-decoder-backend", "InputError", "MegakernelDecoder(plan, source, model, backend='bogus')",
      lambda t: t.new_decoder(backend="bogus")),
    A("api-decoder-cuda", "DeviceError", "MegakernelDecoder(plan, source, model, device='cuda')",
      lambda t: t.new_decoder(device="cuda"), no_gpu=True),
    A("api-decoder-from-package", "MegaBakeError", "MegakernelDecoder.from_package('<tmp>/nope')",
      lambda t: __import__("megabake.runtime").runtime.MegakernelDecoder.from_package(t.tmp / "nope")),
    # ---------------------------------------------------------------------- Python API: bake, verify, publish
    A("api-bake-model", "MegaBakeError", "megabake.bake('no/such/model', out='<tmp>/api')",
      lambda t: _api("bake")("no/such/model", out=t.tmp / "api")),
    A("api-bake-batch", "MegaBakeError", "megabake.bake('tiny-llama', batch=0, out='<tmp>/api')",
      lambda t: _api("bake")("tiny-llama", batch=0, out=t.tmp / "api")),
    A("api-bake-tiling", "PlanError", "megabake.bake('tiny-llama', tiling='2x', out='<tmp>/api')",
      lambda t: _api("bake")("tiny-llama", tiling="2x", out=t.tmp / "api")),
    A("api-bake-gpu-class", "MegaBakeError",
      "megabake.bake('tiny-llama', gpu_class='h200', run_on_gpu=False, out='<tmp>/api')",
      lambda t: _api("bake")("tiny-llama", gpu_class="h200", run_on_gpu=False, out=t.tmp / "api")),
    A("api-bake-revision", "MegaBakeError",
      "megabake.bake('tiny-llama', revision='main', run_on_gpu=False, out='<tmp>/api')",
      lambda t: _api("bake")("tiny-llama", revision="main", run_on_gpu=False, out=t.tmp / "api")),
    A("api-preset", "KeyError", "megabake.presets.get_preset('tiny-lama')",
      lambda t: __import__("megabake.presets").presets.get_preset("tiny-lama")),
    A("api-read-package", "PackageError", "megabake.package.read_package('<empty>')",
      lambda t: __import__("megabake.package").package.read_package(t.empty)),
    A("api-backend-fallback", "InputError", "megabake.make_backend(fallback='bogus')",
      lambda t: _api("make_backend")(fallback="bogus")),
    A("api-backend-other", "InputError", "megabake.make_backend(other='tvm')",
      lambda t: _api("make_backend")(other="tvm")),
    A("api-backend-capacity", "InputError", "megabake.make_backend(capacity=1)",
      lambda t: _api("make_backend")(capacity=1)),
    A("api-load-lock-missing", "LockFileError", "megabake.load_from_hub('acme/x', lockfile='<tmp>/nope.lock')",
      lambda t: _api("load_from_hub")("acme/x", lockfile=t.tmp / "nope.lock")),
    A("api-load-lock-not-json", "LockFileError", "megabake.load_from_hub('acme/x', lockfile='<index>')",
      lambda t: _api("load_from_hub")("acme/x", lockfile=t.index)),
    A("api-verify-not-a-package", "PackageError", "megabake.verify('<empty>')",
      lambda t: _api("verify")(t.empty)),
    A("api-verify-tampered", "DigestMismatchError", "megabake.verify('<tampered>')",
      lambda t: _api("verify")(t.tampered)),
    A("api-verify-no-gpu", "DeviceError", "megabake.verify('<pkg>')", lambda t: _api("verify")(t.pkg),
      no_gpu=True),
    A("api-verify-decoder-steps", "InputError",
      "megabake.verification.api.verify_decoder(decoder, report, steps=1000, prefill=4, timings=False)",
      lambda t: __import__("megabake.verification.api").verification.api.verify_decoder(
          _decoder(t), {}, steps=1000, prefill=4, timings=False)),
    A("api-verify-decoder-prefill", "InputError",
      "megabake.verification.api.verify_decoder(decoder, report, steps=2, prefill=0, timings=False)",
      lambda t: __import__("megabake.verification.api").verification.api.verify_decoder(
          _decoder(t), {}, steps=2, prefill=0, timings=False)),
    A("api-publish-nothing", "PublishRefusedError", "megabake.publish([], 'acme/x')",
      lambda t: _api("publish")([], "acme/x")),
]


class Tree:
    """The folders the cases point at, made once per module (placeholders in argv and messages)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.pkgs = tmp / "pkgs"
        self.pkg = write_fixture_package(self.pkgs)  # verified, random weights, capacity 128
        self.bad = tmp / "bad"
        self.tampered = write_fixture_package(self.bad)
        (self.tampered / "module.py").write_text("tampered\n")
        self.empty = tmp / "empty"
        self.empty.mkdir()
        self.file = tmp / "file.txt"
        self.file.write_text("not a folder\n")
        self.index = tmp / "index.json"
        self.index.write_text("{not json")
        self.cwd = tmp / "cwd"  # commands run here; a refused bake must leave it empty
        self.cwd.mkdir()
        self._compiled = None
        # longest first, so <pkg> wins over <tmp>
        self.names = {"<pkg>": self.pkg, "<tampered>": self.tampered, "<pkgs>": self.pkgs, "<bad>": self.bad,
                      "<empty>": self.empty, "<file>": self.file, "<index>": self.index, "<tmp>": tmp,
                      "<repo>": REPO}

    def expand(self, arg: str) -> str:
        for name, path in self.names.items():
            arg = arg.replace(name, str(path))
        return arg

    def normalize(self, text: str) -> str:
        for name, path in sorted(self.names.items(), key=lambda item: -len(str(item[1]))):
            text = text.replace(str(path), name)
        return re.sub(r"torch [^\s,]+, built for CUDA [^\s)]+", "torch <version>, built for CUDA <version>", text)

    def compiled(self):
        if self._compiled is None:
            from tests.compiler_fixtures import compile_preset

            self._compiled = compile_preset("tiny-llama", capacity=32)
        return self._compiled

    def new_decoder(self, **kwargs):
        from megabake.runtime import MegakernelDecoder

        tiny = self.compiled()
        kwargs.setdefault("device", "cpu")
        return MegakernelDecoder(tiny.plan, tiny.generated.source, tiny.model, **kwargs)

    def decoder(self):
        if not hasattr(self, "_decoder"):
            self._decoder = self.new_decoder()
        return self._decoder


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return Tree(tmp_path_factory.mktemp("errors"))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_case(case: Case, tree: Tree) -> tuple[str, str]:
    """(exit code or exception class, the message as the table shows it: placeholders, lines joined by \\n)."""
    if case.cli is not None:
        cwd = os.getcwd()
        os.chdir(tree.cwd)
        try:
            result = CliRunner().invoke(cli, [tree.expand(a) for a in case.cli])
        finally:
            os.chdir(cwd)
        stderr = result.stderr
        assert "Traceback" not in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        lines = stderr.splitlines()
        first = next((i for i, line in enumerate(lines) if line.startswith(("error: ", "Error: "))), None)
        assert first is not None, f"no error line on stderr: {stderr!r}"
        if lines[first].startswith("Error: "):  # click's own usage error: `Usage: ...` then one Error line
            assert result.exit_code == EXIT_USAGE and "Usage:" in stderr and first == len(lines) - 1, stderr
        assert not any(tree.cwd.iterdir()), f"{case.id} wrote {list(tree.cwd.iterdir())}"
        return str(result.exit_code), tree.normalize("\n".join(lines[first:]).rstrip())
    with pytest.raises(Exception) as info:
        case.api(tree)
    exc = info.value
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    assert not (tree.tmp / "api").exists(), f"{case.id} wrote {tree.tmp / 'api'}"
    return type(exc).__name__, tree.normalize(message)


# ---------------------------------------------------------------------------------------------- the table


def _cell(text: str) -> str:
    """A markdown table cell of code spans, one per line (double backticks: messages hold single ones)."""
    return "<br>".join(f"`` {line.replace('|', '&#124;')} ``" for line in text.splitlines() or [""])


def _uncell(cell: str) -> str:
    lines = []
    for part in cell.strip().split("<br>"):
        part = part.strip()
        assert part.startswith("`` ") and part.endswith(" ``"), part
        lines.append(part[3:-3].replace("&#124;", "|"))
    return "\n".join(lines)


def render(results: dict[str, tuple[str, str]]) -> str:
    rows = ["| id | input | exit code / raises | error (exact) |", "|---|---|---|---|"]
    for case in CASES:
        outcome, message = results[case.id]
        rows.append(f"| {case.id} | {_cell(case.input)} | {outcome} | {_cell(message)} |")
    return "\n".join(rows)


def doc_rows() -> dict[str, tuple[str, str, str]]:
    """id -> (input, outcome, message) from docs/ERRORS.md."""
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index(START) + len(START):text.index(END)]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = line.strip().strip("|").split(" | ")
        assert len(cells) == 4, line
        rows[cells[0].strip()] = (_uncell(cells[1]), cells[2].strip(), _uncell(cells[3]))
    return rows


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_the_documented_error(case, tree):
    if WRITE:
        pytest.skip("writing docs/ERRORS.md (test_table_is_current)")
    if case.no_gpu and _has_cuda():
        pytest.skip("the row describes a machine without a CUDA GPU")
    outcome, message = run_case(case, tree)
    assert outcome == str(case.expect), (outcome, message)
    if case.cli is not None and message.startswith("error: "):
        assert outcome in {str(USAGE), str(FAILED), str(CANNOT)}
    row = doc_rows().get(case.id)
    assert row is not None, f"docs/ERRORS.md has no row {case.id}; regenerate it (see this module's doc)"
    assert row == (case.input, outcome, message), "docs/ERRORS.md disagrees; regenerate it (see module doc)"


def test_table_is_current(tree):
    """Every documented row is a case here (and, with MEGABAKE_WRITE_ERRORS_TABLE=1, rewrite the table)."""
    if WRITE:
        results = {case.id: run_case(case, tree) for case in CASES}
        text = DOC.read_text(encoding="utf-8")
        head, tail = text[:text.index(START) + len(START)], text[text.index(END):]
        DOC.write_text(f"{head}\n{render(results)}\n{tail}", encoding="utf-8")
    rows = doc_rows()
    assert list(rows) == [case.id for case in CASES]
    assert len(rows) >= 30
    cli_rows = [c for c in CASES if c.cli is not None]
    assert len(cli_rows) >= 30 and len(CASES) - len(cli_rows) >= 10
    for outcome in (str(USAGE), str(FAILED), str(CANNOT)):
        assert any(row[1] == outcome for row in rows.values()), outcome


def test_exit_codes_are_in_every_help():
    runner = CliRunner()
    commands = [[], ["bake"], ["verify"], ["publish"], ["inspect"], ["ls"], ["registry"], ["registry", "build"],
                ["registry", "matrix"], ["lock"], ["run"]]
    for words in commands:
        out = runner.invoke(cli, [*words, "--help"], terminal_width=200).output
        assert "Exit codes" in out, words
        for code in ("0", "1", "2", "3"):
            assert re.search(rf"^\s+{code}\s+\S", out, re.M), (words, code)


def test_readme_documents_the_exit_codes():
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## Commands", 1)[1].split("\n## ", 1)[0]
    for text in ("Exit codes", "0", "1", "2", "3", "docs/ERRORS.md"):
        assert text in section


def test_largest_seed_builds_the_preset():
    from megabake.cli import MAX_SEED
    from megabake.presets import get_preset

    assert MAX_SEED == 2**63 - 1
    get_preset("tiny-llama").build_model(seed=MAX_SEED)  # seed + 1 still fits torch's generator


def test_out_check_creates_nothing_when_refused(tmp_path):
    from megabake.errors import InputError, check_out_dir, remove_created

    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is not a directory"):
        check_out_dir(tmp_path / "file" / "a" / "b")
    created = check_out_dir(tmp_path / "new" / "deeper")
    assert created == [tmp_path / "new" / "deeper", tmp_path / "new"] and (tmp_path / "new" / "deeper").is_dir()
    assert list((tmp_path / "new" / "deeper").iterdir()) == []  # the probe file is gone
    remove_created(created)
    assert not (tmp_path / "new").exists()
