"""The ``spare_loads`` / ``spare_ring`` builds on the GPU (session 48; the default since session 49;
tests/test_spare_warp.py has what they emit): warp 0 copies nothing ahead of a grid barrier's wait, so they only move which thread issues which copy
and when. Every step must give the default build's logits bit for bit, from one random KV cache, at fused and split
steps (positions near 0, at split boundaries, at capacity - 1); a moving result would be a race (a copy read before
it landed)."""

from __future__ import annotations

import pytest

from tests.test_fused_o_gpu import _assert_builds_give_the_first_bits

pytestmark = pytest.mark.gpu

# SmolLM-135M and Qwen3-0.6B run fused_mlp by default (W_down copies of 8 / 16 bytes), Qwen2.5-0.5B does not
PRESETS = [("smollm-135m", 2048), ("qwen2.5-0.5b", 4096), ("qwen3-0.6b", 4096)]


@pytest.mark.parametrize("preset,capacity", PRESETS)
def test_spare_builds_give_the_default_bits(preset, capacity):
    # the default's other choices (the helper turns the tensor-core items off otherwise), without the spare options
    # (and without the loader warp, which leaves them off where it is built)
    default = {"mma_attention": None, "spare_loads": False, "spare_ring": False, "loader_warp": False}
    builds = [default, {**default, "spare_loads": True, "spare_ring": True}]
    _assert_builds_give_the_first_bits(preset, capacity, builds)


@pytest.mark.parametrize("preset,capacity", PRESETS)
def test_bulk_down_gives_the_fused_mlp_bits(preset, capacity):
    """``bulk_down`` puts the same W_down bytes in shared memory as ``bodies.mlp_down_load`` (from the runtime's
    packed ``w_down_cta``), so the fused_mlp build's logits come out bit for bit (Qwen2.5-0.5B: fused_mlp forced on,
    its columns are 76 bytes a row); with the spare options on top too, and issued at attention's barrier (early_down,
session 49), where the copy of layer L overwrites s_down one interval after layer L - 1 read it. A copy read
before its mbarrier phase
    completed, or a phase parity off by one layer, would move them."""
    base = {"mma_attention": None, "fused_mlp": True, "bulk_down": False, "spare_loads": False, "spare_ring": False}
    builds = [base, {**base, "bulk_down": True}, {**base, "bulk_down": True, "spare_loads": True, "spare_ring": True},
              {**base, "bulk_down": True, "early_down": "arrival"},  # early_down: the copies land during attention
              {**base, "bulk_down": True, "early_down": "wait"}]
    _assert_builds_give_the_first_bits(preset, capacity, builds)
