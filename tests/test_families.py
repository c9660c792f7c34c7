"""Model families beyond Llama on the CPU: plan recognition, the reference executor against eager fp32 over
advancing steps (split-KV boundaries included), and the CuTe DSL compile of the generated module for sm_90a.

Gemma (tiny-gemma, gemma-2b shapes): GeGLU with tanh GELU, embedding scaled by sqrt(hidden) as the model
rounds it, RMSNorm with (1 + weight), head_dim 256 and a single KV head. Granite (tiny-granite): Llama plus four
scalars, folded into the plan (embedding scale, softmax scale, the packed o/down weights' and final norm's scale).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megabake.plan.reference import reference_executor_for
from megabake.presets import get_preset
from tests.compiler_fixtures import assert_matches_eager, body_calls, compile_model, compile_preset


@pytest.fixture(scope="module")
def tiny_gemma():
    return compile_preset("tiny-gemma", capacity=160)


def test_gemma_plan_records_its_features(tiny_gemma):
    dims = tiny_gemma.plan.dims
    assert dims.act == "gelu_tanh" and dims.norm_offset == 1.0 and dims.n_kv_heads == 1
    assert dims.embed_scale == torch.tensor(math.sqrt(256.0)).item() == 16.0
    assert '"embed_scale": 16.0' in tiny_gemma.plan.to_json()
    source = tiny_gemma.generated.source
    assert "EMBED_SCALE = 16.0" in source and "bodies.embed_gather_scaled(" in source
    kernel = source.split("# ====")[0]
    acts = [call["act"] for call in body_calls(source, "gemv_rows_streamed")]
    assert acts.count("2") == 1 and set(acts) == {"0", "2"}  # the gate/up GEMV writes gelu_tanh(gate) * up
    assert "bodies.gelu_mul_to_smem(" not in kernel and "bodies.silu_mul_to_smem(" not in kernel
    unfused = tiny_gemma.replan(tuning={}).generated.source  # the activation staged by the down stage instead
    assert body_calls(unfused, "gelu_mul_to_smem") == [dict(gate_up="gate_up", s_vec="s_vec", tidx="tidx",
                                                           batch="BATCH", inter="INTER", threads="THREADS",
                                                           approximate="True")]


def test_llama_plan_json_has_no_embed_scale():
    """Models without an embedding scale keep their plan bytes (and hash) from before the field existed."""
    plan = compile_preset("tiny-llama", capacity=32).plan
    assert plan.dims.embed_scale == 1.0 and "embed_scale" not in plan.to_json()
    assert type(plan).from_json(plan.to_json()).hash == plan.hash


def test_gemma_reference_executor_matches_eager_fp32_past_a_kv_split_boundary(tiny_gemma):
    """140 advancing steps: attention splits the cache in chunks of 128 positions, so the last steps merge two
    partial softmaxes; the scaled embedding, GeGLU and (1 + w) norms all enter every step."""
    errors = assert_matches_eager(tiny_gemma.model, reference_executor_for(tiny_gemma.plan, tiny_gemma.model),
                                   steps=140)
    assert max(errors) < 1e-5


def tiny_phi3(head_dim: int = 64, capacity_positions: int = 4096):
    """A 2-layer Phi-3 over 4 heads of ``head_dim`` (96 is Phi-3-mini's): fused qkv_proj and gate_up_proj."""
    import transformers

    config = transformers.Phi3Config(hidden_size=4 * head_dim, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=1, max_position_embeddings=capacity_positions,
                                     original_max_position_embeddings=capacity_positions, rope_scaling=None)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    from megabake.presets import _randomize_norm_weights

    _randomize_norm_weights(model, 0)
    return model


def test_phi3_fused_projections_pack_rows_of_one_weight_and_match_eager_fp32():
    """Phi-3's qkv_proj and gate_up_proj are sliced in the graph: the plan packs row ranges of the fused weights
    (q | k | v and gate | up, as Llama's separate projections) and the step matches eager fp32 past a KV split."""
    from tests.compiler_fixtures import compile_model

    model = tiny_phi3()
    compiled = compile_model(model, capacity=160)
    plan = compiled.plan
    assert plan.dims.head_dim == 64 and plan.dims.q_rows == 256 and plan.dims.kv_rows == 128
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    assert plan.packed[1].sources[0] == [(fused, 0, 256), (fused, 256, 384), (fused, 384, 512)]
    gate_up = next(p for p in plan.packed if p.buffer == "w_gate_up").sources[1]
    assert gate_up == [("model.layers.1.mlp.gate_up_proj.weight", 0, 512),
                       ("model.layers.1.mlp.gate_up_proj.weight", 512, 1024)]
    assert type(plan).from_json(plan.to_json()).packed == plan.packed
    assert_matches_eager(model, reference_executor_for(plan, model), steps=140)


@pytest.fixture(scope="module")
def tiny_phi3_96():
    return compile_preset("tiny-phi3", capacity=160, ctas=4)


def test_head_dim_96_plans_lane_groups_padded_to_16_and_matches_eager_fp32(tiny_phi3_96):
    """Phi-3-mini's head_dim 96 reads a cached row with 12 lanes; the split-KV attention pads a lane group to 16
    (session 7's wrong H200 result: 12-lane groups shuffled as if a power of two). Two positions per warp pass,
    so a split is a multiple of 8 warps x 2 x unroll 4; the reference executor matches eager fp32 past a KV split
    and past the 96-position window (the lanes themselves are checked on the H200: test_gpu_decode -k phi3)."""
    plan, model = tiny_phi3_96.plan, tiny_phi3_96.model
    attention = next(s.tiling for s in plan.stages if s.kind == "attention")
    assert plan.dims.head_dim == 96 and plan.windows == [96, 96] and attention.per_tile == 64
    assert_matches_eager(model, reference_executor_for(plan, model), steps=140)


def test_head_dims_outside_the_lane_layout_are_refused_naming_the_limit():
    from megabake.compiler import compile_step
    from megabake.errors import PlanError

    with pytest.raises(PlanError, match=r"head_dim 96 is baked into the split-KV attention only .* 32, 64, 128, 256"):
        compile_step(tiny_phi3(head_dim=96), capacity=64, split_kv=False)
    with pytest.raises(PlanError, match=r"head_dim 36 .* multiples of 8 from 32 to 256"):
        compile_model(tiny_phi3(head_dim=36), capacity=64)





@pytest.fixture(scope="module")
def tiny_phi4():
    """tiny-phi4 at 320 KV slots: past its original long-RoPE range of 128 positions (and past a KV split)."""
    return compile_preset("tiny-phi4", capacity=320, ctas=4)


LONG_ROPE_SCALING = math.sqrt(1 + math.log(8192 / 128) / math.log(128))  # tiny-phi4: factor 64 over 128 positions


def test_partial_rotary_is_one_rope_op_over_the_whole_head(tiny_phi4):
    """``cat([rope(q[..., :48]), q[..., 48:]])`` lowers to one RoPE op with rotary_dim 48 over the 64-wide head;
    the plan records it (a plan without partial rotary does not name it) and module.py passes ROTARY_DIM."""
    from megabake.ir import RoPE

    ropes = tiny_phi4.ir.of_kind(RoPE)
    assert len(ropes) == 4 and {(op.head_dim, op.rotary_dim) for op in ropes} == {(64, 48)}
    assert tiny_phi4.plan.dims.rotary_dim == 48 and tiny_phi4.plan.to_dict()["dims"]["rotary_dim"] == 48
    assert "rotary_dim" not in compile_preset("tiny-llama").plan.to_dict()["dims"]
    call = body_calls(tiny_phi4.generated.source, "split_kv_attention")[0]
    assert call["rotary_dim"] == "ROTARY_DIM" and "ROTARY_DIM = 48" in tiny_phi4.generated.source


def test_long_rope_bucket_past_its_original_range_records_the_switch_in_the_plan(tiny_phi4):
    """A 320-slot bucket of a model whose long-RoPE original range is 128: the step is exported over the short
    factors and the plan's ``rotary`` records the long factors' fp32 inverse frequencies (as transformers computes
    them past the range) and the first position that rotates with them; plan.json round-trips them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    plan, model = tiny_phi4.plan, tiny_phi4.model
    rotary_emb = model.model.rotary_emb
    assert rotary_emb.rope_type == "longrope" and plan.rotary.attention_scaling == pytest.approx(LONG_ROPE_SCALING)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, "cpu", seq_len=129)
    assert plan.rotary.long_from == 128 and torch.equal(torch.tensor(plan.rotary.long_inv_freq), long)
    assert not torch.equal(long, rotary_emb.original_inv_freq)
    recorded = tiny_phi4.captured.long_rope["model.rotary_emb.inv_freq"]
    assert torch.equal(recorded[0], long) and recorded[1] == 128
    data = plan.to_dict()["rotary"]
    assert data["long_from"] == 128 and len(data["long_inv_freq"]) == 24
    again = type(plan).from_json(plan.to_json())
    assert again.rotary == plan.rotary and again.hash == plan.hash
    assert tiny_phi4.plan_for().hash == plan.hash  # replan keeps the switch


def test_long_rope_tables_switch_to_the_long_factors_at_the_original_range(tiny_phi4):
    """Rows below 128 are the short factors' (as a bucket within the range has them), rows from 128 on the long
    factors', both times the same attention scaling; features past the 48 rotated pass (cos 1, sin 0)."""
    from megabake.plan.packing import plan_inv_freqs, rotary_tables

    plan, model = tiny_phi4.plan, tiny_phi4.model
    cos, sin = rotary_tables(plan, plan_inv_freqs(plan, model))
    positions = torch.arange(320, dtype=torch.float32)[:, None]
    for rows, inv_freq in ((slice(0, 128), model.model.rotary_emb.original_inv_freq),
                           (slice(128, 320), torch.tensor(plan.rotary.long_inv_freq))):
        freqs = positions[rows] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        assert torch.equal(cos[rows, :48], emb.cos() * plan.rotary.attention_scaling)
        assert torch.equal(sin[rows, :48], emb.sin() * plan.rotary.attention_scaling)
    assert torch.equal(cos[:, 48:], torch.ones(320, 16)) and torch.equal(sin[:, 48:], torch.zeros(320, 16))


def test_long_rope_past_its_original_range_matches_eager_fp32_token_by_token(tiny_phi4):
    """200 advancing steps from position 0: 48 of 64 features rotate with the short long-RoPE factors up to
    position 127 and with the long ones from 128 on (transformers' switch, max(position_ids) + 1 > 128), with the
    attention scaling of both; the other 16 pass through (tables hold cos 1, sin 0 there). Past a KV split too.
    The model's ``inv_freq`` holds the long factors after such a run: tables bound afterwards (a runtime built
    after an eager run) still take the short ones from ``original_inv_freq``."""
    plan, model = tiny_phi4.plan, tiny_phi4.model
    executor = reference_executor_for(plan, model)
    errors = assert_matches_eager(model, executor, steps=200)
    assert max(errors) < 1e-5
    assert torch.equal(model.model.rotary_emb.inv_freq, torch.tensor(plan.rotary.long_inv_freq))  # HF switched
    again = reference_executor_for(plan, model)
    assert torch.equal(again.cos, executor.cos) and torch.equal(again.sin, executor.sin)


@pytest.mark.parametrize("long_from", [0, 127, 129])
def test_a_missed_or_misplaced_long_rope_switch_would_be_caught(tiny_phi4, long_from):
    """The same plan with the short factors everywhere (no switch) or the switch one position early or late
    does not match eager: the first step that differs is the first one whose rotation differs."""
    from megabake.plan.packing import plan_inv_freqs, rotary_tables

    plan, model = tiny_phi4.plan, tiny_phi4.model
    moved = dataclasses.replace(plan, rotary=dataclasses.replace(
        plan.rotary, long_inv_freq=plan.rotary.long_inv_freq if long_from else [], long_from=long_from))
    executor = reference_executor_for(plan, model)
    executor.cos, executor.sin = rotary_tables(moved, plan_inv_freqs(moved, model))
    first_wrong = min(long_from, 128) if long_from else 128
    with pytest.raises(AssertionError, match=rf"step {first_wrong}: rel-L2"):
        assert_matches_eager(model, executor, steps=first_wrong + 1)


def test_long_rope_bucket_within_its_original_range_has_no_long_fields():
    """A bucket of at most 128 positions only ever uses the short factors: no switch is captured, and the plan
    (JSON and hash) is the one built without any long-RoPE input, as before the switch existed."""
    from megabake.plan import build_plan

    compiled = compile_preset("tiny-phi4", capacity=128, ctas=4)
    plan = compiled.plan
    assert compiled.captured.long_rope == {} and not plan.rotary.long_inv_freq and plan.rotary.long_from == 0
    assert set(plan.to_dict()["rotary"]) == {"attention_scaling", "head_dim", "inv_freq_buffer", "ops"}
    assert "long_" not in plan.to_json()
    plain = build_plan(compiled.ir, ctas=4, inv_freq_buffer=compiled.inv_freq_buffer,
                       rotary_scaling=compiled.rotary_scaling)
    assert plain.to_json() == plan.to_json()
    assert_matches_eager(compiled.model, reference_executor_for(plan, compiled.model), steps=128)


def test_rotating_the_whole_head_would_be_caught(tiny_phi4):
    """The same plan read as a full rotation (pairs d, d + 32 instead of d, d + 24) does not match eager."""
    from megabake.plan.packing import rotary_tables

    plan, model = tiny_phi4.plan, tiny_phi4.model
    whole = dataclasses.replace(plan, dims=dataclasses.replace(plan.dims, rotary_dim=0),
                                rotary=dataclasses.replace(plan.rotary, long_inv_freq=[], long_from=0))
    executor = reference_executor_for(plan, model)
    full_cos, full_sin = rotary_tables(whole, model.model.rotary_emb.original_inv_freq.repeat(2)[:32])
    executor.plan, executor.cos, executor.sin = whole, full_cos, full_sin
    with pytest.raises(AssertionError, match="step"):
        assert_matches_eager(model, executor, steps=8)


def test_partial_rotary_is_baked_into_the_split_kv_attention_only():
    from megabake.compiler import compile_step
    from megabake.errors import PlanError

    with pytest.raises(PlanError, match=r"partial rotary \(rotary_dim 48 of head_dim 64\) is baked into the split-KV"):
        compile_step(get_preset("tiny-phi4").build_model(), capacity=64, split_kv=False)


# ------------------------------------------------------------------------------------------- OLMo-2
@pytest.fixture(scope="module")
def tiny_olmo2():
    return compile_preset("tiny-olmo2", capacity=160, ctas=4)


def test_olmo2_plans_the_post_norm_layout_with_whole_projection_qk_norms(tiny_olmo2):
    """No norm before attention or the MLP: q/k/v and gate/up read the residual stream (the staged row is the
    new residual, ``residual_norm_to_smem(..., normalize=False)``); q/k RMSNorm spans the whole projection, its
    weights packed [layers, q_rows + kv_rows] at the qkv row's offsets."""
    plan = tiny_olmo2.plan
    assert plan.layout == "post_norm" and plan.dims.whole_qk_norm and plan.to_dict()["dims"]["whole_qk_norm"]
    assert plan.buffer("qk_norms").shape == [2, plan.dims.q_rows + plan.dims.kv_rows]
    assert plan.buffer("norms").shape == [2, 2, plan.dims.hidden]  # post-attention, post-feed-forward
    assert {"input_norm", "post_norm"}.isdisjoint(plan.layers[0].params)
    stagings = body_calls(tiny_olmo2.generated.source, "residual_norm_to_smem")
    assert [call["normalize"] for call in stagings] == ["False", "False", "True"]  # qkv, gate/up; final norm
    assert body_calls(tiny_olmo2.generated.source, "split_kv_attention")[0]["whole_qk_norm"] == "True"
    assert "whole_qk_norm" not in compile_preset("qwen3-0.6b", layers=1, vocab=4096, capacity=32).plan.to_dict()["dims"]


def test_the_kv_pipeline_is_the_default_for_one_query_head_per_kv_head_of_128_or_more(tiny_olmo2):
    """``codegen.default_kv_pipeline``: OLMo-2 (one query head per KV head x 128, the tiny preset's shape too)
    streams split-KV rows one loop iteration ahead; GQA (Qwen3, 128 wide) and narrow MHA heads (SmolLM-1.7B, 64
    wide) keep the plain loop, where the H200 measured no gain."""
    from megabake.codegen import KV_FENCE, default_kv_pipeline
    from megabake.plan import kv_splits

    assert default_kv_pipeline(tiny_olmo2.plan) and "KV_PIPELINE = True" in tiny_olmo2.generated.source
    for preset, expected in (("olmo-2-1b", True), ("qwen3-0.6b", False), ("smollm-1.7b", False)):
        compiled = compile_preset(preset, layers=1, vocab=4096, capacity=256)
        assert default_kv_pipeline(compiled.plan) is expected, preset
        mode = True if expected else KV_FENCE if kv_splits(compiled.plan) else False  # default_kv_fence otherwise
        assert f"\nKV_PIPELINE = {mode}\n" in compiled.generated.source, preset


def test_the_kv_fence_is_the_default_where_the_lane_group_loop_runs_without_the_kv_pipeline(tiny_olmo2, monkeypatch):
    """``codegen.default_kv_fence``: on where attention is split and the K/V pipeline is off (SmolLM-135M), never
    beside the pipeline (OLMo-2); ``kv_fence=False`` still builds the plain loop, and so does a plan without split
    attention. The feature is GPU-verified (session 58); the flag itself decides it."""
    import megabake.plan as plan_module
    from megabake.codegen import default_kv_fence, generate

    smollm = compile_preset("smollm-135m", layers=1, vocab=4096, capacity=2048)
    assert default_kv_fence(smollm.plan, kv_pipeline=False)
    assert "\nKV_PIPELINE = 2\n" in smollm.generated.source
    assert "\nKV_PIPELINE = False\n" in generate(smollm.plan, kv_fence=False).source
    assert not default_kv_fence(tiny_olmo2.plan, kv_pipeline=True)
    assert "\nKV_PIPELINE = True\n" in tiny_olmo2.generated.source
    short = compile_preset("smollm-135m", layers=1, vocab=4096, capacity=128)
    if not plan_module.kv_splits(short.plan):
        assert not default_kv_fence(short.plan, kv_pipeline=False)
    verified = tuple(f for f in plan_module.GPU_VERIFIED_FEATURES if f != "kv_fence")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", verified)
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    assert not default_kv_fence(smollm.plan, kv_pipeline=False)
    assert "\nKV_PIPELINE = False\n" in generate(smollm.plan).source


def test_group_fold_is_built_by_default_only_where_it_changes_the_module(monkeypatch):
    """``codegen.default_group_fold`` (the default since session 60, when the GPU suite passed with it): Qwen3-0.6B
    (16 splits a KV group at batch 1, fused_split) folds 16 splits, while a build whose groups have no more splits
    than :func:`fold_splits` allows (OLMo-2-1B: 8) is unchanged; it needs fused_split."""
    from megabake.codegen import default_group_fold, fold_splits, generate, group_fold_splits

    qwen3 = compile_preset("qwen3-0.6b", layers=1, vocab=4096, capacity=4096)
    olmo = compile_preset("olmo-2-1b", layers=1, vocab=4096, capacity=4096)
    assert (fold_splits(qwen3.plan), group_fold_splits(qwen3.plan)) == (8, 16)
    assert default_group_fold(qwen3.plan, fold_merge=True, fused_split=True)
    assert not default_group_fold(qwen3.plan, fold_merge=True, fused_split=False)
    assert not default_group_fold(qwen3.plan, fold_merge=False, fused_split=True)
    assert "\nFOLD_SPLITS = 16\n" in generate(qwen3.plan).source
    assert "\nFOLD_SPLITS = 8\n" in generate(qwen3.plan, group_fold=False).source
    assert group_fold_splits(olmo.plan) == fold_splits(olmo.plan) == 8
    assert not default_group_fold(olmo.plan, fold_merge=True, fused_split=True)
    import megabake.plan as plan_module

    verified = tuple(f for f in plan_module.GPU_VERIFIED_FEATURES if f != "group_fold")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", verified)
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    assert not default_group_fold(qwen3.plan, fold_merge=True, fused_split=True)  # the feature decides it
    assert "\nFOLD_SPLITS = 8\n" in generate(qwen3.plan).source


def test_group_fold_changes_the_batch_1_default_of_the_presets_the_scorecard_dates_by_it():
    """benchmarks/status.py dates the batch-1 cells of ``GROUP_FOLD_PRESETS`` by session 60 (their stored numbers
    predate group_fold, so a failing row is stale): exactly the non-tiny presets whose batch-1 default module changes
    with it (fused_split, more than 8 splits a KV group; batches 4 / 8 have 8 or fewer)."""
    from megabake.codegen import generate
    from megabake.presets import PRESETS
    from tests.test_loader_warp import _bench_status

    changed = set()
    for name in (n for n in PRESETS if not n.startswith("tiny-")):
        plan = compile_preset(name, layers=1, vocab=512, capacity=2048).plan
        if generate(plan).source != generate(plan, group_fold=False).source:
            changed.add(name)
    assert changed == _bench_status().GROUP_FOLD_PRESETS


def test_the_runtime_reads_the_tensor_core_attention_of_every_build(monkeypatch):
    """``MegakernelDecoder.mma_attention`` / ``fused_mma`` (what its reference executor mirrors) come from module.py's
    header constants, which candidate builds set to a load-mode number (``early_kv``: 3): still on; off where the
    build scores on the lane-group loop."""
    from megabake.codegen import generate
    from megabake.runtime import MegakernelDecoder

    compiled = compile_preset("smollm-135m", layers=1, vocab=4096, capacity=2048)
    for build, expected in (({}, True), ({"early_kv": True}, True), ({"mma_attention": False}, False)):
        decoder = MegakernelDecoder(compiled.plan, generate(compiled.plan, **build).source, compiled.model,
                                    backend="reference")
        assert (decoder.mma_attention, decoder.fused_mma) == (expected, expected), build


def test_olmo2_matches_eager_fp32_past_a_kv_split(tiny_olmo2):
    assert_matches_eager(tiny_olmo2.model, reference_executor_for(tiny_olmo2.plan, tiny_olmo2.model), steps=140)


def test_olmo2_whole_projection_norms_are_not_per_head_norms(tiny_olmo2):
    """The same weights normalised per head instead (each head's own RMS) do not match eager: the test can fail."""
    plan, model = tiny_olmo2.plan, tiny_olmo2.model
    executor = reference_executor_for(plan, model)
    d = plan.dims

    def per_head(x, layer, b, which, offset):
        weight = executor.w["qk_norms"][layer, offset:offset + d.head_dim]
        return x * torch.rsqrt(x.pow(2).mean() + d.eps) * weight

    executor._head_norm = per_head
    with pytest.raises(AssertionError, match="step"):
        assert_matches_eager(model, executor, steps=8)


def test_qwen3_5_hybrid_layers_are_refused_by_their_layer_type():
    """Qwen3.5's Gated DeltaNet layers keep a recurrent state beside the KV cache: refused at capture, naming the
    layer types, instead of an AttributeError from deep inside the export."""
    import transformers

    from megabake.compiler import compile_step
    from megabake.errors import UnsupportedGraphError

    config = transformers.Qwen3_5TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                            vocab_size=512)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with pytest.raises(UnsupportedGraphError, match=r"'linear_attention' layers \(full_attention x1, "
                                                    r"linear_attention x3\).*recurrent state"):
        compile_step(model, capacity=32)


