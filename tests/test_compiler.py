"""CPU tests of the compiler: capture, IR by semantics, plan, reference executor vs eager fp32, codegen."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from megabake.errors import InputError, PlanError, UnsupportedGraphError
from megabake.ir import DecodeAttention, Linear, RMSNorm
from megabake.plan import Plan
from megabake.plan.reference import reference_executor_for
from megabake.presets import get_preset
from tests.compiler_fixtures import assert_matches_eager, body_calls, compile_model, compile_preset


@pytest.fixture(scope="module")
def tiny():
    return compile_preset("tiny-llama")


def test_capture_classifies_placeholders(tiny):
    cap = tiny.captured
    assert cap.user_inputs == ["input_ids", "cache_position"]
    assert sorted(cap.cache_buffers.values()) == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]
    assert "model.layers.0.self_attn.q_proj.weight" in cap.parameters.values()


def test_a_captured_model_is_freed_once_its_step_is_dropped():
    """torch.export's Dynamo capture leaves a compiled function holding the traced graph (and every weight) in a torch
    module's globals; capture removes it, else each bake leaks its model's size (the CPU suite was OOM-killed)."""
    import gc
    import weakref

    from megabake.capture import capture_decode_step

    model = get_preset("tiny-llama").build_model()
    weight = weakref.ref(model.model.embed_tokens.weight)
    step = capture_decode_step(model, capacity=16)
    assert step.program is not None
    del model, step
    gc.collect()
    assert weight() is None, "a captured model's weights outlive the capture"


def test_ir_recognises_every_op_kind(tiny):
    counts = tiny.ir.summary()
    assert counts == {"Embedding": 1, "RotaryTable": 1, "RMSNorm": 5, "Linear": 15, "RoPE": 4, "KVAppend": 4,
                      "DecodeAttention": 2, "Add": 4, "GatedAct": 2}
    attn = tiny.ir.of_kind(DecodeAttention)[0]
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim) == (4, 2, 64)
    assert attn.scale == pytest.approx(64 ** -0.5)
    norm = tiny.ir.of_kind(RMSNorm)[0]
    assert norm.hf_module == "model.layers.0.input_layernorm" and norm.eps == pytest.approx(1e-5)
    assert {"pow_1", "rsqrt", "mean"} <= set(norm.fx_nodes)
    assert tiny.ir.of_kind(Linear)[-1].out == tiny.ir.output  # LM head produces the logits


class _OddlyNamedNorm(torch.nn.Module):
    """Same math as LlamaRMSNorm, different class and attribute names: must still lower to RMSNorm."""

    def __init__(self, original):
        super().__init__()
        self.scale_vector = torch.nn.Parameter(original.weight.detach().clone())
        self.epsilon = original.variance_epsilon

    def forward(self, hidden):
        h = hidden.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.epsilon)
        return self.scale_vector * h.to(hidden.dtype)


def test_ir_matches_semantics_not_module_names():
    model = get_preset("tiny-llama").build_model()
    model.model.layers[1].post_attention_layernorm = _OddlyNamedNorm(model.model.layers[1].post_attention_layernorm)
    compiled = compile_model(model)
    norms = compiled.ir.of_kind(RMSNorm)
    assert len(norms) == 5
    assert any(n.weight.endswith("post_attention_layernorm.scale_vector") for n in norms)
    executor = reference_executor_for(compiled.plan, model)
    assert_matches_eager(model, executor, steps=3)


def test_unsupported_node_names_node_target_module_and_source():
    model = get_preset("tiny-llama").build_model()
    model.model.layers[0].mlp.act_fn = torch.nn.Mish()
    with pytest.raises(UnsupportedGraphError) as info:
        compile_model(model)
    message = str(info.value)
    assert "mish" in message and "model.layers.0.mlp.act_fn" in message
    assert ".py:" in message and "cannot be baked yet" in message


def test_plan_is_data_with_a_stable_hash(tiny):
    plan = tiny.plan
    again = Plan.from_json(plan.to_json())
    assert again.hash == plan.hash and again.to_json() == plan.to_json()
    assert plan.barriers_per_step == 1 + 5 * plan.dims.layers
    data = json.loads(plan.to_json())
    assert data["dims"]["hidden"] == 256 and data["ctas"] == 132
    other = compile_preset("tiny-llama", ctas=60).plan
    assert other.hash != plan.hash


def _randomise_biases(model, std: float = 0.5):
    """HF initialises biases to zero: make them count."""
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if name.endswith(".bias"):
                param.normal_(0.0, std, generator=torch.Generator().manual_seed(index))
    return model


def test_reference_from_a_decoders_buffers_runs_on_those_weights_and_tables(tiny):
    """``reference_executor_from_buffers``: the GPU checks' reference (scripts and GPU tests) reads the packed
    weights and rotary tables out of a decoder's buffers; on the bf16 packing of the tiny model it gives the
    logits of ``reference_executor_for`` in bf16, and a changed weight buffer changes its logits."""
    from megabake.plan.packing import pack_weights, plan_inv_freqs, rotary_tables
    from megabake.plan.reference import reference_executor_from_buffers

    plan, model = tiny.plan, tiny.model
    buffers = dict(pack_weights(plan, model.get_parameter, dtype=torch.bfloat16))
    buffers["rope_cos"], buffers["rope_sin"] = rotary_tables(plan, plan_inv_freqs(plan, model))
    buffers["k_cache"] = torch.full((1,), float("nan"))  # not a weight: ignored
    tokens = torch.tensor([3])
    got = reference_executor_from_buffers(plan, buffers).step(tokens, 0)
    want = reference_executor_for(plan, model, dtype=torch.bfloat16).step(tokens, 0)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    buffers["w_qkv"] = buffers["w_qkv"] * 2
    assert not torch.equal(reference_executor_from_buffers(plan, buffers).step(tokens, 0), want)


@pytest.mark.parametrize("heads,head_dim,keys,warps", [(2, 64, 1, 4), (3, 64, 17, 4), (7, 64, 512, 4),
                                                       (4, 128, 1000, 8), (2, 64, 33, 16), (8, 256, 300, 8)])
def test_the_reference_tensor_core_partial_is_softmax_attention_then_bf16_rounding(heads, head_dim, keys, warps):
    """``plan.reference._mma_partial`` mirrors ``bodies._mma_softmax_chunk``'s order (16-key steps dealt over the
    warps, per-warp running maxima, rescales, the warps' merge): without its roundings it is the plain softmax
    partial to fp32 order (one key; masked tails; warps with no step, 33 keys over 16 warps); with them (bf16 query
    and probabilities into P.V, fp32 sums) the output moves by bf16 rounding, no more. Its step size is the
    kernel's."""
    from megabake.codegen.bodies import split_attention
    from megabake.plan.attention import MMA_ATT_KEYS
    from megabake.plan.reference import _mma_partial

    assert MMA_ATT_KEYS == split_attention.MMA_ATT_KEYS
    generator = torch.Generator().manual_seed(keys)
    queries = torch.randn(heads, head_dim, generator=generator) * head_dim ** -0.5
    k = torch.randn(keys, head_dim, generator=generator).bfloat16()
    v = torch.randn(keys, head_dim, generator=generator).bfloat16()
    scores = queries @ k.float().T
    top = scores.max(dim=1).values
    weights = torch.exp(scores - top[:, None])
    want = (weights @ v.float()) / weights.sum(dim=1)[:, None]
    exact = _mma_partial(queries, k, v, warps, rounded=False)
    assert torch.equal(exact[0], top)
    assert torch.allclose(exact[2] / exact[1][:, None], want, atol=1e-6, rtol=1e-5)
    rounded = _mma_partial(queries, k, v, warps)
    error = float((rounded[2] / rounded[1][:, None] - want).norm() / want.norm())
    assert (error == 0.0) if keys == 1 else (1e-4 < error < 1e-2), error  # one key: p = 1, exact in bf16


