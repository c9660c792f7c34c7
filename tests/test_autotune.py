"""Bake-time autotuning of GEMV tilings: the per-stage choice (pure), the loop over candidates with a stand-in
measurement, the report object, and the refusal without a Hopper GPU. The GPU measurement itself is covered
by tests/test_gpu_decode.py::test_bake_with_autotune_on_the_gpu."""

from __future__ import annotations

import pytest

from megabake.errors import MegaBakeError
from megabake.plan import DEFAULT_TUNING, GEMV_STAGES, GemvTuning
from megabake.runtime.autotune import Autotuned, autotune, choose_tuning

CANDIDATES = {"a": GemvTuning(2, 4), "b": GemvTuning(1, 16), "c": GemvTuning(4, 8)}


def _times(**per_stage):
    return {stage: per_stage.get(stage, 100.0) for stage in GEMV_STAGES}


def test_each_stage_takes_its_fastest_candidate():
    stage_us = {"a": _times(norm_qkv=90, norm_lm_head=120), "b": _times(norm_qkv=80, down_residual=60, norm_lm_head=130),
                "c": _times(norm_lm_head=110)}
    chosen = choose_tuning(stage_us, CANDIDATES)
    assert chosen["norm_qkv"] == GemvTuning(1, 16) and chosen["down_residual"] == GemvTuning(1, 16)
    assert chosen["norm_lm_head"] == GemvTuning(4, 8)
    assert choose_tuning({}, CANDIDATES) == DEFAULT_TUNING  # nothing timed: the default everywhere


def test_autotune_measures_every_candidate_and_records_failures():
    built, seen = [], []

    def build(tuning, attention_preload=False):
        built.append(tuning)
        return dict(tuning, attention=attention_preload)

    def measure(plan, model):
        tiling = plan["norm_qkv"]
        seen.append(tiling)
        if tiling == GemvTuning(4, 8):
            raise RuntimeError("ptxas ran out of registers")
        mixed = plan["norm_lm_head"] != tiling  # the per-stage composite: b's QKV, a's other stages
        return dict(_times(norm_qkv=100 - tiling.unroll), step=500 if mixed else 600 - tiling.unroll)

    messages = []
    result = autotune(build, object(), candidates=CANDIDATES, measure_plan=measure, progress=messages.append)
    assert seen[:3] == list(CANDIDATES.values()) and all(set(t) == set(GEMV_STAGES) for t in built)
    assert len(seen) == 5 and result.chosen == "per-stage"  # the per-stage winners, measured together
    assert not result.attention_preload  # measured once more with it (same time here): not taken
    assert result.tuning["norm_qkv"] == GemvTuning(1, 16)
    assert "ptxas ran out of registers" in result.errors["c"]
    assert set(result.stage_us) == {"a", "b", "per-stage", "attention-preload"}
    assert messages[0].startswith("autotune 1/3: a")
    report = result.report()
    assert report["tuning"]["norm_qkv"] == {"per_tile": 1, "unroll": 16, "spread": False, "preload": False,
                                            "spec": "1x16"}
    assert report["stage_us"]["b"]["norm_qkv"] == 84 and report["chosen"] == "per-stage"


def test_a_faster_uniform_candidate_beats_the_per_stage_composite():
    def measure(plan, model):
        if plan["norm_qkv"] == GemvTuning(1, 16) and plan["norm_lm_head"] == GemvTuning(1, 16):
            return dict(_times(norm_qkv=50), step=400)  # b: fastest qkv, and the fastest whole step
        if plan["norm_qkv"] == GemvTuning(1, 16):  # the composite: b's qkv with a's LM head
            return dict(_times(norm_qkv=50), step=450)
        return dict(_times(norm_lm_head=90), step=500)

    result = autotune(lambda tuning, attention_preload=False: tuning, object(), candidates=CANDIDATES,
                      measure_plan=measure)
    assert result.chosen == "b" and all(t == GemvTuning(1, 16) for t in result.tuning.values())


