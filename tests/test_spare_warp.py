"""The ``spare_loads`` / ``spare_ring`` builds (session 48, the default since 49, ``codegen.generate``): warp 0,
whose thread 0 polls each grid barrier, issues no copies between a split barrier's arrival and its wait. What they
emit, what they refuse, and a CuTe DSL compile for sm_90a (no GPU). Their logits (the default's bits) run on the GPU:
tests/test_spare_warp_gpu.py."""

from __future__ import annotations

import re

import pytest

from megabake.codegen import _RING_PREFILL_ACTIVE, generate
from megabake.runtime.compile import compile_check, load_module
from tests.compiler_fixtures import compile_preset


@pytest.fixture(scope="module")
def qwen3():
    return compile_preset("qwen3-0.6b", layers=2, vocab=512, capacity=4096).plan


def _kernel(source: str) -> str:
    return source.split("def megakernel(", 1)[1]


def _compiled_ptx(preset: str, capacity: int, tmp_path, **options) -> str:
    """The PTX of a one-layer ``preset`` build with ``options``, compiled for sm_90a (the compile must succeed)."""
    plan = compile_preset(preset, layers=1, vocab=512, capacity=capacity).plan
    result = compile_check(plan, load_module(generate(plan, **options).source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    return max(tmp_path.glob("*.ptx"), key=lambda p: p.stat().st_mtime).read_text()


def test_spare_loads_leaves_the_w_o_and_w_down_copies_to_threads_32_on(qwen3):
    # bulk_down off: no mlp_down_load; loader_warp off: it copies for the consumers wherever it is built
    default = generate(qwen3, loader_warp=False, spare_loads=False, bulk_down=False).source
    spare = generate(qwen3, loader_warp=False, spare_loads=True, bulk_down=False).source
    assert "\nCOPY_SKIP = 0\n" in default and "\nCOPY_SKIP = 32\n" in spare
    assert default.replace("\nCOPY_SKIP = 0\n", "\nCOPY_SKIP = 32\n") == spare  # nothing else moves
    for load in ("bodies.fused_o_load(", "bodies.mlp_down_load("):
        call = _kernel(spare).split(load, 1)[1].split(")\n", 1)[0]
        assert call.rstrip().rstrip(",").endswith("skip=COPY_SKIP"), call


def test_spare_ring_moves_warp_0s_ring_prefills_after_each_wait(qwen3):
    default = _kernel(generate(qwen3, loader_warp=False, spare_ring=False).source)
    spare = _kernel(generate(qwen3, loader_warp=False, spare_ring=True).source)
    prefills = default.count("bodies.gemv_ring_prefill(")
    assert prefills >= 2  # the gate/up ring (fused_mlp) and the next layer's QKV ring
    assert spare.count("bodies.gemv_ring_prefill(") == 2 * prefills
    deferred = spare.split("if tidx < 32:  # spare_ring: warp 0 fills its ring once it has polled\n")
    assert len(deferred) == prefills + 1
    for before, after in zip(deferred, deferred[1:]):
        # ahead of the wait, warp 0's copy of the same prefill is active 0; right after the wait it runs as before
        ahead = before.rsplit("bodies.gemv_ring_prefill(", 1)[1]
        assert "active=cutlass.min(tidx // 32, 1) * " in ahead
        assert before.rstrip().endswith("bodies.grid_wait(barrier=barrier, next_target=bar_next, tidx=tidx, "
                                        "ctas=CTAS)")
        again = after.split("bodies.gemv_ring_prefill(", 1)[1].split("stages=", 1)[0]
        assert after.lstrip().startswith("bodies.gemv_ring_prefill(") and "active=cutlass.min(tidx" not in again
        assert again.replace("\n", " ").split() == ahead.split("stages=", 1)[0].replace(
            "cutlass.min(tidx // 32, 1) * ", "").replace("\n", " ").split()  # the same call, warp 0 active


def test_the_ring_prefill_pattern_splits_every_prefill_the_codegen_writes(qwen3):
    """_spare_ring_calls finds a prefill's ``active`` argument by pattern: every prefill call a build writes
    (plain, fused_mlp's gate/up ring, SmolLM-135M's) must match it, or warp 0 would keep its copies silently."""
    smollm = compile_preset("smollm-135m", layers=2, vocab=512, capacity=2048).plan
    from megabake.codegen import BuildOptions, _before_barrier_calls, _fused_mlp_before

    calls = [c for plan in (qwen3, smollm) for stage in plan.stages for c in _before_barrier_calls(plan, stage)]
    calls += _fused_mlp_before(calls)
    prefills = [c for c in calls if c.startswith("bodies.gemv_ring_prefill(")]
    assert prefills and any("MLP_PER_CTA" in c for c in prefills)
    for call in prefills:
        match = _RING_PREFILL_ACTIVE.match(call)
        assert match and match.group(2) in ("1", "cutlass.min(LAYERS - 1 - layer, 1)"), call
    assert BuildOptions().spare_ring is False


def test_spare_loads_needs_a_fused_build():
    plan = compile_preset("qwen3-0.6b", layers=1, vocab=512, capacity=4096, batch=4).plan
    with pytest.raises(ValueError, match=r"spare_loads keeps warp 0 out of a fused build's W_O / W_down copies, but "
                                         r"this build is not fused_o: build without it"):
        generate(plan, spare_loads=True)
    # batch 4 streams no GEMV through a cp.async ring (its tilings are the tensor cores'): nothing to defer
    assert "bodies.gemv_ring_prefill(" not in generate(plan).source
    assert generate(plan, spare_ring=True).source == generate(plan).source


@pytest.mark.parametrize("preset,capacity", [("qwen3-0.6b", 4096), ("smollm-135m", 2048)])
def test_a_spare_build_compiles_for_sm90a(preset, capacity, tmp_path):
    """Both options on: the kernel compiles, and warp 0's guard in the loads is a branch on the thread index."""
    ptx = _compiled_ptx(preset, capacity, tmp_path, spare_loads=True, spare_ring=True)
    assert re.search(r"cp\.async\.(ca|cg)\.shared\.global", ptx)


# ------------------------------------------------------------------------------------------------------ bulk_down
def test_bulk_down_copies_packed_columns_by_bulk_copies_onto_an_mbarrier(qwen3):
    from megabake.codegen.fused_mlp import bulk_copy_bytes, mlp_geometry

    source = generate(qwen3, loader_warp=False, bulk_down=True).source
    kernel = _kernel(source)
    geometry = mlp_geometry(qwen3)
    assert "bodies.mlp_down_load(" not in kernel and kernel.count("bodies.mlp_down_bulk(") == 1
    assert "w_cta=w_down_cta[layer, mchunk, None], s_down=s_down, s_bar=s_down_bar" in kernel
    assert "s_bar=s_down_bar, phase=layer % 2, bulk=MLP_BULK)" in kernel
    assert "\nMLP_BULK = True\n" in source and f"\nMLP_BULK_BYTES = {bulk_copy_bytes(geometry)}\n" in source
    assert f"'w_down_cta': (2, {geometry.chunks}, {qwen3.dims.hidden * geometry.per_cta})" in source
    assert "DERIVED_BUFFERS = {'w_down_cta': ('w_down', MLP_PER_CTA)}" in source
    assert "cute.arch.mbarrier_init(s_down_bar.iterator, 1)" in kernel
    default = generate(qwen3, loader_warp=False, bulk_down=False).source
    assert "\nMLP_BULK = False\n" in default and "s_bar=s_down, phase=layer % 2, bulk=MLP_BULK)" in default
    with pytest.raises(ValueError, match=r"bulk_down copies a fused_mlp build's W_down columns by cp.async.bulk, but "
                                         r"this build is not fused_mlp: build without it"):
        generate(qwen3, loader_warp=False, fused_mlp=False, bulk_down=True)


def test_early_down_issues_the_bulk_copies_at_attentions_barrier(qwen3):
    """The same call, once per layer, at the barrier after the QKV projection and no longer before the MLP's:
    ``arrival`` right after the arrival (ahead of the K/V prefetch and the W_O block), ``wait`` right after the
    wait (before attention's calls); everything else as bulk_down."""
    bulk = _kernel(generate(qwen3, loader_warp=False, bulk_down=True).source)
    early = _kernel(generate(qwen3, loader_warp=False, bulk_down=True, early_down="arrival").source)
    call = "bodies.mlp_down_bulk(\n"
    assert bulk.count(call) == early.count(call) == 1
    attention = early.split("# ---- stage 2: attention", 1)[0].rsplit("bodies.grid_arrive(", 1)[1]
    assert attention.split("\n", 1)[1].lstrip().startswith(call.strip())
    assert attention.index(call) < attention.index("bodies.fused_o_load(") < attention.index("bodies.grid_wait(")
    mlp = early.split("# ---- stage 3: o_residual", 1)[1].split("# ---- stage 4", 1)[0]
    assert call not in mlp and call in bulk.split("# ---- stage 3: o_residual", 1)[1].split("# ---- stage 4", 1)[0]
    moved = bulk.split(call, 1)[1].split(")\n", 1)[0]
    assert early.split(call, 1)[1].split(")\n", 1)[0] == moved  # the same copies of the same layer
    with pytest.raises(ValueError, match=r"early_down issues a bulk_down build's W_down copies at attention's "
                                         r"barrier, but this build is not bulk_down: build without it"):
        generate(qwen3, loader_warp=False, bulk_down=False, early_down="arrival")
    with pytest.raises(ValueError, match=r"early_down=True: use one of \(None, 'arrival', 'wait'\)"):
        generate(qwen3, loader_warp=False, early_down=True)
    waits = _kernel(generate(qwen3, loader_warp=False, early_down="wait").source)
    assert waits.count(call) == 1 and call not in waits.split("# ---- stage 3: o_residual", 1)[1]
    after_wait = waits.split("# ---- stage 2: attention", 1)[0].rsplit("bodies.grid_wait(", 1)[1]
    assert after_wait.split("\n", 1)[1].lstrip().startswith(call.strip())


@pytest.mark.parametrize("preset,capacity,copy_bytes", [("smollm-135m", 2048, 3456), ("qwen2.5-0.5b", 4096, 3584),
                                                         ("qwen3-0.6b", 4096, 4096)])
def test_bulk_copies_tile_each_ctas_columns_in_16_byte_multiples(preset, capacity, copy_bytes):
    from megabake.codegen.fused_mlp import BULK_MAX_COPY_BYTES, bulk_copy_bytes, mlp_geometry

    geometry = mlp_geometry(compile_preset(preset, layers=1, vocab=512, capacity=capacity).plan)
    size = bulk_copy_bytes(geometry)
    assert size == copy_bytes and size % 16 == 0 and size <= BULK_MAX_COPY_BYTES
    assert geometry.down_bytes % size == 0 and geometry.down_bytes // size <= 32  # one round of warp 0's lanes


def test_block_columns_puts_each_ctas_columns_in_one_contiguous_run():
    import torch

    from megabake.runtime.compile import block_columns

    weight = torch.arange(2 * 3 * 8).reshape(2, 3, 8)
    packed = block_columns(weight, 2)
    assert packed.shape == (2, 4, 6)
    for layer in range(2):
        for block in range(4):
            assert torch.equal(packed[layer, block].reshape(3, 2), weight[layer, :, 2 * block:2 * block + 2])
    with pytest.raises(ValueError, match="8 columns are not whole blocks of 3: re-bake the package"):
        block_columns(weight, 3)


@pytest.mark.parametrize("preset,capacity", [("qwen3-0.6b", 4096), ("qwen2.5-0.5b", 4096)])
def test_a_bulk_down_build_compiles_for_sm90a(preset, capacity, tmp_path):
    """Qwen2.5-0.5B's columns are 76 bytes a row (cp.async of 4 bytes); packed, they are bulk copies too. Qwen3-0.6B
    with early_down="wait"."""
    early = "wait" if preset == "qwen3-0.6b" else None
    ptx = _compiled_ptx(preset, capacity, tmp_path, fused_mlp=True, bulk_down=True, early_down=early)
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive.expect_tx" in ptx


def test_the_features_are_on_by_default_where_they_apply(qwen3):
    """GPU-verified since session 49 (the whole GPU suite passed with them on, on an H100): the default build is the
    spare_warp + bulk_down build wherever fused_o / fused_mlp are on (and no loader warp is built: it leaves the
    consumers no copies to spare), and the build without fused_mlp has no bulk copies; a batch-4 bucket (not fused)
    is unchanged."""
    from megabake.plan import EXPERIMENTAL_FEATURES, GPU_VERIFIED_FEATURES

    assert {"spare_warp", "bulk_down"} <= set(EXPERIMENTAL_FEATURES) & set(GPU_VERIFIED_FEATURES)
    default = generate(qwen3, loader_warp=False).source
    assert default == generate(qwen3, loader_warp=False, spare_loads=True, spare_ring=True, bulk_down=True).source
    assert default != generate(qwen3, loader_warp=False, spare_loads=False, spare_ring=False, bulk_down=False).source
    assert "\nCOPY_SKIP = 32\n" in default and "\nMLP_BULK = True\n" in default
    assert generate(qwen3, loader_warp=False, fused_mlp=False).source == generate(
        qwen3, loader_warp=False, fused_mlp=False, bulk_down=False).source
    batched = compile_preset("qwen3-0.6b", layers=1, vocab=512, capacity=4096, batch=4).plan
    assert "COPY_SKIP" not in generate(batched).source  # not fused: nothing to spare, nothing refused
