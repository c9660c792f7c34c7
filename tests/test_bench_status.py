"""benchmarks/status.py: issue 12's scorecard from stored benchmark cells (synthetic runs, and the repo's own)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def status():
    spec = importlib.util.spec_from_file_location("bench_status", ROOT / "benchmarks" / "status.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_status"] = module
    spec.loader.exec_module(module)
    return module


def cell(preset, batch, position, speedup, gpu_ms, sync_ms=None, status="measured", numerics=True):
    return {"preset": preset, "batch": batch, "position": position, "status": status, "speedup": speedup,
            "megabake_gpu_ms": gpu_ms, "megabake_ms": sync_ms or gpu_ms + 0.02, "numerics": {"pass": numerics}}


def write_run(root: Path, folder: str, cells: list[dict], name: str = "matrix.json") -> None:
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / folder / name).write_text(json.dumps(cells))


# one layer, one KV head of 4: 16 bytes of K+V per position in bf16
TINY = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=4, hidden_size=8, num_attention_heads=2,
                       sliding_window=None, intermediate_size=16, vocab_size=32)


def test_newest_cell_wins_by_session_and_position_classes(status, tmp_path):
    write_run(tmp_path, "2026-12-01-h200-session5", [cell("m", 1, 16, 1.4, 0.5), cell("m", 1, 1000, 1.6, 0.6)])
    write_run(tmp_path, "2026-12-02-h200-session6/bench-m", [cell("m", 1, 17, 1.7, 0.45), cell("m", 1, 300, 9.0, 1.0)])
    write_run(tmp_path, "2026-12-02-h200-session6", [{"not": "a cell"}], name="tune-m.json")  # ignored
    cells = status.load_cells(tmp_path)
    best = status.newest(cells)
    assert best[("m", 1, "~16")].position == 17 and best[("m", 1, "~16")].session == "s6"
    assert best[("m", 1, "~1000")].session == "s5"
    assert ("m", 1, "~4000") not in best  # 300 positions belongs to no class
    assert [status.position_class(p) for p in (16, 99, 100, 500, 1899, 1900, 2027, 8000)] == \
        ["~16", "~16", None, "~1000", "~1000", "~4000", "~4000", "~4000"]


def test_speedup_verdict_needs_every_class_measured_fast_and_numerically_right(status, tmp_path):
    write_run(tmp_path, "2026-12-01-h200-session5", [
        cell("a", 1, 16, 2.0, 0.5), cell("a", 1, 1000, 1.6, 0.6), cell("a", 1, 4000, 1.5, 0.7),
        cell("b", 1, 16, 2.0, 0.5), cell("b", 1, 1000, 1.6, 0.6), cell("b", 1, 4000, 1.49, 0.7),
        cell("c", 1, 16, 2.0, 0.5), cell("c", 1, 1000, 1.6, 0.6, numerics=False), cell("c", 1, 4000, 1.8, 0.7),
        cell("d", 1, 16, 2.0, 0.5, status="failed-numerics"), cell("d", 1, 1000, 1.6, 0.6)])
    rows = {line.split(" | ")[0][2:]: line for line in status.speedup_table(status.newest(status.load_cells(tmp_path)))[2:]}
    assert rows["a"].endswith("| yes |")
    assert rows["b"].endswith("| **no** |") and "1.49x @4000 (s5)" in rows["b"]
    assert "numerics failed" in rows["c"] and rows["c"].endswith("| **no** |")
    assert "not measured (s5)" in rows["d"] and "missing" in rows["d"]


def test_growth_budget_uses_the_short_step_of_the_same_run_and_the_windowed_kv_bytes(status, tmp_path):
    write_run(tmp_path, "2026-12-01-h200-session5", [cell("m", 2, 16, 2.0, 0.9), cell("m", 2, 3999, 2.0, 0.95)])
    write_run(tmp_path, "2026-12-02-h200-session6", [cell("m", 2, 16, 2.0, 0.500), cell("m", 2, 3999, 2.0, 0.640),
                                                      cell("n", 2, 16, 2.0, 0.500), cell("n", 2, 1000, 2.0, 0.9),
                                                      cell("n", 2, 3999, 2.0, 0.570)])
    over, within = status.growth_rows(status.load_cells(tmp_path), config_of=lambda name: TINY)
    assert (over.preset, over.short.session, over.long.position) == ("m", "s6", 3999)
    assert over.kv_bytes == 4000 * 16 * 2  # 4000 visible keys x 16 bytes x 2 sequences
    assert over.budget_ms == pytest.approx((0.5 + 128000 / 3.5e12 * 1e3) * 1.15)
    assert not over.within and within.within
    windowed = SimpleNamespace(**{**vars(TINY), "sliding_window": 1000})
    assert status.kv_bytes(windowed, 3999, 2) == 1000 * 16 * 2
    assert "| m | 2 | 0.500 @16 | 0.640 @3999 | 0 MB | 0.575 | **no** | s6 |" in status.growth_table([over])


def test_kv_bytes_follow_layer_types_and_qwen2s_use_sliding_window(status):
    mixed = SimpleNamespace(**{**vars(TINY), "num_hidden_layers": 3, "sliding_window": 10,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})
    assert status.layer_windows(mixed) == [10, None, 10]
    assert status.kv_bytes(mixed, 99, 1) == (10 + 100 + 10) * 16
    qwen2 = SimpleNamespace(**{**vars(TINY), "sliding_window": 10, "use_sliding_window": False})
    assert status.layer_windows(qwen2) == [None]
    no_head_dim = SimpleNamespace(**{**vars(TINY), "head_dim": None})  # head_dim from hidden / heads = 4
    assert status.kv_bytes(no_head_dim, 0, 1) == 16


def test_layer_windows_match_the_committed_plans(status):
    """The config rule gives every committed package's plan its per-layer windows (what the kernel reads)."""
    checked = 0
    for plan_path in sorted((ROOT / "packages").glob("*/*/*/plan.json")):
        report = json.loads((plan_path.parent / "report.json").read_text())
        plan = json.loads(plan_path.read_text())
        capacity = plan["capacity"]
        config = status.preset_config(report["model"]["preset"])
        from_config = [min(w, capacity) if w else capacity for w in status.layer_windows(config)]
        from_plan = [min(layer.get("window") or capacity, capacity) for layer in plan["layers"]]
        assert from_config == from_plan, plan_path
        checked += 1
    assert checked >= 10