# ------------------------------------------------------------------------------------------- Gemma 2
@pytest.fixture(scope="module")
def tiny_gemma2():
    return compile_preset("tiny-gemma2", capacity=160)


def test_a_layout_not_yet_verified_on_a_gpu_is_refused_until_enabled(monkeypatch):
    """A layout whose kernel has not run on a GPU (here: sandwich, as it was before session 8's H200 run) is
    refused naming the opt-in variable, and bakes once the variable names it."""
    import megabake.plan
    from megabake.errors import PlanError

    monkeypatch.setattr(megabake.plan, "GPU_VERIFIED_LAYOUTS", ("pre_norm",))
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    with pytest.raises(PlanError, match=r"'sandwich' decoder layout, .* MEGABAKE_EXPERIMENTAL_LAYOUTS=sandwich"):
        compile_preset("tiny-gemma2", capacity=32)
    monkeypatch.setenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", "pre_norm, sandwich")
    assert compile_preset("tiny-gemma2", capacity=32).plan.layout == "sandwich"


def test_gemma2_plan_uses_the_sandwich_layout(tiny_gemma2):
    """Norms before and after attention and the MLP: the o and down GEMVs write their own rows and the next
    stage's staging adds their normalised output to the residual (no extra grid barrier)."""
    plan = tiny_gemma2.plan
    assert plan.layout == "sandwich" and plan.dims.final_softcap == 3.0
    assert plan.barriers_per_step == 1 + 5 * plan.dims.layers
    assert plan.buffer("norms").shape == [2, 4, 256]
    assert plan.layers[1].params["post_ffn_norm"] == "model.layers.1.post_feedforward_layernorm.weight"
    o_stage = next(s for s in plan.stages if s.name == "o_residual")
    assert o_stage.writes == ["o_out"] and "x" not in o_stage.writes
    source = tiny_gemma2.generated.source
    assert any(call["x"] == "x_mid" and call["delta"] == "down_out"
               and call["post_weight"] == "norms[cutlass.max(layer - 1, 0), 3, None]"
               for call in body_calls(source, "residual_norm_to_smem"))
    assert body_calls(source, "softcap_rows")[0]["out"] == "logits" and "FINAL_SOFTCAP = 3.0" in source
    again = type(plan).from_json(plan.to_json())
    assert again.layout == "sandwich" and again.hash == plan.hash and '"layout": "sandwich"' in plan.to_json()


