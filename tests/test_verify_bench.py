"""benchmarks/decode.py on the CPU: rows from reports, the markdown table, the PNG chart, robustness to a
preset that fails, and re-rendering from results.json."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megabake.verification.report import assemble_report
from megabake.verification.timing import Candidate, Samples, TimingSettings, assemble_timings
from tests.fixtures_packages import make_report

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _report(mk_ms=0.5):
    spread = [1 + 0.01 * ((i % 7) - 3) for i in range(40)]
    candidates = [Candidate("megabake", "megabake", None, graph_replays=True),
                  Candidate("inductor-reduce-overhead", "baseline", None, graph_replays=True),
                  Candidate("inductor-graph", "baseline", None, graph_replays=True)]
    results = {"megabake": Samples([mk_ms * s for s in spread], [mk_ms * s for s in spread], [0.4 * s for s in spread]),
               "inductor-reduce-overhead": Samples([2.05 * s for s in spread]),
               "inductor-graph": Samples([1.45 * s for s in spread])}
    timings = assemble_timings(candidates, results, weight_bytes=270_000_000, bandwidth_GBps=4280.0,
                               settings=TimingSettings())
    numerics = {"prefill": 16, "steps": 64, "pass": True, "per_step": [], "summary": {}, "failures": []}
    return assemble_report(make_report(status="unverified", megabake_ms=None), numerics=numerics, timings=timings,
                           environment=None)


def test_row_and_table(bench):
    row = bench.row_from_report("smollm-135m", _report())
    assert row.status == "verified" and row.megabake_ms == pytest.approx(0.5)
    assert row.baseline == "inductor-graph" and row.speedup == pytest.approx(2.9)
    assert row.baselines_ms == pytest.approx({"inductor-reduce-overhead": 2.05, "inductor-graph": 1.45})
    assert row.floor_ms == pytest.approx(0.0631, abs=1e-4)
    table = bench.markdown_table([row, bench.Row("llama-3.2-1b", reasons=["boom"])])
    lines = table.splitlines()
    assert lines[0].startswith("| preset | status | MegaBake ms [95% CI]")
    assert "inductor-graph ms" in lines[0] and "speedup [95% CI]" in lines[0]
    assert "| smollm-135m | verified | 0.500 [" in table and "2.90x [" in table and "vs inductor-graph" in table
    assert "| llama-3.2-1b | error | - |" in table


def test_chart_png(bench, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [bench.row_from_report("smollm-135m", _report()), bench.row_from_report("llama-3.2-1b", _report(0.9))]
    assert bench.write_chart(rows, tmp_path / "decode.png") is None
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failing_preset_is_logged_and_the_run_goes_on(bench, tmp_path, capsys, monkeypatch):
    def fake_verify(preset, args):
        if preset == "qwen3-0.6b":
            raise RuntimeError("bake exploded")
        return bench.row_from_report(preset, _report())

    monkeypatch.setattr(bench, "verify_preset", fake_verify)
    code = bench.main(["--presets", "qwen3-0.6b", "smollm-135m", "--out", str(tmp_path)])
    assert code == 1  # not every preset verified
    out = capsys.readouterr().out
    assert out.strip().splitlines()[0].startswith("| preset |")  # the table is printed last
    assert "| qwen3-0.6b | error |" in out and "| smollm-135m | verified |" in out
    log = (tmp_path / "decode.log").read_text()
    assert "bake exploded" in log and "Traceback" in log
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["preset"] for r in results] == ["qwen3-0.6b", "smollm-135m"]
    assert (tmp_path / "decode.md").read_text().startswith("| preset |")

    again = tmp_path / "again"
    assert bench.main(["--from-results", str(tmp_path / "results.json"), "--out", str(again)]) == 1
    assert (again / "decode.md").read_text() == (tmp_path / "decode.md").read_text()


def test_table_says_where_and_with_what_it_was_measured(bench):
    env = {"gpu_name": "NVIDIA H200", "sm_count": 132, "driver": "580.159.04", "verified_at": "2026-11-30T12:00:00Z"}
    tools = {"torch": "2.11.0", "transformers": "5.17.0", "cutlass_dsl": "4.8.1", "megabake": "0.1.0",
             "git_revision": "a5b4541deadbeef00+dirty"}
    report = dict(_report(), environment=env, toolchain=tools)
    table = bench.markdown_table([bench.row_from_report("smollm-135m", report)])
    assert ("Measured: 2026-11-30, NVIDIA H200 (132 SMs, driver 580.159.04), torch 2.11.0, transformers 5.17.0, "
            "CuTe DSL 4.8.1, megabake 0.1.0, git a5b4541deadb+dirty.") in table
    assert "Measured:" not in bench.markdown_table([bench.row_from_report("smollm-135m", _report())])


def test_table_carries_the_timing_warnings(bench):
    report = _report()
    report["timings"]["warnings"] = ["inductor-graph: 1.75 ms per synchronized call ... back to back (-28%)"]
    row = bench.row_from_report("llama-3.2-1b", report)
    assert "Warning (llama-3.2-1b): inductor-graph: 1.75 ms" in bench.markdown_table([row])


def test_default_presets_are_every_model_sized_preset_and_typos_stop_before_any_gpu_work(bench, capsys, tmp_path):
    from megabake.presets import PRESETS, get_preset

    args = bench.parse_args(["--out", str(tmp_path)])
    assert set(args.presets) == {name for name, p in PRESETS.items()
                                 if not name.startswith("tiny-") and not p.experimental}
    assert all(get_preset(name) for name in args.presets)
    with pytest.raises(SystemExit) as stopped:
        bench.parse_args(["--out", str(tmp_path), "--presets", "smollm", "qwen3-0.6b"])
    assert stopped.value.code == 2
    assert "unknown preset(s) smollm; built-in presets: tiny-llama" in capsys.readouterr().err


def test_a_tiling_typo_stops_before_any_gpu_work(bench, capsys, tmp_path):
    args = bench.parse_args(["--out", str(tmp_path), "--tiling", "2x4+ring4+preload"])
    assert args.tiling == "2x4+ring4+preload" and not args.attention_preload
    with pytest.raises(SystemExit) as stopped:
        bench.parse_args(["--out", str(tmp_path), "--tiling", "2x4+fast"])
    assert stopped.value.code == 2
    assert "unknown flag 'fast'" in capsys.readouterr().err


def test_table_names_a_kernel_baked_with_a_chosen_tiling(bench):
    default = bench.row_from_report("smollm-135m", _report())
    assert default.kernel == "" and "Kernel (" not in bench.markdown_table([default])
    report = _report()
    report["kernel"]["tiling"] = {"spec": "2x4+preload+ring4", "attention_preload": True}
    row = bench.row_from_report("llama-3.2-1b", report)
    assert "Kernel (llama-3.2-1b): tiling 2x4+preload+ring4 + attention preload." in bench.markdown_table([row])
    report["kernel"]["tiling"] = {"spec": None, "attention_preload": True}
    assert bench.row_from_report("llama-3.2-1b", report).kernel == "attention preload"
    report["kernel"]["autotune"] = {"tuning": {}, "stage_us": {}, "chosen": "t2u4-spread"}
    assert bench.row_from_report("llama-3.2-1b", report).kernel == "autotuned (t2u4-spread)"


def test_verified_package_comes_back_as_one_flat_archive(bench, tmp_path):
    import tarfile

    from megabake.baking import bake

    baked = bake("tiny-llama", out=tmp_path / "packages", run_on_gpu=False, reference_steps=1)
    archive = bench.archive_package(baked.path, tmp_path / "packages", tmp_path / "tiny-llama-package.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    prefix = f"packages/megabake--tiny-llama/random-seed0/{baked.path.name}"
    assert {f"{prefix}/{name}" for name in ("module.py", "plan.json", "report.json", "manifest.json")} <= set(names)
    (tmp_path / "repo").mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "repo", filter="data")
    from megabake.package import read_package

    assert read_package(tmp_path / "repo" / prefix).report["status"] == "unverified"  # digests still check out


def test_resume_keeps_finished_presets_and_measures_only_the_rest(bench, tmp_path, monkeypatch):
    from megabake.verification.env import source_digest

    measured = []

    def fake_verify(preset, args):
        measured.append(preset)
        report = _report(0.7)
        report["model"]["preset"] = preset
        report["toolchain"]["source_sha256"] = source_digest()
        report["numerics"]["prefill"] = args.prefill
        report["timings"]["method"] = {"samples": args.samples}
        (args.out / f"{preset}-report.json").write_text(json.dumps(report))
        return bench.row_from_report(preset, report)

    monkeypatch.setattr(bench, "verify_preset", fake_verify)
    assert bench.main(["--presets", "smollm-135m", "--out", str(tmp_path)]) == 0
    assert measured == ["smollm-135m"]
    first = json.loads((tmp_path / "results.json").read_text())[0]

    assert bench.main(["--presets", "smollm-135m", "llama-3.2-1b", "--out", str(tmp_path), "--resume"]) == 0
    assert measured == ["smollm-135m", "llama-3.2-1b"]  # smollm came from its report, not a second run
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["preset"] for r in rows] == ["smollm-135m", "llama-3.2-1b"]
    assert rows[0]["megabake_ms"] == first["megabake_ms"] and rows[0]["speedup"] == first["speedup"]

    # other settings (here: more samples, a tiling) never reuse a report
    assert bench.main(["--presets", "smollm-135m", "--out", str(tmp_path), "--resume", "--samples", "60"]) == 0
    assert bench.main(["--presets", "smollm-135m", "--out", str(tmp_path), "--resume", "--tiling", "2x4"]) == 0
    assert measured[2:] == ["smollm-135m", "smollm-135m"]
    assert "other settings (samples=40 not 60)" in (tmp_path / "decode.log").read_text()
    # without --resume everything is measured again
    assert bench.main(["--presets", "smollm-135m", "--out", str(tmp_path)]) == 0
    assert measured[4:] == ["smollm-135m"]
    # a report made by other megabake sources (another checkout) is never reused
    report = json.loads((tmp_path / "smollm-135m-report.json").read_text())
    report["toolchain"]["source_sha256"] = "0" * 64
    (tmp_path / "smollm-135m-report.json").write_text(json.dumps(report))
    assert bench.main(["--presets", "smollm-135m", "--out", str(tmp_path), "--resume"]) == 0
    assert measured[5:] == ["smollm-135m"]
    assert "compiler='" + "0" * 64 in (tmp_path / "decode.log").read_text()


def test_matrix_mode_takes_a_requested_capacity_and_known_baselines_or_says_why_not(bench, tmp_path, capsys):
    """--capacity with --positions bakes that bucket (session 24's probe asked for 4096 and silently got 128, where
    graphed Inductor reads a 32x shorter cache); one that cannot hold the positions is refused before any model
    loads, and one past a model's positions fails that preset's cells with the reason, not the run. A misspelt
    --baselines name is refused before any GPU work too."""
    from benchmarks.matrix import _preset_batch, bucket_capacity

    assert bucket_capacity([16], None, 4096) == 4096 and bucket_capacity([16], None) == 128
    with pytest.raises(ValueError, match="past the model's 2048 positions .*use --capacity 2048 or less"):
        bucket_capacity([16], 2048, 4096)
    assert bench.parse_args(["--positions", "16", "--capacity", "4096", "--out", str(tmp_path)]).capacity == 4096
    assert bench.parse_args(["--positions", "16", "--out", str(tmp_path)]).capacity is None
    assert bench.parse_args(["--out", str(tmp_path)]).capacity == 128
    assert bench.parse_args(["--baselines", "inductor-graph", "inductor-default-graph", "--out",
                             str(tmp_path)]).baselines == ["inductor-graph", "inductor-default-graph"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--baselines", "inductor-grpah", "--out", str(tmp_path)])
    assert "unknown baseline(s) inductor-grpah; known: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--positions", "16", "4000", "--capacity", "2048", "--out", str(tmp_path)])
    assert "cannot hold position 4000 and the 20 timed steps after it: use --capacity 4021" in capsys.readouterr().err
    args = bench.parse_args(["--presets", "smollm-135m", "--positions", "16", "--capacity", "8192",
                             "--out", str(tmp_path)])
    cells = _preset_batch("smollm-135m", 1, args)
    assert [(c.position, c.capacity) for c in cells] == [(16, 8192)]
    assert "ValueError: --capacity 8192 is past the model's 2048 positions" in cells[0].error


def test_matrix_mode_buckets_positions_table_and_chart(bench, tmp_path):
    """--positions/--batches: the bucket holds the largest position (capped by the model), positions past it
    become the last that fits, and cells render as a table, a JSON file and a latency-vs-context chart."""
    from benchmarks.matrix import Cell, _fill, bucket_capacity, fitting_positions, write_matrix

    assert bucket_capacity([16, 1000, 4000], None) == 4096 and bucket_capacity([8000], None) == 8192 and bucket_capacity([16], None) == 128
    assert bucket_capacity([16, 1000, 4000], 2048) == 2048
    assert fitting_positions([16, 1000, 4000], 2048) == [16, 1000, 2027]
    args = bench.parse_args(["--presets", "smollm-135m", "--positions", "16", "4000", "--batches", "1", "4",
                             "--out", str(tmp_path)])
    assert args.positions == [16, 4000] and args.batches == [1, 4]
    with pytest.raises(SystemExit):
        bench.parse_args(["--positions", "0", "--out", str(tmp_path)])
    cells = []
    for batch, position, ms in ((1, 16, 0.5), (1, 2027, 0.6), (4, 16, 0.7)):
        cell = Cell("smollm-135m", batch, position, 2048, status="measured",
                    numerics={"pass": True, "prefill": 2012, "max_rel_l2_vs_fp32": 0.01,
                              "max_rel_l2_bf16_vs_fp32": 0.02})
        _fill(cell, _report(ms)["timings"])
        cells.append(cell)
    table = write_matrix(cells, tmp_path)
    assert "| smollm-135m | 4 | 16 | measured | 0.700" in table and "inductor-graph ms" in table
    assert "2.07x" in table.splitlines()[4]  # 1.45 / 0.7
    assert json.loads((tmp_path / "matrix.json").read_text())[1]["position"] == 2027
    assert cells[0].megabake_block_ms is None  # the synthetic report has no back-to-back block
    _fill(cells[0], {"candidates": {"megabake": {"kind": "megabake", "sync_call_block": {"median": 0.51}}}})
    assert cells[0].megabake_block_ms == 0.51  # status.py's back-to-back host cost reads it
    assert (tmp_path / "matrix.png").stat().st_size > 1000


def test_matrix_mode_bakes_the_named_tiling_or_autotunes_each_bucket(bench, tmp_path, monkeypatch):
    """--tiling reaches every bucket the matrix bakes (it was dropped before session 12); --autotune makes each
    bucket's bake time its tilings on the GPU (refused before session 22)."""
    import megabake.baking
    import megabake.runtime
    from benchmarks.matrix import _bake_decoder

    seen = {}

    def fake_bake(preset, **kwargs):
        seen.update(kwargs, preset=preset)
        return type("Baked", (), {"path": tmp_path, "model": None})()

    monkeypatch.setattr(megabake.baking, "bake", fake_bake)
    monkeypatch.setattr(megabake.runtime.MegakernelDecoder, "from_package", classmethod(lambda cls, *a, **k: "decoder"))
    args = bench.parse_args(["--presets", "llama-3.2-1b", "--positions", "16", "--batches", "8", "--tiling",
                             "8x8+mma", "--out", str(tmp_path)])
    assert _bake_decoder("llama-3.2-1b", 8, 128, args) == (tmp_path, "decoder")
    assert seen["tiling"] == "8x8+mma" and seen["batch"] == 8 and seen["attention_preload"] is False
    assert seen["autotune"] is False and seen["run_on_gpu"] is False
    args = bench.parse_args(["--presets", "smollm-1.7b", "--positions", "16", "2027", "--autotune",
                             "--out", str(tmp_path)])
    assert _bake_decoder("smollm-1.7b", 1, 2048, args) == (tmp_path, "decoder")
    assert seen["autotune"] is True and seen["run_on_gpu"] is True and seen["tiling"] is None
    with pytest.raises(SystemExit):  # a contradiction must not cost a GPU run
        bench.parse_args(["--positions", "16", "--autotune", "--tiling", "2x4", "--out", str(tmp_path)])


