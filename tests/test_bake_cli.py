"""`megabake bake` end to end on the CPU: the default preset bakes into a valid package in under 2 minutes."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megabake.package import read_package


def test_bake_default_preset_on_cpu(tmp_path):
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megabake.cli", "bake", "--out", str(tmp_path), "--no-gpu"],
                          capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 120, f"bake took {elapsed:.0f} s on this machine"
    path = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"megabake--tiny-llama/random-seed0/decode-b1-c128-sm90a-132sm-p[0-9a-f]{8}$", path)
    assert "CuTe DSL compile check for sm_90a" in proc.stderr  # progress is shown
    package = read_package(path)  # digests and schemas are checked on read
    report = package.report
    assert report["status"] == "unverified"
    assert any("no Hopper GPU" in reason for reason in report["status_reasons"])
    assert report["kernel"]["compile_check"]["ok"] is True
    assert report["reference_check"]["ok"] is True and report["reference_check"]["rel_l2"] < 1e-4
    plan = json.loads((package.path / "plan.json").read_text())
    assert report["plan"]["hash"] == hashlib.sha256((package.path / "plan.json").read_bytes()).hexdigest()
    assert plan["dims"]["layers"] == report["plan"]["layers"] == 2


def test_bake_rejects_unknown_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megabake.cli", "bake", "--model", "no/such/model", "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # bad input, found before any work
    assert proc.stderr.startswith("error: ") and "neither a built-in preset" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written, not even --out


@pytest.mark.parametrize("args, message", [
    (["--out", "/proc/x"], "error: --out /proc/x is not a writable directory"),
    (["--seed", "-1"], "Error: Invalid value for '--seed': -1 is not in the range 0<=x<=9223372036854775807."),
    (["--seed", "99999999999999999999"], "is not in the range 0<=x<=9223372036854775807."),
])
def test_bake_refuses_bad_input_before_any_work(tmp_path, args, message):
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megabake.cli", "bake", "--no-gpu", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr and "[megabake]" not in proc.stderr
    assert time.perf_counter() - started < 60  # no model was loaded
    assert not any(tmp_path.iterdir())


def _fake_bake(status, calls):
    from megabake.baking import BakeResult

    def run_bake(model, *, out, **kwargs):
        calls.append(dict(kwargs, model=model, out=out))
        if status is None:
            from megabake.errors import PlanError

            raise PlanError("layer 0: could not recognise the attention block")
        return BakeResult(Path(out) / "pkg", {"status": status, "status_reasons": ["numerics check failed"]}, "0")

    return run_bake


@pytest.mark.parametrize("status, code", [("unverified", 0), ("verified", 0), ("failed", 1), (None, 1)])
def test_bake_exit_code_follows_the_status(tmp_path, monkeypatch, status, code):
    from click.testing import CliRunner

    import megabake.baking
    from megabake.cli import cli

    calls = []
    monkeypatch.setattr(megabake.baking, "bake", _fake_bake(status, calls))
    out = tmp_path / "new" / "packages"
    result = CliRunner().invoke(cli, ["bake", "--no-gpu", "--out", str(out), "--capacity", "24"])
    assert result.exit_code == code, result.output
    assert calls[0]["gpu_prefill"] == 12 and calls[0]["gpu_steps"] == 12  # both fit the small bucket
    if status is None:  # the pipeline failed: error: <message>, and the --out folders made by the check are gone
        assert result.stderr.startswith("error: layer 0") and not (tmp_path / "new").exists()
    else:
        assert f"status: {status}" in result.stderr and result.stdout.strip() == str(out / "pkg")


def test_bake_help_lists_options():
    proc = subprocess.run([sys.executable, "-m", "megabake.cli", "bake", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for option in ("--model", "--revision", "--batch", "--capacity", "--out", "--gpu-class"):
        assert option in proc.stdout


def test_first_latency_never_fails_the_bake():
    from megabake.baking import first_latency

    report = {"environment": {"gpu_name": "NVIDIA H200"}}
    reason = first_latency(report, decoder=None)  # no CUDA here: run_timings refuses, the bake goes on
    assert "latency not measured" in reason and "megabake verify" in reason
    assert "timings" not in report


def test_bake_with_a_named_tiling_records_it_and_bakes_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megabake.cli", "bake", "--out", str(tmp_path), "--no-gpu",
                           "--tiling", "2X4+Spread+preload+ring3", "--attention-preload"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    package = read_package(proc.stdout.strip().splitlines()[-1])  # the report validates against its schema
    assert package.report["kernel"]["tiling"] == {"spec": "2x4+spread+preload+ring3", "attention_preload": True}
    assert package.report["kernel"]["compile_check"]["ok"] is True
    plan = json.loads((package.path / "plan.json").read_text())
    tilings = {stage["name"]: stage["tiling"] for stage in plan["stages"]}
    assert tilings["norm_qkv"]["stages"] == 3 and tilings["norm_qkv"]["preload"] and tilings["norm_qkv"]["spread"]
    assert "preload" not in tilings["norm_lm_head"]  # the LM head never preloads
    assert tilings["attention"]["preload"] is True
    assert "gemv_rows_streamed" in (package.path / "module.py").read_text()


def test_bake_with_a_balanced_tiling_picks_rows_per_tile_per_stage(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megabake.cli", "bake", "--out", str(tmp_path), "--no-gpu",
                           "--tiling", "Balanced:2x4+ring3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    package = read_package(proc.stdout.strip().splitlines()[-1])
    assert package.report["kernel"]["tiling"] == {"spec": "balanced:2x4+ring3", "attention_preload": False}
    plan = json.loads((package.path / "plan.json").read_text())
    rows = {s["name"]: (s["tiling"]["per_tile"], s["tiling"]["unroll"], s["tiling"]["stages"])
            for s in plan["stages"] if s["tiling"]["kind"] == "rows"}
    # tiny-llama on 132 CTAs x 8 warps: every GEMV has fewer rows than warps, so one row per warp, 8 loads
    assert set(rows.values()) == {(1, 8, 3)}, rows


@pytest.mark.parametrize("args, message", [
    (["--tiling", "2x"], "tiling '2x' is not of the form PER_TILExUNROLL"),
    (["--tiling", "balanced:"], "tiling '' is not of the form PER_TILExUNROLL"),
    (["--tiling", "2x4+fast"], "unknown flag 'fast'"),
    (["--tiling", "2x4+pipeline+ring4"], "replaces the register pipeline"),
    (["--tiling", "2x4", "--autotune"], "--autotune chooses the GEMV tiling"),
])
def test_bake_refuses_a_bad_tiling_before_writing_anything(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "megabake.cli", "bake", "--out", str(tmp_path), "--no-gpu", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr  # bad input
    assert proc.stderr.startswith("error: ") and message in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())


def test_bake_help_documents_exit_codes():
    proc = subprocess.run([sys.executable, "-m", "megabake.cli", "bake", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for line in ("Exit codes", "0 baked", "1 the bake's status is 'failed'", "--force replaces it",
                 "2 usage or bad input", "3 cannot run here", "0..2**63-1"):
        assert line in text, line


def test_public_functions_survive_submodule_imports():
    """`megabake.bake` / `megabake.verify` stay the functions after their pipelines' modules are imported."""
    import megabake
    import megabake.baking
    import megabake.verification
    import megabake.verification.commands  # noqa: F401  (what `megabake verify` imports)

    assert megabake.bake is megabake.baking.bake and callable(megabake.bake)
    assert megabake.verify is megabake.verification.verify_package and callable(megabake.verify)
    assert megabake.bake is megabake.baking.bake  # a second access after use is the same function