def test_the_plans_own_default_is_a_candidate_and_wins_when_its_step_is_fastest():
    """Session 22: the candidates had no streaming ring, so `bake --autotune` baked a kernel ~10% slower than the
    default (SmolLM-1.7B, H200). The default plan (build(None)) is now measured first and kept when fastest."""
    from megabake.runtime.autotune import CANDIDATES as SHIPPED, DEFAULT

    ring = GemvTuning(2, 4, spread=True, preload=True, stages=4)
    default_plan = {stage: ring for stage in GEMV_STAGES}
    built = []

    def build(tuning, attention_preload=False):
        built.append(tuning)
        return dict(default_plan if tuning is None else tuning, attention=attention_preload)

    def measure(plan, model):
        faster_qkv = plan["norm_qkv"] == GemvTuning(1, 16)
        step = 400 if plan["norm_qkv"] == ring and plan["down_residual"] == ring else 450
        return dict(_times(norm_qkv=50 if faster_qkv else 90), step=step + (50 if plan["attention"] else 0))

    candidates = {DEFAULT: None, **CANDIDATES}
    result = autotune(build, object(), candidates=candidates, measure_plan=measure,
                      tuning_of=lambda plan: {stage: plan[stage] for stage in GEMV_STAGES})
    assert built[0] is None and list(SHIPPED)[0] == DEFAULT and SHIPPED[DEFAULT] is None
    assert "per-stage" in result.stage_us  # b's QKV with the ring elsewhere, measured: a slower whole step
    assert result.chosen == DEFAULT and result.build_tuning is None and not result.attention_preload
    assert result.tuning["down_residual"] == ring and result.report()["tuning"]["norm_qkv"]["spec"] == ring.spec
    assert built[-1] is None  # attention preload was tried on the default plan itself


def test_the_rebalanced_default_is_a_candidate_built_from_the_default_plan():
    """``default-balanced`` (REBALANCED): the default plan's own tiling with rows per tile balanced per stage, built
    from ``build(None)`` and kept when its whole step is fastest. Opt-in: the shipped candidates leave it out (it
    lost every whole step measured, session 32)."""
    from megabake.runtime.autotune import CANDIDATES as SHIPPED, DEFAULT, REBALANCED

    ring = GemvTuning(2, 4, spread=True, preload=True, stages=4)
    default_plan = {stage: ring for stage in GEMV_STAGES}
    balanced = {stage: GemvTuning(1, 8, spread=True, preload=True, stages=4) for stage in GEMV_STAGES}
    built, rebalanced_from = [], []

    def build(tuning, attention_preload=False):
        built.append(tuning)
        return dict(default_plan if tuning is None else tuning, attention=attention_preload)

    def rebalance(plan):
        rebalanced_from.append(plan)
        return balanced

    def measure(plan, model):
        return dict(_times(), step=400 if plan["norm_qkv"] == balanced["norm_qkv"] else 450)

    result = autotune(build, object(), candidates={DEFAULT: None, "default-balanced": REBALANCED, "a": GemvTuning()},
                      measure_plan=measure, rebalance=rebalance,
                      tuning_of=lambda plan: {stage: plan[stage] for stage in GEMV_STAGES})
    assert REBALANCED not in SHIPPED.values() and list(SHIPPED)[0] == DEFAULT
    assert rebalanced_from == [dict(default_plan, attention=False)] and built[:3] == [None, None, balanced]
    assert result.chosen == "default-balanced" and result.tuning == balanced and result.build_tuning == balanced


