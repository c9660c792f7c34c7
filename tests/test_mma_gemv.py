"""The tensor-core GEMV (tiling ``8xU+mma``, experimental feature ``mma_gemv``): batched GEMVs on mma.sync.

At batch 8 the plain GEMV spends 8 fp32 FMAs and 8 bf16 -> fp32 conversions per weight element and sequence, so
Llama-3.2-1B's batch-8 step costs 3.07x its batch-1 step on the H200 (session 12). ``+mma`` multiplies bf16
weights by the bf16-staged input rows on the tensor cores instead (fp32 sums). Checked here on the CPU: the text
form and its refusals, the plan's choice of warps per tile and loads in flight, plans without it unchanged, the
reference executor unchanged (same math as bf16 staging), and a CuTe DSL compile for sm_90a whose PTX holds the
MMAs. Its kernel has not run on a GPU yet (written in session 12 after the device time was spent):
``pytest -m gpu tests/test_gpu_decode.py -k mma``.
"""

from __future__ import annotations

import pytest
import torch

from megabake.errors import PlanError
from megabake.plan import GEMV_STAGES, GemvTuning
from megabake.plan.reference import reference_executor_for
from megabake.plan.tuning import HOPPER_SMEM_PER_BLOCK, mma_split, mma_unroll
from tests.compiler_fixtures import compile_preset

EXPERIMENTAL = "MEGABAKE_EXPERIMENTAL_LAYOUTS"
MMA = {stage: GemvTuning.parse("8x8+mma") for stage in GEMV_STAGES}


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


def test_mma_is_experimental_until_it_runs_on_a_gpu(monkeypatch):
    monkeypatch.delenv(EXPERIMENTAL, raising=False)
    with pytest.raises(PlanError, match="tensor-core GEMV .*MEGABAKE_EXPERIMENTAL_LAYOUTS=mma_gemv"):
        compile_preset("tiny-llama", batch=2, capacity=64, tuning=MMA)


def test_mma_plan_stages_bf16_splits_small_stages_and_keeps_other_plans(monkeypatch):
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
    mma, bf16 = compiled.replan(tuning=MMA), compiled.replan(staging="bfloat16")
    tokens = torch.tensor([5, 9])
    want = reference_executor_for(bf16.plan, compiled.model).step(tokens, 3)
    got = reference_executor_for(mma.plan, compiled.model).step(tokens, 3)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("preset, batch, layers, mmas_per_stage",
                         [("llama-3.2-1b", 8, 2, 16), ("tiny-llama", 2, None, None)])
def test_mma_module_compiles_for_sm90a(monkeypatch, tmp_path, preset, batch, layers, mmas_per_stage):
    """Two m16n8k16 bf16 MMAs per 16-byte weight vector in each GEMV stage's K loop (8 vectors per lane and
    step at Llama's shapes), CTA barriers where split partial sums meet."""
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check, load_module

    monkeypatch.setenv(EXPERIMENTAL, "mma_gemv")
    compiled = compile_preset(preset, layers=layers, vocab=4096 if layers else None, batch=batch, capacity=128,
                              tuning=MMA)
    result = compile_check(compiled.plan, load_module(compiled.generated.source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    mmas = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    gemv_stages = [s for s in compiled.plan.stages if s.tiling.mma]
    want = (mmas_per_stage * len(gemv_stages) if mmas_per_stage
            else sum(2 * s.tiling.unroll for s in gemv_stages))
    assert mmas == want, (mmas, want)


def test_mma_becomes_the_bf16_default_once_verified_on_a_gpu(monkeypatch):
    """Wired for the session that verifies it: with ``mma_gemv`` in GPU_VERIFIED_FEATURES a bf16-staged bucket
    (Llama-3.2-1B at batch 8) plans ``8x8+mma`` by default, an fp32-staged one keeps the streaming ring, and a
    soft-capped LM head keeps the plain tiling. Until then the default is unchanged."""
    import megabake.plan as plan_module

    monkeypatch.delenv(EXPERIMENTAL, raising=False)
    batch8 = compile_preset("llama-3.2-1b", layers=1, vocab=4096, batch=8, capacity=128)
    assert not any(s.tiling.mma for s in batch8.plan.stages)
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", (*plan_module.GPU_VERIFIED_FEATURES, "mma_gemv"))
    assert all(s.tiling.mma for s in batch8.replan().plan.stages if s.tiling.kind == "rows")
    assert batch8.replan().plan.smem_bytes <= HOPPER_SMEM_PER_BLOCK
    batch1 = compile_preset("tiny-llama", capacity=64)
    assert not any(s.tiling.mma for s in batch1.replan().plan.stages)
    gemma2 = compile_preset("tiny-gemma2", capacity=64).replan(staging="bfloat16").plan
    assert [s.tiling.mma > 0 for s in gemma2.stages if s.tiling.kind == "rows"][-1] is False
    assert all(s.tiling.mma for s in gemma2.stages if s.tiling.kind == "rows" and s.name != "norm_lm_head")
