"""scripts/gpu_stream_probe.py: its schedules carry a model's bytes, and each mode compiles for sm_90a on the CPU
with the synchronisation it names (the probe's timings run on a GPU through the device tool)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_stream_probe.py"
BULK = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"


def _probe():
    spec = importlib.util.spec_from_file_location("gpu_stream_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_stream_probe"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_schedule_streams_the_models_weights_in_whole_tiles():
    pytest.importorskip("transformers")
    probe = _probe()
    schedule = probe.model_schedule("qwen3-0.6b", ctas=132, spin_ns=1500)
    layers = 28
    assert len(schedule) == 3 * layers + 1 and schedule[-1].kind == "lm_head"
    assert [i.kind for i in schedule[:3]] == ["qkv", "attention+o", "mlp"]
    assert [i.spin_ns for i in schedule[:3]] == [0, 1500, 0]
    per_layer = (4096 * 1024 + 1024 * 2048 + 3 * 3072 * 1024) * 2  # bf16 QKV, O, gate/up, down
    streamed = sum(i.tiles for i in schedule[:3]) * 132 * probe.SLOT_BYTES
    assert per_layer <= streamed < per_layer + 3 * 132 * probe.SLOT_BYTES  # rounded up per interval only
    rows = probe.schedule_table(schedule)
    assert rows[0] == [0, schedule[0].tiles, 0] and rows[1][0] == schedule[0].tiles
    assert rows[-1][0] + rows[-1][1] == sum(i.tiles for i in schedule)


def _ptx(probe, mode, tmp_path, slots=4) -> str:
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    intervals, tiles = 7, 40
    tmp_path.mkdir(parents=True, exist_ok=True)
    cute.compile(probe.build(intervals, tiles, slots, mode), *probe.fake_arguments(intervals, tiles),
                 make_fake_stream(), options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    return max(tmp_path.glob("*.ptx"), key=lambda p: p.stat().st_mtime).read_text()


@pytest.mark.parametrize("mode", ["stream", "interval", "copy", "sync", "relaxed", "sync-loaded", "l2ahead", "bulk-l2"])
def test_each_mode_compiles_with_its_copies_and_barriers(mode, tmp_path):
    pytest.importorskip("cutlass")
    probe = _probe()
    ptx = _ptx(probe, mode, tmp_path / mode)
    assert ".target sm_90a" in ptx and "globaltimer" in ptx
    copies = [line for line in ptx.splitlines() if "cp.async.bulk" in line and "prefetch" not in line]
    if mode == "sync":  # no tiles: no copy
        assert not copies
    else:  # 4 KB bulk copies onto the slot's full mbarrier, armed with the tile's bytes
        assert copies and all(BULK in line for line in copies)
        armed = re.search(r"mbarrier\.arrive\.expect_tx\.shared\.b64 \S+, \[\S+\], (%r\d+);", ptx)
        assert armed and re.search(rf"mov\.b32\s+{armed[1]}, {probe.SLOT_BYTES};", ptx), armed
    arrivals = re.findall(r"red\.(release|relaxed)\.gpu\.global\.add\.u64", ptx)
    if mode == "copy":  # no grid barrier: one release add of the CTA's arrivals at its end
        assert arrivals == ["release"] and "ld.acquire.gpu" not in ptx
    else:  # the consumer warps meet on a named barrier of 256 threads around thread 0's arrival and polls
        assert arrivals == ["relaxed" if mode == "relaxed" else "release"]
        assert re.search(r"ld\.acquire\.gpu\.global\.b64", ptx)
        assert re.search(rf"bar\.sync\s+{probe.NAMED_BARRIER}, {probe.CONSUMERS};", ptx)
    l2 = {"l2ahead": "prefetch.global.L2 ", "bulk-l2": "cp.async.bulk.prefetch.L2.global"}
    for kind, instruction in l2.items():  # only the L2 modes prefetch, each with its instruction
        assert (instruction in ptx) == (mode == kind), (kind, mode)
    reduces = "shfl.sync.bfly" in ptx
    assert reduces == (mode not in ("copy", "sync", "sync-loaded"))  # only the consuming modes do arithmetic


def test_bad_modes_and_rings_are_refused_with_the_fix():
    probe = _probe()
    with pytest.raises(ValueError, match="unknown mode 'tma': pick one of stream, interval, copy"):
        probe.build(4, 8, mode="tma")
    with pytest.raises(ValueError, match="1 ring slots: pick 2 to 13"):
        probe.build(4, 8, slots=1)
    with pytest.raises(ValueError, match="4 tiles in flight: pick 0 .* to 3"):
        probe.build(4, 8, slots=4, inflight=4)