def test_plan_tuning_reads_back_the_tiling_a_plan_was_built_with():
    from megabake.compiler import compile_step
    from megabake.presets import get_preset
    from megabake.runtime.autotune import plan_tuning

    compiled = compile_step(get_preset("tiny-llama").build_model(), capacity=64)
    default = plan_tuning(compiled.plan)
    assert set(default) == set(GEMV_STAGES) and default["norm_qkv"].stages >= 2  # the streaming ring
    tuned = {stage: GemvTuning(1, 8, spread=True) for stage in GEMV_STAGES}
    assert plan_tuning(compiled.plan_for(tuned)) == tuned
    assert compiled.plan_for(default).hash == compiled.plan.hash  # rebuilding from it gives the same plan
    batched = compile_step(get_preset("tiny-llama").build_model(), batch=8, capacity=64)
    on_tensor_cores = plan_tuning(batched.plan)  # the default at batch 8: the tensor-core GEMV
    assert all(t.mma for t in on_tensor_cores.values())
    assert batched.plan_for(on_tensor_cores).hash == batched.plan.hash


def test_attention_preload_is_kept_only_when_the_step_is_faster():
    def measure(plan, model):
        return dict(_times(), step=450 if plan["attention"] else 500)

    def refuse(tuning, attention_preload=False):
        if attention_preload:
            raise MegaBakeError("attention preload needs at most one (batch, head) tile per CTA")
        return dict(tuning, attention=False)

    faster = autotune(lambda t, attention_preload=False: dict(t, attention=attention_preload), object(),
                      candidates=CANDIDATES, measure_plan=measure)
    assert faster.attention_preload and faster.report()["attention_preload"] is True
    refused = autotune(refuse, object(), candidates=CANDIDATES, measure_plan=measure)
    assert not refused.attention_preload and "one (batch, head) tile per CTA" in refused.errors["attention-preload"]


def test_attention_preload_is_not_tried_in_a_long_bucket():
    """Attention preload gives up split-KV attention and the candidates are timed at positions 1-3: in a bucket
    of 2048 positions it won there (-0.7%) and lost 53% at position 2027 (SmolLM-1.7B, H200, session 22)."""
    from types import SimpleNamespace

    from megabake.runtime.autotune import ATTENTION_PRELOAD_MAX_CAPACITY

    def build(tuning, attention_preload=False, capacity=2048):
        return SimpleNamespace(tuning=tuning, attention=attention_preload, capacity=capacity)

    def measure(plan, model):
        return dict(_times(), step=400 if plan.attention else 500)  # preload would win the short steps

    long = autotune(build, object(), candidates=CANDIDATES, measure_plan=measure)
    assert not long.attention_preload and "attention-preload" not in long.stage_us
    assert "not tried: KV capacity 2048" in long.errors["attention-preload"]
    short = autotune(lambda t, attention_preload=False: build(t, attention_preload, ATTENTION_PRELOAD_MAX_CAPACITY),
                     object(), candidates=CANDIDATES, measure_plan=measure)
    assert short.attention_preload


def test_autotune_with_nothing_measurable_is_a_clear_error():
    def measure(plan, model):
        raise RuntimeError("boom")

    with pytest.raises(MegaBakeError, match="no candidate tiling could be measured"):
        autotune(lambda t, attention_preload=False: t, object(), candidates=CANDIDATES, measure_plan=measure)


def test_autotune_report_validates_in_a_package_report():
    from megabake.package import validate
    from tests.fixtures_packages import make_report

    tuned = Autotuned(dict(DEFAULT_TUNING), {"a": _times()}, {"c": "RuntimeError: x"})
    report = make_report(status="unverified", megabake_ms=None)
    report["kernel"] = dict(report["kernel"] or {"grid": [132, 1, 1], "block": [256, 1, 1]}, autotune=tuned.report())
    validate("report", report)


def test_bake_autotune_needs_a_hopper_gpu(tmp_path):
    from megabake.baking import bake

    with pytest.raises(MegaBakeError, match="--autotune times candidate kernels on a Hopper GPU"):
        bake("tiny-llama", out=tmp_path, autotune=True)
    with pytest.raises(MegaBakeError, match="cannot be combined with --no-gpu"):
        bake("tiny-llama", out=tmp_path, autotune=True, run_on_gpu=False)
    assert not any(tmp_path.iterdir())


