"""GEMV input staging dtype: fp32 rows in shared memory where they fit, bf16 where they do not (large batches).

Llama-3.2-1B at batch 8 stages 8 x 8192 down-projection inputs: 256 KiB in fp32, over Hopper's 227 KiB per CTA.
In bf16 they take half, which is also what eager bf16 PyTorch feeds its GEMVs (its kernel passed `pytest -m gpu`
on the H200 in session 12). Checked here on the CPU: the choice, the refusals,
plan bytes of fp32 buckets unchanged, the reference executor equal to an HF model whose linear layers see
bf16-rounded inputs, and a CuTe DSL compile for sm_90a.
"""

from __future__ import annotations

import pytest
import torch

from megabake.baking import reference_check, rounded_linear_inputs
from megabake.errors import PlanError
from megabake.plan.memory import smem_bytes, staging_dtype
from megabake.plan.reference import reference_executor_for
from megabake.plan.tuning import HOPPER_SMEM_PER_BLOCK
from tests.compiler_fixtures import assert_matches_eager, compile_model, compile_preset

EXPERIMENTAL = "MEGABAKE_EXPERIMENTAL_LAYOUTS"


@pytest.fixture(scope="module")
def llama_1b_dims():
    return compile_preset("llama-3.2-1b", layers=1, vocab=512, batch=1, capacity=128).plan.dims


@pytest.mark.parametrize("batch, want", [(1, "float32"), (4, "float32"), (6, "float32"), (8, "bfloat16")])
def test_fp32_staging_where_it_fits_bf16_where_it_does_not(llama_1b_dims, batch, want):
    assert staging_dtype(llama_1b_dims, batch, 4096, 256, True) == want
    assert smem_bytes(llama_1b_dims, batch, 4096, 256, True, want) <= HOPPER_SMEM_PER_BLOCK
    if want == "bfloat16":
        fp32 = smem_bytes(llama_1b_dims, batch, 4096, 256, True, "float32")
        assert fp32 > HOPPER_SMEM_PER_BLOCK
        assert fp32 - smem_bytes(llama_1b_dims, batch, 4096, 256, True, want) == 2 * batch * 8192


def test_batch_8_bakes_with_bf16_staging_without_an_opt_in(monkeypatch):
    """bf16 staging ran on the H200 (session 12): Llama-3.2-1B batch 8 plans without MEGABAKE_EXPERIMENTAL_LAYOUTS."""
    monkeypatch.delenv(EXPERIMENTAL, raising=False)
    plan = compile_preset("llama-3.2-1b", layers=1, vocab=512, batch=8, capacity=128).plan
    assert plan.staging_dtype == "bfloat16" and '"staging_dtype": "bfloat16"' in plan.to_json()
    assert plan.smem_bytes <= HOPPER_SMEM_PER_BLOCK


def test_fp32_plans_keep_their_bytes(monkeypatch):
    """An fp32-staged plan does not name its staging: plans (and their hashes) of every bucket that baked before
    are unchanged. Forcing bf16 changes the plan and the generated shared-memory row type (with the plain GEMV:
    the tensor-core one, the default of bf16-staged buckets, has no streaming ring, so its bytes differ more)."""
    import megabake.plan as plan_module

    plain = tuple(f for f in plan_module.GPU_VERIFIED_FEATURES if f != "mma_gemv")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", plain)
    compiled = compile_preset("tiny-llama", batch=2, capacity=64)
    assert compiled.plan.staging_dtype == "float32" and "staging_dtype" not in compiled.plan.to_json()
    assert "Float32, cute.make_layout((BATCH, VEC_WIDTH)" in compiled.generated.source
    forced = compiled.replan(staging="bfloat16")
    assert forced.plan.hash != compiled.plan.hash
    assert "cutlass.BFloat16, cute.make_layout((BATCH, VEC_WIDTH)" in forced.generated.source
    assert forced.plan.smem_bytes == compiled.plan.smem_bytes - 2 * 2 * forced.plan.dims.intermediate
    with pytest.raises(PlanError, match="attention preload .* bf16 staging"):
        compiled.replan(staging="bfloat16", attention_preload=True)
    with pytest.raises(PlanError, match="staging dtype 'float16'"):
        compiled.replan(staging="float16")


