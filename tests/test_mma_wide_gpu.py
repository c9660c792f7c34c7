"""``generate(plan, mma_wide=True)`` on a Hopper GPU (session 41; written then, not yet run): split-KV items of 2-8
query heads of 256 dims on the tensor cores (``bodies._mma_softmax_chunk`` loading each step's K/V at the step).
It must give the lane-group loop's logits (the default build for these heads) to the bf16 rounding of the query and
the probabilities, the same bits twice (a moving result is a race), and match the reference executor that mirrors
that rounding, from positions near 0 to capacity - 1 (CPU checks: ``tests/test_mma_wide.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megabake.codegen import generate
from tests.compiler_fixtures import compile_preset
from tests.test_gpu_decode import _assert_random_cache_steps_match, _logits_over_random_cache

pytestmark = pytest.mark.gpu

POSITIONS = (0, 1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 700, 1000, 1023)


@pytest.mark.parametrize("preset,batch", [("gemma-2b", 8), ("gemma-2b", 1), ("gemma-3-1b", 1)])
def test_mma_wide_matches_the_lane_group_loop_to_bf16_rounding(preset, batch):
    """gemma-2b batch 8 (whole 8-head groups from ~1000 keys on, one-head slices before), batch 1 (4- and 2-head
    slices at long contexts), gemma-3-1b (4 heads, sliding-window layers): rel-L2 < 2e-2 against the lane-group
    loop at every position (a wrong fragment or rescale gives O(1)), and a second run bit for bit."""
    from megabake.runtime import gpu_info

    compiled = compile_preset(preset, layers=2, vocab=4096, batch=batch, capacity=1024, ctas=gpu_info().sm_count)
    positions = sorted(set(POSITIONS))
    lane, wide, again = _logits_over_random_cache(compiled, positions, batch,
                                                  [{}, {"mma_wide": True, "mma_attention": True},
                                                   {"mma_wide": True, "mma_attention": True}])
    assert torch.isfinite(lane).all() and torch.isfinite(wide).all()
    assert torch.equal(again, wide)
    errors = [float((wide[i] - lane[i]).norm() / lane[i].norm()) for i in range(len(positions))]
    assert max(errors) < 2e-2, dict(zip(positions, errors))


def test_mma_wide_kernel_matches_its_reference_executor():
    """gemma-2b batch 8, the wide build against ``ReferenceExecutor(..., mma_attention=True, mma_wide=True)``
    (``decoder.reference_executor()`` reads ``MMA_WIDE`` from the module) at the usual bf16-staging tolerance."""
    from megabake.runtime import gpu_info

    compiled = compile_preset("gemma-2b", layers=2, vocab=4096, batch=8, capacity=1024, ctas=gpu_info().sm_count)
    wide = SimpleNamespace(plan=compiled.plan, generated=generate(compiled.plan, mma_wide=True))
    decoder = _assert_random_cache_steps_match(wide, compiled.model, seed=41, positions=POSITIONS)
    assert decoder.mma_wide and decoder.mma_attention
