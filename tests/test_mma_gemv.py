"""The tensor-core GEMV (tiling ``8xU+mma``, experimental feature ``mma_gemv``): batched GEMVs on mma.sync.

At batch 8 the plain GEMV spends 8 fp32 FMAs and 8 bf16 -> fp32 conversions per weight element and sequence, so
Llama-3.2-1B's batch-8 step costs 3.07x its batch-1 step on the H200 (session 12). ``+mma`` multiplies bf16
weights by the bf16-staged input rows on the tensor cores instead (fp32 sums). Checked here on the CPU: the text
form and its refusals, the plan's choice of warps per tile and loads in flight, plans without it unchanged, the
reference executor unchanged (same math as bf16 staging), and a CuTe DSL compile for sm_90a whose PTX holds the
MMAs. Its kernel passed on the H200 in session 13 (``pytest -m gpu tests/test_gpu_decode.py -k mma``: tiny-llama
b2, Llama-3.2-1B b8 and Qwen2.5-0.5B b5 match the bf16-staging reference) and took Llama-3.2-1B's batch-8 step
from 2.838 to 1.993 ms; ``mma_gemv`` is GPU-verified since, the default tiling of bf16-staged buckets.
"""

from __future__ import annotations

import pytest
import torch

from megabake.errors import PlanError
from megabake.plan import GEMV_STAGES, GemvTuning
from megabake.plan.reference import reference_executor_for
from megabake.plan.tuning import HOPPER_SMEM_PER_BLOCK, mma_split, mma_unroll
from tests.compiler_fixtures import body_calls, compile_preset

EXPERIMENTAL = "MEGABAKE_EXPERIMENTAL_LAYOUTS"
MMA = {stage: GemvTuning.parse("8x8+mma") for stage in GEMV_STAGES}
PLAIN = {stage: GemvTuning() for stage in GEMV_STAGES}


def test_text_form_round_trips_and_refuses_other_flags():
    tuning = GemvTuning.parse("8x8+mma")
    assert tuning.mma and tuning.per_tile == 8 and tuning.spec == "8x8+mma"
    with pytest.raises(PlanError, match="tiles of 8 rows .* e.g. 8x8\\+mma"):
        GemvTuning.parse("2x4+mma")
    with pytest.raises(PlanError, match="no other flag"):
        GemvTuning.parse("8x4+spread+mma")


