"""The ``loader_warp`` build on the GPU (session 51 candidate; tests/test_loader_warp.py has what it emits): a ninth
warp streams every weight the step reads into shared memory, in consumption order and across grid barriers, and the
consumer warps read the ring. Each row's sum is the default's, so every step must give the fused default's logits
bit for bit, from one random KV cache, at fused and split steps (positions near 0, at split boundaries, at capacity -
1), paced by the consumers' arrivals as built by default (codegen.loader.DEFAULT_GATES ...) and unpaced with 2 units in
flight, 1, and as many as the ring holds, without the loader's own warpgroup (setmaxnreg), with one ring for all
streams, with other gates (session 52's "mlp", session 53's split-step "attention" order, session 61's "items"), and
twice; a moving result would be a race (a slot read before it landed, or refilled before every warp read it)."""

from __future__ import annotations

import pytest

from tests.test_fused_o_gpu import _assert_builds_give_the_first_bits

pytestmark = pytest.mark.gpu

PRESETS = [("smollm-135m", 2048), ("qwen2.5-0.5b", 4096), ("qwen3-0.6b", 4096)]


@pytest.mark.parametrize("preset,capacity", PRESETS)
def test_loader_warp_gives_the_fused_default_bits(preset, capacity):
    base = {"mma_attention": None, "fused_mlp": True, "bulk_down": True, "spare_loads": False, "spare_ring": False,
            "loader_warp": False}
    loader = {**base, "spare_loads": None, "spare_ring": None, "loader_warp": True}  # paced as codegen.loader's default
    unpaced = {**loader, "loader_gates": (), "loader_inflight": 2, "loader_drain": False}  # session 51's
    builds = [base, loader, unpaced, {**unpaced, "loader_inflight": 1}, {**unpaced, "loader_inflight": 0},
              {**loader, "loader_warpgroup": False}, {**loader, "loader_qkv_ring": False},
              {**unpaced, "loader_gates": ("qkv",)}, {**loader, "loader_gates": ("qkv", "mlp"), "loader_inflight": 2},
              {**loader, "loader_gates": ("qkv", "attention")}, {**loader, "loader_gates": ("qkv", "items")}, loader]
    _assert_builds_give_the_first_bits(preset, capacity, builds)
