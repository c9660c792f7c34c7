"""Gemma 3 text: 5 local layers (sliding window, RoPE base 10k) to 1 global (base 1M) rotate with two rotary
tables from one region. The IR emits a RotaryTable per inv_freq buffer, the plan records each layer's table
(``rope_cos``/``rope_sin`` [tables, capacity, head_dim], ``rope_table`` [layers]) and the kernel slices the
layer's own (verified on the H200 in session 9: ``tests/test_gpu_decode.py -k gemma3``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megabake.errors import PlanError
from megabake.ir import RoPE, RotaryTable
from megabake.plan.reference import reference_executor_for
from megabake.presets import get_preset
from tests.compiler_fixtures import (assert_matches_eager, assert_prefill_then_decode_matches_full_forward, body_calls,
                                     compile_model, compile_preset)


@pytest.fixture(scope="module")
def tiny_gemma3():
    return compile_preset("tiny-gemma3", capacity=160, ctas=4)


def test_one_region_gives_a_rotary_table_per_layer_type(tiny_gemma3):
    tables = tiny_gemma3.ir.of_kind(RotaryTable)
    assert [t.slot for t in tables] == [0, 1] and len({t.submodule for t in tables}) == 1
    assert [t.inv_freq.endswith(k) for t, k in zip(tables, ("sliding_attention_inv_freq",
                                                            "full_attention_inv_freq"))] == [True, True]
    uses = [op.table for op in tiny_gemma3.ir.of_kind(RoPE)]
    assert uses == [tables[0].id] * 10 + [tables[1].id] * 2  # q and k of layers 0-4, then the global layer 5


def test_plan_records_each_layers_table_and_window(tiny_gemma3):
    plan = tiny_gemma3.plan
    assert [layer.rope_table for layer in plan.layers] == [0, 0, 0, 0, 0, 1]
    assert plan.windows == [48] * 5 + [0] and plan.layout == "sandwich" and plan.has_head_norms
    assert [r.inv_freq_buffer for r in plan.rope_tables] == ["model.rotary_emb.sliding_attention_inv_freq",
                                                              "model.rotary_emb.full_attention_inv_freq"]
    assert plan.buffer("rope_cos").shape == [2, 160, 64] and plan.buffer("rope_table").shape == [6]
    assert type(plan).from_json(plan.to_json()).to_json() == plan.to_json()
    (call,) = body_calls(tiny_gemma3.generated.source, "split_kv_attention")
    assert call["rope_cos"] == "rope_cos[rope_table[layer], None, None]"


def test_a_model_with_one_table_has_no_table_index():
    plan = compile_preset("tiny-llama", capacity=32).plan
    assert not plan.rope_tables and "rope_tables" not in plan.to_dict()
    assert all("rope_table" not in layer for layer in plan.to_dict()["layers"])
    assert plan.buffer("rope_cos").shape == [32, 64]


def test_gemma3_matches_eager_fp32_past_its_window(tiny_gemma3):
    """150 advancing steps over window 48: local layers slide, the global one rotates with base 1M. (Keys of the
    sixth layer differ from eager's by fp32 rounding, ~5e-5 on values of order 1; the logits by up to 2e-5 rel-L2
    at step 96 with torch 2.13.0's CPU wheel of session 15, where 1e-5 had passed before: rounding, against the
    O(1) of a wrong table, next test.)"""
    model = tiny_gemma3.model
    assert_matches_eager(model, reference_executor_for(tiny_gemma3.plan, model), steps=150, tol=5e-5,
                         cache_atol=2e-4)


def test_rotating_the_global_layer_with_the_local_table_would_be_caught(tiny_gemma3):
    plan = dataclasses.replace(tiny_gemma3.plan, layers=[dataclasses.replace(layer, rope_table=0)
                                                         for layer in tiny_gemma3.plan.layers])
    with pytest.raises(AssertionError, match="step"):
        assert_matches_eager(tiny_gemma3.model, reference_executor_for(plan, tiny_gemma3.model), steps=8)


def test_a_kernel_feature_not_yet_verified_on_a_gpu_is_refused_until_enabled(monkeypatch):
    """The gate a new kernel feature lands behind (here rope_tables, as it was before session 9's H200 run):
    refused naming the feature and the opt-in variable, baked once the variable names it."""
    import megabake.plan

    monkeypatch.setattr(megabake.plan, "GPU_VERIFIED_FEATURES", ())
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    with pytest.raises(PlanError, match=r"per-layer rotary tables.*'rope_tables'.*MEGABAKE_EXPERIMENTAL_LAYOUTS=rope_tables"):
        compile_preset("tiny-gemma3", capacity=32)
    monkeypatch.setenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", "rope_tables")
    assert compile_preset("tiny-gemma3", capacity=32).plan.has_rope_tables


def test_bf16_cast_keeps_each_layer_types_exact_frequencies():
    """Both per-layer-type buffers are rotary buffers: recomputed from the config in fp32, restored after a cast
    (a bf16-rounded base-1M table would rotate the global layer's keys wrongly at long context)."""
    from megabake.rope import cast_model, exact_inv_freq, exact_rotary_buffers

    model = get_preset("tiny-gemma3").build_model()
    exact = {fqn: t.clone() for fqn, t in exact_rotary_buffers(model).items()}
    assert {f.rsplit(".", 1)[1] for f in exact} >= {"sliding_attention_inv_freq", "full_attention_inv_freq"}
    model.to(torch.bfloat16)
    for fqn, values in exact.items():
        assert model.get_buffer(fqn).dtype == torch.bfloat16
        assert torch.equal(exact_inv_freq(model, fqn), values), fqn
    cast_model(model, dtype=torch.bfloat16)
    assert all(torch.equal(model.get_buffer(fqn), values) for fqn, values in exact.items())


def test_prefill_past_the_window_then_decode_matches_a_full_forward():
    compiled = compile_preset("tiny-gemma3", capacity=128, ctas=4)
    assert_prefill_then_decode_matches_full_forward(compiled, prompt=90, total=100, seed=4)


def test_gemma3_1b_shape_plans():
    """The real 26-layer shape (two layers built, the plan's shape checks are per layer)."""
    preset = get_preset("gemma-3-1b")
    small = dataclasses.replace(preset, config=dict(preset.config, num_hidden_layers=6, vocab_size=4096))
    plan = compile_model(small.build_model(), capacity=1024).plan
    assert plan.dims.head_dim == 256 and plan.dims.n_kv_heads == 1 and plan.windows == [512] * 5 + [0]