def test_the_reference_rounds_attention_where_the_kernel_uses_the_tensor_cores():
    """``ReferenceExecutor(..., mma_attention=True)`` (a GPU check's reference for a default build since session
    33) rounds only the items of 2-8 heads: Qwen2.5-0.5B batch 8 deals 1-head slices at short contexts (the same
    logits as without) and whole 7-head groups at 1000 keys (logits moved by the rounding, 1e-3 to 2e-2)."""
    compiled = compile_preset("qwen2.5-0.5b", layers=2, vocab=512, batch=8, capacity=1024)
    plain, rounding = (reference_executor_for(compiled.plan, compiled.model, dtype=torch.bfloat16) for _ in range(2))
    rounding.mma_attention = True
    generator = torch.Generator().manual_seed(3)
    for name in ("k_cache", "v_cache"):
        cache = torch.randn(plain.buffers[name].shape, generator=generator).bfloat16()
        plain.buffers[name].copy_(cache)
        rounding.buffers[name].copy_(cache)
    tokens = torch.randint(1, 512, (8,), generator=generator)
    assert torch.equal(rounding.step(tokens, 5), plain.step(tokens, 5))
    want, got = plain.step(tokens, 1000), rounding.step(tokens, 1000)
    assert 1e-3 < float((got - want).norm() / want.norm()) < 2e-2


def test_a_decoder_knows_whether_its_module_uses_the_tensor_core_attention():
    """``MegakernelDecoder.mma_attention`` reads module.py's ``MMA_ATTENTION`` (what GPU checks build their
    reference with); the reference backend mirrors it, so on a CPU the same module gives the rounded logits."""
    from megabake.codegen import generate
    from megabake.runtime import MegakernelDecoder

    compiled = compile_preset("qwen2.5-0.5b", layers=2, vocab=512, batch=8, capacity=1024)
    decoders = [MegakernelDecoder(compiled.plan, generate(compiled.plan, **build).source, compiled.model,
                                  device="cpu") for build in ({}, {"mma_attention": False})]
    assert [d.mma_attention for d in decoders] == [True, False]
    assert [d._reference.mma_attention for d in decoders] == [True, False]


