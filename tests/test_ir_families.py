"""CPU tests of the IR on other decoder families (tiny random configs): Gemma's embedding scale and GELU-tanh,
Phi-3's fused projections, inference no-ops, worded refusals, and the Llama IR left as it was."""

from __future__ import annotations

import pytest
import torch

from megabake.capture import capture_decode_step
from megabake.errors import UnsupportedGraphError
from megabake.ir import Embedding, GatedAct, Linear, RMSNorm, lower
from megabake.presets import get_preset

CAPACITY = 64
LLAMA_COUNTS = {"Embedding": 1, "RotaryTable": 1, "RMSNorm": 5, "Linear": 15, "RoPE": 4, "KVAppend": 4,
                "DecodeAttention": 2, "Add": 4, "GatedAct": 2}
# hidden 288: sqrt(288) = 16.9705... is not a bf16 number (bf16 rounds it to 17.0)
GEMMA = dict(hidden_size=288, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64, vocab_size=512, hidden_activation="gelu_pytorch_tanh")
PHI3 = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512, pad_token_id=0)
MISTRAL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=512)


def _build(arch: str, dtype=torch.float32, **config):
    import transformers

    cls = getattr(transformers, arch)
    torch.manual_seed(0)
    return cls(cls.config_class(**config)).to(dtype).eval()


def _lower(model, capacity: int = CAPACITY):
    return lower(capture_decode_step(model, batch=1, capacity=capacity))


def _refusal(model, capacity: int = CAPACITY) -> str:
    with pytest.raises(UnsupportedGraphError) as info:
        _lower(model, capacity)
    return str(info.value)


# ------------------------------------------------------------------------------------------ Llama unchanged


def test_llama_ir_keeps_the_defaults_of_the_new_fields():
    ir = _lower(get_preset("tiny-llama").build_model())
    assert ir.summary() == LLAMA_COUNTS
    (embed,) = ir.of_kind(Embedding)
    assert embed.scale == 1.0 and embed.fx_nodes == ["embedding"] and embed.out == "embedding"
    linears = ir.of_kind(Linear)
    assert all(lin.weight_rows is None for lin in linears)
    assert len({lin.weight for lin in linears}) == len(linears)  # one op per weight: nothing split
    assert {act.act for act in ir.of_kind(GatedAct)} == {"silu"}
    assert ir.of_kind(RMSNorm)[0].inp == embed.out


# ------------------------------------------------------------------------------------------ embedding scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma_embedding_scale_is_the_models_normalizer(dtype):
    model = _build("GemmaForCausalLM", dtype, **GEMMA)
    ir = _lower(model)
    assert ir.summary() == LLAMA_COUNTS
    (embed,) = ir.of_kind(Embedding)
    normalizer = torch.tensor(GEMMA["hidden_size"] ** 0.5, dtype=dtype).item()  # HF Gemma's normalizer
    assert embed.scale == normalizer
    assert embed.scale == model.model.embed_tokens.embed_scale.to(dtype).item()
    if dtype == torch.bfloat16:
        assert embed.scale == 17.0 != GEMMA["hidden_size"] ** 0.5
    assert embed.fx_nodes == ["embedding", "mul"] and embed.out == "mul"
    assert ir.of_kind(RMSNorm)[0].inp == "mul"  # consumers see the scaled value only
    assert ir.of_kind(RMSNorm)[0].weight_offset == 1.0


def test_gemma3_scale_is_read_from_the_embed_scale_buffer():
    model = _build("Gemma3ForCausalLM", **dict(GEMMA, sliding_window=4096))
    model.model.embed_tokens.embed_scale.fill_(3.25)  # not sqrt(hidden): the value must come from the buffer
    ir = _lower(model)
    (embed,) = ir.of_kind(Embedding)
    assert embed.scale == 3.25 and embed.table == "model.embed_tokens.weight"


class _ScaledEmbedding(torch.nn.Module):
    """Embedding times a factor written in forward (a lifted tensor constant, a Python number, ...)."""

    def __init__(self, embedding, mode: str):
        super().__init__()
        self.weight = embedding.weight
        self.mode = mode
        self.factor = torch.nn.Parameter(torch.tensor(3.0))
        self.register_buffer("vector", torch.full((embedding.weight.shape[1],), 2.0), persistent=False)

    def forward(self, ids):
        x = torch.nn.functional.embedding(ids, self.weight)
        if self.mode == "tensor":
            return x * torch.tensor(8.5, dtype=x.dtype)
        if self.mode == "python":
            return x * 0.75
        if self.mode == "vector":
            return x * self.vector
        if self.mode == "parameter":
            return x * self.factor
        return x * 2.0 + x  # "reused": the unscaled value is used too


def _scaled_llama(mode: str):
    model = get_preset("tiny-llama").build_model()
    model.model.embed_tokens = _ScaledEmbedding(model.model.embed_tokens, mode)
    return model.eval()