def test_short_targets_batch8_host_and_missing_cells(status, tmp_path):
    write_run(tmp_path, "2026-12-01-h200-session5", [cell("llama-3.2-1b", 1, 16, 2.0, 0.800),
                                                      cell("llama-3.2-1b", 8, 16, 3.0, 1.100, sync_ms=1.110)])
    write_run(tmp_path, "2026-12-02-h200-session6", [cell("llama-3.2-1b", 1, 16, 2.0, 0.700, sync_ms=0.740)])
    cells = status.load_cells(tmp_path)
    best = status.newest(cells)
    table = "\n".join(status.short_target_table(best))
    assert "| llama-3.2-1b | 0.700 (s6) | 0.75 | yes |" in table and "| smollm-135m | missing | 0.3 | no |" in table
    line = status.batch8_line(cells, best)
    assert "same run 1.100 (s5) / 0.800 (s5) = 1.38x, met" in line
    assert "newest of each 1.100 (s5) / 0.700 (s6) = 1.57x, **not met**" in line
    assert "10-40 us" in status.host_line(best) and "1 of 2 cells within 15 us" in status.host_line(best)
    assert "Back to back" not in status.host_line(best)  # no cell stored its block median
    write_run(tmp_path, "2026-12-04-h200-session32", [dict(cell("llama-3.2-1b", 4, 16, 2.9, 0.959, sync_ms=0.993),
                                                           megabake_block_ms=0.9723)])
    line = status.host_line(status.newest(status.load_cells(tmp_path)))
    assert "alternating rounds: 10-40 us" in line and "Back to back (synchronized calls in a row, cells since " \
        "session 32): 13-13 us, median 13; 1 of 1 cells within 15 us." in line
    missing = status.missing_lines(best, ["llama-3.2-1b", "other"],
                                   config_of=lambda name: status.preset_config("llama-3.2-1b") if name != "other"
                                   else TINY)
    assert missing[0] == "- llama-3.2-1b: b1 ~1000, b1 ~4000, b4 ~16, b4 ~1000, b4 ~4000, b8 ~1000, b8 ~4000"
    assert missing[1].startswith("- other: b1 ~16")