def test_linear_biases_are_packed_per_stage_with_zeros_where_absent():
    """Llama's attention_bias puts biases on q, k, v and o; mlp_bias on gate, up and down."""
    from megabake.plan.packing import pack_weights

    model = _randomise_biases(_small("LlamaForCausalLM", attention_bias=True))
    plan = compile_model(model).plan
    assert [b.name for b in plan.buffers if b.name.startswith("bias")] == ["bias_qkv", "bias_o"]
    assert plan.bias_of("norm_qkv") == "bias_qkv" and plan.bias_of("norm_gate_up") is None
    assert "bias_qkv" in next(s for s in plan.stages if s.name == "norm_qkv").reads
    packed = pack_weights(plan, model.get_parameter)
    layer1 = model.model.layers[1].self_attn
    want = torch.cat([layer1.q_proj.bias, layer1.k_proj.bias, layer1.v_proj.bias])
    assert packed["bias_qkv"].dtype == torch.float32 and torch.equal(packed["bias_qkv"][1], want)
    qwen = compile_model(_small("Qwen2ForCausalLM")).plan  # q/k/v biased, o not
    assert [b.name for b in qwen.buffers if b.name.startswith("bias")] == ["bias_qkv"]


@pytest.mark.parametrize("arch, extra", [("Qwen2ForCausalLM", {}),
                                         ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True})])
def test_reference_executor_with_linear_biases_matches_eager_fp32(arch, extra):
    model = _randomise_biases(_small(arch, **extra))
    compiled = compile_model(model)
    assert_matches_eager(model, reference_executor_for(compiled.plan, model), steps=4)


def test_biased_module_compiles_for_sm90a_and_llama_modules_stay_bias_free(tiny):
    from megabake.codegen import KERNEL_ARGUMENTS
    from megabake.runtime.compile import compile_check, load_module

    def fused_buffers(module) -> list[str]:
        """o_mid / o_part: the fused attention+O steps' workspace (the default since session 36); mlp_acc: the fused
        MLP's accumulator and o_count: fused_split's per-group counters (the defaults since session 45); w_down_cta:
        bulk_down's packed W_down (the default with fused_mlp since session 49)."""
        fused_mlp = getattr(module, "FUSED_MLP", False)
        return (["o_mid", "o_part"] + (["mlp_acc"] if fused_mlp else []) + ["o_count"]
                + (["w_down_cta"] if getattr(module, "MLP_BULK", False) else []))

    qwen = compile_model(_randomise_biases(_small("Qwen2ForCausalLM")))
    module = load_module(qwen.generated.source)
    assert module.ARGUMENTS == KERNEL_ARGUMENTS + ["bias_qkv", "attn_part", "attn_count"] + fused_buffers(module)
    # the default streaming tiling passes the bias to the QKV GEMV (the plain tiling calls gemv_rows_bias)
    qkv_call = body_calls(qwen.generated.source, "gemv_rows_streamed")[0]
    assert (qkv_call["weight"], qkv_call["bias"], qkv_call["out"], qkv_call["has_bias"]) == (
        "w_qkv[layer, None, None]", "bias_qkv[layer, None]", "qkv", "True")
    result = compile_check(qwen.plan, module)
    assert result.ok, result.error
    # a model without biases gets exactly the kernel it had before biases existed
    tiny_module = load_module(tiny.generated.source)
    assert tiny_module.FUSED_MLP is True  # 64-bit W_down copies: the fused MLP (codegen.fused_mlp.default_fused_mlp)
    assert tiny_module.ARGUMENTS == KERNEL_ARGUMENTS + ["attn_part", "attn_count"] + fused_buffers(tiny_module)
    assert "gemv_rows_bias" not in tiny.generated.source and "bias_qkv" not in tiny.generated.source


@torch.no_grad()


def test_reference_executor_matches_eager_fp32_tiny(tiny):
    assert_matches_eager(tiny.model, reference_executor_for(tiny.plan, tiny.model), steps=10)


def test_reference_executor_matches_eager_fp32_smollm_shaped_stack():
    compiled = compile_preset("smollm-135m", layers=4, capacity=16)
    assert compiled.plan.dims.hidden == 576 and compiled.plan.dims.n_heads == 9
    assert_matches_eager(compiled.model, reference_executor_for(compiled.plan, compiled.model), steps=5)


def test_reference_executor_checks_tile_ownership(tiny):
    executor = reference_executor_for(tiny.plan, tiny.model)
    executor.step(torch.tensor([5]), 0)
    owners = executor.tile_owners["norm_qkv"]
    assert len(owners) == tiny.plan.stages[1].tiling.tiles
    assert all(0 <= cta < tiny.plan.ctas and 0 <= warp < tiny.plan.warps for cta, warp in owners.values())


def test_reference_executor_refuses_a_tiling_that_leaves_rows_unwritten(tiny):
    """A GEMV tiling one tile short leaves its last rows to nobody: the reference executor's first step says so
    (the check runs once per stage; later steps write whole rows at once)."""
    import dataclasses

    stage = next(s for s in tiny.plan.stages if s.name == "o_residual")
    short = dataclasses.replace(stage, tiling=dataclasses.replace(stage.tiling, tiles=stage.tiling.tiles - 1))
    plan = dataclasses.replace(tiny.plan, stages=[short if s is stage else s for s in tiny.plan.stages])
    with pytest.raises(AssertionError, match="o_residual: some output rows written"):
        reference_executor_for(plan, tiny.model).step(torch.tensor([5]), 0)