def test_reference_executor_with_bf16_staging_rounds_every_gemv_input():
    """bf16 staging = the fp32 model with bf16-rounded inputs to q/k/v, o, gate/up, down and the LM head: the
    reference executor matches that model to 1e-5 over 12 steps and misses the unrounded model by far more."""
    compiled = compile_preset("tiny-llama", batch=1, capacity=32)
    model = compiled.model
    bf16 = compiled.replan(staging="bfloat16").plan
    plain_errors = assert_matches_eager(model, reference_executor_for(compiled.plan, model), steps=12)
    with rounded_linear_inputs(model):
        errors = assert_matches_eager(model, reference_executor_for(bf16, model), steps=12)
    assert max(errors) < 1e-5 and max(plain_errors) < 1e-5
    with pytest.raises(AssertionError, match="rel-L2"):  # without the rounding the two differ
        assert_matches_eager(model, reference_executor_for(bf16, model), steps=12)


def test_bake_reference_check_of_a_bf16_staged_plan_compares_like_with_like():
    """`megabake bake`'s reference check (1e-4 against eager fp32) holds for a bf16-staged plan: it compares with
    the fp32 model whose linear layers see bf16-rounded inputs (session 12: every bf16-staged bake reported
    `failed`, rel-L2 ~3e-3 against the unrounded model)."""
    compiled = compile_preset("tiny-llama", batch=2, capacity=32)
    bf16 = compiled.replan(staging="bfloat16").plan
    check = reference_check(bf16, compiled.model)
    assert check["ok"] and check["rel_l2"] < 1e-5, check
    assert reference_check(compiled.plan, compiled.model)["ok"]


def test_bf16_staged_llama_1b_batch_8_compiles_for_sm90a(tmp_path, monkeypatch):
    """The bucket bf16 staging exists for: Llama-3.2-1B (two of its layers) at batch 8 with the plain GEMV's
    default tiling (the cp.async ring still fits beside the bf16 rows; the tensor-core GEMV, this bucket's default
    since session 13, compiles in tests/test_mma_gemv.py); fp32 -> bf16 conversions where the rows are staged."""
    pytest.importorskip("cutlass")
    import megabake.plan as plan_module
    from megabake.runtime.compile import compile_check, load_module

    plain = tuple(f for f in plan_module.GPU_VERIFIED_FEATURES if f != "mma_gemv")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", plain)

    compiled = compile_preset("llama-3.2-1b", layers=2, vocab=4096, batch=8, capacity=128)
    assert compiled.plan.staging_dtype == "bfloat16"
    result = compile_check(compiled.plan, load_module(compiled.generated.source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    assert "cp.async.cg.shared.global" in next(tmp_path.glob("*.ptx")).read_text()


def test_bf16_staging_converts_where_rows_are_staged(tmp_path):
    """tiny-llama b2 with bf16 staging: more fp32 -> bf16 conversions than its fp32 kernel (which has them only for
    the KV cache), and its shared-memory rows take half the bytes."""
    pytest.importorskip("cutlass")
    from megabake.plan import DEFAULT_TUNING
    from megabake.runtime.compile import compile_check, load_module

    compiled = compile_preset("tiny-llama", batch=2, capacity=64)
    counts = {}  # the plain GEMV in both (batch 2's default is bf16 rows on the tensor cores since session 14)
    for staging in ("float32", "bfloat16"):
        variant = compiled.replan(staging=staging, tuning=dict(DEFAULT_TUNING))
        dump = tmp_path / staging
        result = compile_check(variant.plan, load_module(variant.generated.source), dump_dir=str(dump))
        assert result.ok, result.error
        counts[staging] = next(dump.glob("*.ptx")).read_text().count("cvt.rn.bf16")
    assert counts["bfloat16"] > counts["float32"], counts
