"""Report assembly: schema-valid merges, the status rule and its reasons, the CPU refusal of `megabake verify`
(report unchanged), environment/toolchain helpers."""

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from megabake.errors import DeviceError
from megabake.package import read_package, update_report, validate
from megabake.presets import get_preset
from megabake.verification import assemble_report, run_numerics, toolchain, verify_package
from megabake.verification.api import verify_decoder
from megabake.verification.commands import parse_baselines, verify_command
from megabake.verification.doubles import EagerDecoder
from megabake.verification.env import gpu_class_name, hopper_problem, parse_driver_text
from megabake.verification.report import decide_status, summary_lines, validated
from megabake.verification.timing import Candidate, Samples, TimingSettings, assemble_timings
from tests.fixtures_packages import make_report, write_fixture_package

ENV = {"gpu_name": "NVIDIA H200", "gpu_class": "sm90a-132sm", "sm_count": 132, "compute_capability": "9.0",
       "driver": "580.159.04", "cuda_runtime": "13.0", "hostname": "h200"}


@pytest.fixture(scope="module")
def model():
    return get_preset("tiny-llama").build_model(dtype=torch.bfloat16)


@pytest.fixture
def base_report():
    return make_report(status="unverified", megabake_ms=None)


@pytest.fixture(scope="module")
def good_numerics(model):
    return run_numerics(EagerDecoder(model, capacity=24), prefill=4, steps=8)


@pytest.fixture(scope="module")
def bad_numerics(model):
    def perturb(step, logits):
        if step == 5:
            logits = logits.clone()
            logits[0, 3] -= 40.0
        return logits

    return run_numerics(EagerDecoder(model, capacity=24, perturb=perturb), prefill=4, steps=8)


def timings(samples=40, baselines=True, mk_ms=0.5):
    spread = [1 + 0.01 * ((i % 7) - 3) for i in range(samples)]
    candidates = [Candidate("megabake", "megabake", None, graph_replays=True)]
    results = {"megabake": Samples([mk_ms * s for s in spread], [0.9 * mk_ms * s for s in spread],
                                   [0.8 * mk_ms * s for s in spread])}
    if baselines:
        candidates += [Candidate("inductor-reduce-overhead", "baseline", None, graph_replays=True),
                       Candidate("inductor-graph", "baseline", None, graph_replays=True)]
        results["inductor-reduce-overhead"] = Samples([2.0 * s for s in spread], [1.9 * s for s in spread])
        results["inductor-graph"] = Samples([1.45 * s for s in spread], [1.40 * s for s in spread])
    else:
        candidates.append(Candidate("inductor-graph", "baseline", None, error="BackendCompilerFailed: boom"))
    return assemble_timings(candidates, results, weight_bytes=270_000_000, bandwidth_GBps=4280.0,
                            settings=TimingSettings(samples=samples))


def test_verified_report_validates_and_input_is_untouched(base_report, good_numerics):
    before = copy.deepcopy(base_report)
    report = assemble_report(base_report, numerics=good_numerics, timings=timings(), environment=ENV,
                             toolchain=toolchain(), verified_at="2026-12-01T08:00:00Z")
    assert base_report == before
    validate("report", report)
    assert report["status"] == "verified"
    assert report["timings"]["baseline"] == "inductor-graph"
    assert report["timings"]["speedup"]["median"] == pytest.approx(2.9)
    assert report["environment"]["verified_at"] == "2026-12-01T08:00:00Z"
    assert any(r.startswith("numerics: 8 steps after a 4-token prefill") for r in report["status_reasons"])
    assert any(r.startswith("timings: 2.90x vs inductor-graph (95% CI") for r in report["status_reasons"])
    json.dumps(report, allow_nan=False)


def test_perturbed_logit_turns_status_failed_naming_step_and_metric(base_report, bad_numerics):
    report = validated(assemble_report(base_report, numerics=bad_numerics, timings=timings(), environment=ENV,
                                       toolchain=toolchain()))
    assert report["status"] == "failed"
    assert report["numerics"]["pass"] is False
    assert "numerics: max rel_l2_vs_fp32" in " | ".join(report["status_reasons"])
    assert "(worst: step 5, position 9)" in " | ".join(report["status_reasons"])
    assert all(r.startswith("numerics: ") for r in report["status_reasons"])


@pytest.mark.parametrize("case,expected", [
    ("few_samples", "timings: megabake has 10 samples per measure, < 40 required"),
    ("no_baseline", "timings: no baseline could be timed (inductor-graph: BackendCompilerFailed: boom)"),
    ("no_timings", "timings: not run"),
    ("other_gpu", "environment: package is for sm90a-132sm but ran on sm90a-114sm (NVIDIA H100 PCIe)"),
    ("no_numerics", "numerics: not run"),
])
def test_status_reasons(base_report, good_numerics, case, expected):
    numerics, timing, env = good_numerics, timings(), ENV
    if case == "few_samples":
        timing = timings(samples=10)
    elif case == "no_baseline":
        timing = timings(baselines=False)
    elif case == "no_timings":
        timing = None
    elif case == "other_gpu":
        env = dict(ENV, gpu_class="sm90a-114sm", sm_count=114, gpu_name="NVIDIA H100 PCIe")
    elif case == "no_numerics":
        numerics = None
    report = validated(assemble_report(base_report, numerics=numerics, timings=timing, environment=env))
    assert report["status"] == "failed"
    assert expected in report["status_reasons"]