def test_source_map_points_at_module_lines(tiny):
    lines = tiny.generated.source.splitlines()
    entries = tiny.generated.source_map["entries"]
    assert tiny.generated.source_map["plan_hash"] == tiny.plan.hash
    bodies = [e for e in entries if e["kind"] == "body_call"]
    # the default's batch-1 fusions (fused_o, fused_split, fused_mlp) stage the residual from o_mid + the MLP's
    # accumulator (rmsnorm_from_acc_to_smem) and the O partials, where the plain build copies rows to shared memory
    assert {e["name"].split(".")[-1] for e in bodies} >= {"embed_gather", "rmsnorm_from_acc_to_smem",
                                                         "gemv_rows_streamed", "split_kv_attention", "split_o_block",
                                                         "fused_attention_o", "mlp_down_partial"}
    for entry in entries:
        start, end = entry["lines"]
        assert 1 <= start <= end <= len(lines)
        if entry["kind"] == "body_call":  # a body (bodies.NAME) or a CuTe call (fused_mlp's cute.arch.sync_threads)
            assert "." + entry["name"].split(".")[-1] + "(" in "\n".join(lines[start - 1:end]), entry
    attention = next(e for e in bodies if e["name"].endswith("split_kv_attention"))
    assert "model.layers.1.self_attn" in attention["hf_modules"]
    assert "scaled_dot_product_attention_1" in attention["fx_nodes"]
    covered = {op for e in entries for op in e["ir_ops"]}
    wanted = {op.id for op in tiny.ir.ops if not isinstance(op, type(None)) and op.kind != "RotaryTable"}
    assert wanted <= covered


def test_module_is_one_cooperative_kernel(tiny):
    source = tiny.generated.source
    assert source.count("@cute.kernel") == 1 and "cooperative=True" in source
    assert "for layer in range(LAYERS):" in source
    import ast

    tree = ast.parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    # self-contained: the device code is all in the package, nothing comes from the installed MegaBake
    assert imported and all(name.split(".")[0] in ("cutlass", "cuda", "__future__") for name in imported), imported


