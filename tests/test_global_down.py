"""``Plan.down_input == "global"`` (session 40): a batched bucket whose intermediate-wide GEMV input rows overflow
shared memory (batch 8 of gemma-2b and Mistral-7B) has its gate/up GEMV write act(gate) * up in bf16 to the ``act``
buffer and its tensor-core down GEMV read those rows from global memory, instead of staging them. On the CPU: the
plan (baked by default since its GPU tests passed on an H100 in session 41), its plan.json, the generated calls and
the CuTe DSL compile for sm_90a; the kernel's GPU tests are in ``tests/test_global_down_gpu.py``."""

from __future__ import annotations

import dataclasses

import pytest

from megabake.errors import PlanError
from megabake.plan import HOPPER_SMEM_PER_BLOCK, Plan, check_shared_memory
from megabake.presets import get_preset
from tests.compiler_fixtures import compile_model, compile_preset

FLAG = "MEGABAKE_EXPERIMENTAL_LAYOUTS"


def _wide_tiny_llama():
    """tiny-llama, one layer, with gemma-2b's MLP width: 8 x 16384 bf16 input rows (256 KiB) cannot be staged."""
    preset = get_preset("tiny-llama")
    config = dict(preset.config, intermediate_size=16384, num_hidden_layers=1)
    return dataclasses.replace(preset, config=config).build_model()


def test_a_bucket_too_wide_to_stage_reads_the_down_input_from_global_memory(monkeypatch):
    model = _wide_tiny_llama()
    monkeypatch.delenv(FLAG, raising=False)  # a GPU-verified feature: no flag needed
    compiled = compile_model(model, batch=8, capacity=128)
    plan = compiled.plan
    assert plan.down_input == "global" and plan.staging_dtype == "bfloat16"
    assert plan.smem_bytes <= HOPPER_SMEM_PER_BLOCK
    with pytest.raises(PlanError, match="16384-wide bf16 GEMV input"):  # staged, it would not fit
        check_shared_memory(plan.dims, 8, 128, plan.threads, True, "bfloat16")
    # s_vec holds hidden-wide rows only (tiny-llama: 256), as SMEM_BYTES counts
    assert "\nVEC_WIDTH = 256\n" in compiled.generated.source
    act = next(b for b in plan.buffers if b.name == "act")
    assert (act.dtype, act.shape, act.role) == ("bfloat16", [8, 16384], "workspace")
    assert '"down_input": "global"' in plan.to_json()
    assert Plan.from_json(plan.to_json()).down_input == "global"
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_buckets_that_fit_keep_staging_and_their_plan_json():
    plan = compile_preset("tiny-llama", batch=8, capacity=128).plan
    assert plan.down_input == "smem" and "down_input" not in plan.to_json()
    assert not any(b.name == "act" for b in plan.buffers)


def test_global_down_input_on_request_generates_the_calls_and_compiles_for_sm_90a(tmp_path):
    compiled = compile_preset("tiny-llama", batch=8, capacity=128, down_input="global")
    source = compiled.generated.source
    gate_up = source.split("# ---- stage 4: norm_gate_up")[1].split("# ---- stage 5")[0]
    down = source.split("# ---- stage 5: down_residual")[1].split("# ---- stage 6")[0]
    assert "out=act" in gate_up and "gated=1" in gate_up
    assert "copy_to_smem" not in down and "s_vec=act" in down and "out=x" in down
    assert compiled.generated.arguments[-1] == "act" and "act" not in compiled.generated.arguments[:-1]
    staged = compile_preset("tiny-llama", batch=8, capacity=128)
    staged_down = staged.generated.source.split("# ---- stage 5: down_residual")[1].split("# ---- stage 6")[0]
    assert "copy_to_smem" in staged_down
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check, load_module

    stores = []
    for name, step in (("global", compiled), ("staged", staged)):
        result = compile_check(step.plan, load_module(step.generated.source), dump_dir=str(tmp_path / name))
        assert result.ok, result.error
        stores.append(next((tmp_path / name).glob("*.ptx")).read_text().count("st.global.b16"))
    assert stores[0] > stores[1]  # the gated write stores bf16 rows (both append bf16 K/V rows)


def test_global_down_input_refusals():
    with pytest.raises(PlanError, match="needs the tensor-core GEMV"):
        compile_preset("tiny-llama", batch=1, capacity=128, down_input="global")
    with pytest.raises(PlanError, match="down_input must be 'smem' or 'global'"):
        compile_preset("tiny-llama", batch=8, capacity=128, down_input="l2")
    assert compile_preset("tiny-llama", batch=8, capacity=128, down_input="smem").plan.down_input == "smem"


def test_gpu_tune_times_the_global_down_input_against_the_bakes_plan():
    """``gpu_tune.py --variants bake bake-global-down --batch 8``: the A/B for buckets where both plans fit (the
    staging copy it skips against the down GEMV's L2 reads)."""
    from megabake.plan.rotary import recover_rotary
    from tests.test_autotune import _gpu_tune_script

    module = _gpu_tune_script()
    compiled = compile_preset("tiny-llama", batch=8, capacity=128)
    inv, scale = recover_rotary(compiled.captured, compiled.ir)
    context = dict(ir=compiled.ir, inv=inv, scale=scale, sm_count=132)
    variant = module.variants()["bake-global-down"]
    plan = module.build_tuned_plan(context, module.tuning_for(variant, compiled.plan), False, "global")
    assert plan.down_input == "global"
    assert [s.tiling for s in plan.stages] == [s.tiling for s in compiled.plan.stages]