def test_cells_timed_after_the_profiled_graph_check_are_counted(status, tmp_path):
    write_run(tmp_path, "2026-12-04-h200-session31", [cell("llama-3.2-1b", 1, 16, 2.0, 0.741)])
    write_run(tmp_path, "2026-12-05-h200-session32", [cell("smollm-135m", 1, 16, 3.0, 0.369)])
    write_run(tmp_path, "2026-12-01-h200-long-context", [cell("qwen3-0.6b", 1, 16, 3.0, 0.6)])  # no session number
    best = status.newest(status.load_cells(tmp_path))
    assert {key[0]: c.profiled for key, c in best.items()} == \
        {"llama-3.2-1b": True, "smollm-135m": False, "qwen3-0.6b": True}
    assert status.profiled_line(best).startswith("2 of 3 cells shown were timed after")
    clean = {key: c for key, c in best.items() if not c.profiled}
    assert status.profiled_line(clean) == "Every cell shown was timed without a profiler attached."


def test_cells_of_other_gpus_are_listed_apart_and_never_scored(status, tmp_path):
    write_run(tmp_path, "2026-12-04-h200-session36", [cell("llama-3.2-1b", 1, 16, 2.5, 0.741)])
    write_run(tmp_path, "2026-12-05-h100-session39/bench-llama", [cell("llama-3.2-1b", 1, 16, 2.2, 0.952),
                                                                   cell("llama-3.2-1b", 1, 4000, 2.0, 1.051)])
    cells = status.load_cells(tmp_path)
    assert sorted((c.gpu, c.position) for c in cells) == [("h100", 16), ("h100", 4000), ("h200", 16)]
    text = status.render(cells, ["llama-3.2-1b"], config_of=lambda name: TINY)
    scored, others = text.split("## Other GPUs")
    assert "| llama-3.2-1b | 0.741 (s36) | 0.75 | yes |" in scored and "0.952" not in scored
    assert "1 stored H200 cells (2 of other GPUs" in scored and "b1 ~4000" in scored  # the H100 cell fills nothing
    assert "| H100 | llama-3.2-1b | 1 | 4000 | 1.051 | 2.00x | pass | s39 |" in others
    growth = others.split("Growth with context on the H100")[1]
    assert "| llama-3.2-1b | 1 | 0.952 @16 | 1.051 @4000 |" in growth  # the H100 run's own pair, never the H200's


def test_bad_input_names_the_file(status, tmp_path):
    write_run(tmp_path, "run", [{"preset": "m", "position": 16, "speedup": 2.0}])
    with pytest.raises(ValueError, match=r"matrix.json: a benchmark cell lacks batch, status"):
        status.load_cells(tmp_path)
    (tmp_path / "run" / "matrix.json").write_text("[")
    with pytest.raises(ValueError, match="not valid JSON"):
        status.load_cells(tmp_path)
    assert status.main(["--results", str(tmp_path / "nowhere")]) == 2


def test_scorecard_of_the_repositorys_results(status, tmp_path, capsys):
    out = tmp_path / "status.md"
    assert status.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    for heading in ("## Speedup", "## Growth with context", "## Short-context GPU time", "## Not measured yet"):
        assert heading in text
    stored = {c.preset for c in status.load_cells(ROOT / "benchmarks" / "results")}
    assert stored and all(f"| {preset} |" in text for preset in stored)


# one layer, 4 query heads per KV head of 64 dims: the shape whose attention went to the tensor cores in session 33
GQA = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=64, hidden_size=256, num_attention_heads=4,
                      sliding_window=None, intermediate_size=512, vocab_size=32)