def test_pre_norm_plans_do_not_name_a_layout_or_softcap():
    plan = compile_preset("tiny-llama", capacity=32).plan
    text = plan.to_json()
    assert plan.layout == "pre_norm" and '"layout"' not in text and "final_softcap" not in text


def test_gemma2_reference_executor_matches_eager_fp32_past_a_kv_split_boundary(tiny_gemma2):
    """140 steps with pre/post norms, the residual adds folded into the next stage, and soft-capped logits
    (cap 3: the tanh bends every logit)."""
    errors = assert_matches_eager(tiny_gemma2.model, reference_executor_for(tiny_gemma2.plan, tiny_gemma2.model),
                                   steps=140)
    assert max(errors) < 1e-5


def test_gemma2_beyond_its_sliding_window_windows_its_local_layers():
    """A bucket larger than Gemma 2's sliding window: the local (even) layers attend over the window, the global
    ones over every cached key (tests/test_sliding_window.py checks the numbers past the window)."""
    import dataclasses

    from megabake.presets import get_preset

    preset = get_preset("tiny-gemma2")
    small = dataclasses.replace(preset, config=dict(preset.config, sliding_window=64))
    assert compile_preset_model(small, capacity=128).plan.windows == [64, 0]


def compile_preset_model(preset, **kwargs):
    from tests.compiler_fixtures import compile_model

    return compile_model(preset.build_model(), **kwargs)


