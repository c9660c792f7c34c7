"""The ``fused_split`` build (session 44 candidate, built without a GPU): every step's O projection in attention's
interval, the split steps' too (``bodies.split_o_block`` after the split-KV items, a per-KV-group arrival counter
instead of a grid barrier). What it emits, its buffers, its timelines, and a CuTe DSL compile for sm_90a (no GPU).
Its numerics run on the GPU: tests/test_fused_split_gpu.py."""

from __future__ import annotations

import re

import pytest

from megabake.codegen import TIMELINE_PHASES, generate
from megabake.codegen.fused import FUSED_SPLIT_BUFFERS, fused_split_refusal
from megabake.runtime.compile import argument_buffers, compile_check, extra_buffers, load_module
from tests.compiler_fixtures import body_calls, compile_preset


@pytest.fixture(scope="module")
def smollm():
    return compile_preset("smollm-135m", layers=2, vocab=512, capacity=2048)


def test_refusals_name_the_cause(smollm):
    assert "extends fused_o" in fused_split_refusal(smollm.plan, fused_o=False)
    assert fused_split_refusal(smollm.plan, fused_o=True) is None
    with pytest.raises(ValueError, match=r"fused_split runs every step's O projection in attention's interval, but "
                                         r"it extends fused_o .*: build without it"):
        generate(smollm.plan, fused_o=False, fused_split=True)
    with pytest.raises(ValueError, match="fused_kv_smem copies a step's cached K/V rows"):
        generate(smollm.plan, fused_o=True, fused_kv_smem=True, fused_split=True)
    batch2 = compile_preset("smollm-135m", layers=1, vocab=512, capacity=1024, batch=2).plan
    with pytest.raises(ValueError, match="fused_o"):  # fused_o's own refusal comes first
        generate(batch2, fused_split=True)


def test_the_module_has_one_barrier_less_per_layer_and_counts_items_per_group(smollm):
    """Against the fused_o build: the O stage's barrier and ring fill are gone at every step (one grid wait less
    per layer in the text: fused_o's sits under ``if fo == 0:``), every step copies its W_O block, the split call
    counts its items into the layer's ``o_count`` row, ``split_o_block`` follows it, and the gate/up staging
    always sums the O partials; the prologue zeroes the counters (int64 [layers, n_kv_heads])."""
    plan = smollm.plan
    fused_o = generate(plan, fused_o=True, fused_split=False, fused_mlp=False).source
    source = generate(plan, fused_o=True, fused_split=True, fused_mlp=False).source
    kernel, base = source.split("\n# ====")[0], fused_o.split("\n# ====")[0]
    assert kernel.count("bodies.grid_wait(") == base.count("bodies.grid_wait(") - 1
    assert "if fo == 0:" in base and "if fo == 0:" not in kernel
    o_ring_fill = re.compile(r"bodies\.gemv_ring_prefill\(\s+weight=w_o\[")
    assert o_ring_fill.search(base) and not o_ring_fill.search(kernel)
    assert kernel.count("bodies.fused_o_load(") == 1 and not re.search(r"if fo == 1:\s+bodies\.fused_o_load", kernel)
    assert "group_counts=o_count[layer, None], count_groups=True)" in kernel
    assert kernel.index("bodies.split_kv_attention(") < kernel.index("bodies.split_o_block(")
    assert "fused=1, parts=N_KV_HEADS" in kernel and "fused=fo, parts=N_KV_HEADS" in base
    assert re.search(r"bodies\.zero_rows\(\s*t=o_count, cta=cta, tidx=tidx, batch=LAYERS, width=N_KV_HEADS", kernel)
    module = load_module(source)
    assert module.FUSED_SPLIT is True and FUSED_SPLIT_BUFFERS == ("o_count",)
    assert module.EXTRA_BUFFERS["o_count"] == (plan.dims.layers, plan.dims.n_kv_heads)
    assert module.EXTRA_BUFFER_DTYPES == {"o_count": "int64"}
    counts = {b.name: b for b in extra_buffers(module)}["o_count"]
    assert (counts.dtype, counts.shape) == ("int64", [plan.dims.layers, plan.dims.n_kv_heads])
    assert [b.name for b in argument_buffers(plan, module)][-1] == "o_count"
    header = source.split('"""')[1]
    assert f"{plan.barriers_per_step - plan.dims.layers} grid barriers per step (fused_o, fused_split)" in header