def test_preloading_candidates_never_preload_the_lm_head():
    from megabake.runtime.autotune import uniform_tuning

    tiling = GemvTuning(2, 4, preload=True)
    tuning = uniform_tuning(tiling)
    assert tuning["norm_qkv"].preload and not tuning["norm_lm_head"].preload
    chosen = choose_tuning({"p": _times()}, {"p": tiling})
    assert chosen["down_residual"].preload and not chosen["norm_lm_head"].preload


def test_rows_per_warp_counts_the_busiest_warp():
    from megabake.runtime.autotune import rows_per_warp

    assert rows_per_warp(3072, 2, 1056) == 4  # Llama-1B QKV: 1536 tiles, 480 warps get two
    assert rows_per_warp(3072, 1, 1056) == 3
    assert rows_per_warp(3072, 3, 1056) == 3
    assert rows_per_warp(2048, 2, 1056) == 2
    assert rows_per_warp(7, 2, 8) == 2


@pytest.mark.parametrize("preset_name, ctas, expected", [
    # 1056 warps: one row per warp beats two wherever a stage has fewer tiles than warps (SmolLM's 960 QKV rows)
    # or its tiles of 2 split unevenly (3072 gate/up rows: 4 rows for the busiest warp, 3 with tiles of 1)
    ("smollm-135m", 132, {name: 1 for name in GEMV_STAGES}),
    ("tiny-llama", 4, {name: 2 for name in GEMV_STAGES}),  # 32 warps: tiles of 2 are already even; keep them
])
def test_balanced_tuning_picks_rows_per_tile_per_stage(preset_name, ctas, expected):
    from megabake.codegen import generate
    from megabake.plan import build_plan
    from megabake.plan.rotary import recover_rotary
    from megabake.runtime.autotune import balanced_tuning
    from tests.compiler_fixtures import compile_preset

    compiled = compile_preset(preset_name, layers=1, capacity=32, ctas=ctas)
    tuning = balanced_tuning(compiled.plan, GemvTuning(2, 4, spread=True, preload=True, pipeline=True))
    assert {stage: t.per_tile for stage, t in tuning.items()} == expected
    assert all(t.per_tile * t.unroll == 8 and t.spread and t.pipeline for t in tuning.values())
    assert not tuning["norm_lm_head"].preload and tuning["norm_qkv"].preload
    inv_freq, scaling = recover_rotary(compiled.captured, compiled.ir)
    plan = build_plan(compiled.ir, ctas=ctas, inv_freq_buffer=inv_freq, rotary_scaling=scaling, tuning=tuning)
    assert "gemv_rows_pipelined" in generate(plan).source


def test_rebalanced_tuning_keeps_the_bakes_tiling_and_balances_rows_per_stage(tmp_path):
    """``gpu_tune.py --variants bake-balanced``: the bake's own per-stage tiling (ring, spread, preload, gated
    gate/up) with rows per tile chosen for warp balance. SmolLM-135M on 132 CTAs (1056 warps): QKV (960 rows), O and
    down (576) take tiles of 1 with twice the loads in flight; the gated gate/up (3072 rows) keeps tiles of 2 (a
    gated tile pairs a gate row with its up row; 4 rows would not balance better) and the LM head (4096 rows here)
    too (4 rows for the busiest warp either way: a tie keeps the stage's own). The kernel compiles for sm_90a."""
    pytest.importorskip("cutlass")
    from megabake.codegen import generate
    from megabake.plan import build_plan
    from megabake.plan.rotary import recover_rotary
    from megabake.runtime.autotune import plan_tuning, rebalanced_tuning
    from megabake.runtime.compile import compile_check, load_module
    from tests.compiler_fixtures import compile_preset

    compiled = compile_preset("smollm-135m", layers=2, vocab=4096, capacity=128, ctas=132)
    baked = plan_tuning(compiled.plan)
    tuning = rebalanced_tuning(compiled.plan)
    assert {stage: t.per_tile for stage, t in tuning.items()} == \
        {"norm_qkv": 1, "o_residual": 1, "norm_gate_up": 2, "down_residual": 1, "norm_lm_head": 2}
    for stage, tiling in tuning.items():
        assert tiling.per_tile * tiling.unroll == baked[stage].per_tile * baked[stage].unroll
        assert (tiling.spread, tiling.preload, tiling.stages, tiling.gated) == \
            (baked[stage].spread, baked[stage].preload, baked[stage].stages, baked[stage].gated)
    assert tuning["norm_gate_up"].gated and tuning["norm_qkv"].stages >= 2
    inv_freq, scaling = recover_rotary(compiled.captured, compiled.ir)
    plan = build_plan(compiled.ir, ctas=132, inv_freq_buffer=inv_freq, rotary_scaling=scaling, tuning=tuning)
    assert plan_tuning(plan) == tuning
    assert rebalanced_tuning(plan) == tuning  # balanced already: a fixed point
    result = compile_check(plan, load_module(generate(plan).source), dump_dir=str(tmp_path))
    assert result.ok, result.error


