"""The ``spare_loads`` / ``spare_ring`` builds (session 48 candidates, ``codegen.generate``): warp 0, whose thread 0
polls each grid barrier, issues no copies between a split barrier's arrival and its wait. What they emit, what they
refuse, and a CuTe DSL compile for sm_90a (no GPU). Their logits (the default's bits) run on the GPU:
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


def test_spare_loads_leaves_the_w_o_and_w_down_copies_to_threads_32_on(qwen3):
    default = generate(qwen3).source
    spare = generate(qwen3, spare_loads=True).source
    assert "\nCOPY_SKIP = 0\n" in default and "\nCOPY_SKIP = 32\n" in spare
    assert default.replace("\nCOPY_SKIP = 0\n", "\nCOPY_SKIP = 32\n") == spare  # nothing else moves
    for load in ("bodies.fused_o_load(", "bodies.mlp_down_load("):
        call = _kernel(spare).split(load, 1)[1].split(")\n", 1)[0]
        assert call.rstrip().rstrip(",").endswith("skip=COPY_SKIP"), call


def test_spare_ring_moves_warp_0s_ring_prefills_after_each_wait(qwen3):
    default = _kernel(generate(qwen3).source)
    spare = _kernel(generate(qwen3, spare_ring=True).source)
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
    plan = compile_preset(preset, layers=1, vocab=512, capacity=capacity).plan
    result = compile_check(plan, load_module(generate(plan, spare_loads=True, spare_ring=True).source),
                           dump_dir=str(tmp_path))
    assert result.ok, result.error
    ptx = max(tmp_path.glob("*.ptx"), key=lambda p: p.stat().st_mtime).read_text()
    assert re.search(r"cp\.async\.(ca|cg)\.shared\.global", ptx)