def test_the_default_module_is_the_fused_split_build(smollm):
    """On by default since session 45 (the whole GPU suite passed with it on): ``generate(plan)`` of a plan whose
    default is fused_o is the fused_split build; ``fused_split=False`` gives the fused_o build without it."""
    default = generate(smollm.plan).source
    assert default == generate(smollm.plan, fused_split=True).source
    assert "split_o_block" in default.split("\n# ====")[0]
    assert "split_o_block" not in generate(smollm.plan, fused_split=False).source.split("\n# ====")[0]


@pytest.mark.parametrize("preset,capacity,builds", [
    ("smollm-135m", 2048, {}),
    ("qwen2.5-0.5b", 4096, {"fused_mlp": True}),  # 7-head groups: 448 columns per W_O block row
    ("qwen3-0.6b", 4096, {"timeline": TIMELINE_PHASES}),  # per-head q/k norms, heads of 128
])
def test_a_fused_split_build_compiles_for_sm90a(preset, capacity, builds):
    plan = compile_preset(preset, layers=2, vocab=512, capacity=capacity).plan
    module = load_module(generate(plan, fused_o=True, fused_split=True, **builds).source)
    result = compile_check(plan, module)
    assert result.ok, result.error


def test_it_is_on_wherever_fused_o_is_and_only_there(smollm):
    """A GPU-verified feature (``GPU_VERIFIED_FEATURES``): ``fused_split=None`` turns it on wherever fused_o is on
    and fused_kv_smem off, never asks for it elsewhere (no refusal raised by the default)."""
    from megabake.plan import GPU_VERIFIED_FEATURES, feature_enabled

    assert "fused_split" in GPU_VERIFIED_FEATURES and feature_enabled("fused_split")

    def kernel(**build) -> str:
        return generate(smollm.plan, **build).source.split("\n# ====")[0]

    assert "split_o_block" in kernel(fused_o=True)
    assert "split_o_block" not in kernel(fused_o=False)
    assert "split_o_block" not in kernel(fused_o=True, fused_kv_smem=True)


def test_fused_builds_take_the_dealing_made_for_the_tensor_cores(smollm, tmp_path):
    """``mma_schedule`` (whole KV groups over more, shorter chunks on the tensor cores) with an explicit fused_o
    (session 45 candidate, ``gpu_tune.py --builds fused-mma-schedule``; the default still leaves fused_o off under
    it): every body that deals split-KV items, the attention, its K/V prefetch and ``split_o_block`` (whose counter
    target is the group's item count), deals alike, and the module compiles for sm_90a."""
    from megabake.plan.attention import mma_slice_mask

    plan = smollm.plan
    assert "bodies.fused_attention_o(" not in generate(plan, mma_attention=True, mma_schedule=True).source
    source = generate(plan, mma_attention=True, mma_schedule=True, fused_o=True).source
    module = load_module(source)
    assert module.MMA_SLICES == mma_slice_mask(plan) != 0 and module.FUSED_SPLIT is True
    kernel = source.split("\n# ====")[0]
    dealing = ("split_kv_attention", "split_kv_prefetch", "split_o_block")
    for body in dealing:
        calls = body_calls(kernel, body)
        assert calls and all(call.get("mma_slices") == "MMA_SLICES" for call in calls), body
    result = compile_check(plan, module, dump_dir=str(tmp_path))
    assert result.ok, result.error


def test_the_reference_backend_deals_as_an_mma_schedule_build_does(smollm):
    """A decoder of an ``mma_schedule`` module reads its dealing (``MMA_SLICES``) and its reference executor deals
    alike: at 1500 positions SmolLM-135M's items are whole 3-head groups on the tensor cores (bf16 probabilities),
    not one-head slices in fp32, so its logits move within that rounding of the default dealing's."""
    import torch

    from megabake.plan.attention import mma_slice_mask
    from megabake.runtime import MegakernelDecoder

    plan = smollm.plan
    source = generate(plan, mma_attention=True, mma_schedule=True, fused_o=True).source
    logits = []
    for module_source in (source, generate(plan).source):
        decoder = MegakernelDecoder(plan, module_source, smollm.model, device="cpu")
        generator = torch.Generator().manual_seed(45)
        for name in ("k_cache", "v_cache"):
            buffer = decoder.buffers[name]
            buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
        logits.append((decoder.mma_slices, decoder.step(torch.tensor([17]), 1500).float().clone()))
    (slices, scheduled), (default_slices, default) = logits
    assert slices == mma_slice_mask(plan) != 0 and default_slices == 0
    difference = float((scheduled - default).norm() / default.norm())
    assert 0 < difference < 2e-2, difference