@pytest.mark.parametrize("mode, scale", [("tensor", 8.5), ("python", 0.75)])
def test_scalar_constant_factors_fold_into_the_embedding(mode, scale):
    ir = _lower(_scaled_llama(mode))
    (embed,) = ir.of_kind(Embedding)
    assert embed.scale == scale and len(embed.fx_nodes) == 2
    assert ir.summary() == LLAMA_COUNTS


@pytest.mark.parametrize("mode, words", [
    ("vector", "constant of shape (256,)"),
    ("parameter", "parameter model.embed_tokens.factor"),
    ("reused", "unscaled embedding output is also used"),
])
def test_other_embedding_factors_are_refused_in_words(mode, words):
    message = _refusal(_scaled_llama(mode))
    assert "embedding scale" in message and words in message


# ----------------------------------------------------------------------------------------------------- GELU


def test_gemma_mlp_is_a_gelu_tanh_gated_activation():
    ir = _lower(_build("GemmaForCausalLM", **GEMMA))
    acts = ir.of_kind(GatedAct)
    assert len(acts) == 2 and {a.act for a in acts} == {"gelu_tanh"}
    producers = ir.producer()
    assert all(isinstance(producers[a.gate], Linear) and producers[a.gate].weight.endswith("gate_proj.weight")
               for a in acts)


@pytest.mark.parametrize("approximate, act", [("tanh", "gelu_tanh"), ("none", "gelu")])
def test_gelu_variants(approximate, act):
    model = get_preset("tiny-llama").build_model()
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU(approximate=approximate)
    ir = _lower(model.eval())
    assert [a.act for a in ir.of_kind(GatedAct)] == [act, act]


# ---------------------------------------------------------------------------------------- fused projections


@pytest.mark.parametrize("kv_heads, rows", [
    (4, [(0, 256), (256, 512), (512, 768)]),
    (2, [(0, 256), (256, 384), (384, 512)]),
])
def test_phi3_fused_projections_become_row_range_linears(kv_heads, rows):
    ir = _lower(_build("Phi3ForCausalLM", **dict(PHI3, num_key_value_heads=kv_heads)))
    llama = _lower(_build("LlamaForCausalLM", **dict(PHI3, num_key_value_heads=kv_heads)))
    assert ir.summary() == llama.summary() == LLAMA_COUNTS
    for layer in (0, 1):
        qkv = [lin for lin in ir.of_kind(Linear) if lin.weight == f"model.layers.{layer}.self_attn.qkv_proj.weight"]
        assert [lin.weight_rows for lin in qkv] == rows
        assert [lin.out_features for lin in qkv] == [stop - start for start, stop in rows]
        assert all(lin.in_features == 256 and lin.hf_module.endswith("qkv_proj") for lin in qkv)
        gate_up = [lin for lin in ir.of_kind(Linear) if lin.weight == f"model.layers.{layer}.mlp.gate_up_proj.weight"]
        assert [lin.weight_rows for lin in gate_up] == [(0, 512), (512, 1024)]
        (act,) = [a for a in ir.of_kind(GatedAct) if a.gate == gate_up[0].out]
        assert act.up == gate_up[1].out and act.act == "silu"
    # the fused projections themselves are not in the ops: only row ranges of their weights
    fused = [lin for lin in ir.of_kind(Linear) if "qkv_proj" in lin.weight or "gate_up_proj" in lin.weight]
    assert len(fused) == 10 and all(lin.weight_rows is not None for lin in fused)
    # q (through RoPE) feeds the attention, k (through RoPE) and v feed the caches
    producers = ir.producer()
    for op in ir.ops:
        if op.kind == "DecodeAttention":
            assert producers[producers[op.q].inp].weight_rows == rows[0]
        if op.kind == "KVAppend":
            source = producers[op.value] if op.which == "v" else producers[producers[op.value].inp]
            assert source.weight_rows == rows[1 if op.which == "k" else 2]


class _FusedProjection(torch.nn.Module):
    """A q projection computed as rows [16, 16 + n) of a larger weight with a bias."""

    def __init__(self, linear, step: int = 1):
        super().__init__()
        rows = linear.weight.shape[0]
        self.weight = torch.nn.Parameter(torch.cat([torch.randn(16, linear.weight.shape[1]), linear.weight.detach(),
                                                    torch.randn(rows, linear.weight.shape[1])]))
        self.bias = torch.nn.Parameter(torch.randn(self.weight.shape[0]))
        self.rows, self.step = rows, step

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return y[..., 16:16 + self.rows] if self.step == 1 else y[..., 16:16 + 2 * self.rows:self.step]


def test_a_sliced_projection_with_bias_keeps_the_bias_and_the_row_range():
    model = get_preset("tiny-llama").build_model()
    model.model.layers[0].self_attn.q_proj = _FusedProjection(model.model.layers[0].self_attn.q_proj)
    ir = _lower(model.eval())
    assert ir.summary() == LLAMA_COUNTS
    (q,) = [lin for lin in ir.of_kind(Linear) if lin.weight == "model.layers.0.self_attn.q_proj.weight"]
    assert q.weight_rows == (16, 272) and q.out_features == 256
    assert q.bias == "model.layers.0.self_attn.q_proj.bias"


