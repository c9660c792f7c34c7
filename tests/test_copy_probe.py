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


@pytest.mark.parametrize("kind", ["cp16", "cp8", "cp4", "bulk"])
def test_each_copy_kind_compiles_to_its_instruction(kind, tmp_path):
    pytest.importorskip("cutlass")
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    probe = _probe()
    elems = 8 * 1024  # 16 KB a CTA
    cute.compile(probe.build(kind, elems), *probe.fake_arguments(elems), make_fake_stream(),
                 options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}")
    ptx = max(tmp_path.glob("*.ptx"), key=lambda p: p.stat().st_mtime).read_text()
    assert ".target sm_90a" in ptx and "globaltimer" in ptx and "clock64" in ptx
    assert re.search(r"atom\.global\.release(\.gpu)?\.add\.u64", ptx)  # the barrier's arrival, as bodies.sync
    copies = [line for line in ptx.splitlines() if "cp.async" in line and "shared" in line and "global" in line]
    assert copies, "no global -> shared copy in the PTX"
    if kind == "bulk":
        assert all(BULK in line for line in copies), copies[:3]
        size = re.search(r"\], \[%rd\d+\], (%r\d+), \[(%r\d+)\];", copies[0])
        assert size and re.search(rf"mov\.b32\s+{size[1]}, 4096;", ptx), copies[0]  # 4 KB a copy
        # onto the mbarrier that was armed with the CTA's bytes and is waited on
        assert "mbarrier.arrive.expect_tx.shared.b64" in ptx and re.search(rf"mbarrier\.try_wait\.parity\S* \S+ \[{re.escape(size[2])}\]", ptx)
    else:
        size = {"cp16": 16, "cp8": 8, "cp4": 4}[kind]
        assert all(line.rstrip().endswith(f", {size}, {size};") for line in copies), copies[:3]
        assert re.search(r"cp\.async\.wait_group\s+0;", ptx) and "cp.async.bulk" not in ptx


def test_bad_sizes_and_kinds_are_refused_with_the_fix():
    pytest.importorskip("cutlass")
    probe = _probe()
    with pytest.raises(ValueError, match="unknown copy kind 'tma': pick one of cp16, cp8, cp4, bulk"):
        probe.build("tma", 8192)
    with pytest.raises(ValueError, match="not whole 4096-byte bulk copies: pick a multiple of 2048"):
        probe.build("cp16", 1000)