def test_rebench_first_lists_failing_rows_measured_before_todays_default(status, tmp_path):
    # growth fails in both runs (0.5 -> 1.0 ms); only the one before session 33 is stale
    write_run(tmp_path, "2026-12-04-h200-session30", [cell("old", 8, 16, 3.0, 0.5), cell("old", 8, 4000, 2.0, 1.0)])
    write_run(tmp_path, "2026-12-05-h200-session34", [cell("new", 8, 16, 3.0, 0.5), cell("new", 8, 4000, 2.0, 1.0)])
    text = status.render(status.load_cells(tmp_path), ["old", "new"], config_of=lambda name: GQA)
    rebench = text.split("## Re-bench first")[1].split("## Not measured")[0]
    assert "- old batch 8: growth (s30), before session 33's default" in rebench
    assert '--positions 16 1000 4000 --batches 8' in rebench and '"$OUT" old`' in rebench
    assert "- new batch" not in rebench
    assert status.default_since(GQA, 1, "~16") == 49 and status.default_since(GQA, 1, "~4000") == 49  # spare_warp
    assert status.default_since(GQA, 1, "~16", "qwen3-0.6b") == 60  # group_fold (status.GROUP_FOLD_PRESETS)
    assert status.default_since(GQA, 1, "~4000", "qwen2.5-0.5b") == 64  # split_cap (status.SPLIT_CAP_PRESETS)
    assert status.default_since(GQA, 8, "~4000", "qwen2.5-0.5b") == 33  # batch 1 only
    assert status.default_since(GQA, 1, "~16", "phi-3-mini") == 49  # group_fold does not change it
    assert status.default_since(GQA, 4, "~16", "qwen3-0.6b") == 33  # batch 1 only
    assert status.default_since(GQA, 4, "~16") == 33
    assert status.default_since(TINY, 8, "~4000") == 29  # 2 query heads of 4 dims: no tensor-core attention
    gemma = status.preset_config("gemma-2b")  # 8 query heads of 256 per KV head: mma_wide since session 42
    assert [status.default_since(gemma, 1, cls) for cls in ("~16", "~1000", "~4000")] == [49, 49, 49]  # spare_ring
    assert [status.default_since(gemma, 8, cls) for cls in ("~16", "~1000", "~4000")] == [42, 42, 42]


# a 16384-wide residual stream: eight bf16 rows of it (256 KiB) never fit a CTA's shared memory, four do
HUGE = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=8, head_dim=128, hidden_size=16384,
                       num_attention_heads=128, sliding_window=None, intermediate_size=65536, vocab_size=32)


def test_buckets_no_plan_holds_are_named_apart_from_the_missing_cells(status):
    configs = {"huge": HUGE, "gemma-2b": status.preset_config("gemma-2b")}
    lines = status.missing_lines({}, ["huge", "gemma-2b"], config_of=configs.get)
    holes = {line.split(": ")[0][2:]: line for line in lines if line.startswith("- ") and "batch" not in line}
    assert "b4 ~16" in holes["huge"] and "b8" not in holes["huge"]
    assert "b8 ~4000 (these read the down input from global memory)" in holes["gemma-2b"]  # 16384-wide
    assert "b4 ~4000, b8" in holes["gemma-2b"]  # MLP input, read from global memory at batch 8 only
    refused = lines[lines.index("Buckets no plan holds (the bake refuses them; nothing to measure):") + 2:]
    assert len(refused) == 1 and refused[0].startswith("- huge batch 8: bucket batch=8")
    assert "16384-wide bf16 GEMV input" in refused[0] and "--batch 4 or less" in refused[0]


def test_the_script_runs_from_any_folder_without_the_package_on_the_path(tmp_path):
    """``python3 benchmarks/status.py`` from another folder, with no PYTHONPATH: it finds megabake in its own
    repository (session 47: it failed with ModuleNotFoundError unless the package was installed)."""
    import os
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "status.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("# Issue 12 scorecard") and "## Short-context GPU time" in run.stdout
