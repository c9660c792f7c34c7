"""``Plan.down_input == "global"`` on a Hopper GPU (session 40; first run in session 41, on an H100: 3 passed in
102 s): the down projection of a batched bucket reading its bf16 input rows from global memory (the ``act`` buffer
the gate/up GEMV writes) instead of shared memory. It must give the staged plan's bits where both fit, a second run
the same bits (a moving result is a race), and where only it fits (batch 8 of gemma-2b and Mistral-7B) match the
CPU reference executor."""

from __future__ import annotations

import pytest
import torch

from tests.compiler_fixtures import compile_model, compile_preset
from tests.test_gpu_decode import _assert_random_cache_steps_match

pytestmark = pytest.mark.gpu


def _logits(compiled, positions: list[int]) -> torch.Tensor:
    """One step at each of ``positions`` over one seeded random KV cache, poisoned logits before each step."""
    from megabake.runtime import MegakernelDecoder

    decoder = MegakernelDecoder(compiled.plan, compiled.generated.source, compiled.model, device="cuda")
    generator = torch.Generator().manual_seed(40)
    for name in ("k_cache", "v_cache"):
        buffer = decoder.buffers[name]
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
    tokens = torch.randint(1, compiled.plan.dims.vocab, (len(positions), compiled.plan.batch), generator=generator)
    steps = []
    for token, position in zip(tokens, positions):
        decoder.buffers["logits"].fill_(float("nan"))
        steps.append(decoder.step(token, position).cpu().clone())
        torch.cuda.synchronize()
    return torch.stack(steps)


def test_global_down_input_gives_the_staged_plans_bits():
    """Llama-3.2-1B's shape (2 layers), batch 8, where the staged rows fit too: the same bf16 rows (rounded once
    either way) into the same MMAs, so the same logits bit for bit, at positions near 0, at the first split
    boundary and at capacity - 1."""
    from megabake.runtime import gpu_info

    staged = compile_preset("llama-3.2-1b", layers=2, vocab=4096, batch=8, capacity=1024, ctas=gpu_info().sm_count)
    unstaged = compile_model(staged.model, batch=8, capacity=1024, ctas=gpu_info().sm_count, down_input="global")
    assert (staged.plan.down_input, unstaged.plan.down_input) == ("smem", "global")
    positions = [0, 1, 127, 128, 129, 700, 1023]
    want = _logits(staged, positions)
    got, again = _logits(unstaged, positions), _logits(unstaged, positions)
    assert torch.isfinite(got).all()
    assert torch.equal(got, again)
    assert torch.equal(got, want)


@pytest.mark.parametrize("preset", ["gemma-2b", "mistral-7b"])
def test_batch8_of_a_wide_mlp_matches_the_reference_executor(preset):
    """The buckets only this plan holds (2-layer shapes, batch 8): kernel against the CPU reference executor from
    one random cache (every slot filled), near 0, around the split boundary, at capacity - 1 (bf16 tolerance)."""
    from megabake.runtime import gpu_info

    compiled = compile_preset(preset, layers=2, vocab=4096, batch=8, capacity=1024, ctas=gpu_info().sm_count)
    assert compiled.plan.down_input == "global"
    _assert_random_cache_steps_match(compiled, compiled.model, seed=40, positions=(0, 1, 127, 128, 129, 700, 1023))
