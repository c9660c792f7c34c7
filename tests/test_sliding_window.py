"""Sliding-window attention (Mistral, Gemma 2's local layers): recognised from transformers' mask, carried per
layer through the plan, run by the split-KV attention over (position - window, position], checked against eager
fp32 past the window on the CPU and compiled for sm_90a."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megabake.errors import PlanError
from megabake.ir import DecodeAttention
from megabake.plan.reference import reference_executor_for
from megabake.presets import get_preset
from tests.compiler_fixtures import (assert_matches_eager, assert_prefill_then_decode_matches_full_forward, body_calls,
                                     compile_model, compile_preset)


def _model(preset: str, **config):
    base = get_preset(preset)
    return dataclasses.replace(base, config=dict(base.config, **config)).build_model()


def _windows(compiled) -> list[int]:
    return [op.window for op in compiled.ir.ops if isinstance(op, DecodeAttention)]


@pytest.fixture(scope="module")
def tiny_mistral():
    """Window 96 over 320 slots: past the window the first visible key moves; two splits hold the window."""
    return compile_preset("tiny-mistral", capacity=320, ctas=4)


def test_mistral_window_reaches_every_layer_and_the_plan(tiny_mistral):
    plan = tiny_mistral.plan
    assert _windows(tiny_mistral) == [96, 96]
    assert plan.windows == [96, 96] and plan.has_windows
    assert plan.buffer("attn_window").shape == [2] and plan.buffer("attn_window").dtype == "int32"
    assert plan.attn_window_table() == [96, 96]
    assert all(layer["window"] == 96 for layer in plan.to_dict()["layers"])
    assert "attn_window" in tiny_mistral.generated.arguments
    (call,) = body_calls(tiny_mistral.generated.source, "split_kv_attention")
    assert call["first_key"] == "cutlass.max(pos + 1 - attn_window[layer], 0)"


def test_a_window_covering_the_bucket_is_the_causal_mask():
    """window >= capacity: no window in the IR, the plan or the kernel (the plan of a model without one)."""
    compiled = compile_preset("tiny-mistral", capacity=96)
    assert _windows(compiled) == [0, 0] and not compiled.plan.has_windows
    assert all("window" not in layer for layer in compiled.plan.to_dict()["layers"])
    assert "attn_window" not in compiled.generated.arguments
    (call,) = body_calls(compiled.generated.source, "split_kv_attention")
    assert call["first_key"] == "0"


def test_mistral_matches_eager_fp32_past_the_window(tiny_mistral):
    """300 advancing steps: the window starts to slide at position 96 and crosses split boundaries; the kernel's
    reference executor keeps the eager fp32 model's logits (a wrong first key would move them at step 96)."""
    executor = reference_executor_for(tiny_mistral.plan, tiny_mistral.model)
    errors = assert_matches_eager(tiny_mistral.model, executor, steps=300)
    assert max(errors[96:]) < 1e-5


def test_reading_keys_outside_the_window_would_be_caught(tiny_mistral):
    """The check above can fail: the same executor with the window switched off drifts from eager past 96."""
    plan = dataclasses.replace(tiny_mistral.plan, layers=[dataclasses.replace(layer, window=0)
                                                          for layer in tiny_mistral.plan.layers],
                               buffers=[b for b in tiny_mistral.plan.buffers if b.name != "attn_window"])
    executor = reference_executor_for(plan, tiny_mistral.model)
    with pytest.raises(AssertionError, match="step 9[6-9]|step 1[0-9][0-9]"):
        assert_matches_eager(tiny_mistral.model, executor, steps=140)


def test_gemma2_windows_only_its_sliding_layers_and_matches_eager():
    """Gemma 2 alternates sliding (even) and full (odd) layers; window 48 over 160 slots, 150 steps."""
    model = _model("tiny-gemma2", sliding_window=48)
    compiled = compile_model(model, capacity=160, ctas=4)
    assert compiled.plan.windows == [48, 0] and compiled.plan.attn_window_table() == [48, 160]
    assert_matches_eager(model, reference_executor_for(compiled.plan, model), steps=150)


def test_batched_window_matches_eager():
    model = _model("tiny-mistral", sliding_window=40)
    # fp32 GEMV inputs (batch 2's default stages bf16 for the tensor cores): the window math against eager fp32
    compiled = compile_model(model, batch=2, capacity=96, ctas=8, staging="float32")
    executor = reference_executor_for(compiled.plan, model)
    from megabake.capture import full_length_static_cache

    cache = full_length_static_cache(model.config, 96)
    tokens = torch.randint(1, 1024, (2, 90), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for pos in range(90):
            want = model(tokens[:, pos:pos + 1], past_key_values=cache, use_cache=True,
                         cache_position=torch.tensor([pos])).logits[:, -1]
            got = executor.step(tokens[:, pos], pos)
            assert float((got - want).norm() / want.norm()) < 1e-5, pos


def test_prefill_past_the_window_then_decode_matches_a_full_forward():
    """The runtime's prefill keeps every position of a sliding layer (transformers' StaticCache would keep a
    window-long ring): a 120-token prompt over window 96, then 8 megakernel (reference backend) steps, against
    the eager model's full-sequence logits."""
    compiled = compile_preset("tiny-mistral", capacity=160, ctas=4)
    assert_prefill_then_decode_matches_full_forward(compiled, prompt=120, total=128, seed=9)


def test_window_needs_the_split_kv_attention():
    model = get_preset("tiny-mistral").build_model()
    with pytest.raises(PlanError, match=r"sliding-window attention \(window 96\).*without --attention-preload"):
        from megabake.compiler import compile_step

        compile_step(model, capacity=128, attention_preload=True)
