"""The ``spare_loads`` / ``spare_ring`` builds on the GPU (session 48 candidates; tests/test_spare_warp.py has what
they emit): warp 0 copies nothing ahead of a grid barrier's wait, so they only move which thread issues which copy
and when. Every step must give the default build's logits bit for bit, from one random KV cache, at fused and split
steps (positions near 0, at split boundaries, at capacity - 1); a moving result would be a race (a copy read before
it landed)."""

from __future__ import annotations

import pytest
import torch

from tests.test_fused_o_gpu import _compiled, _fused_and_split_positions
from tests.test_gpu_decode import _logits_over_random_cache

pytestmark = pytest.mark.gpu

# SmolLM-135M and Qwen3-0.6B run fused_mlp by default (W_down copies of 8 / 16 bytes), Qwen2.5-0.5B does not
PRESETS = [("smollm-135m", 2048), ("qwen2.5-0.5b", 4096), ("qwen3-0.6b", 4096)]


@pytest.mark.parametrize("preset,capacity", PRESETS)
def test_spare_builds_give_the_default_bits(preset, capacity):
    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    positions = split + fused
    default = {"mma_attention": None}  # the default's choices (the helper turns the tensor-core items off otherwise)
    builds = [default, {**default, "spare_loads": True, "spare_ring": True}]
    logits = _logits_over_random_cache(compiled, positions, 1, builds)
    assert torch.isfinite(logits[0]).all()
    for build, result in zip(builds[1:], logits[1:]):
        for i, position in enumerate(positions):
            assert torch.equal(result[i], logits[0][i]), (build, position)
