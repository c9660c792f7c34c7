"""The ``fused_o`` build (session 34 candidate, ``megabake.codegen.fused``): where it applies, its geometry, what it
emits, and a CuTe DSL compile for sm_90a (no GPU). Its numerics run on the H200: tests/test_fused_o_gpu.py."""

from __future__ import annotations

import pytest

from megabake.codegen import generate
from megabake.codegen.fused import FUSED_O_BUFFERS, fused_geometry, fused_kv_refusal, fused_o_refusal
from megabake.runtime.compile import argument_buffers, compile_check, extra_buffers, load_module
from tests.compiler_fixtures import compile_preset

# batch-1 pre-norm presets whose W_O block fits the ring (the four with short-context targets among them)
FUSED_PRESETS = ["smollm-135m", "qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "smollm-1.7b", "granite-3.1-2b"]


@pytest.fixture(scope="module")
def smollm():
    return compile_preset("smollm-135m", layers=2, vocab=4096, capacity=2048)


@pytest.mark.parametrize("preset", FUSED_PRESETS)
def test_fused_geometry_covers_every_row_and_fits_the_ring(preset):
    """Every W_O row has a block in every KV group's CTAs, the grid holds them, and a block fits the idle ring."""
    plan = compile_preset(preset, layers=1, vocab=512, capacity=1024).plan
    assert fused_o_refusal(plan) is None
    geometry = fused_geometry(plan)
    assert geometry.blocks * plan.dims.n_kv_heads <= plan.ctas
    assert geometry.blocks * geometry.block_rows >= plan.dims.hidden
    assert (geometry.blocks - 1) * geometry.block_rows < plan.dims.hidden  # no block wholly past the last row
    assert geometry.cols == plan.dims.n_heads // plan.dims.n_kv_heads * plan.dims.head_dim
    assert geometry.block_bytes <= geometry.ring_bytes
    assert fused_kv_refusal(plan) is None  # and the group's K/V rows after it
    attention = next(s.tiling for s in plan.stages if s.kind == "attention")
    assert geometry.kv_bytes == 2 * attention.per_tile * plan.dims.head_dim * 2


def test_fused_o_module_declares_its_buffers_and_keeps_the_split_path(smollm):
    """The fused build passes o_mid and o_part (fp32, declared in EXTRA_BUFFERS for the runtime and the compile
    check), runs the default build's attention and O-projection calls where a step is split (fo == 0), and adds
    the down projection's output to o_mid (the residual after attention) instead of accumulating into x."""
    plan = smollm.plan
    # fused_o alone (spare_ring, the default since session 49, repeats warp 0's ring fills after a wait, but not
    # the W_O fill that _write_fused_o_loads writes: test_spare_warp)
    source = generate(plan, fused_o=True, fused_split=False, fused_mlp=False, spare_ring=False).source
    module = load_module(source)
    assert module.ARGUMENTS[-2:] == list(FUSED_O_BUFFERS)
    buffers = {b.name: b for b in extra_buffers(module)}
    assert buffers["o_mid"].shape == [1, plan.dims.hidden] and buffers["o_part"].shape == [plan.dims.n_kv_heads,
                                                                                           plan.dims.hidden]
    assert all(b.dtype == "float32" for b in buffers.values())
    assert [b.name for b in argument_buffers(plan, module)][-2:] == ["o_mid", "o_part"]
    kernel = source.split("# ====")[0]
    default_kernel = generate(plan, fused_o=False, spare_ring=False).source.split("# ====")[0]
    for call in ("bodies.split_kv_attention(", "bodies.merge_splits_to_smem(", "bodies.fused_attention_o(",
                 "bodies.fused_o_load(", "bodies.rmsnorm_partials_to_smem("):
        assert call in kernel, call
    assert "fo = bodies.fused_o_step(" in kernel and kernel.count("if fo == 0:") == 1
    assert "bias=o_mid[0, None]" in kernel and "has_bias=True" in kernel
    # the split path's calls are the default build's, in order, but the gate/up stage's staging (the per-layer
    # RMSNorm between the layer's input norm and the final norm)
    called = [line.strip().split("(")[0] for line in default_kernel.splitlines() if line.strip().startswith("bodies.")]
    fused_called = [line.strip().split("(")[0] for line in kernel.splitlines() if line.strip().startswith("bodies.")]
    norms = [i for i, name in enumerate(called) if name == "bodies.rmsnorm_to_smem"]
    assert len(norms) == 3
    called[norms[1]] = "bodies.rmsnorm_partials_to_smem"
    assert [name for name in fused_called if name not in ("bodies.fused_o_load", "bodies.fused_attention_o")] == called
    # the O projection's ring fill stays on the split path only
    lines = kernel.splitlines()
    fill = next(i for i, line in enumerate(lines)
                if "bodies.gemv_ring_prefill(" in line and "weight=w_o[" in " ".join(lines[i:i + 2]))
    assert lines[fill - 1].strip() == "else:"


@pytest.mark.parametrize("build", [{}, {"fused_kv_smem": True}, {"fused_mma": False}])
def test_fused_o_build_compiles_for_sm90a(smollm, build, tmp_path):
    source = generate(smollm.plan, fused_o=True, **build).source
    assert ("FUSED_KV_SMEM = True" in source) == ("fused_kv_smem" in build)
    assert ("FUSED_MMA = True" in source) == ("fused_mma" not in build)
    result = compile_check(smollm.plan, load_module(source), dump_dir=str(tmp_path))
    assert result.ok, result.error


def test_fused_o_build_compiles_with_head_norms_and_the_tensor_cores(tmp_path):
    """Qwen3-0.6B: per-head q/k norms in the fused item, whole groups of 2 heads of 128 on the tensor cores
    (``fused_mma``)."""
    compiled = compile_preset("qwen3-0.6b", layers=2, vocab=4096, capacity=4096)
    source = generate(compiled.plan, fused_o=True, fused_mma=True).source
    assert "FUSED_MMA = True" in source
    result = compile_check(compiled.plan, load_module(source), dump_dir=str(tmp_path))
    assert result.ok, result.error


def test_fused_steps_score_on_the_tensor_cores_unless_fused_mma_is_off(smollm):
    """A fused step's whole KV group runs on the tensor cores where it fits (``fused_mma=None``: the default);
    ``fused_mma=False`` puts it on the fp32 lane-group loop, as the default's short-context head slices do. The
    item reads the module constant FUSED_MMA; the header counts the fused steps' barriers."""
    plan = smollm.plan
    default = generate(plan, fused_o=True, fused_split=False, fused_mlp=False).source
    assert "MMA_ATTENTION = True" in default and "FUSED_MMA = True" in default
    assert "mma_attention=FUSED_MMA," in default
    assert "FUSED_MMA = False" in generate(plan, fused_o=True, fused_mma=False).source
    header = default.split('"""')[1]
    layers = plan.dims.layers
    assert (f"{plan.barriers_per_step} grid barriers per step ({plan.barriers_per_step - layers} where the context "
            "fits MIN_CHUNK: fused_o)") in header


@pytest.mark.parametrize("preset,build,reason", [
    ("smollm-135m", {"fused_o": False}, "needs fused_o=True"),
    ("smollm-135m", {"fused_o": True, "mma_attention": False}, "needs mma_attention=True"),
])
def test_fused_mma_refuses_what_it_cannot_build(preset, build, reason):
    plan = compile_preset(preset, layers=1, vocab=512, capacity=1024).plan
    with pytest.raises(ValueError, match="fused_mma") as error:
        generate(plan, fused_mma=True, **build)
    assert reason in str(error.value)


def test_fused_mma_refuses_groups_the_tensor_cores_cannot_take(monkeypatch):
    """SmolLM-1.7B has one query head per KV head: no tensor-core item (the rule itself; its generate refuses
    mma_attention=True first)."""
    import megabake.codegen as codegen

    plan = compile_preset("smollm-1.7b", layers=1, vocab=512, capacity=1024).plan
    monkeypatch.setattr(codegen, "mma_attention_items", lambda *args, **kwargs: [1])  # let mma_attention=True through
    with pytest.raises(ValueError, match="fused_mma") as error:
        generate(plan, fused_o=True, mma_attention=True, fused_mma=True)
    assert "a KV group of 1 x 64 is not 2-8 heads of 64 or 128 dims" in str(error.value)


@pytest.mark.parametrize("preset,build,reason", [
    ("smollm-135m", {"batch": 2}, "batch 1"),
    ("olmo-2-1b", {}, "not pre-norm"),
    ("phi-3-mini", {}, "does not fit the cp.async ring"),
    ("smollm-135m", {"watchdog": True}, "split grid barrier"),
])
def test_fused_o_refuses_what_it_cannot_build(preset, build, reason):
    batch = build.pop("batch", 1)
    plan = compile_preset(preset, layers=1, vocab=512, capacity=1024, batch=batch).plan
    with pytest.raises(ValueError, match="fused_o") as error:
        generate(plan, fused_o=True, **build)
    assert reason in str(error.value)


@pytest.mark.parametrize("preset,fused_o,reason", [
    ("smollm-135m", False, "needs fused_o=True"),
    ("tiny-mistral", True, "sliding windows"),
    ("gemma-2b", True, "do not fit the cp.async ring"),
])
def test_fused_kv_smem_refuses_what_it_cannot_build(preset, fused_o, reason):
    plan = compile_preset(preset, layers=1, vocab=512, capacity=1024).plan
    if preset == "gemma-2b":  # its generate refuses fused_o first (the spread merge): the rule itself
        assert reason in fused_kv_refusal(plan)
        return
    with pytest.raises(ValueError, match="fused_kv_smem") as error:
        generate(plan, fused_o=fused_o, fused_kv_smem=True)
    assert reason in str(error.value)


def test_default_fused_o_is_on_where_its_groups_take_the_tensor_cores(smollm, monkeypatch):
    """``FUSED_O_DEFAULT`` is on (session 35 measured it faster on four presets; session 36's GPU suite passed with
    it): ``generate(plan)`` fuses short-context steps with their whole KV groups on the tensor cores, and quietly
    stays off where the build cannot (batch 2; a timeline build is fused too since session 44, so it times the
    default) or where the groups would run the lane-group loop
    (mma_attention=False, or one query head per KV head: SmolLM-1.7B), which the H200 measured slower
    (Qwen2.5-0.5B); an explicit ``fused_o=True`` refuses instead. Off, every plan gets the split build."""
    import megabake.codegen as codegen

    assert codegen.FUSED_O_DEFAULT is True
    source = generate(smollm.plan).source
    assert "bodies.fused_attention_o(" in source and "FUSED_MMA = True" in source
    assert "bodies.fused_attention_o(" in generate(smollm.plan, timeline=True).source
    assert "bodies.fused_attention_o(" not in generate(smollm.plan, fused_o=False).source
    assert "bodies.fused_attention_o(" not in generate(smollm.plan, mma_attention=False).source
    lane = generate(smollm.plan, fused_o=True, mma_attention=False).source
    assert "bodies.fused_attention_o(" in lane and "FUSED_MMA = False" in lane
    batch2 = compile_preset("smollm-135m", layers=1, vocab=512, capacity=1024, batch=2).plan
    assert "bodies.fused_attention_o(" not in generate(batch2).source
    with pytest.raises(ValueError, match="batch 1"):
        generate(batch2, fused_o=True)
    mha = compile_preset("smollm-1.7b", layers=1, vocab=512, capacity=1024).plan
    assert fused_o_refusal(mha) is None and "bodies.fused_attention_o(" not in generate(mha).source
    monkeypatch.setattr(codegen, "FUSED_O_DEFAULT", False)
    assert "bodies.fused_attention_o(" not in generate(smollm.plan).source


def test_reference_mirrors_fused_groups_on_the_tensor_cores_only_where_steps_are_fused():
    """``ReferenceExecutor(..., fused_mma=True)`` (a GPU check's reference for a default build since session 35):
    a step whose visible positions fit MIN_CHUNK scores whole KV groups with the tensor cores' bf16 rounding, so
    its logits move by that rounding from the plan's fp32 dealing (1-head items there); a split step is the same
    computation, bit for bit."""
    import torch

    from megabake.plan.reference import reference_executor_for

    compiled = compile_preset("smollm-135m", layers=2, vocab=512, capacity=512)
    plan = compiled.plan
    min_chunk = next(s.tiling for s in plan.stages if s.kind == "attention").per_tile
    mirrors = [reference_executor_for(plan, compiled.model) for _ in range(2)]
    mirrors[1].mma_attention = mirrors[1].fused_mma = True
    generator = torch.Generator().manual_seed(5)
    for name in ("k_cache", "v_cache"):
        cache = torch.randn(mirrors[0].buffers[name].shape, generator=generator).to(mirrors[0].buffers[name].dtype)
        for mirror in mirrors:
            mirror.buffers[name].copy_(cache)
    token = torch.tensor([7])
    # split steps first (a fused step's attention reaches the next layer's cached K/V rows): 1-head items at
    # these positions, none on the tensor cores
    for position in (min_chunk, 400):
        plain, fused = (mirror.step(token, position) for mirror in mirrors)
        assert torch.equal(plain, fused), position
    for position in (3, min_chunk - 1):  # fused: within bf16 rounding, not equal
        plain, fused = (mirror.step(token, position) for mirror in mirrors)
        error = float((fused - plain).norm() / plain.norm())
        assert 1e-5 < error < 2e-2, (position, error)
