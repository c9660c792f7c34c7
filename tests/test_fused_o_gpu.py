"""The ``fused_o`` build on the H200 (session 34 candidate, ``megabake.codegen.fused``): a step whose attention is
one split runs it and the O projection in one barrier interval. Against the default build from one random KV cache
and against the CPU reference executor; a second run must give the same bits (a moving result is a race)."""

from __future__ import annotations

import pytest
import torch

from tests.compiler_fixtures import compile_preset
from tests.test_gpu_decode import _assert_random_cache_steps_match, _logits_over_random_cache

pytestmark = pytest.mark.gpu


def _fused_and_split_positions(compiled, capacity: int) -> tuple[list[int], list[int]]:
    """Positions near 0, at the first split boundaries, halfway and at capacity - 1, parted into the steps a fused
    build runs fused in some layer (one split over the layer's visible positions: its sliding window's, where it
    has one) and the rest, split steps first: a fused step's K/V carry its rounding into every later step that
    reads them."""
    from megabake.plan import split_schedule

    plan = compiled.plan
    tiling = next(s.tiling for s in plan.stages if s.kind == "attention")
    windows = plan.attn_window_table()  # the capacity where a layer has no window
    candidates = sorted(p for p in {0, 1, 2, 63, 64, tiling.per_tile - 1, tiling.per_tile, tiling.per_tile + 1, 700,
                                    capacity // 2, capacity - 1} if p < capacity)

    def visible(p: int) -> list[int]:
        return [min(p + 1, window) for window in windows]

    # bodies.fused_o_step: the layer's visible positions fit MIN_CHUNK
    fused = [p for p in candidates if min(visible(p)) <= tiling.per_tile]
    assert all(split_schedule(tiling, v).active == 1 for p in fused for v in visible(p) if v <= tiling.per_tile)
    return fused, [p for p in candidates if p not in fused]


def _compiled(preset: str, capacity: int):
    from megabake.runtime import gpu_info

    return compile_preset(preset, layers=2, vocab=4096, capacity=capacity, ctas=gpu_info().sm_count)


def _assert_builds_give_the_first_bits(preset: str, capacity: int, builds: list[dict]) -> None:
    """Each of ``builds`` (generate options) after the first gives the first's logits bit for bit, from one random
    KV cache, at fused and split steps (:func:`_fused_and_split_positions`), split steps first."""
    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    positions = split + fused
    logits = _logits_over_random_cache(compiled, positions, 1, builds)
    assert torch.isfinite(logits[0]).all()
    for build, result in zip(builds[1:], logits[1:]):
        for i, position in enumerate(positions):
            assert torch.equal(result[i], logits[0][i]), (build, position)


@pytest.mark.parametrize("preset,capacity", [("smollm-135m", 2048), ("qwen2.5-0.5b", 4096), ("qwen3-0.6b", 4096),
                                             ("llama-3.2-1b", 1024), ("tiny-mistral", 256), ("tiny-phi3", 256)])
def test_fused_o_gives_the_default_bits_where_split_and_fp32_order_where_fused(preset, capacity):
    """The fused build as timed (its whole KV groups on the fp32 lane-group loop, as the default's short-context
    head slices; the split steps here on the lane-group loop too): split steps give the default build's bits (the
    O stage, o_mid as the down projection's bias: the same sums), fused steps its logits to fp32 order (the
    attention per group, the O projection summed per KV group, then over groups); with the cached K/V rows copied
    into shared memory first (``fused_kv_smem``, no sliding windows) the fused build's own bits. Sliding windows:
    tiny-mistral's 96 positions fit MIN_CHUNK (128), so every step is fused; tiny-phi3's do not (64): fused
    only up to position 63."""
    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    assert fused and (split or preset == "tiny-mistral")
    positions = split + fused
    only_fused_o = {"fused_o": True, "fused_split": False, "fused_mlp": False}  # fused_split, fused_mlp: their tests
    builds = [{}, only_fused_o, only_fused_o]
    windows = compiled.plan.has_windows
    results = _logits_over_random_cache(compiled, positions, 1,
                                        builds + ([] if windows else [{**only_fused_o, "fused_kv_smem": True}]))
    default, fused_o, again = results[:3]
    assert torch.isfinite(fused_o).all() and torch.equal(again, fused_o)
    if not windows:
        assert torch.equal(results[3], fused_o)  # the same rows from shared memory: the same bits
    for i, position in enumerate(positions):
        if position in fused:
            assert float((fused_o[i] - default[i]).norm() / default[i].norm()) < 1e-5, position
        else:
            assert torch.equal(fused_o[i], default[i]), position


@pytest.mark.parametrize("preset,capacity", [("smollm-135m", 2048), ("qwen3-0.6b", 4096)])
def test_fused_o_on_the_tensor_cores_stays_within_bf16_rounding_of_the_default(preset, capacity):
    """``fused_mma`` (gpu_tune build fused-o): fused steps score whole KV groups on the tensor cores (bf16
    query and probabilities, where the default deals 1-head slices to the lane-group loop at short contexts), so
    their logits stay within that rounding (2e-2, as the tensor cores against the lane-group loop); split steps
    keep the default's bits (tensor-core items where the default deals them)."""
    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    positions = split + fused
    default, fused_o, again = _logits_over_random_cache(
        compiled, positions, 1, [{"mma_attention": True}, {"fused_o": True, "mma_attention": True, "fused_mma": True},
                                 {"fused_o": True, "mma_attention": True, "fused_mma": True}])
    assert torch.isfinite(fused_o).all() and torch.equal(again, fused_o)
    for i, position in enumerate(positions):
        if position in fused:
            assert float((fused_o[i] - default[i]).norm() / default[i].norm()) < 2e-2, position
        else:
            assert torch.equal(fused_o[i], default[i]), position


@pytest.mark.parametrize("preset,capacity", [("smollm-135m", 2048), ("qwen3-0.6b", 4096), ("tiny-mistral", 256)])
def test_fused_o_kernel_matches_the_reference_executor(preset, capacity):
    """The fused build as ``FUSED_O_DEFAULT`` makes it (fused steps' whole groups on the tensor cores, split
    steps' items there where the default deals such items; ``ReferenceExecutor(..., fused_mma=True)`` mirrors both
    roundings) against the CPU reference executor from one random cache, fused steps and split steps, at the usual
    tolerance (2e-3)."""
    from megabake.codegen import generate

    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    source = generate(compiled.plan, fused_o=True).source
    assert "\nFUSED_MMA = True\n" in source
    _assert_random_cache_steps_match(compiled, compiled.model, seed=41, positions=fused + split, source=source)