def test_generated_module_compiles_for_sm90a(tiny, tmp_path):
    from megabake.runtime.compile import compile_check, load_module

    result = compile_check(tiny.plan, load_module(tiny.generated.source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert ".target sm_90a" in ptx
    assert result.ptx_stats["vector_loads_16B"] >= 5  # 16-byte weight loads in every GEMV
    assert "atom.global.release.add.u64" in ptx and "ld.acquire.gpu" in ptx  # the grid barrier
    assert "prefetch.global.L2" in ptx


def test_reference_decoder_rejects_bad_inputs(tiny):
    from megabake.runtime import MegakernelDecoder

    decoder = MegakernelDecoder(tiny.plan, tiny.generated.source, tiny.model, device="cpu")
    with pytest.raises(InputError, match="capacity"):
        decoder.step(torch.tensor([1]), tiny.plan.capacity)
    with pytest.raises(InputError, match="vocabulary"):
        decoder.step(torch.tensor([tiny.plan.dims.vocab]), 0)
    with pytest.raises(InputError, match="batch"):
        decoder.step(torch.tensor([1, 2]), 0)
    with pytest.raises(InputError, match="position"):
        decoder.step(torch.tensor([1]), -1)
    with pytest.raises(InputError, match="prompt token id"):
        decoder.prefill(torch.tensor([[1, tiny.plan.dims.vocab + 5, 2]]))
    with pytest.raises(InputError, match="capacity"):
        decoder.prefill(torch.ones(1, tiny.plan.capacity + 1, dtype=torch.long))
    with pytest.raises(InputError, match="max_new_tokens"):
        decoder.generate(torch.tensor([[1, 2]]), max_new_tokens=0)
    with pytest.raises(InputError, match="integer tensor"):
        decoder.step(torch.tensor([1.0]), 0)
    with pytest.raises(InputError, match="integers"):
        decoder.step([1.5], 0)
    with pytest.raises(InputError, match="position must be an int"):
        decoder.step(1, 2.0)
    with pytest.raises(InputError, match="capacity"):
        decoder.greedy_tokens(1, tiny.plan.capacity - 2, 3)
    with pytest.raises(InputError, match="count"):
        decoder.greedy_tokens(1, 0, 0)
    with pytest.raises(InputError, match="backend"):
        MegakernelDecoder(tiny.plan, tiny.generated.source, tiny.model, device="cpu", backend="rocm")
    # a list of host ints and an int position (step's fast path, session 61) are checked as strictly
    for tokens, position, why in (([tiny.plan.dims.vocab], 0, "vocabulary"), ([-1], 0, "vocabulary"),
                                  ([1, 2], 0, "batch"), ([], 0, "no token ids"), ([True], 0, "integers"),
                                  (["7"], 0, "integers"), ([1], tiny.plan.capacity, "capacity"),
                                  ([1], -1, "negative"), ([1], True, "position must be an int")):
        with pytest.raises(InputError, match=why):
            decoder.step(tokens, position)


def test_step_inputs_take_the_same_values_on_the_fast_path_and_off_it():
    """``MegakernelDecoder._check_inputs``: host ints in range pass on plain comparisons, padded to the bucket's
    batch with 0, exactly as numpy ints or a tensor of the same ids are after the full checks."""
    import types

    import numpy as np

    from megabake.runtime import MegakernelDecoder

    bucket = types.SimpleNamespace(batch=4, vocab_size=100, capacity=64)
    bucket._check_position = types.MethodType(MegakernelDecoder._check_position, bucket)
    check = types.MethodType(MegakernelDecoder._check_inputs, bucket)
    assert check([7, 99], 63) == check(np.array([7, 99]), 63) == check(torch.tensor([7, 99]), 63) == [7, 99, 0, 0]
    # a numpy or tensor position takes the full checks, with the same bounds (it was refused before session 63)
    for position in (np.int64(63), np.int32(5), torch.tensor(5), torch.tensor([5])):
        assert check([7], position) == [7, 0, 0, 0]
    for position, why in ((np.int64(64), "capacity"), (np.int64(-1), "negative"), (np.bool_(True), "must be an int"),
                          (np.float32(2.0), "must be an int"), (torch.tensor(True), "must be an int"),
                          (torch.tensor([1, 2]), "must be an int"), (torch.tensor(2.0), "must be an int"),
                          ("3", "must be an int")):
        with pytest.raises(InputError, match=why):
            check([7], position)
    assert check([1, 2, 3, 4], 0) == [1, 2, 3, 4]
    assert check(5, torch.tensor(3)) == [5, 0, 0, 0]
    # the staging row the step graph copies to the device: the padded ids, then the position (one numpy write)
    waited = []
    bucket._staged = [types.SimpleNamespace(synchronize=lambda row=row: waited.append(row)) for row in range(3)]
    bucket._staging_view = np.full((3, 5), -1, dtype=np.int32)
    MegakernelDecoder._stage(bucket, 1, check([7, 99], 63), 63)
    assert waited == [1] and bucket._staging_view.tolist() == [[-1] * 5, [7, 99, 0, 0, 63], [-1] * 5]


def test_reference_greedy_tokens_follow_step_by_step_argmax(tiny):
    import copy

    from megabake.runtime import MegakernelDecoder

    decoder = MegakernelDecoder(tiny.plan, tiny.generated.source, copy.deepcopy(tiny.model), device="cpu")
    prompt = torch.randint(1, tiny.plan.dims.vocab, (1, 6), generator=torch.Generator().manual_seed(4))
    first = decoder.prefill(prompt).argmax(-1)
    chunk = decoder.greedy_tokens(first, 6, 5)
    decoder.prefill(prompt)
    token, host = first, []
    for k in range(5):
        token = decoder.step(token, 6 + k).argmax(-1)
        host.append(token)
    assert chunk.shape == (1, 5) and torch.equal(chunk, torch.stack(host, 1))
    assert torch.equal(decoder.generate(prompt, max_new_tokens=11),
                       decoder.generate(prompt, max_new_tokens=11, sync_every=1))


def test_cuda_backend_needs_hopper(tiny):
    from megabake.errors import DeviceError
    from megabake.runtime import require_hopper

    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has a Hopper GPU")
    with pytest.raises(DeviceError, match="SM90|Hopper"):
        require_hopper()


def test_missing_cutlass_says_how_to_install(monkeypatch):
    import sys

    from megabake.errors import MissingDependencyError, require_cutlass

    monkeypatch.setitem(sys.modules, "cutlass", None)
    with pytest.raises(MissingDependencyError, match="pip install"):
        require_cutlass()


def test_reference_decoder_generate_matches_hf_greedy(tiny):
    from megabake.runtime import MegakernelDecoder

    decoder = MegakernelDecoder(tiny.plan, tiny.generated.source, tiny.model, device="cpu")
    prompt = torch.randint(1, tiny.plan.dims.vocab, (1, 5), generator=torch.Generator().manual_seed(0))
    ours = decoder.generate(prompt, max_new_tokens=6)
    with torch.no_grad():
        theirs = tiny.model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


_SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=512,
              tie_word_embeddings=False)


def _small(arch: str, **extra):
    import transformers

    cls = getattr(transformers, arch)
    torch.manual_seed(0)
    return cls(cls.config_class(**_SMALL, **extra)).eval()


def test_other_architectures_with_llama_semantics_bake():
    """Mistral's modules have other class names; the IR sees the same computation (and an untied LM head)."""
    model = _small("MistralForCausalLM", sliding_window=None)
    compiled = compile_model(model)
    assert not compiled.plan.tied_lm_head and compiled.plan.buffer("lm_head").shape == [1024, 256]
    assert_matches_eager(model, reference_executor_for(compiled.plan, model), steps=4)


@pytest.mark.parametrize("arch, error, where", [
    ("OlmoForCausalLM", UnsupportedGraphError, "layer_norm"),
])
def test_unsupported_architectures_fail_with_the_cause(arch, error, where):
    with pytest.raises(error) as info:
        compile_model(_small(arch))
    assert where in str(info.value)


def _randomise_head_norms(model):
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(index))
    return model


def test_qwen3_head_norms_are_recognised_and_match_eager_fp32():
    """Qwen3 normalises each head's q and k (RMSNorm over head_dim) before RoPE."""
    model = _randomise_head_norms(_small("Qwen3ForCausalLM"))
    compiled = compile_model(model)
    plan = compiled.plan
    assert plan.has_head_norms and plan.buffer("qk_norms").shape == [2, 2, 64]
    layer = plan.layers[1]
    assert layer.params["q_norm"] == "model.layers.1.self_attn.q_norm.weight"
    assert "model.layers.1.self_attn.q_norm" in layer.hf_modules["attention"]
    (call,) = body_calls(compiled.generated.source, "split_kv_attention")
    assert call["qk_norm"] == "qk_norms[layer, None, None]" and call["has_qk_norm"] == "True"
    assert_matches_eager(model, reference_executor_for(plan, model), steps=4)