def test_gemma3_text_layers_bake_with_the_sandwich_layout_and_head_norms():
    """Gemma 3's layer (sandwich norms, per-head q/k RMSNorm with 1 + w, scaled embedding) in a config whose
    layers are all local with a window covering the bucket; real Gemma 3 (5 local : 1 global, two RoPE tables) is
    refused by the IR."""
    import transformers

    from megabake.presets import _randomize_norm_weights
    from tests.compiler_fixtures import compile_model

    config = transformers.Gemma3TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                           vocab_size=512, sliding_window=4096, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    _randomize_norm_weights(model, 0)
    plan = compile_model(model, capacity=64).plan
    assert plan.layout == "sandwich" and plan.has_head_norms and plan.dims.norm_offset == 1.0
    assert_matches_eager(model, reference_executor_for(plan, model), steps=24)


class Halve(torch.nn.Module):
    """``inner(x) / 2``: a division by a scalar wrapped around a module."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) / 2.0


def test_a_division_by_a_scalar_outside_soft_capping_or_a_linear_is_refused_saying_so():
    """The div of a soft-capping is accepted only when tanh and the same * cap follow, and a Linear's output divided
    by a scalar is the Linear's output scale (Granite's logits): any other ``x / c`` (here an RMSNorm's output) is
    refused at its consumer, which names the division."""
    from megabake.compiler import compile_step
    from megabake.errors import UnsupportedGraphError

    model = get_preset("tiny-llama").build_model()
    model.model.layers[0].input_layernorm = Halve(model.model.layers[0].input_layernorm)
    with pytest.raises(UnsupportedGraphError, match=r"mul_3 / 2 \(a division by a scalar lowers only as part of "
                                                    r"soft-capping c \* tanh\(x / c\) or as a Linear's output scale"):
        compile_step(model, capacity=32)


# ------------------------------------------------------------------------------------------- Granite
@pytest.fixture(scope="module")
def tiny_granite():
    return compile_preset("tiny-granite", capacity=160, ctas=4)


def test_granite_plan_folds_its_four_multipliers(tiny_granite):
    """Granite is Llama plus four scalars, none of them new kernel code: embedding_multiplier is the embedding scale
    (Gemma's), attention_multiplier the softmax scale, residual_multiplier is folded into the packed o and down
    weights, and 1 / logits_scaling into the fp32 final norm (the LM head is the tied embedding, so not there)."""
    from megabake.ir import Linear
    from megabake.plan.packing import pack_weights

    plan, model = tiny_granite.plan, tiny_granite.model
    config = model.config
    scaled = {op.hf_module: op.scale for op in tiny_granite.ir.of_kind(Linear) if op.scale != 1.0}
    assert scaled == {**{f"model.layers.{i}.{m}": 0.22 for i in (0, 1) for m in ("self_attn.o_proj", "mlp.down_proj")},
                      "lm_head": 1 / 8}
    assert plan.layout == "pre_norm" and plan.tied_lm_head and not plan.dims.final_softcap
    assert plan.dims.embed_scale == config.embedding_multiplier == 12.0
    assert plan.dims.attn_scale == config.attention_multiplier == 0.015625 != plan.dims.head_dim ** -0.5
    assert {p.buffer: p.scale for p in plan.packed if p.scale != 1.0} == {"w_o": 0.22, "w_down": 0.22,
                                                                        "final_norm": 0.125}
    assert [p.get("scale") for p in plan.to_dict()["packed"]] == [None, None, 0.22, None, 0.22, None, 0.125]
    assert type(plan).from_json(plan.to_json()).hash == plan.hash
    weights = pack_weights(plan, model.get_parameter, dtype=torch.bfloat16)
    down = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(weights["w_down"][1], (down.float() * 0.22).to(torch.bfloat16))  # in fp32, one rounding
    assert torch.equal(weights["final_norm"], model.model.norm.weight.float() * 0.125)
    assert torch.equal(weights["embed"], model.model.embed_tokens.weight.to(torch.bfloat16))  # the tied head: as is
    source = tiny_granite.generated.source
    assert "EMBED_SCALE = 12.0" in source and "ATTN_SCALE = 0.015625" in source and "FINAL_SOFTCAP" not in source


def test_granite_matches_eager_fp32_past_a_kv_split(tiny_granite):
    errors = assert_matches_eager(tiny_granite.model, reference_executor_for(tiny_granite.plan, tiny_granite.model),
                                  steps=140)
    assert max(errors) < 1e-5


@pytest.mark.parametrize("buffer", ["w_o", "w_down", "final_norm"])
def test_granite_without_a_folded_scale_would_be_caught(tiny_granite, buffer):
    """The same plan with one folded multiplier left out does not match eager: the test can fail."""
    plan = dataclasses.replace(tiny_granite.plan, packed=[dataclasses.replace(p, scale=1.0) if p.buffer == buffer
                                                          else p for p in tiny_granite.plan.packed])
    with pytest.raises(AssertionError, match="step 0"):
        assert_matches_eager(tiny_granite.model, reference_executor_for(plan, tiny_granite.model), steps=2)


def test_a_scaled_linear_folds_only_when_every_layer_scales_it_alike():
    """``o_proj(x) / 2`` in every layer is a Linear output scale folded into w_o (and matches eager); in one layer
    only, the packed weight cannot hold it and the plan refuses, naming the scales."""
    from megabake.errors import PlanError

    model = get_preset("tiny-llama").build_model()
    model.model.layers[0].self_attn.o_proj = Halve(model.model.layers[0].self_attn.o_proj)
    with pytest.raises(PlanError, match=r"o scale their outputs by \[0.5, 1.0\] .* packed weight w_o"):
        compile_model(model, capacity=32)
    model.model.layers[1].self_attn.o_proj = Halve(model.model.layers[1].self_attn.o_proj)
    plan = compile_model(model, capacity=32).plan
    assert next(p for p in plan.packed if p.buffer == "w_o").scale == 0.5
    assert_matches_eager(model, reference_executor_for(plan, model), steps=8)
