"""GEMV tiling sweep and per-stage timeline of the megakernel on the H200 (a performance investigation tool).

For each preset: capture and lower once, then for each tuning variant (rows per warp tile x loads in flight
per lane) build the plan, generate, compile and bind the kernel, check its logits against the first
(default) variant at the same state (the default also against the CPU reference executor), time graph
replays with CUDA events (median of --reps), and read one step of a ``timeline=True`` build: where the
time goes per stage kind (summed over layers), with the bytes each stage streams and the bandwidth that
implies. Finally a "composite" variant takes, for every GEMV stage, the tiling of the variant that was
fastest in that stage, and is measured the same way; its spec is printed (a ``tuning=`` for build_plan).

    source .cute/activate.sh && python3 scripts/gpu_tune.py smollm-135m llama-3.2-1b --out $OUT

``--builds default red no-kvpf`` also builds each variant with the fire-and-forget grid-barrier arrival
(``generate(plan, barrier="red")``; rows ``<variant>@red``; ``atom``: the one-call barrier, the default until
session 27) and without the L2 prefetch of cached K/V rows before
the barrier that precedes attention (``generate(plan, kv_prefetch=False)``, the default until session 16; rows
``<variant>@no-kvpf``), ``kvpf-all`` that prefetch uncapped (the whole first work item, sessions 16-28; the
default asks for its first ``MIN_CHUNK`` rows, ``codegen.default_kv_prefetch_rows``), ``kvpf-l1`` that prefetch
into L1 instead (``generate(plan, kv_prefetch_l1=True)``, a
candidate), and the split-KV merges one at a time (the default picks per plan, ``codegen.default_merge``):
``last-merge`` the plain last-arrival merge (the default until session 17), ``merge-preload`` that merge loading
its first partials at once, ``spread-merge`` the merge shared out over the group's items, ``fold-merge`` the merge
folded into the O projection's staging (``generate(plan, fold_merge=True)``, the default since session 24) and
``no-fold-merge`` the build without it (the default until session 23), ``pf0`` / ``pf8mb`` / ``pf16mb`` /
``pf32mb`` / ``pf48mb`` the L2 prefetch of the next GEMV's first tiles before each barrier at that budget over the
grid for every stage (``generate(plan, prefetch_bytes=...)``; ``pf16mb`` is the default until session 26, which
has none before ring-prefilled GEMVs: ``codegen.default_prefetch_bytes``); the
same logits required, to 1e-3 (``--barriers`` is the older name). ``--ctas N`` runs the persistent
grid on N CTAs instead of one per SM. ``--position 4000 --capacity 4096`` times the step at a long context.
``--batch 8`` times batched steps (``mma``: the tensor-core GEMV); ``--phases`` adds each variant's clocks per
phase of each stage (staging, GEMV, prefetch, barrier wait); ``--per-cta`` builds each variant once more with every
CTA's phase clocks (``timeline="phases-per-cta"``, session 26, not GPU-run yet) and summarizes where the barrier
waits come from: arrival skew across CTAs, the barrier's own latency, the spread of GEMV times, the CTAs that
arrive last (:func:`summarize_ctas`). Writes OUT/tune-<preset>-b<batch>.json; prints a
short table per preset last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

BAKE_DEFAULT = None  # variant value: build_plan's own default tuning (tuning=None)
BAKE_BALANCED = "bake-balanced"  # variant value: that tuning with rows per tile balanced per stage
# variant value: the bake's tuning with the down GEMV reading its bf16 input rows from global memory
# (build_plan(down_input="global"); a batch 2-8 bucket on the tensor cores; session 40, GPU-verified in session 41)
BAKE_GLOBAL_DOWN = "bake-global-down"


@dataclass(frozen=True)
class Balanced:
    """A variant whose rows per tile are chosen per stage for tile balance (``autotune.balanced_tuning``)."""

    base: object  # GemvTuning: flags and loads in flight


def variants() -> dict:
    """name -> GemvTuning applied to every GEMV stage (the bake autotuner's candidates plus deeper unrolls and
    pipelined K loops), :class:`Balanced` (rows per tile chosen per stage), or ``BAKE_DEFAULT`` (the plan
    `megabake bake` builds)."""
    from megabake.plan import GemvTuning
    from megabake.runtime.autotune import CANDIDATES

    # None: the bake default, REBALANCED: that balanced (the variants bake / bake-balanced below)
    uniform = {k: v for k, v in CANDIDATES.items() if isinstance(v, GemvTuning) and v != GemvTuning()}
    return {"default": GemvTuning(), **uniform,
            "t2u16": GemvTuning(2, 16), "t1u32": GemvTuning(1, 32),
            # software-pipelined K loops (two chunks per warp in flight, in registers)
            "t2u4-pipe": GemvTuning(2, 4, pipeline=True), "t2u4-pipe-preload": GemvTuning(2, 4, preload=True, pipeline=True),
            "t2u4-spread-pipe-preload": GemvTuning(2, 4, spread=True, preload=True, pipeline=True),
            "balanced": Balanced(GemvTuning()), "balanced-pipe": Balanced(GemvTuning(2, 4, pipeline=True)),
            # per-warp cp.async shared-memory rings, 2 or 3 chunks in flight per warp
            "t2u4-ring3": GemvTuning(2, 4, stages=3), "t2u4-ring4": GemvTuning(2, 4, stages=4),
            "t2u4-spread-ring4": GemvTuning(2, 4, spread=True, stages=4),
            "balanced-ring4": Balanced(GemvTuning(2, 4, stages=4)),
            # ... and filled with the next GEMV's first chunks before each grid barrier
            "t2u4-ring4-preload": GemvTuning(2, 4, preload=True, stages=4),
            "t2u4-spread-ring4-preload": GemvTuning(2, 4, spread=True, preload=True, stages=4),
            "balanced-ring4-preload": Balanced(GemvTuning(2, 4, preload=True, stages=4)),
            # tensor cores (bf16-staged inputs, at most 8 sequences; the default of such buckets)
            "mma": GemvTuning(8, 8, mma=True),
            # the activation in the plain gate/up GEMV's write (ring-gated: the default since session 15)
            "gated": GemvTuning(2, 4, gated=True),
            "ring-gated": GemvTuning(2, 4, spread=True, preload=True, stages=4, gated=True),
            # ... with a fifth ring stage (4 chunks ahead, 160 KB per CTA of 8 warps: it fits next to the rest of
            # the kernel for Phi-3-mini, Llama-1B, SmolLM, OLMo-2 and Qwen2.5 at c4096), and warp-major tile order
            # (no spread) at either depth (session 26: within 1.2% of the default on Phi-3-mini and Llama-1B)
            "ring5-gated": GemvTuning(2, 4, spread=True, preload=True, stages=5, gated=True),
            "ring-gated-warp": GemvTuning(2, 4, preload=True, stages=4, gated=True),
            "ring5-gated-warp": GemvTuning(2, 4, preload=True, stages=5, gated=True),
            # what `megabake bake` plans by default for this bucket (ring-gated where its shared memory fits a
            # 4-stage ring, a shallower ring or the tensor cores elsewhere)
            "bake": BAKE_DEFAULT,
            # ... with each stage's rows per tile chosen for warp balance (autotune.rebalanced_tuning; session 30,
            # not run yet: Qwen3-0.6B's O and down projections keep 512 of 1056 warps busy with tiles of 2 rows)
            "bake-balanced": BAKE_BALANCED,
            # ... with the down projection's input read from global memory instead of staged (session 40: where a
            # bucket's rows do not fit it is the plan's own choice; elsewhere it skips the staging copy, ~31 us
            # of Qwen2.5-0.5B's 807 at batch 8, while every step of the down GEMV waits for its input from L2)
            "bake-global-down": BAKE_GLOBAL_DOWN}


# also measured with attention preload
ATTENTION_PRELOAD_VARIANTS = ("default", "t2u4-spread-preload", "t2u4-spread-pipe-preload",
                              "t2u4-spread-ring4-preload")


# variant -> the experimental kernel feature it needs: none now (gated_gemv passed on the H200 in session 15,
# bake-global-down's global_down_input on an H100 in session 41); a new candidate's variant goes here
EXPERIMENTAL_VARIANTS: dict[str, str] = {}


def opt_in_experimental(chosen: list[str]) -> None:
    """A sweep that asks for an experimental variant measures it: add its feature to the opt-in variable."""
    import os

    from megabake.plan import EXPERIMENTAL_LAYOUTS_ENV

    wanted = [EXPERIMENTAL_VARIANTS[v] for v in chosen if v in EXPERIMENTAL_VARIANTS]
    current = os.environ.get(EXPERIMENTAL_LAYOUTS_ENV, "").replace(",", " ").split()
    os.environ[EXPERIMENTAL_LAYOUTS_ENV] = " ".join(dict.fromkeys(current + wanted))


def tuning_for(variant, default_plan) -> dict | None:
    from megabake.runtime.autotune import balanced_tuning, rebalanced_tuning, uniform_tuning

    if variant is BAKE_DEFAULT or variant == BAKE_GLOBAL_DOWN:
        return None
    if variant == BAKE_BALANCED:
        return rebalanced_tuning(default_plan)
    if isinstance(variant, Balanced):
        return balanced_tuning(default_plan, variant.base)
    return uniform_tuning(variant)


def stage_bytes(plan) -> dict[str, float]:
    d = plan.dims
    per_layer = {"norm_qkv": d.qkv_rows * d.hidden, "o_residual": d.hidden * d.q_rows,
                 "norm_gate_up": 2 * d.intermediate * d.hidden, "down_residual": d.hidden * d.intermediate}
    out = {k: 2.0 * v * d.layers for k, v in per_layer.items()}
    out["norm_lm_head"] = 2.0 * d.vocab * d.hidden
    return out


STEPS = 3  # decode steps from an empty cache before timing (positions 0..STEPS-1)


def vs_reference(decoder, plan, tokens) -> float:
    """rel-L2 of the decoder's last logits against the plan's CPU reference executor on its own bf16 weights."""
    reference = decoder.reference_executor()
    for p in range(len(tokens)):
        want = reference.step(tokens[p], p)
    got = decoder.buffers["logits"].float().cpu()
    return float((got - want).norm() / want.norm())


def time_replays(decoder, token, pos: int, reps: int) -> float:
    import torch

    # step() alternates two staging rows (one graph each) and _graph replays row 0's: stage pos in both rows,
    # or a --position sweep would replay the position of the last checked step that used row 0
    decoder.step(token, pos)  # captures the graphs
    decoder.step(token, pos)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decoder._graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sync_call(decoder, token, pos: int, reps: int) -> tuple[float, float]:
    """Medians of a synchronized ``step()`` (ms) and of its host part alone, until ``step()`` returns (us): the
    rest of the gap to the GPU time is the launch reaching the GPU and the host waking from the sync."""
    import torch

    samples, host = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        decoder.step(token, pos)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
        host.append((t1 - t0) * 1e6)
    return statistics.median(samples), statistics.median(host)


# code-generation options a variant can be built with besides the default ("default"): name -> generate() keywords
# (the grid barrier: "atom" = one call that arrives and waits, the default until session 27; "split" = the default)
# session 51-52's loader pacing (unpaced: no gate, 2 units in flight, no drain), which the loader-* builds below
# were measured with; generate's own defaults pace the loader since session 53 (codegen.loader.DEFAULT_GATES ...)
UNPACED = {"loader_gates": (), "loader_inflight": 2, "loader_drain": False}
LOADER = {"fused_o": True, "fused_mlp": True, "bulk_down": True, "loader_warp": True, **UNPACED}  # the loader-* base
BUILDS = {"default": {}, "no-loader": {"loader_warp": False}, "atom": {"barrier": "atom"}, "red": {"barrier": "red"},
          "red-fence": {"barrier": "red-fence"},
          "no-kvpf": {"kv_prefetch": False}, "kvpf-l1": {"kv_prefetch_l1": True},
          # the K/V prefetch of each CTA's whole first work item (sessions 16-28) instead of its first MIN_CHUNK rows
          "kvpf-all": {"kv_prefetch_rows": 1 << 20},
          "last-merge": {"merge_preload": False, "spread_merge": False},
          "merge-preload": {"merge_preload": True, "spread_merge": False},
          "spread-merge": {"merge_preload": False, "spread_merge": True},
          "no-slices": {"head_slices": False}, "short-slices": {"long_slices": False},
          "pass-chunks": {"pass_chunks": True}, "kv-pipeline": {"kv_pipeline": True},
          "no-kv-pipeline": {"kv_pipeline": False}, "kv-fence": {"kv_fence": True, "kv_pipeline": False},
          "no-kv-fence": {"kv_fence": False},  # the plain lane-group loop, the default before session 58
          "mma-two-buffers": {"mma_two_buffers": True},  # session 58: tensor-core items' K/V in two buffers
          # session 59: a warp's first K/V step issued before the query is roped (session 60, H100: no faster)
          "early-kv": {"early_kv": True},
          "early-kv-l1": {"early_kv": "l1"},  # ... its lines prefetched into L1 there instead (no registers held)
          "fold-merge": {"fold_merge": True},
          # session 59: fused_split's O blocks merge up to 16 active splits of their group (the items never merge);
          # the default since session 60, so no-group-fold builds the 8-split merge of before
          "group-fold": {"group_fold": True},
          "no-group-fold": {"group_fold": False},
          "no-fold-merge": {"fold_merge": False},
          # split-KV items of 2-8 query heads scored and summed on the tensor cores (session 32; the default since
          # session 33 wherever such items are dealt) or every item on the lane-group loop (the default before)
          "mma-attention": {"mma_attention": True}, "lane-attention": {"mma_attention": False},
          # ... and every split-KV dealing weighs those items by their chunk alone (whole groups, shorter chunks)
          "mma-schedule": {"mma_attention": True, "mma_schedule": True},
          # ... with fused_o (and so fused_split / fused_mlp) kept on, which the default turns off under it (session
          # 45 candidate: whole groups over shorter chunks at long contexts, one barrier less per layer)
          "fused-mma-schedule": {"mma_attention": True, "mma_schedule": True, "fused_o": True},
          # ... dealt over at most 16 splits a KV group (session 60 candidate: where the plan has more, e.g.
          # Qwen2.5-0.5B b1's 66, long contexts deal fewer, longer tensor-core items that the O blocks merge; since
          # session 62 what the split_cap feature builds: codegen.default_mma_schedule + default_split_cap)
          "fused-mma-schedule-cap16": {"mma_attention": True, "mma_schedule": True, "fused_o": True, "split_cap": 16},
          # ... the default's own dealing capped so (session 61's split_cap feature; with the feature enabled now,
          # the build above), or where that feature is enabled the default it replaces (no cap, no schedule)
          "cap16": {"split_cap": 16}, "no-split-cap": {"split_cap": False},
          # ... and items of 2-8 query heads of 256 dims there too (session 41, a candidate: Gemma's heads)
          "mma-wide": {"mma_wide": True},
          # ... with the dealing made for them (batch 1: whole groups over shorter chunks where slices were dealt)
          "mma-wide-schedule": {"mma_wide": True, "mma_schedule": True},
          # one-split steps run attention (whole KV groups, on the tensor cores where they fit) and the O projection
          # in one interval: one grid barrier less per layer at short contexts (codegen.fused; session 35: -2% to
          # -8% at 16); fused-o-lane: those groups on the fp32 lane-group loop (slower: +8% on Qwen2.5-0.5B);
          # fused-o-kv: their cached K/V rows from shared memory. Each names fused_split / fused_mlp off: since session
          # 45 both are on by default wherever fused_o is (fused_mlp where its W_down copies are 64 bits or wider)
          "fused-o": {"fused_o": True, "fused_split": False, "fused_mlp": False},
          "fused-o-lane": {"fused_o": True, "fused_mma": False, "fused_split": False, "fused_mlp": False},
          "fused-o-kv": {"fused_o": True, "fused_kv_smem": True, "fused_mlp": False},
          # every layer's gate/up and down GEMVs in one interval (session 43; session 45's default where its W_down
          # copies are 64 bits or wider): each CTA owns a block of the intermediate width, the down partials meet in
          # an int64 fixed-point accumulator
          "fused-mlp": {"fused_o": True, "fused_mlp": True, "fused_split": False},
          # the split steps' O projection in attention's interval too (session 44; session 45's default): each CTA
          # waits for its KV group's items on a counter, merges the group and multiplies its W_O block (one barrier
          # less at long contexts); fused-split-mlp: with fused-mlp on top; no-fused-mlp: the default without it
          "fused-split": {"fused_o": True, "fused_split": True, "fused_mlp": False},
          "fused-split-mlp": {"fused_o": True, "fused_split": True, "fused_mlp": True},
          "no-fused-mlp": {"fused_mlp": False}, "no-fused-split": {"fused_split": False},
          # warp 0 (thread 0 polls each grid barrier) without copies in flight while it polls (session 48; the
          # default since 49):
          # a fused build's W_O / W_down copies by threads 32.. (spare-loads), warp 0's ring prefills after the wait
          # (spare-ring), or both (spare-all)
          "spare-loads": {"spare_loads": True}, "spare-ring": {"spare_ring": True},
          "spare-all": {"spare_loads": True, "spare_ring": True},
          # fused_mlp's W_down columns by cp.async.bulk from a packed copy (session 48; default since 49): fused_mlp on
          # by default (bulk-down), with it forced on (fused-mlp-bulk: Qwen2.5-0.5B), and with spare-all on top
          "bulk-down": {"bulk_down": True}, "bulk-spare": {"bulk_down": True, "spare_loads": True, "spare_ring": True},
          "fused-mlp-bulk": {"fused_o": True, "fused_mlp": True, "bulk_down": True},
          # ... and both off (the default before session 49)
          "no-spare": {"spare_loads": False, "spare_ring": False}, "no-bulk": {"bulk_down": False},
          "fused-mlp-bulk-spare": {"fused_o": True, "fused_mlp": True, "bulk_down": True, "spare_loads": True,
                                   "spare_ring": True},
          # the W_down bulk copies issued at attention's barrier (after its arrival / its wait) instead of the MLP's
          # (session 49 candidates): on the
          # default (bulk_down wherever fused_mlp is), and with fused_mlp forced on (Qwen2.5-0.5B)
          "early-down": {"early_down": "arrival"}, "early-down-wait": {"early_down": "wait"},
          "fused-mlp-early": {"fused_o": True, "fused_mlp": True, "bulk_down": True, "early_down": "arrival"},
          "fused-mlp-early-wait": {"fused_o": True, "fused_mlp": True, "bulk_down": True, "early_down": "wait"},
          # the L2 prefetch of the next GEMV's first tiles before each barrier at one budget for every stage (the
          # default since session 26: none before a ring-prefilled GEMV, 16 MB elsewhere; pf16mb: the old default)
          "pf0": {"prefetch_bytes": 0}, "pf8mb": {"prefetch_bytes": 8 << 20}, "pf16mb": {"prefetch_bytes": 16 << 20},
          "pf32mb": {"prefetch_bytes": 32 << 20}, "pf48mb": {"prefetch_bytes": 48 << 20},
          # a ninth warp per CTA streams every weight in consumption order across grid barriers (session 51
          # candidate, codegen.loader; on the fused default, with fused_mlp forced on): at most 2 units of 16 KB in
          # flight per CTA (loader-warp), 1, or as many as the ring holds (loader-warp-ring); the QKV rows in a ring of
          # their own, loaded during attention (the default since session 51's second build; loader-warp-shared: one
          # ring for all, as first measured: Qwen3-0.6B 0.700 vs 0.669 on an H100); loader-warp-288: without
          # the loader's own warpgroup (288 threads of 168 registers, not 384 with setmaxnreg: consumers 232)
          "loader-warp": {**LOADER},
          "loader-warp-1": {**LOADER, "loader_inflight": 1},
          "loader-warp-ring": {**LOADER, "loader_inflight": 0},
          "loader-warp-288": {**LOADER, "loader_warpgroup": False},
          # ... the QKV stream unbounded (its units wait for the gate/up slots of the layer before), the rest at 2
          "loader-warp-qkv0": {**LOADER, "loader_qkv_inflight": 0},
          "loader-warp-shared": {**LOADER, "loader_qkv_ring": False},
          # session 52: the loader paced by the consumers' grid arrivals (loader_gates: the next layer's QKV rows,
          # W_down and gate/up after the QKV GEMV's arrival; "mlp": the next W_O block after the MLP's) and / or
          # waiting for the W_O block and W_down to land (loader_drain), so fewer copies are in flight at a release
          "loader-gate": {**LOADER, "loader_gates": ("qkv",)},
          "loader-gate-mlp": {**LOADER, "loader_gates": ("qkv", "mlp")},
          "loader-drain": {**LOADER, "loader_drain": True},
          "loader-paced": {**LOADER, "loader_gates": ("qkv", "mlp"), "loader_drain": True},
          "loader-gate-1": {**LOADER, "loader_gates": ("qkv",), "loader_inflight": 1},
          "loader-gate-drain": {**LOADER, "loader_gates": ("qkv",), "loader_drain": True},
          "loader-gate-1-drain": {**LOADER, "loader_gates": ("qkv",), "loader_inflight": 1, "loader_drain": True},
          # ... and in split steps (long contexts) the copies after attention's arrival, as the default ring fill
          "loader-gate-1-drain-att": {**LOADER, "loader_gates": ("qkv", "attention"), "loader_inflight": 1,
                                      "loader_drain": True},
          "loader-gate-att": {**LOADER, "loader_gates": ("qkv", "attention")},
          # session 61 candidate: Qwen3-0.6B's default pacing with the split-step gate at the CTA's items' end
          # ("items") in place of its arrival after attention (session 62, H100: 3.7% slower at 4000)
          "loader-gate-1-drain-items": {**LOADER, "loader_gates": ("qkv", "items"), "loader_inflight": 1,
                                        "loader_drain": True},
          "loader-gate-q1": {**LOADER, "loader_gates": ("qkv",), "loader_qkv_inflight": 1}}


def stepped_timeline_decoder(plan, model, tokens, timeline, build: str = "default", position: int | None = None):
    """A decoder of a ``generate(plan, timeline=timeline)`` build, stepped through ``tokens`` and then three times
    at ``position`` (default: the last checked one), so its clocks hold that step."""
    from megabake.codegen import generate
    from megabake.runtime import MegakernelDecoder

    source = generate(plan, timeline=timeline, **BUILDS[build]).source
    decoder = MegakernelDecoder(plan, source, model, device="cuda", use_graph=False)
    for p in range(len(tokens)):
        decoder.step(tokens[p], p)
    for _ in range(3):
        decoder.step(tokens[-1], len(tokens) - 1 if position is None else position)
    return decoder


def timeline(plan, model, tokens, phases: bool = False, build: str = "default",
             position: int | None = None) -> dict[str, float]:
    """Microseconds per stage kind (CTA 0, summed over layers) of one step at ``position`` (default: the last
    checked one); with ``phases`` per ``<stage>.<phase>`` (staging, GEMV, prefetch, barrier wait:
    ``codegen.stage_phases``)."""
    from megabake.codegen import TIMELINE_PHASES

    decoder = stepped_timeline_decoder(plan, model, tokens, TIMELINE_PHASES if phases else True, build, position)
    by_kind: dict[str, float] = {}
    for label, us in decoder.stage_timeline():
        kind = ".".join(label.split(".")[-2:]) if phases else label.split(".")[-1]
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    del decoder
    return by_kind


def summarize_ctas(labels: list[str], rows: list[list[float]], top: int = 8, split: bool = False,
                   fused_step: bool = False) -> dict:
    """Where the grid barriers' waits come from, from every CTA's phase clocks (``cta_timelines``: per CTA, us
    from the earliest start to the end of each interval). Per stage kind, summed over layers: ``wait_mean`` (a
    CTA's mean time in the barrier interval), ``skew`` (last minus first arrival), ``latency`` (first release
    minus last arrival: the barrier itself), and ``gemv_min`` / ``gemv_median`` / ``gemv_max`` (a CTA's GEMV
    time); ``last_arrivals``: the CTAs that arrived last most often, with their counts. A CTA arrives where the
    barrier interval starts, or with ``split`` (a split barrier, the default since session 27) where the stage's
    ``prefetch`` interval before it starts, if it has one. In a fused_o build (codegen.stage_phases) the attention
    stage's ``split_barrier`` is its barrier (a CTA arrives where it starts) in a step of several splits and no
    barrier at all in a fused step (``fused_step``), where a CTA arrives at the O stage's barrier right after
    ``fused_attention_o``."""
    import collections

    kinds: dict[str, dict[str, float]] = {}
    gemv: dict[str, list[float]] = {}
    last = collections.Counter()
    ctas = range(len(rows))
    fused_ends = {label.split(".")[0]: k + 1 for k, label in enumerate(labels) if label.endswith("|fused_attention_o")}
    for k, label in enumerate(labels):  # interval k runs from rows[c][k] to rows[c][k + 1]
        kind, phase = label.split(".")[-2:]
        if phase == "split_barrier" and not fused_step:
            phase = "barrier"  # its arrival comes right after the attention body: where this interval starts
        if phase == "barrier":
            arrived = k - 1 if split and k and labels[k - 1].endswith(".prefetch") else k
            if fused_step and kind == "o_residual" and label.split(".")[0] in fused_ends:
                arrived = fused_ends[label.split(".")[0]]
            arrivals = [rows[c][arrived] for c in ctas]
            releases = [rows[c][k + 1] for c in ctas]
            entry = kinds.setdefault(kind, {"wait_mean": 0.0, "skew": 0.0, "latency": 0.0})
            entry["wait_mean"] += statistics.fmean(r - a for r, a in zip(releases, arrivals))
            entry["skew"] += max(arrivals) - min(arrivals)
            entry["latency"] += min(releases) - max(arrivals)
            last[max(ctas, key=lambda c: arrivals[c])] += 1
        elif phase.startswith("gemv"):
            per_cta = gemv.setdefault(kind, [0.0] * len(rows))
            for c in ctas:
                per_cta[c] += rows[c][k + 1] - rows[c][k]
    for kind, per_cta in gemv.items():
        kinds.setdefault(kind, {}).update(gemv_min=min(per_cta), gemv_median=statistics.median(per_cta),
                                          gemv_max=max(per_cta))
    rounded = {kind: {key: round(value, 1) for key, value in entry.items()} for kind, entry in kinds.items()}
    return {"stages": rounded, "last_arrivals": last.most_common(top)}


def cta_timeline(plan, model, tokens, build: str = "default", position: int | None = None) -> dict:
    """:func:`summarize_ctas` of one step of a ``timeline="phases-per-cta"`` build (a CTA-wide sync before each
    clock: it perturbs the step; compare its waits with each other, not with the other builds' times)."""
    from megabake.codegen import DEFAULT_BARRIER, TIMELINE_PER_CTA

    decoder = stepped_timeline_decoder(plan, model, tokens, TIMELINE_PER_CTA, build, position)
    labels, rows = decoder.cta_timelines()
    at = len(tokens) - 1 if position is None else position
    fused_step = hasattr(decoder.module, "FUSED_O_BLOCKS") and at + 1 <= decoder.module.MIN_CHUNK  # fused_o_step
    del decoder
    return summarize_ctas(labels, rows, split=BUILDS[build].get("barrier", DEFAULT_BARRIER) == "split",
                          fused_step=fused_step)


def sweep(name: str, chosen: list[str], reps: int, capacity: int, batch: int = 1, phases: bool = False,
          builds: tuple[str, ...] = ("default",), ctas: int | None = None, composite: bool = True,
          position: int | None = None, per_cta: bool = False) -> dict:
    import torch

    from megabake.capture import capture_decode_step
    from megabake.ir import lower
    from megabake.plan.rotary import recover_rotary
    from megabake.presets import get_preset
    from megabake.runtime import gpu_info
    from megabake.runtime.autotune import choose_tuning

    info = gpu_info()
    model = get_preset(name).build_model()
    captured = capture_decode_step(model, batch=batch, capacity=capacity)
    ir = lower(captured)
    inv, scale = recover_rotary(captured, ir)
    tokens = torch.randint(1, model.config.vocab_size, (STEPS, batch), generator=torch.Generator().manual_seed(3))
    context = dict(ir=ir, inv=inv, scale=scale, sm_count=ctas or info.sm_count, model=model, tokens=tokens, reps=reps,
                   phases=phases, position=position, per_cta=per_cta)
    rows, timelines, default_logits = [], {}, []
    candidates = variants()
    default_plan = bake_plan(context)
    for variant in chosen:
        tuning = tuning_for(candidates[variant], default_plan)
        row, timelines[variant] = measure_variant(variant, tuning, context, default_logits)
        rows.append(row)
        for build in [b for b in builds if b != "default"]:  # the variant again with each other build (BUILDS)
            row, timelines[f"{variant}@{build}"] = measure_variant(f"{variant}@{build}", tuning, context,
                                                                   default_logits, build=build)
            rows.append(row)
        if variant in ATTENTION_PRELOAD_VARIANTS:
            with_attention = f"{variant}+attn"
            row, timelines[with_attention] = measure_variant(with_attention, tuning, context, default_logits,
                                                             attention_preload=True)
            rows.append(row)
    uniform = {k: v for k, v in candidates.items()
               if not isinstance(v, Balanced) and v is not BAKE_DEFAULT and v != BAKE_BALANCED}
    timed = {r["variant"]: timelines[r["variant"]] for r in rows
             if _usable(r) and timelines.get(r["variant"]) and r["variant"] in uniform}
    if timed and composite:
        chosen_tuning = choose_tuning(timed, uniform)
        row, timelines["composite"] = measure_variant("composite", chosen_tuning, context, default_logits)
        row["spec"] = {stage: [t.per_tile, t.unroll, t.spread, t.preload, t.pipeline, t.stages]
                       for stage, t in chosen_tuning.items()}
        rows.append(row)
    usable = [r for r in rows if _usable(r)]
    best = min(usable, key=lambda r: r["gpu_ms"])["variant"] if usable else None
    return {"preset": name, "batch": batch, "ctas": context["sm_count"], "gpu": info.name, "rows": rows, "best": best,
            "timelines": timelines,
            "stage_bytes": stage_bytes(default_plan)}


def _usable(row: dict) -> bool:
    return "gpu_ms" in row and row["finite"] and row["rel_l2_vs_default"] < 1e-3 \
        and row.get("rel_l2_at_position_vs_default", 0.0) < 1e-3


def bake_plan(context: dict):
    """The plan ``megabake bake`` ships for this bucket (``tuning=None``: the streaming ring where it fits, the
    gated gate/up): the variants that start from the bake's tiling (bake-balanced) read it. Session 30 passed
    ``{}`` here, the plain register tiling, so session 31's bake-balanced run measured a balanced plain tiling
    (no ring, no gated write), not the bake's."""
    return build_tuned_plan(context, None)


def build_tuned_plan(context: dict, tuning: dict | None, attention_preload: bool = False,
                     down_input: str | None = None):
    from megabake.plan import build_plan

    return build_plan(context["ir"], ctas=context["sm_count"], inv_freq_buffer=context["inv"],
                      rotary_scaling=context["scale"], tuning=tuning, attention_preload=attention_preload,
                      down_input=down_input)


def measure_variant(variant: str, tuning: dict, context: dict, default_logits: list,
                    attention_preload: bool = False, build: str = "default") -> tuple[dict, dict]:
    """Build, check (poisoned logits, vs the first variant, the first one also vs the CPU reference), time, and
    read one step's per-stage clocks. Errors become the row's ``error``: one variant must not end the sweep."""
    import torch

    from megabake.codegen import generate
    from megabake.runtime import MegakernelDecoder

    started = time.perf_counter()
    model, tokens, reps = context["model"], context["tokens"], context["reps"]
    pos = len(tokens) - 1
    try:
        down_input = "global" if variant.split("@")[0] == BAKE_GLOBAL_DOWN else None
        plan = build_tuned_plan(context, tuning, attention_preload, down_input)
        decoder = MegakernelDecoder(plan, generate(plan, **BUILDS[build]).source, model, device="cuda")
        for p in range(len(tokens)):
            decoder.buffers["logits"].fill_(float("nan"))  # poison
            logits = decoder.step(tokens[p], p).float().cpu().clone()
        row = {"variant": variant, "finite": bool(torch.isfinite(logits).all())}
        if not default_logits:
            default_logits.append(logits)
            row["rel_l2_vs_cpu_reference"] = vs_reference(decoder, plan, tokens)
        reference = default_logits[0]
        row["rel_l2_vs_default"] = float((logits - reference).norm() / reference.norm())
        timed_at = pos if context.get("position") is None else context["position"]  # --position: a long context
        row["position"] = timed_at
        row["gpu_ms"] = time_replays(decoder, tokens[pos], timed_at, reps)
        row["sync_ms"], row["host_us"] = sync_call(decoder, tokens[pos], timed_at, reps)
        if timed_at != pos:  # the timed step itself (a long context), against the first variant's
            decoder.buffers["logits"].fill_(float("nan"))
            at_position = decoder.step(tokens[pos], timed_at).float().cpu().clone()
            if len(default_logits) == 1:
                default_logits.append(at_position)
            row["rel_l2_at_position_vs_default"] = float((at_position - default_logits[1]).norm()
                                                         / default_logits[1].norm())
        del decoder
        stages = timeline(plan, model, tokens, build=build, position=context.get("position"))
        if context.get("phases"):
            row["phases_us"] = {k: round(v, 1) for k, v in timeline(plan, model, tokens, phases=True, build=build,
                                                                     position=context.get("position")).items()}
        if context.get("per_cta"):
            row["per_cta"] = cta_timeline(plan, model, tokens, build=build, position=context.get("position"))
        row["build_s"] = round(time.perf_counter() - started, 1)
    except Exception as exc:
        row, stages = {"variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}, {}
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return row, stages


def print_table(result: dict) -> None:
    print(f"== {result['preset']} batch {result.get('batch', 1)}, {result.get('ctas')} CTAs ({result['gpu']}) ==")
    print("| variant | GPU ms (graph replay) | sync ms | host us in step() | rel-L2 vs default | "
          "at the timed position | vs CPU reference |")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:80]} | | | | | |")
        else:
            ref, at = r.get("rel_l2_vs_cpu_reference"), r.get("rel_l2_at_position_vs_default")
            print(f"| {r['variant']} | {r['gpu_ms']:.3f} | {r['sync_ms']:.3f} | {r.get('host_us', float('nan')):.1f} | "
                  f"{r['rel_l2_vs_default']:.1e} | {'' if at is None else f'{at:.1e}'} | "
                  f"{'' if ref is None else f'{ref:.1e}'} |")
    for r in result["rows"]:
        if "spec" in r:
            print(f"composite (per-stage winners): {json.dumps(r['spec'])}")
    for variant, kinds in result["timelines"].items():
        if not kinds:
            continue
        total = sum(kinds.values())
        parts = []
        for kind, us in kinds.items():
            moved = result["stage_bytes"].get(kind)
            rate = f" {moved / us / 1e6:.2f} TB/s" if moved else ""  # bytes per us / 1e6 = TB/s
            parts.append(f"{kind} {us:.0f}us{rate}")
        print(f"timeline {variant} (CTA 0, total {total:.0f} us): " + "; ".join(parts))
    for r in result["rows"]:
        if r.get("phases_us"):
            parts = [f"{phase} {us:.0f}us" for phase, us in r["phases_us"].items()]
            print(f"phases {r['variant']} (CTA 0, summed over layers): " + "; ".join(parts))
    for r in result["rows"]:
        if r.get("per_cta"):
            parts = [f"{kind}: " + ", ".join(f"{key} {value:.0f}" for key, value in entry.items())
                     for kind, entry in r["per_cta"]["stages"].items()]
            print(f"per-CTA {r['variant']} (us summed over layers): " + "; ".join(parts)
                  + f"; last to arrive (CTA, times): {r['per_cta']['last_arrivals']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--variants", nargs="+", default=list(variants()), choices=list(variants()))
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (mma: at most 8, bf16-staged)")
    parser.add_argument("--phases", action="store_true",
                        help="also time every phase of every stage (staging, GEMV, prefetch, barrier wait)")
    parser.add_argument("--per-cta", action="store_true",
                        help="also build each variant with every CTA's phase clocks (timeline=\"phases-per-cta\") "
                             "and summarize the barrier waits: mean wait, arrival skew, barrier latency, GEMV "
                             "time over CTAs, the CTAs that arrive last")
    parser.add_argument("--builds", "--barriers", dest="builds", nargs="+", default=["default"], choices=list(BUILDS),
                        help="code-generation options to build each variant with (BUILDS: grid-barrier arrivals of "
                             "codegen.BARRIER_ARRIVALS; no-kvpf = without the K/V L2 prefetch; kvpf-l1 = that "
                             "prefetch into L1; last-merge / merge-preload / spread-merge = one split-KV merge "
                             "only): 'default red no-kvpf' adds <variant>@red and <variant>@no-kvpf rows per variant, "
                             "checked against the first variant's logits")
    parser.add_argument("--position", type=int, default=None,
                        help="time the step at this position (< --capacity) instead of the last checked one")
    parser.add_argument("--no-composite", action="store_true",
                        help="skip the composite variant (per-stage winners), e.g. for a quick A/B")
    parser.add_argument("--ctas", type=int, default=None,
                        help="CTAs of the persistent grid (default: one per SM); fewer CTAs meet at each grid "
                             "barrier, each streams more weights")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    opt_in_experimental(args.variants)
    results = []
    for name in args.presets:
        result = sweep(name, args.variants, args.reps, args.capacity, args.batch, args.phases, tuple(args.builds),
                       args.ctas, not args.no_composite, args.position, args.per_cta)
        (args.out / f"tune-{name}-b{args.batch}.json").write_text(json.dumps(result, indent=1))
        results.append(result)
    for result in results:
        print_table(result)


if __name__ == "__main__":
    main()
