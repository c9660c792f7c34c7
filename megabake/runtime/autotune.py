"""Bake-time autotuning of GEMV tilings on the GPU the package is baked for.

Contract: ``autotune(build, model, *, candidates=CANDIDATES, progress=...) -> Autotuned`` takes
``build(tuning, attention_preload=False) -> Plan`` (the bake's plan builder), builds one ``timeline=True``
kernel per candidate tiling, runs a few decode steps on this Hopper GPU and reads each step's per-stage
clocks (``MegakernelDecoder.stage_timeline``). The first candidate, ``default`` (value None), is the plan
``build(None)`` makes: the kernel a bake without ``--autotune`` ships (the streaming ring since session 6), so
autotuning can only pick something measured faster than it. ``REBALANCED`` (a candidate value callers may pass,
not shipped) is that plan's tiling with each stage's rows per tile chosen for warp balance
(:func:`rebalanced_tuning`): it lost the whole step on all three presets measured (H200, session 32, GPU ms
default vs balanced: Qwen3-0.6B @16 0.619 vs 0.639, Phi-3-mini @1000 2.236 vs 2.424, SmolLM-135M @16 0.376 vs
0.414), so a bake does not pay its build. For every GEMV stage it takes the candidate that
spent the least time in that stage (median over steps, summed over layers), measures those per-stage winners
together, and returns them, unless a whole candidate's step was faster (then that one); finally, in a bucket
of at most ``ATTENTION_PRELOAD_MAX_CAPACITY`` positions, the chosen tiling is measured once more with attention
preload, kept if the whole step is faster. Attention preload gives up split-KV attention, and the candidates
are timed at positions 1-3 only: in a longer bucket it would win there and lose badly at the bucket's long end
(SmolLM-1.7B, capacity 2048, H200, session 22: -0.7% at position 16, +53% at 2027). The
measured table comes back with the choice. Tilings never change numerics: every lane sums its K vectors in the same
order whatever the rows per tile or loads in flight, so the tuned kernel's logits are bit-identical to the
default's (``choose_tuning`` is pure and runs on a CPU; ``measure`` needs the GPU).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import MegaBakeError
from ..plan import DEFAULT_TUNING, GEMV_STAGES, GemvTuning, Plan

DEFAULT = "default"  # candidate name of the plan's own default tiling (value None: build(None))
REBALANCED = "rebalanced"  # candidate value: the default plan's tiling with rows per tile balanced per stage
CANDIDATES: dict[str, GemvTuning | str | None] = {  # applied to every GEMV stage; the winner is picked per stage
    DEFAULT: None,  # what build_plan picks (the streaming ring where it fits), per stage
    "t2u4": GemvTuning(2, 4),  # the plain register tiling (the default until session 6)
    "t2u8": GemvTuning(2, 8),
    "t1u8": GemvTuning(1, 8),
    "t1u16": GemvTuning(1, 16),
    "t4u4": GemvTuning(4, 4),
    "t2u4-spread": GemvTuning(2, 4, spread=True),
    "t1u8-spread": GemvTuning(1, 8, spread=True),
    "t2u4-preload": GemvTuning(2, 4, preload=True),
    "t2u4-spread-preload": GemvTuning(2, 4, spread=True, preload=True),
}
STEPS = 3  # timed decode steps per candidate (after one warm-up step)
TOTAL = "step"  # key of the whole step's time (every stage, as CTA 0 sees it) in a measurement
COMPOSITE = "per-stage"  # the measurement of the per-stage winners together
ATTENTION_PRELOAD = "attention-preload"  # the chosen tiling again, with attention's first K/V rows preloaded
ATTENTION_PRELOAD_MAX_CAPACITY = 256  # larger buckets keep split-KV attention (module doc)


@dataclass
class Autotuned:
    tuning: dict[str, GemvTuning]  # per GEMV stage, the tiling baked
    stage_us: dict[str, dict[str, float]]  # candidate -> GEMV stage (and TOTAL) -> microseconds per step
    errors: dict[str, str] = field(default_factory=dict)
    chosen: str = COMPOSITE  # the measured configuration baked: a candidate's name or COMPOSITE
    attention_preload: bool = False  # the chosen tiling measured faster with attention preload

    @property
    def build_tuning(self) -> dict[str, GemvTuning] | None:
        """The ``tuning`` to build the baked plan with: None (the plan's own default) when ``default`` won."""
        return None if self.chosen == DEFAULT else self.tuning

    def report(self) -> dict:
        """The ``kernel.autotune`` object of report.json."""
        return {"tuning": {stage: {"per_tile": t.per_tile, "unroll": t.unroll, "spread": t.spread,
                                   "preload": t.preload, "spec": t.spec}
                           for stage, t in self.tuning.items()},
                "stage_us": self.stage_us, "errors": self.errors, "chosen": self.chosen,
                "attention_preload": self.attention_preload}


BALANCE_CHOICES = (2, 1, 3, 4)  # rows per tile tried by balanced_tuning; ties keep the earlier (default first)


def rows_per_warp(rows: int, per_tile: int, warps: int) -> int:
    """The most rows any warp reduces when ``rows`` are dealt in tiles of ``per_tile`` over ``warps`` warps."""
    tiles = -(-rows // per_tile)
    return -(-tiles // warps) * per_tile


def balanced_tuning(plan: Plan, base: GemvTuning = GemvTuning()) -> dict[str, GemvTuning]:
    """Per GEMV stage of ``plan``, the rows per tile (``BALANCE_CHOICES``) that minimise the most rows any warp
    reduces, with ``base``'s flags and as many 16-byte loads in flight per lane as ``base`` (per_tile x
    unroll kept where it divides). E.g. Llama-1B's QKV (3072 rows, 1056 warps): tiles of 2 leave 480 warps
    two tiles (4 rows) while the mean is 2.9; tiles of 1 give at most 3."""
    warps = plan.ctas * plan.threads // 32
    tuning = {stage.name: balanced_rows(base, stage.tiling.units, warps)
              for stage in plan.stages if stage.name in GEMV_STAGES}
    return without_lm_head_preload(tuning)


def rebalanced_tuning(plan: Plan) -> dict[str, GemvTuning]:
    """``plan``'s own tiling per GEMV stage (:func:`plan_tuning`: what ``megabake bake`` ships, ring, spread,
    preload and gated write kept) with each stage's rows per tile chosen for balance as :func:`balanced_tuning`
    does, a stage keeping its rows per tile on a tie. Qwen3-0.6B's O and down projections (1024 rows, 1056
    warps): tiles of 2 give 512 of the warps a tile and leave the rest idle; tiles of 1 keep 1024 busy."""
    warps = plan.ctas * plan.threads // 32
    rows = {stage.name: stage.tiling.units for stage in plan.stages if stage.name in GEMV_STAGES}
    return {name: balanced_rows(tiling, rows[name], warps) for name, tiling in plan_tuning(plan).items()}


def balanced_rows(tiling: GemvTuning, rows: int, warps: int) -> GemvTuning:
    """``tiling`` with the rows per tile that minimise the busiest warp's rows over ``warps`` warps (its own rows
    per tile first on a tie, then ``BALANCE_CHOICES`` in order; even ones only for a gated write, which pairs a
    gate row with its up row), its loads in flight per lane (per_tile x unroll) kept. Tensor-core tiles stay."""
    if tiling.mma:
        return tiling
    choices = [n for n in dict.fromkeys((tiling.per_tile, *BALANCE_CHOICES)) if not tiling.gated or n % 2 == 0]
    per_tile = min(choices, key=lambda n: (rows_per_warp(rows, n, warps), choices.index(n)))
    return replace(tiling, per_tile=per_tile, unroll=max(1, tiling.per_tile * tiling.unroll // per_tile))


def without_lm_head_preload(tuning: dict[str, GemvTuning]) -> dict[str, GemvTuning]:
    """``tuning`` with the LM head's preload off (no barrier precedes it in the layer loop)."""
    return {stage: replace(t, preload=False) if stage == "norm_lm_head" else t for stage, t in tuning.items()}


def uniform_tuning(tiling: GemvTuning) -> dict[str, GemvTuning]:
    """``tiling`` for every GEMV stage (the LM head never preloads: no barrier precedes it in the layer loop;
    ``+gated`` is the gate/up stage's alone: the others get the same tiling without it)."""
    plain = replace(tiling, gated=False)
    return without_lm_head_preload({stage: tiling if stage == "norm_gate_up" else plain for stage in GEMV_STAGES})


def plan_tuning(plan: Plan) -> dict[str, GemvTuning]:
    """Per GEMV stage, the tiling ``plan`` was built with (its first layer's; every layer has the same)."""
    tuning = {}
    for stage in plan.stages:
        t = stage.tiling
        if stage.name in GEMV_STAGES and stage.name not in tuning:
            tuning[stage.name] = (GemvTuning(t.per_tile, t.unroll, mma=True) if t.mma else
                                  GemvTuning(t.per_tile, t.unroll, t.spread, t.preload, t.pipeline, t.stages,
                                             gated=t.gated))
    return tuning


def choose_tuning(stage_us: dict[str, dict[str, float]],
                  candidates: dict[str, GemvTuning | dict[str, GemvTuning]]) -> dict[str, GemvTuning]:
    """Per GEMV stage, the tiling of the candidate with the least time in it (default where none was timed).
    A candidate is one tiling for every stage or, like ``default``, a tiling per stage."""
    chosen = {}
    for stage in GEMV_STAGES:
        timed = [(times[stage], name) for name, times in stage_us.items() if stage in times and name in candidates]
        if not timed:
            chosen[stage] = DEFAULT_TUNING[stage]
            continue
        winner = candidates[min(timed)[1]]
        per_stage = winner if isinstance(winner, dict) else uniform_tuning(winner)
        chosen[stage] = per_stage.get(stage, DEFAULT_TUNING[stage])
    return chosen


def _candidate_tuning(tiling: GemvTuning | str | None, build: Callable, rebalance: Callable) -> dict | None:
    """The ``tuning`` to build a candidate with: None for the plan's default, the default's rebalanced per-stage
    tiling for ``REBALANCED``, else ``tiling`` on every GEMV stage."""
    if tiling is None:
        return None
    if tiling == REBALANCED:
        return rebalance(build(None))
    return uniform_tuning(tiling)


def measure(plan: Plan, model, *, steps: int = STEPS) -> dict[str, float]:
    """Microseconds per GEMV stage (summed over layers, median over steps) of a timeline build of ``plan``."""
    import torch

    from ..codegen import generate
    from . import MegakernelDecoder

    # unfused: every GEMV stage keeps an interval of its own (a fused_o timeline clocks the O projection inside
    # attention's, and at these short positions its fused steps do not run the O stage's tiling at all)
    source = generate(plan, timeline=True, fused_o=False).source
    decoder = MegakernelDecoder(plan, source, model, device="cuda", use_graph=False)
    tokens = torch.randint(1, plan.dims.vocab, (steps + 1,), generator=torch.Generator().manual_seed(0))
    per_step: list[dict[str, float]] = []
    for position in range(steps + 1):
        decoder.step(tokens[position:position + 1], position)
        if position:  # the first step warms caches and clocks
            totals: dict[str, float] = {}
            for label, us in decoder.stage_timeline():
                stage = label.rsplit(".", 1)[-1]
                totals[stage] = totals.get(stage, 0.0) + us
            per_step.append(totals)
    del decoder
    torch.cuda.empty_cache()
    times = {stage: statistics.median(step[stage] for step in per_step) for stage in GEMV_STAGES}
    times[TOTAL] = statistics.median(sum(step.values()) for step in per_step)
    return times


def _describe(name: str, tiling: GemvTuning | str | None) -> str:
    if tiling is None:
        return f"{name} (the plan's own tiling)"
    if tiling == REBALANCED:
        return f"{name} (the plan's own tiling, rows per tile balanced per stage)"
    return f"{name} ({tiling.spec}: rows per tile {tiling.per_tile}, {tiling.unroll} loads in flight" \
           f"{', CTA-major' if tiling.spread else ''}{', preloaded' if tiling.preload else ''})"


def autotune(build: Callable[[dict | None], Plan], model, *,
             candidates: dict[str, GemvTuning | str | None] | None = None, measure_plan: Callable = measure,
             tuning_of: Callable[[Plan], dict[str, GemvTuning]] = plan_tuning,
             rebalance: Callable[[Plan], dict[str, GemvTuning]] = rebalanced_tuning,
             progress: Callable[[str], None] = lambda msg: None) -> Autotuned:
    """Measure every candidate tiling (``measure_plan(plan, model)``) and choose per stage (module doc).

    A candidate None is ``build(None)``, the plan's default; ``tuning_of(plan)`` reads its tiling per stage.
    ``REBALANCED`` is ``build(rebalance(build(None)))``: that default with rows per tile balanced per stage.
    ``model`` is used as given: pass a CUDA bf16 copy (binding a decoder moves a model to the GPU in place)."""
    candidates = candidates or CANDIDATES
    stage_us, errors, per_stage = {}, {}, {}
    capacity = 0  # the bucket's KV capacity, from the plans built (0 where they do not say, as in the unit tests)
    for index, (name, tiling) in enumerate(candidates.items(), 1):
        progress(f"autotune {index}/{len(candidates)}: {_describe(name, tiling)}")
        try:
            tuning = _candidate_tuning(tiling, build, rebalance)
            plan = build(tuning)
            capacity = max(capacity, int(getattr(plan, "capacity", 0) or 0))
            per_stage[name] = tuning_of(plan) if tuning is None else tuning
            stage_us[name] = measure_plan(plan, model)
        except Exception as exc:  # a tiling that does not compile or run is skipped, and said so
            errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if not stage_us:
        raise MegaBakeError(f"autotune: no candidate tiling could be measured on this GPU: {errors}")
    composite = choose_tuning(stage_us, per_stage)
    if composite not in per_stage.values():  # the winners are one candidate's tiling: that one was measured
        progress("autotune: the per-stage winners together")
        try:
            stage_us[COMPOSITE] = measure_plan(build(composite), model)
            per_stage[COMPOSITE] = composite
        except Exception as exc:
            errors[COMPOSITE] = f"{type(exc).__name__}: {str(exc)[:300]}"
    # Preloads and prefetches move work across stage boundaries: keep the composite only if the whole step
    # is faster than every candidate's.
    best = min(stage_us, key=lambda name: stage_us[name].get(TOTAL, float("inf")))
    tuning = per_stage[best]
    if capacity > ATTENTION_PRELOAD_MAX_CAPACITY:
        errors[ATTENTION_PRELOAD] = (f"not tried: KV capacity {capacity} > {ATTENTION_PRELOAD_MAX_CAPACITY}; attention "
                                     "preload gives up split-KV attention, which the bucket's long end needs")
        return Autotuned(tuning, stage_us, errors, chosen=best)
    progress("autotune: the chosen tiling with attention preload")
    try:
        stage_us[ATTENTION_PRELOAD] = measure_plan(build(None if best == DEFAULT else tuning, attention_preload=True),
                                                   model)
    except Exception as exc:  # e.g. more (batch, head) tiles than CTAs
        errors[ATTENTION_PRELOAD] = f"{type(exc).__name__}: {str(exc)[:300]}"
    preload = (stage_us.get(ATTENTION_PRELOAD, {}).get(TOTAL, float("inf"))
               < stage_us[best].get(TOTAL, float("inf")))
    return Autotuned(tuning, stage_us, errors, chosen=best, attention_preload=preload)