def test_balanced_rows_keeps_even_rows_for_the_gated_write_and_tensor_core_tiles():
    from megabake.runtime.autotune import balanced_rows

    gated = GemvTuning(2, 4, spread=True, preload=True, stages=4, gated=True)
    assert balanced_rows(gated, 3072, 1056).per_tile == 2  # 1 would balance better, but a gated tile needs pairs
    assert balanced_rows(GemvTuning(2, 4, stages=4), 3072, 1056) == GemvTuning(1, 8, stages=4)
    assert balanced_rows(GemvTuning(2, 4), 2048, 1056) == GemvTuning(2, 4)  # a tie keeps the stage's own
    assert balanced_rows(GemvTuning(1, 8), 2048, 1056) == GemvTuning(1, 8)
    mma = GemvTuning(8, 8, mma=True)
    assert balanced_rows(mma, 1024, 1056) is mma


def test_every_gpu_tune_variant_builds_a_plan(monkeypatch):
    """scripts/gpu_tune.py runs on the GPU only; its variants must at least plan on a CPU (a PlanError there
    would cost a device call). The script opts in to the experimental ``gated`` variant's feature itself."""
    from megabake.plan import build_plan
    from megabake.plan.rotary import recover_rotary
    from tests.compiler_fixtures import compile_preset

    module = _gpu_tune_script()
    compiled = compile_preset("smollm-135m", layers=1, capacity=32)
    inv_freq, scaling = recover_rotary(compiled.captured, compiled.ir)
    monkeypatch.setenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", "")
    module.opt_in_experimental(list(module.variants()))
    for name, variant in module.variants().items():
        for attention_preload in ((False, True) if name in module.ATTENTION_PRELOAD_VARIANTS else (False,)):
            plan = build_plan(compiled.ir, inv_freq_buffer=inv_freq, rotary_scaling=scaling,
                              attention_preload=attention_preload, tuning=module.tuning_for(variant, compiled.plan))
            if name == "bake":  # the variant that times what `megabake bake` plans
                assert [s.tiling for s in plan.stages] == [s.tiling for s in compiled.plan.stages]


def test_gpu_tune_balances_the_bakes_own_tiling():
    """``gpu_tune.py --variants bake-balanced`` starts from the plan the script builds as the bake's
    (``bake_plan``): the streaming ring and the gated gate/up must survive into the variant's plan (session 31
    measured a balanced plain tiling because that plan was built with ``tuning={}``)."""
    from megabake.plan import build_plan
    from megabake.plan.rotary import recover_rotary
    from megabake.runtime.autotune import plan_tuning
    from tests.compiler_fixtures import compile_preset

    module = _gpu_tune_script()
    compiled = compile_preset("smollm-135m", layers=1, capacity=32)
    inv_freq, scaling = recover_rotary(compiled.captured, compiled.ir)
    context = dict(ir=compiled.ir, inv=inv_freq, scale=scaling, sm_count=132)
    baked = module.bake_plan(context)
    assert plan_tuning(baked) == plan_tuning(build_plan(compiled.ir, ctas=132, inv_freq_buffer=inv_freq,
                                                        rotary_scaling=scaling))
    tuning = module.tuning_for(module.BAKE_BALANCED, baked)
    plan = module.build_tuned_plan(context, tuning)
    assert all(stage.tiling.stages >= 2 for stage in plan.stages if stage.name in tuning), "the ring was dropped"
    assert plan_tuning(plan)["norm_gate_up"].gated
    assert plan_tuning(plan)["o_residual"].per_tile == 1  # 576 rows over 1056 warps: tiles of 1 balance better