def test_qwen3_module_compiles_for_sm90a_and_llama_attention_is_unchanged(tiny):
    from megabake.runtime.compile import compile_check, load_module

    compiled = compile_model(_randomise_head_norms(_small("Qwen3ForCausalLM")))
    result = compile_check(compiled.plan, load_module(compiled.generated.source))
    assert result.ok, result.error
    assert not tiny.plan.has_head_norms and "qk_norms[layer" not in tiny.generated.source
    assert "q_norm" not in tiny.plan.stages[2].roles


def test_plan_refuses_buckets_that_do_not_fit_shared_memory():
    from megabake.plan import HOPPER_SMEM_PER_BLOCK, ModelDims, _check_shared_memory

    dims = ModelDims(hidden=2048, n_heads=32, n_kv_heads=8, head_dim=64, intermediate=8192, vocab=128256,
                     layers=16, eps=1e-5, norm_offset=0.0, attn_scale=0.125, act="silu")
    _check_shared_memory(dims, batch=1, capacity=4096, threads=256)  # Llama-3.2-1B, the usual bucket: fits
    with pytest.raises(PlanError, match=r"--batch 6 or less") as info:
        _check_shared_memory(dims, batch=8, capacity=128, threads=256)
    assert str(HOPPER_SMEM_PER_BLOCK) in str(info.value)
    with pytest.raises(PlanError, match=r"--capacity \d+ or less"):
        _check_shared_memory(dims, batch=1, capacity=60000, threads=256)  # unsplit: one head's scores on chip
    _check_shared_memory(dims, batch=1, capacity=60000, threads=256, split_kv=True)  # split-KV: no capacity term
    # no capacity helps at batch 8: the message must not suggest "--capacity 0"
    with pytest.raises(PlanError) as info:
        _check_shared_memory(dims, batch=8, capacity=2048, threads=256)
    assert "--batch 6 or less at this capacity" in str(info.value) and "--capacity" not in str(info.value)
    with pytest.raises(PlanError, match=r"a smaller --batch and --capacity \(neither alone is enough\)"):
        _check_shared_memory(dims, batch=8, capacity=60000, threads=256)


def test_committed_default_package_matches_the_compiler():
    """A tripwire for kernel drift: the committed default package is what the compiler bakes today. When this
    fails on purpose, re-bake (`megabake bake`), rebuild the registry and run the GPU tests on an H200."""
    from pathlib import Path

    compiled = compile_preset("tiny-llama", capacity=128)
    package = Path(__file__).resolve().parents[1] / "packages" / "megabake--tiny-llama" / "random-seed0" / \
        f"decode-b1-c128-sm90a-132sm-p{compiled.plan.hash[:8]}"
    assert compiled.plan.to_json() == (package / "plan.json").read_text()
    assert compiled.generated.source == (package / "module.py").read_text()


@pytest.mark.parametrize("position", [0, 1, 127, 128, 129, 300, 1023])
def test_split_kv_attention_matches_eager_fp32_near_0_at_split_boundaries_and_at_capacity(position):
    """Flash decoding on the CPU: the plan's reference executor splits the cached keys as the kernel does
    (chunks of 128 positions for the tiny model: boundaries at 127/128/129) and merges the partial softmaxes;
    after an eager prefill of ``position`` tokens one step matches eager fp32 (the last slot included). The split
    build (``fused_o=False``): the default fuses steps within the first chunk, on the tensor cores' bf16 rounding
    (tests/test_fused_o.py)."""
    import torch

    from megabake.codegen import generate
    from megabake.runtime import MegakernelDecoder
    from megabake.verification.numerics import rel_l2, teacher_tokens
    from megabake.verification.reference import ReferenceDecoder

    compiled = _split_tiny()
    stage = next(s for s in compiled.plan.stages if s.kind == "attention")
    assert stage.tiling.kind == "kv_splits" and stage.tiling.per_tile == 128
    model = compiled.model
    decoder = MegakernelDecoder(compiled.plan, generate(compiled.plan, fused_o=False).source, model, device="cpu")
    eager = ReferenceDecoder(model, capacity=1024, fp32=True)
    tokens = teacher_tokens(1, position + 1, model.config.vocab_size, seed=position)
    if position:
        decoder.prefill(tokens[:, :position])
        eager.prefill(tokens[:, :position])
    got = decoder.step(tokens[:, position], position).clone()
    want = eager.step(tokens[:, position], position)
    assert rel_l2(got, want) < 1e-5
    k_ours, _ = decoder.kv_cache()
    k_eager, _ = eager.kv_cache()
    assert torch.allclose(k_ours[:, :, :, position], k_eager[:, :, :, position].float(), atol=1e-5)


@functools.lru_cache(maxsize=1)
def _split_tiny():
    return compile_preset("tiny-llama", capacity=1024)


