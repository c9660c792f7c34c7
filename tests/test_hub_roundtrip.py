"""Round trip: bake the default preset -> publish (CLI) -> fresh cache -> load_from_hub by branch, tag and
commit -> identical files and identical decode steps on the CPU; then an offline reload from the HF cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from megabake.hub import PublishRefusedError, fetch_package, load_from_hub, publish
from megabake.hub.commands import publish as publish_cmd
from megabake.package import read_package


REPO = "my-org/tiny-llama-megabake"
TOKEN = "hf_fake_token"
REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENS = [5, 17, 301, 42]


@pytest.fixture(scope="module")
def baked(tmp_path_factory):
    """The default preset baked once per module (CPU: compiled for sm_90a, not run -> status unverified)."""
    from megabake.baking import bake
    from megabake.presets import DEFAULT_PRESET

    result = bake(DEFAULT_PRESET, out=tmp_path_factory.mktemp("packages"), run_on_gpu=False)
    return read_package(result.path)


def _steps(decoder) -> list[list[float]]:
    """Logits (rounded) of a few decode steps: the same package must decode identically."""
    out = []
    for position, token in enumerate(TOKENS):
        logits = decoder.step(torch.tensor([token]), position)
        out.append([round(float(x), 5) for x in logits[0, :8]] + [int(logits[0].argmax())])
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_bake_publish_load_round_trip(hub_server, baked, tmp_path):
    assert baked.status == "unverified" and baked.report["model"]["weights"] == "random"
    with pytest.raises(PublishRefusedError) as err:  # CPU bake: unverified, random weights
        publish([baked.path], REPO, endpoint=hub_server.url, token=TOKEN)
    assert "--allow-unverified" in str(err.value) and "--allow-random-weights" in str(err.value)

    run = CliRunner().invoke(publish_cmd, [str(baked.path), "--repo", REPO, "--endpoint", hub_server.url,
                                           "--token", TOKEN, "--allow-unverified", "--allow-random-weights"])
    assert run.exit_code == 0, run.output
    commit = hub_server.head(REPO)
    tag = f"megabake--tiny-llama.random-seed0.{baked.report['variant']}"
    assert hub_server.refs(REPO)["tags"] == {tag: commit}

    common = dict(endpoint=hub_server.url, token=TOKEN, device="cpu", allow_unverified=True)
    loaded = {}
    for name, revision, trust in (("branch", "main", True), ("tag", tag, True), ("commit", commit, False)):
        cache = tmp_path / f"cache-{name}"  # a fresh, empty HF cache each time
        fetched = fetch_package(REPO, revision, endpoint=hub_server.url, token=TOKEN, cache_dir=cache,
                                allow_unverified=True)
        assert fetched.commit == commit
        assert _files(fetched.path) == _files(baked.path)
        decoder = load_from_hub(REPO, revision, cache_dir=cache, trust_remote_code=trust, **common)
        loaded[name] = _steps(decoder)
    assert loaded["branch"] == loaded["tag"] == loaded["commit"]

    # offline: a new process with HF_HUB_OFFLINE=1 reloads from the cache without touching the server
    hub_server.clear_requests()
    script = textwrap.dedent(f"""
        import json, torch
        from megabake.hub import load_from_hub
        dec = load_from_hub({REPO!r}, "main", cache_dir={str(tmp_path / 'cache-branch')!r}, device="cpu",
                            trust_remote_code=True, allow_unverified=True, endpoint={hub_server.url!r})
        out = []
        for position, token in enumerate({TOKENS!r}):
            logits = dec.step(torch.tensor([token]), position)
            out.append([round(float(x), 5) for x in logits[0, :8]] + [int(logits[0].argmax())])
        print(json.dumps(out))
    """)
    pythonpath = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == loaded["branch"]
    assert hub_server.requests == []
