"""The ``fused_mlp`` build on the GPU (session 43 candidate, ``megabake.codegen.fused_mlp``; 8 passed on an H100):
every layer's gate/up and down projections in one barrier interval, the down projection's per-CTA partials summed
as int64 fixed point. Against the ``fused_o`` build it extends, from one random KV cache, at fused and split steps;
a second run must give the same bits (the integer sums are order-free: a moving result is a race); against the CPU
reference executor; and a non-finite down projection must still reach the logits."""

from __future__ import annotations

import pytest
import torch

from tests.test_fused_o_gpu import _compiled, _fused_and_split_positions
from tests.test_gpu_decode import _assert_random_cache_steps_match, _logits_over_random_cache

pytestmark = pytest.mark.gpu

PRESETS = [("smollm-135m", 2048), ("qwen2.5-0.5b", 4096), ("qwen3-0.6b", 4096), ("tiny-mistral", 256)]


@pytest.mark.parametrize("preset,capacity", PRESETS)
def test_fused_mlp_gives_the_fused_o_logits_to_fp32_order_and_the_same_bits_twice(preset, capacity):
    """SmolLM-135M copies its W_down columns 8 bytes at a time, Qwen2.5-0.5B 4, Qwen3-0.6B 16; tiny-mistral has
    sliding windows. The activations are the fused_o build's (the same gate/up GEMV per row); the down
    projection's sum order differs (a CTA's columns in fp32, then the CTAs in fixed point), so logits agree to
    fp32 order (1e-4 over 2 layers), not bit for bit."""
    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    positions = split + fused
    base = {"fused_o": True, "fused_mlp": False}  # the fused_o build without it (a default where it copies >= 64 bits)
    fused_o, fused_mlp, again = _logits_over_random_cache(
        compiled, positions, 1, [base, {**base, "fused_mlp": True}, {**base, "fused_mlp": True}])
    assert torch.isfinite(fused_mlp).all()
    assert torch.equal(again, fused_mlp)
    for i, position in enumerate(positions):
        assert float((fused_mlp[i] - fused_o[i]).norm() / fused_o[i].norm()) < 1e-4, position


@pytest.mark.parametrize("preset,capacity", [("smollm-135m", 2048), ("qwen3-0.6b", 4096)])
def test_fused_mlp_kernel_matches_the_reference_executor(preset, capacity):
    """The fused_mlp build on the default's other choices (fused groups and split items on the tensor cores,
    mirrored by ``ReferenceExecutor(..., fused_mma=True)``) against the CPU reference at the usual tolerance."""
    from megabake.codegen import generate

    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    source = generate(compiled.plan, fused_mlp=True).source
    assert "\nFUSED_MLP = True\n" in source and "\nFUSED_MMA = True\n" in source
    _assert_random_cache_steps_match(compiled, compiled.model, seed=43, positions=fused + split, source=source)


def test_a_non_finite_or_huge_down_projection_reaches_the_logits():
    """One W_down weight of the first layer set to inf, NaN or 3e38 (a partial past the fixed-point range): the
    flag word turns the residual into NaN, so the logits are not finite (inf and NaN make the fp32 build's logits
    non-finite too: nothing is silently clipped); the next call with the weight restored is finite again (the
    accumulator is zeroed every launch)."""
    from megabake.codegen import generate
    from megabake.runtime import MegakernelDecoder

    compiled = _compiled("smollm-135m", 2048)
    decoder = MegakernelDecoder(compiled.plan, generate(compiled.plan, fused_mlp=True).source, compiled.model,
                                device="cuda")
    w_down = decoder.buffers["w_down"]
    kept = w_down[0, 5, 7].clone()
    token = torch.tensor([11])
    for poison in (float("inf"), float("nan"), 3.0e38):
        w_down[0, 5, 7] = poison
        decoder.refresh_derived_buffers()  # a bulk_down build reads its packed copy of W_down
        assert not torch.isfinite(decoder.step(token, 3).float()).all(), poison
        w_down[0, 5, 7] = kept
        decoder.refresh_derived_buffers()
        assert torch.isfinite(decoder.step(token, 3).float()).all(), poison


def test_the_accumulator_holds_the_last_layers_mlp_and_replays_give_the_same_bits():
    """After a step (SmolLM-135M, 2 layers): accumulator row 0 is zero, no flag word is set, and the last row / 2^32
    is the last layer's MLP of rmsnorm(o_mid) (o_mid: the residual after its attention) computed in fp32 by torch
    from the same packed weights (1e-5: fp32 order). Then 30 replays of one step give the same logits and
    accumulator bits (a race would move them: the review of session 43 found a missing CTA barrier this way)."""
    from megabake.codegen import generate
    from megabake.plan.stages import norm_slot, spec_of
    from megabake.runtime import MegakernelDecoder

    compiled = _compiled("smollm-135m", 2048)
    plan, d = compiled.plan, compiled.plan.dims
    decoder = MegakernelDecoder(plan, generate(plan, fused_mlp=True).source, compiled.model, device="cuda")
    tokens = torch.tensor([[5], [17], [29], [41]])
    for position, token in enumerate(tokens):
        logits = decoder.step(token, position).float().clone()
    acc = decoder.buffers["mlp_acc"].cpu()
    assert acc.dtype == torch.int64 and not acc[0].any() and not acc[:, d.hidden:].any()
    up_stage = next(s for s in plan.stages if s.scope == "layer" and s.name == "norm_gate_up")
    slot = norm_slot(spec_of(up_stage, plan).vector.norm_role, plan)
    residual = decoder.buffers["o_mid"][0].double().cpu()
    normed = residual * torch.rsqrt(residual.square().mean() + d.eps) * decoder.buffers["norms"][-1, slot].double().cpu()
    gate_up = decoder.buffers["w_gate_up"][-1].double().cpu() @ normed
    activation = torch.nn.functional.silu(gate_up[0::2]) * gate_up[1::2]
    expected = decoder.buffers["w_down"][-1].double().cpu() @ activation
    got = acc[-1, :d.hidden].double() / 2.0 ** 32
    assert float((got - expected).norm() / expected.norm()) < 1e-5
    kept = acc.clone()
    for _ in range(30):
        again = decoder.step(tokens[-1], len(tokens) - 1).float()
        assert torch.equal(again, logits) and torch.equal(decoder.buffers["mlp_acc"].cpu(), kept)