@pytest.mark.parametrize("position,slices", [(0, 2), (128, 2), (129, 2), (300, 1), (1023, 1)])
def test_head_slices_match_eager_fp32_on_both_sides_of_where_they_stop(position, slices):
    """Head slices (session 18): on 8 CTAs the tiny model's 2 KV groups get 4 splits each, and the 2 query heads
    of a group are dealt over 2 items while at most 2 splits are active (positions below 256: one split, or two
    that merge per (group, slice)), one item per group above that. After an eager prefill of ``position`` tokens
    one step matches eager fp32 in both regimes (the lane-group loop's module, ``mma_attention=False``: whole 2-head
    groups round to bf16 on the tensor cores in the default), and every slice of the split holding the position
    appended the same key."""
    from megabake.codegen import generate
    from megabake.plan import slices_at, split_chunks
    from megabake.runtime import MegakernelDecoder
    from megabake.verification.numerics import rel_l2, teacher_tokens
    from megabake.verification.reference import ReferenceDecoder

    compiled = _sliced_tiny()
    tiling = next(s.tiling for s in compiled.plan.stages if s.kind == "attention")
    assert (tiling.units, tiling.tiles, tiling.head_slices) == (2, 8, 2)
    assert slices_at(tiling, split_chunks(tiling, position + 1)[1]) == slices
    decoder = MegakernelDecoder(compiled.plan, generate(compiled.plan, mma_attention=False).source, compiled.model,
                                device="cpu")
    eager = ReferenceDecoder(compiled.model, capacity=1024, fp32=True)
    tokens = teacher_tokens(1, position + 1, compiled.model.config.vocab_size, seed=position + 5)
    if position:
        decoder.prefill(tokens[:, :position])
        eager.prefill(tokens[:, :position])
    assert rel_l2(decoder.step(tokens[:, position], position).clone(), eager.step(tokens[:, position], position)) < 1e-5
    k_ours, _ = decoder.kv_cache()
    k_eager, _ = eager.kv_cache()
    assert torch.allclose(k_ours[:, :, :, position], k_eager[:, :, :, position].float(), atol=1e-5)


@functools.lru_cache(maxsize=1)
def _sliced_tiny():
    return compile_preset("tiny-llama", capacity=1024, ctas=8)


@functools.lru_cache(maxsize=1)
def _long_sliced_tiny():
    return compile_preset("tiny-gemma", capacity=1024, ctas=12)


@pytest.mark.parametrize("position,dealt", [(100, (128, 1, 4)), (600, (128, 5, 2)), (800, (384, 3, 4)),
                                             (1023, (384, 3, 4))])
def test_long_context_slices_match_eager_fp32(position, dealt):
    """Head slices at long contexts (session 19, ``plan.split_schedule``): tiny-gemma's 4 query heads on one KV
    head over 12 splits are dealt as 2 slices of 2 heads over the same 128-position chunks at 600 positions, and
    as 4 slices of one head over 3 chunks of 384 at 800 (the short-context rule deals one item per split from
    385 positions on). After an eager prefill one step matches eager fp32 in each regime: the dealing's math, in
    fp32, so the module is the lane-group loop's (``mma_attention=False``; the default's 2-head items round to bf16
    on the tensor cores, and the reference backend mirrors that)."""
    from megabake.codegen import generate
    from megabake.plan import split_schedule
    from megabake.runtime import MegakernelDecoder
    from megabake.verification.numerics import rel_l2, teacher_tokens
    from megabake.verification.reference import ReferenceDecoder

    compiled = _long_sliced_tiny()
    tiling = next(s.tiling for s in compiled.plan.stages if s.kind == "attention")
    step = split_schedule(tiling, position + 1)
    assert (step.chunk, step.active, step.slices) == dealt
    assert split_schedule(tiling, position + 1, long_slices=False).slices == (4 if position < 384 else 1)
    decoder = MegakernelDecoder(compiled.plan, generate(compiled.plan, mma_attention=False).source, compiled.model,
                                device="cpu")
    eager = ReferenceDecoder(compiled.model, capacity=1024, fp32=True)
    tokens = teacher_tokens(1, position + 1, compiled.model.config.vocab_size, seed=position + 7)
    decoder.prefill(tokens[:, :position])
    eager.prefill(tokens[:, :position])
    assert rel_l2(decoder.step(tokens[:, position], position).clone(), eager.step(tokens[:, position], position)) < 1e-5


@pytest.mark.parametrize("preset,ctas", [("smollm-135m", 132), ("gemma-2b", 132), ("qwen2.5-0.5b", 132),
                                         ("llama-3.2-1b", 132), ("tiny-gemma", 12), ("tiny-llama", 8)])
@pytest.mark.parametrize("pass_chunks", [False, True])
def test_split_schedule_covers_the_keys_within_the_items_and_never_adds_work(preset, ctas, pass_chunks):
    """At every context up to 8192 positions the long-context dealing covers the visible keys exactly (the last
    chunk holds the newest key), fits its items in the splits, gives each item no more work (positions x query
    heads) than the short-context rule, and deals exactly as that rule wherever that rule slices; with chunks in
    whole CTA passes (``pass_chunks``, a candidate) too, its chunks are whole passes and never longer than whole
    ``per_tile`` chunks."""
    from megabake.plan import chunk_quantum, kv_splits, split_schedule

    compiled = compile_preset(preset, layers=1, vocab=256, capacity=2048, ctas=ctas)  # the tiling is not the bucket's
    tiling = next(s.tiling for s in compiled.plan.stages if s.kind == "attention")
    splits, group = kv_splits(tiling), compiled.plan.dims.n_heads // compiled.plan.dims.n_kv_heads
    quantum = chunk_quantum(compiled.plan, pass_chunks)
    assert tiling.per_tile % quantum == 0 and (quantum < tiling.per_tile) == pass_chunks
    for visible in range(1, 8193):
        new = split_schedule(tiling, visible, quantum=quantum)
        old = split_schedule(tiling, visible, long_slices=False, quantum=quantum)
        assert (new.active - 1) * new.chunk < visible <= new.active * new.chunk
        assert new.active * new.slices <= splits and group % new.slices == 0 and new.chunk % quantum == 0
        assert new.chunk * group // new.slices <= old.chunk * group // old.slices
        if old.slices > 1:
            assert new == old
        if pass_chunks:
            whole = split_schedule(tiling, visible)
            assert new.chunk * group // new.slices <= whole.chunk * group // whole.slices