def test_slower_megakernel_is_verified_but_said(base_report, good_numerics):
    verdict = decide_status(base_report, good_numerics, timings(mk_ms=3.0), ENV)
    assert verdict.status == "verified"
    assert "timings: the megakernel is slower than inductor-graph" in verdict.reasons


def test_timing_crash_record_is_schema_valid(base_report, good_numerics):
    crash = {"unit": "ms", "candidates": {"megabake": {"kind": "megabake", "error": "timing crashed: X"}},
             "baseline": None}
    report = validated(assemble_report(base_report, numerics=good_numerics, timings=crash, environment=ENV))
    assert "timings: the megakernel was not timed (timing crashed: X)" in report["status_reasons"]


def test_verify_decoder_without_timing_on_cpu(base_report, model):
    report = verify_decoder(EagerDecoder(model, capacity=32), base_report, steps=6, prefill=4, timings=False)
    assert report["status"] == "failed" and report["status_reasons"] == ["timings: not run"]
    assert report["numerics"]["pass"] is True


def test_update_report_round_trip(tmp_path, good_numerics):
    path = write_fixture_package(tmp_path, status="unverified", megabake_ms=None)
    report = assemble_report(read_package(path).report, numerics=good_numerics, timings=timings(),
                             environment=ENV, toolchain=toolchain())
    update_report(path, report)
    stored = read_package(path).report
    assert stored["status"] == "verified" and stored["timings"]["candidates"]["megabake"]["sync_call"]["samples"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_verify_package_without_gpu_leaves_report_unchanged(tmp_path):
    path = write_fixture_package(tmp_path, status="unverified", megabake_ms=None)
    before = (path / "report.json").read_bytes()
    with pytest.raises(DeviceError, match="needs a Hopper GPU.*report was left unchanged"):
        verify_package(path)
    result = CliRunner().invoke(verify_command, [str(path), "--steps", "8"])
    assert result.exit_code == 3
    assert "needs a Hopper GPU" in result.output
    assert (path / "report.json").read_bytes() == before


def test_cli_parsing_helpers():
    assert parse_baselines(("inductor-graph,eager", "inductor-graph")) == ("inductor-graph", "eager")
    assert parse_baselines(()) is None


def test_environment_helpers():
    assert gpu_class_name(9, 0, 132) == "sm90a-132sm"
    assert gpu_class_name(8, 0, 108) == "sm80-108sm"
    proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct 30 2025\nGCC version: 12"
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build"
    assert parse_driver_text(proprietary) == "580.159.04"
    assert parse_driver_text(open_module) == "570.86.15"
    assert parse_driver_text("nothing here") is None
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in hopper_problem()
    assert "not a CUDA GPU" in hopper_problem("cpu")
    tc = toolchain()
    assert tc["torch"] == torch.__version__ and tc["megabake"]
    validate("report", dict(make_report(status="unverified", megabake_ms=None), toolchain=tc))


def test_summary_lines(base_report, good_numerics):
    report = assemble_report(base_report, numerics=good_numerics, timings=timings(), environment=ENV)
    text = "\n".join(summary_lines(report))
    assert text.startswith("status: verified")
    assert "inductor-graph" in text and "floor 0.0631 ms" in text


def test_evidence_states_top1_as_the_pass_rule_reads_it(base_report, good_numerics):
    numerics = copy.deepcopy(good_numerics)
    numerics["summary"].update(top1_agreement=0.921875, top1_agreement_decisive=1.0, decisive_steps=17)
    report = assemble_report(base_report, numerics=numerics, timings=timings(), environment=ENV,
                             toolchain=toolchain(), verified_at="2026-12-01T08:00:00Z")
    line = next(r for r in report["status_reasons"] if r.startswith("numerics: "))
    assert line.endswith("top-1 agreement 1 over the 17 decisive steps (0.922 over all steps)")


def test_source_digest_names_the_sources_not_the_checkout(tmp_path):
    import shutil
    from pathlib import Path

    from megabake.verification.env import source_digest

    source = Path(__file__).resolve().parents[1] / "megabake"
    copied = tmp_path / "megabake"
    shutil.copytree(source, copied, ignore=shutil.ignore_patterns("__pycache__"))
    (copied / "__pycache__").mkdir(exist_ok=True)
    (copied / "__pycache__" / "stale.py").write_text("x = 1\n")  # generated files do not count
    assert source_digest(copied) == source_digest(source)  # same bytes elsewhere: same compiler
    assert len(source_digest(source)) == 64
    body = copied / "plan" / "__init__.py"
    body.write_text(body.read_text() + "\n# one more line\n")
    assert source_digest(copied) != source_digest(source)
