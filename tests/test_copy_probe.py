"""scripts/gpu_copy_probe.py compiles for sm_90a on the CPU, each copy kind emitting the instruction it names (the
probe's timings run on a GPU through the device tool)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_copy_probe.py"
BULK = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"


def _probe():
    spec = importlib.util.spec_from_file_location("gpu_copy_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ptx(probe, kind, mode, tmp_path) -> str:
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    elems = 8 * 1024  # 16 KB a CTA
    tmp_path.mkdir(parents=True, exist_ok=True)
    cute.compile(probe.build(kind, elems, mode=mode), *probe.fake_arguments(elems, kind=kind), make_fake_stream(),
                 options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    return max(tmp_path.glob("*.ptx"), key=lambda p: p.stat().st_mtime).read_text()


@pytest.mark.parametrize("kind,mode", [("cp16", "after"), ("cp8", "after"), ("cp4", "after"), ("bulk", "after"),
                                       ("cp16", "split"), ("cp16", "spare"), ("bulk", "spare"),
                                       ("cp4", "spare-after"), ("cp16", "relaxed"), ("cp16row", "chase"),
                                       ("bulkrow", "chase"), ("bulkrow", "split"), ("none", "chase")])
def test_each_copy_kind_compiles_to_its_instruction(kind, mode, tmp_path):
    pytest.importorskip("cutlass")
    probe = _probe()
    ptx = _ptx(probe, kind, mode, tmp_path)
    assert ".target sm_90a" in ptx and "globaltimer" in ptx and "clock64" in ptx
    arrivals = re.findall(r"red\.release\.gpu\.global\.add\.u64", ptx)  # as bodies.grid_arrive
    # the grid barrier as bodies.grid_arrive / grid_wait: one release arrival, then acquire polls of the counter
    if mode == "chase":  # no grid barrier: thread 0 walks the chain, one relaxed load after another
        assert not arrivals and len(re.findall(r"ld\.relaxed\.gpu\.global\.b32", ptx)) == probe.CHASE
    elif mode == "relaxed":  # relaxed polls, then one fence
        assert len(arrivals) == 1 and "fence.acq_rel.gpu" in ptx and "ld.acquire" not in ptx
    else:
        assert len(arrivals) == 1 and re.search(r"ld\.acquire\.gpu\.global\.b64", ptx)
    copies = [line for line in ptx.splitlines() if "cp.async" in line and "shared" in line and "global" in line]
    if kind == "none":  # the chase's baseline copies nothing
        assert not copies and "cp.async" not in ptx and "mbarrier" not in ptx
        return
    assert copies, "no global -> shared copy in the PTX"
    if kind in ("bulk", "bulkrow"):
        assert all(BULK in line for line in copies), copies[:3]
        size = re.search(r"\], \[%rd\d+\], (%r\d+), \[(%r\d+)\];", copies[0])
        bytes_ = 4096 if kind == "bulk" else 2 * probe.ROW_ELEMS  # 4 KB a copy, or a CTA's slice of a row
        assert size and re.search(rf"mov\.b32\s+{size[1]}, {bytes_};", ptx), copies[0]
        # onto the mbarrier that was armed with the CTA's bytes and is waited on
        assert "mbarrier.arrive.expect_tx.shared.b64" in ptx and re.search(rf"mbarrier\.try_wait\.parity\S* \S+ \[{re.escape(size[2])}\]", ptx)
    else:
        size = {"cp16": 16, "cp8": 8, "cp4": 4, "cp16row": 16}[kind]
        assert all(line.rstrip().endswith(f", {size}, {size};") for line in copies), copies[:3]
        assert re.search(r"cp\.async\.wait_group\s+0;", ptx) and "cp.async.bulk" not in ptx


def test_bad_sizes_and_kinds_are_refused_with_the_fix():
    pytest.importorskip("cutlass")
    probe = _probe()
    kinds = "cp16, cp8, cp4, bulk, cp16row, bulkrow, none"
    with pytest.raises(ValueError, match=f"unknown copy kind 'tma': pick one of {kinds}"):
        probe.build("tma", 8192)
    with pytest.raises(ValueError, match="not whole 4096-byte bulk copies: pick a multiple of 2048"):
        probe.build("bulk", 1000)
    modes = "after, split, spare, spare-after, relaxed, chase"
    with pytest.raises(ValueError, match=f"unknown arrival mode 'early': pick one of {modes}"):
        probe.build("cp16", 8192, mode="early")


def test_the_spare_modes_keep_warp_0_out_of_the_copies(tmp_path):
    """In ``spare`` the copies are issued by threads 32.. only (a guard on the thread index before the copy loop),
    and in ``split`` the arrival comes before the first copy in program order, in ``after`` after the last."""
    pytest.importorskip("cutlass")
    probe = _probe()
    orders = {}
    for mode in ("after", "split"):
        ptx = _ptx(probe, "cp16", mode, tmp_path / mode)
        lines = ptx.splitlines()
        arrival = next(i for i, line in enumerate(lines) if "red.release.gpu" in line)
        copies = [i for i, line in enumerate(lines) if "cp.async.cg.shared.global" in line]
        orders[mode] = (arrival < min(copies), arrival > max(copies))
    assert orders == {"after": (False, True), "split": (True, False)}
    spare = _ptx(probe, "cp16", "spare", tmp_path / "spare")
    guard = r"setp\.(ge|lt|gt|le)\.(s|u)32\s+%p\d+, %r\d+, (32|31);"
    assert re.search(guard, spare), "no warp-0 guard before the copies"