def test_head_slices_are_planned_only_for_groups_of_several_query_heads():
    """The plan records ``head_slices`` (the largest divisor of a group's query heads that fits the splits) and
    sizes the arrival counters per (group, slice); a model with one query head per KV head (Phi-3-mini) has no
    slices, and its plan.json does not name them (plans made before them keep their hash). The module's
    ``HEAD_SLICES`` constant is 1 when built with ``head_slices=False``."""
    from megabake.codegen import generate
    from megabake.plan import ATTN_COUNT, slices_at

    gemma = compile_preset("gemma-2b", layers=2, vocab=512, capacity=1024)
    tiling = next(s.tiling for s in gemma.plan.stages if s.kind == "attention")
    assert tiling.head_slices == 8 and gemma.plan.buffer(ATTN_COUNT).shape == [8]
    splits = tiling.tiles // tiling.units
    assert [slices_at(tiling, a) for a in (1, splits // 8, splits // 8 + 1)] == [8, 8, 1]
    assert "\nHEAD_SLICES = 8\n" in gemma.generated.source
    assert "\nHEAD_SLICES = 1\n" in generate(gemma.plan, head_slices=False).source
    phi = compile_preset("phi-3-mini", layers=2, vocab=512, capacity=1024)
    tiling = next(s.tiling for s in phi.plan.stages if s.kind == "attention")
    assert tiling.head_slices == 0 and "head_slices" not in phi.plan.to_json()
    assert phi.plan.buffer(ATTN_COUNT).shape == [phi.plan.batch * phi.plan.dims.n_kv_heads]


def test_generate_stops_at_eos_samples_by_seed_and_streams(tiny):
    """megabake.generation on the reference backend: greedy = HF, EOS stops, same seed = same sample, streamer."""
    import torch

    from megabake.runtime import MegakernelDecoder

    decoder = MegakernelDecoder(tiny.plan, tiny.generated.source, tiny.model, device="cpu")
    prompt = torch.tensor([[5, 9, 3]])
    greedy = decoder.generate(prompt, max_new_tokens=6, eos_token_id=[])
    eos = int(greedy[0, 4])  # a token the greedy answer makes: generation must stop right after its first one
    first_eos = 3 + greedy[0, 3:].tolist().index(eos)
    stopped = decoder.generate(prompt, max_new_tokens=6, eos_token_id=eos, return_details=True)
    assert stopped.stopped_by == "eos" and stopped.tokens.tolist() == greedy[:, :first_eos + 1].tolist()
    first = decoder.generate(prompt, max_new_tokens=5, do_sample=True, temperature=1.5, top_k=20, top_p=0.9,
                             seed=7, eos_token_id=[])
    again = decoder.generate(prompt, max_new_tokens=5, do_sample=True, temperature=1.5, top_k=20, top_p=0.9,
                             seed=7, eos_token_id=[])
    assert first.tolist() == again.tolist()

    class Recorder:
        def __init__(self):
            self.calls = []

        def put(self, value):
            self.calls.append(value.reshape(-1).tolist())

        def end(self):
            self.calls.append("end")

    streamer = Recorder()
    out = decoder.generate(prompt, max_new_tokens=4, eos_token_id=[], streamer=streamer)
    assert streamer.calls == [[5, 9, 3]] + [[t] for t in out[0, 3:].tolist()] + ["end"]
    with pytest.raises(InputError, match="top_p"):
        decoder.generate(prompt, max_new_tokens=2, do_sample=True, top_p=0.0)
    with pytest.raises(InputError, match="stop_strings need a tokenizer"):
        decoder.generate(prompt, max_new_tokens=2, stop_strings=["x"])


def test_compile_step_is_the_one_chain_and_replans_from_the_same_ir(tiny):
    """megabake.compiler.compile_step: capture -> IR -> rotary -> plan -> codegen for bake, the in-memory bake,
    scripts and tests; replan builds another tiling from the same capture and IR."""
    from megabake.codegen import generate
    from megabake.compiler import CompiledStep
    from megabake.plan import DEFAULT_TUNING

    assert isinstance(tiny, CompiledStep) and tiny.generated.source == generate(tiny.plan).source
    plain = tiny.replan(tuning=DEFAULT_TUNING)
    assert plain.ir is tiny.ir and plain.captured is tiny.captured and plain.plan.hash != tiny.plan.hash
    assert {s.tiling.stages for s in plain.plan.stages if s.tiling.kind == "rows"} == {0}
    assert plain.generated.source == generate(plain.plan).source
    assert tiny.plan_for().hash == tiny.plan.hash  # the default tiling, deterministically