def test_gpu_tune_summarizes_every_ctas_barrier_arrivals():
    """``gpu_tune.py --per-cta`` reads every CTA's phase clocks (``cta_timelines``) into, per stage kind: the mean
    wait, the arrival skew (last minus first), the barrier's own latency (first release minus last arrival), the
    GEMV time over CTAs, and which CTAs arrive last; a pure function, checked here on three made-up CTAs."""
    module = _gpu_tune_script()
    labels = ["embed.embed_gather", "embed.barrier", "layer0.norm_qkv.gemv_rows_streamed", "layer0.norm_qkv.barrier"]
    rows = [[0, 1, 5, 8, 12], [0, 2, 5, 10, 12], [0, 3, 6, 11, 13]]  # per CTA: start, then each interval's end
    summary = module.summarize_ctas(labels, rows)
    assert summary["stages"]["embed"] == {"wait_mean": 3.3, "skew": 2.0, "latency": 2.0}
    assert summary["stages"]["norm_qkv"] == {"wait_mean": 2.7, "skew": 3.0, "latency": 1.0, "gemv_min": 3.0,
                                             "gemv_median": 5.0, "gemv_max": 5.0}
    assert summary["last_arrivals"] == [(2, 2)]
    # a split barrier's CTA arrives before the stage's prefetch phase (session 27's default)
    labels = ["layer0.norm_qkv.gemv_rows_streamed", "layer0.norm_qkv.prefetch", "layer0.norm_qkv.barrier"]
    rows = [[0, 4, 6, 9], [0, 5, 7, 9], [0, 2, 8, 10]]
    split = module.summarize_ctas(labels, rows, split=True)["stages"]["norm_qkv"]
    assert (split["skew"], split["latency"]) == (3.0, 4.0)  # arrivals at 4, 5, 2; releases at 9, 9, 10
    atom = module.summarize_ctas(labels, rows)["stages"]["norm_qkv"]
    assert (atom["skew"], atom["latency"]) == (2.0, 1.0)  # arrivals at 6, 7, 8
    # a fused_o build: in a fused step a CTA arrives at the O barrier right after fused_attention_o and the
    # attention's split_barrier is no barrier; in a split step that split_barrier is one (arrival where it starts)
    labels = ["layer0.attention.split_kv_attention|fused_attention_o", "layer0.attention.split_barrier",
              "layer0.o_residual.gemv_rows_streamed", "layer0.o_residual.prefetch", "layer0.o_residual.barrier"]
    rows = [[0, 3, 3, 3, 4, 9], [0, 5, 5, 5, 6, 9], [0, 2, 2, 2, 3, 10]]
    fused = module.summarize_ctas(labels, rows, split=True, fused_step=True)["stages"]
    assert set(fused) == {"o_residual"} and fused["o_residual"]["skew"] == 3.0  # arrivals at 3, 5, 2
    rows = [[0, 3, 5, 6, 7, 9], [0, 4, 5, 7, 8, 9], [0, 2, 6, 7, 8, 10]]
    unfused = module.summarize_ctas(labels, rows, split=True)["stages"]
    assert (unfused["attention"]["skew"], unfused["attention"]["latency"]) == (2.0, 1.0)  # 3, 4, 2 -> 5, 5, 6
    assert unfused["o_residual"]["skew"] == 1.0  # the prefetch starts: 6, 7, 7


def _gpu_tune_script():
    """scripts/gpu_tune.py loaded as a module (it is a script, not part of the package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_tune.py"
    spec = importlib.util.spec_from_file_location("gpu_tune", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module