def test_a_strided_slice_of_a_projection_is_refused():
    model = get_preset("tiny-llama").build_model()
    model.model.layers[0].self_attn.q_proj = _FusedProjection(model.model.layers[0].self_attn.q_proj, step=2)
    message = _refusal(model.eval())
    assert "fused projection" in message and "step=2" in message


# ------------------------------------------------------------------------------------------ inference no-ops


def test_eval_dropout_is_transparent_and_training_dropout_is_refused():
    model = get_preset("tiny-llama").build_model()
    layer = model.model.layers[0].self_attn
    layer.o_proj = torch.nn.Sequential(layer.o_proj, torch.nn.Dropout(0.1))
    captured = capture_decode_step(model.eval(), batch=1, capacity=CAPACITY)
    assert any(node.target is torch.ops.aten.dropout.default for node in captured.graph.nodes)
    assert lower(captured).summary() == LLAMA_COUNTS
    message = _refusal(model.train())
    assert "dropout in training mode" in message and "eval()" in message


def test_gpt_neox_gets_past_its_dropout():
    model = _build("GPTNeoXForCausalLM", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, vocab_size=512)
    message = _refusal(model)
    assert "dropout" not in message.split(": ", 1)[0]  # the refused node is no longer the dropout
    assert "'dropout'" not in message
    assert "LayerNorm" in message  # the next unsupported feature, in words


# ---------------------------------------------------------------------------------------- worded refusals


def test_mistral_sliding_window_smaller_than_the_capacity_becomes_the_attention_window():
    """The mask's ``q - window`` node carries the window into each layer's DecodeAttention; nothing else of the
    mask survives (same ops as Llama)."""
    from megabake.ir import DecodeAttention

    windowed = _lower(_build("MistralForCausalLM", **MISTRAL, sliding_window=32))
    assert windowed.summary() == LLAMA_COUNTS
    assert [op.window for op in windowed.ops if isinstance(op, DecodeAttention)] == [32] * MISTRAL["num_hidden_layers"]


def test_a_sliding_window_covering_the_whole_cache_is_the_causal_mask():
    plain = _lower(_build("MistralForCausalLM", **MISTRAL, sliding_window=None))
    for window in (64, 4096):
        windowed = _lower(_build("MistralForCausalLM", **MISTRAL, sliding_window=window))
        assert windowed.summary() == plain.summary() == LLAMA_COUNTS
        assert [op.kind for op in windowed.ops] == [op.kind for op in plain.ops]
        assert all(getattr(op, "window", 0) == 0 for op in windowed.ops)


def test_gemma2_final_logit_soft_capping_lowers_to_one_softcap_op():
    from megabake.ir import Softcap

    config = dict(GEMMA, sliding_window=4096)
    ir = _lower(_build("Gemma2ForCausalLM", **config))
    (cap,) = ir.of_kind(Softcap)
    assert cap.cap == 30.0 and cap.out == ir.output and len(cap.fx_nodes) == 3  # div, tanh, mul
    assert ir.producer()[cap.inp].hf_module == "lm_head"
    ir = _lower(_build("Gemma2ForCausalLM", **config, final_logit_softcapping=None))
    assert not ir.of_kind(Softcap)
    assert {a.act for a in ir.of_kind(GatedAct)} == {"gelu_tanh"} and ir.of_kind(Embedding)[0].scale != 1.0


def test_partial_rotary_lowers_to_one_rope_op_per_projection():
    """Phi-3 with partial_rotary_factor 0.5: q and k of each layer are one RoPE op over the whole head that
    rotates its first 32 features (the slices and the cat are covered by it)."""
    from megabake.ir import RoPE

    ropes = _lower(_build("Phi3ForCausalLM", **PHI3, partial_rotary_factor=0.5)).of_kind(RoPE)
    assert ropes and {(op.head_dim, op.rotary_dim) for op in ropes} == {(64, 32)}
    assert all(sum(n.startswith("cat") for n in op.fx_nodes) == 2 for op in ropes)  # rotate-half's and the join


def test_gemma3_with_sliding_and_full_layers_lowers_one_rotary_table_per_layer_type():
    """One rotary region, two inv_freq buffers: a RotaryTable each; the global layer's RoPE uses the second."""
    from megabake.ir import RoPE, RotaryTable

    ir = _lower(_build("Gemma3ForCausalLM", **dict(GEMMA, num_hidden_layers=6, sliding_window=4096)))
    tables = ir.of_kind(RotaryTable)
    assert [(t.slot, t.inv_freq.rsplit("rotary_emb_", 1)[1]) for t in tables] == [
        (0, "sliding_attention_inv_freq"), (1, "full_attention_inv_freq")]
    assert [op.table for op in ir.of_kind(RoPE)] == [tables[0].id] * 10 + [tables[1].id] * 2