@pytest.mark.parametrize("rows, cols, split", [
    (3072, 2048, 8),    # Llama-3.2-1B q/k/v: 384 tiles; 8 warps per tile keep 97% of 1056 warps busy
    (2048, 2048, 4),    # o_proj: 256 tiles
    (16384, 2048, 1),   # gate/up: 2048 tiles fill every warp twice
    (2048, 8192, 4),    # down
    (128256, 2048, 2),  # LM head
])
def test_warps_per_tile_keep_the_grid_busy(rows, cols, split):
    assert mma_split(rows, cols, 132, 8) == split
    tiles = -(-rows // 8)
    per_round = 132 * (8 // split)
    assert tiles / (-(-tiles // per_round) * per_round) > 0.9


def test_loads_in_flight_divide_the_k_slice():
    assert mma_unroll(2048, 4, 8) == 8  # 512 of K per warp = 16 steps of 32
    assert mma_unroll(896, 4, 8) == 7   # Qwen2.5-0.5B: 224 = 7 steps
    assert mma_unroll(608 * 8, 8, 8) == 1  # 19 steps (prime): one load per lane and step
    with pytest.raises(PlanError, match="multiple of it"):
        mma_split(64, 520, 132, 8)


def test_mma_bakes_without_opt_in_once_gpu_verified(monkeypatch):
    """Verified on the H200 (session 13): ``+mma`` bakes without the opt-in; the gate itself still refuses it
    for a tree where it is not in GPU_VERIFIED_FEATURES."""
    import megabake.plan as plan_module

    monkeypatch.delenv(EXPERIMENTAL, raising=False)
    compiled = compile_preset("tiny-llama", batch=2, capacity=64, tuning=MMA)
    assert all(s.tiling.mma for s in compiled.plan.stages if s.tiling.kind == "rows")
    unverified = tuple(f for f in plan_module.GPU_VERIFIED_FEATURES if f != "mma_gemv")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", unverified)
    with pytest.raises(PlanError, match="tensor-core GEMV .*MEGABAKE_EXPERIMENTAL_LAYOUTS=mma_gemv"):
        compiled.replan(tuning=MMA)


def test_mma_plan_stages_bf16_splits_small_stages_and_keeps_other_plans(monkeypatch):
    import megabake.plan as plan_module

    unverified = tuple(f for f in plan_module.GPU_VERIFIED_FEATURES if f != "mma_gemv")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", unverified)  # the default is the plain tiling
    monkeypatch.setenv(EXPERIMENTAL, "mma_gemv")
    plain = compile_preset("llama-3.2-1b", layers=1, vocab=4096, batch=8, capacity=128)
    compiled = plain.replan(tuning=MMA)
    plan = compiled.plan
    assert plan.staging_dtype == "bfloat16" and plan.smem_bytes <= HOPPER_SMEM_PER_BLOCK
    splits = {s.name: (s.tiling.mma, s.tiling.per_tile, s.tiling.unroll)
              for s in plan.stages if s.tiling.kind == "rows"}
    assert splits == {"norm_qkv": (8, 8, 8), "o_residual": (4, 8, 8), "norm_gate_up": (1, 8, 8),
                      "down_residual": (4, 8, 8), "norm_lm_head": (2, 8, 8)}
    assert '"mma": 8' in plan.to_json() and '"mma"' not in plain.plan.to_json()
    source = compiled.generated.source
    assert "bodies.gemv_rows_mma(" in source and "s_part = smem.allocate_tensor" in source
    assert "gemv_rows_mma" not in plain.generated.source.split("# ---- stage")[1]


def test_mma_refusals(monkeypatch):
    monkeypatch.setenv(EXPERIMENTAL, "mma_gemv")
    compiled = compile_preset("tiny-llama", batch=2, capacity=64)
    with pytest.raises(PlanError, match="reads its inputs as bf16.*float32"):
        compiled.replan(tuning=MMA, staging="float32")
    softcapped = compile_preset("tiny-gemma2", capacity=64)
    with pytest.raises(PlanError, match="soft-cap the LM head"):
        softcapped.replan(tuning=MMA)
    head_plain = {**MMA, "norm_lm_head": GemvTuning()}
    assert softcapped.replan(tuning=head_plain).plan.stages[-1].tiling.mma == 0


def test_reference_executor_is_the_bf16_staging_math(monkeypatch):
    """The MMA sums the same bf16 products in fp32 (in its own order): the reference executor of an mma plan is
    the bf16-staging reference, so the GPU test compares the kernel against it."""
    monkeypatch.setenv(EXPERIMENTAL, "mma_gemv")
    compiled = compile_preset("tiny-llama", batch=2, capacity=64)
    mma, bf16 = compiled.replan(tuning=MMA), compiled.replan(tuning=PLAIN, staging="bfloat16")
    tokens = torch.tensor([5, 9])
    want = reference_executor_for(bf16.plan, compiled.model).step(tokens, 3)
    got = reference_executor_for(mma.plan, compiled.model).step(tokens, 3)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("preset, batch, layers, mmas_per_stage, gated",
                         [("llama-3.2-1b", 8, 2, 16, "1"), ("tiny-llama", 2, None, None, "1"),
                          ("tiny-gemma", 2, None, None, "2")])
def test_mma_module_compiles_for_sm90a(monkeypatch, tmp_path, preset, batch, layers, mmas_per_stage, gated):
    """Two m16n8k16 bf16 MMAs per 16-byte weight vector in each GEMV stage's K loop (8 vectors per lane and
    step at Llama's shapes), CTA barriers where split partial sums meet; the gate/up GEMV applies the model's
    activation (code 1 silu, 2 Gemma's tanh GELU) and only it. Built with split-KV attention on the lane-group
    loop (``mma_attention=False``), so every MMA counted is a GEMV's (the default's attention adds its own)."""
    pytest.importorskip("cutlass")
    from megabake.codegen import generate
    from megabake.runtime.compile import compile_check, load_module

    monkeypatch.setenv(EXPERIMENTAL, "mma_gemv")
    compiled = compile_preset(preset, layers=layers, vocab=4096 if layers else None, batch=batch, capacity=128,
                              tuning=MMA)
    source = generate(compiled.plan, mma_attention=False).source
    result = compile_check(compiled.plan, load_module(source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    mmas = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    gemv_stages = [s for s in compiled.plan.stages if s.tiling.mma]
    want = (mmas_per_stage * len(gemv_stages) if mmas_per_stage
            else sum(2 * s.tiling.unroll for s in gemv_stages))
    assert mmas == want, (mmas, want)
    calls = body_calls(source, "gemv_rows_mma")
    assert [c["gated"] for c in calls] == ["0", "0", gated, "0", "0"], calls


def test_mma_is_the_bf16_default(monkeypatch):
    """GPU-verified in session 13: a bf16-staged bucket of at most 8 sequences of a SiLU model (Llama-3.2-1B at
    batch 8) plans ``8x8+mma`` by default, an fp32-staged one keeps the streaming ring, a bf16-staged batch of 9
    keeps the plain tiling, a tanh-GELU model (session 14) too on its soft-capped LM head, a model whose activation
    has not run on a GPU everywhere; on a tree where the feature is not verified the default is the plain one."""
    import megabake.plan as plan_module

    monkeypatch.delenv(EXPERIMENTAL, raising=False)
    batch8 = compile_preset("llama-3.2-1b", layers=1, vocab=4096, batch=8, capacity=128)
    assert all(s.tiling.mma for s in batch8.plan.stages if s.tiling.kind == "rows")
    assert batch8.plan.smem_bytes <= HOPPER_SMEM_PER_BLOCK
    assert batch8.replan(tuning=MMA).plan == batch8.plan  # the GPU test's explicit 8x8+mma is this default
    batch1 = compile_preset("tiny-llama", capacity=64)
    assert not any(s.tiling.mma for s in batch1.plan.stages) and batch1.plan.staging_dtype == "float32"
    # batches 2-8 stage bf16 rows for the tensor cores even where fp32 rows fit (session 14: faster at batch 4);
    # the same plan the GPU test builds explicitly (staging="bfloat16", tuning=8x8+mma)
    batch2 = compile_preset("tiny-llama", batch=2, capacity=64)
    assert batch2.plan.staging_dtype == "bfloat16"
    assert batch2.replan(staging="bfloat16", tuning=MMA).plan == batch2.plan
    assert batch2.replan(staging="float32").plan.staging_dtype == "float32"  # an explicit staging is kept
    assert not any(s.tiling.mma for s in batch2.replan(staging="float32").plan.stages)
    batch9 = compile_preset("tiny-llama", batch=9, capacity=64).replan(staging="bfloat16").plan
    assert batch9.staging_dtype == "bfloat16" and not any(s.tiling.mma for s in batch9.stages)
    # tanh-GELU models (Gemma, verified in session 14): all but the soft-capped LM head (Gemma 2)
    gemma2 = compile_preset("tiny-gemma2", capacity=64)
    gemma2_mma = gemma2.replan(staging="bfloat16").plan
    assert [s.tiling.mma > 0 for s in gemma2_mma.stages if s.tiling.kind == "rows"][-1] is False
    assert all(s.tiling.mma for s in gemma2_mma.stages if s.tiling.kind == "rows" and s.name != "norm_lm_head")
    monkeypatch.setattr(plan_module, "MMA_DEFAULT_ACTIVATIONS", ("silu",))  # an activation not verified: plain
    assert not any(s.tiling.mma for s in gemma2.replan(staging="bfloat16").plan.stages)
    unverified = tuple(f for f in plan_module.GPU_VERIFIED_FEATURES if f != "mma_gemv")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", unverified)
    assert not any(s.tiling.mma for s in batch8.replan().plan.stages)
    assert batch2.replan().plan.staging_dtype == "float32"  # fp32 rows fit: no reason for bf16 without the MMA


def test_interleave_halves_pairs_gate_and_up_blocks():
    from megabake.plan.packing import interleave_halves

    rows = torch.arange(16).float()[:, None].expand(16, 3)
    got = interleave_halves(rows, 4)[:, 0].long().tolist()
    assert got == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="blocks of 4"):
        interleave_halves(torch.zeros(12, 2), 4)


@pytest.mark.parametrize("preset, batch", [("tiny-llama", 2), ("tiny-gemma", 2), ("tiny-olmo2", 1)])
def test_gate_up_gemv_on_tensor_cores_applies_the_activation(preset, batch):
    """With ``+mma`` on the gate/up stage its packed rows alternate 4 gate and 4 up rows, it writes act(gate) * up
    (silu; Gemma's tanh GELU) once, and the down stage copies that row: the reference executor gives exactly the
    logits of the unfused bf16-staged plan (the same products, rounded to bf16 at the same place), and plans
    without the tensor-core gate/up GEMV keep their packing."""
    from megabake.plan.stages import spec_of

    compiled = compile_preset(preset, batch=batch, capacity=64)
    fused, unfused = compiled.replan(tuning=MMA).plan, compiled.replan(tuning=PLAIN, staging="bfloat16").plan
    gate_up = next(s for s in fused.stages if s.name == "norm_gate_up")
    down = next(s for s in fused.stages if s.name == "down_residual")
    assert spec_of(gate_up, fused).gemv.gated and "act" in gate_up.roles and "act" not in down.roles
    assert spec_of(down, fused).vector.kind == "copy"
    assert {p.buffer: p.interleave for p in fused.packed if p.interleave} == {"w_gate_up": 4}
    assert not any(p.interleave for p in unfused.packed) and '"interleave"' not in unfused.to_json()
    from megabake.plan.model import Plan
    assert Plan.from_json(fused.to_json()) == fused
    tokens = torch.arange(1, batch + 1) * 7
    want, got = reference_executor_for(unfused, compiled.model), reference_executor_for(fused, compiled.model)
    for position in range(5):
        assert torch.equal(got.step(tokens, position), want.step(tokens, position))


def test_gated_gemv_interleaves_its_bias_too():
    """Llama's mlp_bias: the gate/up bias is packed in the same row order as the weight."""
    from tests.test_compiler import _randomise_biases, _small
    from tests.compiler_fixtures import compile_model

    model = _randomise_biases(_small("LlamaForCausalLM", mlp_bias=True))
    compiled = compile_model(model, batch=2)
    fused, unfused = compiled.replan(tuning=MMA).plan, compiled.replan(tuning=PLAIN, staging="bfloat16").plan
    assert {p.buffer: p.interleave for p in fused.packed if p.interleave} == {"w_gate_up": 4, "bias_gate_up": 4}
    tokens = torch.tensor([3, 11])
    want, got = reference_executor_for(unfused, model), reference_executor_for(fused, model)
    for position in range(3):
        assert torch.allclose(got.step(tokens, position), want.step(tokens, position), rtol=0, atol=1e-6)