def test_matrix_mode_writes_its_evidence_into_the_package_and_archives_it(bench, tmp_path):
    """The long-context bucket baked by matrix mode comes back verified: numerics at the longest context and
    the timings there go into its report.json (schema-checked, status by verify's rule), one flat archive."""
    import tarfile

    from benchmarks.matrix import _record_evidence
    from megabake.baking import bake
    from megabake.package import read_package

    baked = bake("tiny-llama", out=tmp_path / "packages", run_on_gpu=False, reference_steps=1)
    timed = _report(0.5)
    timings = dict(timed["timings"], method=dict(timed["timings"]["method"], prefill=100))
    numerics = dict(timed["numerics"], prefill=100)
    env = {"gpu_name": "NVIDIA H200", "gpu_class": baked.path.name.split("-", 3)[3].split("-p")[0], "sm_count": 132,
           "compute_capability": "9.0", "driver": None, "cuda_runtime": None, "hostname": "test"}
    report = _record_evidence(baked.path, numerics, timings, tmp_path, "tiny-llama-b1", env=env)
    assert report["status"] == "verified", report["status_reasons"]
    assert read_package(baked.path).report["timings"]["method"]["prefill"] == 100
    assert json.loads((tmp_path / "tiny-llama-b1-report.json").read_text())["numerics"]["prefill"] == 100
    with tarfile.open(tmp_path / "tiny-llama-b1-package.tar.gz") as tar:
        tar.extractall(tmp_path / "repo", filter="data")
    unpacked = read_package(tmp_path / "repo" / "packages" / "megabake--tiny-llama" / "random-seed0" / baked.path.name)
    assert unpacked.report["status"] == "verified"  # digests check out after the report changed

    failing = dict(numerics, **{"pass": False, "failures": ["step 3: rel-L2 0.9 > 0.1"]})
    report = _record_evidence(baked.path, failing, timings, tmp_path, "tiny-llama-b1", env=env)
    assert report["status"] == "failed" and "step 3" in report["status_reasons"][0]
