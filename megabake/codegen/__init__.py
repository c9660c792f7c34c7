"""Codegen: plan -> ``module.py`` (generated CuTe DSL, one persistent cooperative ``@cute.kernel``) + source map.

Contract: ``generate(plan) -> GeneratedModule`` with ``.source`` (the text of module.py) and
``.source_map`` (the ``source_map.json`` object: for every barrier interval and body call, its line range,
the IR ops it implements, their FX nodes and HF module paths). The module defines ``megakernel`` (the device
kernel), ``launch`` (the ``@cute.jit`` host function that launches it with ``cooperative=True``),
``ARGUMENTS`` (kernel parameter order = plan buffer names: ``KERNEL_ARGUMENTS``, then the plan's linear-bias
buffers if it has any), ``GRID``, ``BLOCK``, ``SMEM_BYTES`` and ``PLAN_HASH``.

Self-contained: the module imports only ``cutlass`` and ``cuda.bindings`` (never ``megabake``). The device
routines the kernel calls as ``bodies.<name>`` are copied verbatim, after the kernel, from
``megabake/codegen/bodies`` (``bodies_source()``: only those the kernel calls and what they call, in source order,
with their comments), below a banner, and bound to the name ``bodies``; so a package runs the device code it
was baked with, whatever MegaBake is installed. ``generate(plan, self_contained=False)`` writes the legacy
form that imports the installed ``megabake.codegen.bodies`` instead (same kernel text; kept to compare the
two compilations, and because packages baked before 0.1.x still import it).
Model dimensions and the bucket are compile-time constants; position and token ids are runtime values read
from device buffers, so one compiled kernel serves every step and CUDA-graph replay.

``generate(plan, timeline=True)`` writes a profiling variant: CTA 0 stores ``%globaltimer`` into
``barrier[1 + k]`` at kernel start (k=0), after every grid barrier and at its end, and the module declares
``TIMELINE_SLOTS``; the runtime then sizes the barrier buffer ``1 + TIMELINE_SLOTS`` and reads per-stage
times back (:meth:`megabake.runtime.MegakernelDecoder.stage_timeline`). ``timeline="phases"`` stores a clock
after every phase of every stage instead (:func:`stage_phases`: staging, GEMV, prefetch, barrier wait) and
declares ``TIMELINE_PHASES``; ``timeline="phases-per-cta"`` stores them in every CTA, each once the whole CTA is
through the phase (a ``sync_threads`` before each clock: a diagnostic that perturbs what it measures), in rows of
``TIMELINE_STRIDE`` (:meth:`megabake.runtime.MegakernelDecoder.cta_timelines`). Every timeline module names its
intervals in ``TIMELINE_LABELS`` (:func:`timeline_labels` of its build: fused_o and fused_mlp builds, which have
timelines since session 44, merge or skip some stages' intervals). Grid barriers are split by default
(``DEFAULT_BARRIER``): a CTA arrives right after its stage's writes and waits after the next GEMV's ring fill and
prefetches; ``generate(plan, barrier="atom")`` (one call that arrives and waits, the default until session 27),
``"red"`` or ``"red-fence"`` (fire-and-forget arrivals) build the others (``BARRIER_ARRIVALS``).
``generate(plan, watchdog=True)`` (debugging a hang) waits at each grid barrier for at most ``WATCHDOG_POLLS``
polls and records per CTA its arrivals and the first barrier it gave up at
(:meth:`megabake.runtime.MegakernelDecoder.barrier_watch`). Packages never ship these variants.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..plan import (ATTN_COUNT, ATTN_PART, ATTN_WINDOW, DOWN_INPUT, HEAD_NORMS, ROPE_TABLE, STAGE_BIAS, Plan,
                   Stage, feature_enabled, kv_splits, ring_shape, smem_floats)
from ..plan.attention import (LONG_SLICES, MMA_ATT_WIDE_HEAD_DIMS, PASS_CHUNKS, capped_splits, chunk_quantum,
                              mma_attention_fits, mma_attention_items, mma_slice_mask)
from ..plan.stages import (ACTIVATIONS, DIMENSION_CONSTANTS, GATED_ACT_CODES, StageSpec, next_gemv, norm_slot,
                           spec_of)
from .fused import (FUSED_O_BUFFERS, FUSED_SPLIT_BUFFERS, fused_geometry, fused_kv_refusal, fused_o_refusal,
                    fused_split_refusal)
from .loader import (CONSUMER_REGISTERS, DEFAULT_DRAIN, DEFAULT_INFLIGHT, ITEMS_GATE, LOADER_GATES,
                     PRODUCER_REGISTERS, WARPGROUP, LoaderGeometry, default_loader_gates, default_loader_warp,
                     loader_geometry, loader_record, loader_refusal)
from .fused_mlp import (ACC_PAD, BULK_DOWN_BUFFERS, FUSED_MLP_BUFFERS, bulk_copy_bytes, default_fused_mlp,
                        fused_mlp_refusal, mlp_geometry, mlp_smem_bytes)

KERNEL_ARGUMENTS = [
    "embed", "w_qkv", "w_o", "w_gate_up", "w_down", "norms", "final_norm", "lm_head", "rope_cos", "rope_sin",
    "k_cache", "v_cache", "tokens", "position", "x", "qkv", "attn", "gate_up", "logits", "barrier",
]


def kernel_arguments(plan: Plan) -> list[str]:
    """Kernel parameter order: the fixed buffers, then the optional ones this plan has (biases, per-head norms,
    split-KV workspace, the sandwich layout's residual buffers, per-layer sliding windows; none for Llama)."""
    optional = list(STAGE_BIAS.values()) + [HEAD_NORMS, ATTN_PART, ATTN_COUNT, "x_mid", "o_out", "down_out",
                                            ATTN_WINDOW, ROPE_TABLE, DOWN_INPUT]
    return KERNEL_ARGUMENTS + [name for name in optional if any(b.name == name for b in plan.buffers)]


@dataclass
class GeneratedModule:
    source: str
    source_map: dict
    arguments: list[str] = field(default_factory=lambda: list(KERNEL_ARGUMENTS))
    # what module.py holds beyond its plan's default build and plan.json does not say: {} or, where a loader warp
    # streams the weights, {"loader_warp": its pacing} (codegen.loader.loader_record). A bake records it in the
    # report (kernel.codegen) and folds it into the package's plan tag (package.layout.build_hash), so builds of
    # one plan with and without the loader never share a variant name.
    codegen: dict = field(default_factory=dict)

    @property
    def kernel_source(self) -> str:
        """module.py without the copied device routines: what the plan generated (all of a legacy module)."""
        head, banner, _ = self.source.partition("\n\n\n" + _BANNER + "\n")
        return head + "\n" if banner else self.source


LINE_WIDTH = 120  # generated kernel lines are wrapped to this width


class _Writer:
    """Collects lines and remembers which line ranges implement which plan entries. With ``keyword_calls``
    (the kernel body), every ``bodies.<name>(...)`` call is written with keyword arguments, wrapped to
    :data:`LINE_WIDTH` (:func:`keyword_call_lines`)."""

    def __init__(self, keyword_calls: bool = False):
        self.lines: list[str] = []
        self.entries: list[dict] = []
        self._open: list[tuple[int, dict]] = []
        self._parameters = body_parameters() if keyword_calls else None
        self.base = 0  # levels added to every indent (a loader_warp build's consumer program: under an if)

    def __call__(self, text: str = "", indent: int = 0):
        indent += self.base
        for line in text.splitlines() or [""]:
            line = ("    " * indent + line) if line else ""
            if self._parameters is not None and line.lstrip().startswith("bodies."):
                self.lines.extend(keyword_call_lines(line, self._parameters))
            else:
                self.lines.append(line)

    def begin(self, entry: dict):
        self._open.append((len(self.lines) + 1, entry))

    def end(self):
        start, entry = self._open.pop()
        entry["lines"] = [start, len(self.lines)]
        self.entries.append(entry)

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def body_parameters() -> dict[str, list[str]]:
    """Parameter names of every device routine in megabake/codegen/bodies, read from its source text."""
    tree = ast.parse(bodies_source())
    return {f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)}


def keyword_call_lines(line: str, parameters: dict[str, list[str]] | None = None) -> list[str]:
    """``bodies.f(a, b, c=1)`` as ``bodies.f(x=a, y=b, c=1)`` (names from ``f``'s signature), on one line when it
    fits :data:`LINE_WIDTH`, else the arguments packed onto continuation lines indented one level further.
    The call compiles to the same PTX (CuTe DSL binds routine arguments by name either way)."""
    stripped = line.lstrip()
    indent = line[:len(line) - len(stripped)]
    call = ast.parse(stripped).body[0].value
    name = call.func.attr
    names = (parameters or body_parameters())[name]
    if len(call.args) > len(names):
        raise ValueError(f"bodies.{name} takes {len(names)} arguments, the generated call passes {len(call.args)}")
    arguments = [f"{n}={ast.unparse(a)}" for n, a in zip(names, call.args)]
    arguments += [f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords]
    single = f"{indent}bodies.{name}({', '.join(arguments)})"
    if len(single) <= LINE_WIDTH:
        return [single]
    lines, current = [f"{indent}bodies.{name}("], ""
    for i, argument in enumerate(arguments):
        piece = argument + ("," if i < len(arguments) - 1 else ")")
        if current and len(indent) + 4 + len(current) + 1 + len(piece) > LINE_WIDTH:
            lines.append(f"{indent}    {current}")
            current = ""
        current = f"{current} {piece}" if current else piece
    lines.append(f"{indent}    {current}")
    return lines


TIMELINE_PHASES = "phases"  # generate(plan, timeline=TIMELINE_PHASES): a clock after every phase of every stage
# generate(plan, timeline=TIMELINE_PER_CTA): the same clocks in every CTA, each after the whole CTA finished the phase
TIMELINE_PER_CTA = "phases-per-cta"


def timeline_labels(plan: Plan, phases: bool = False, options: BuildOptions | None = None) -> list[str]:
    """Names of the timeline intervals (slot k-1 -> k) of a ``timeline=True`` module, in order; with
    ``phases`` those of a ``timeline="phases"`` module: ``<stage>.<phase>`` (:func:`stage_phases`). ``options``:
    the build's (:class:`BuildOptions`; a ``fused_o`` build's attention interval holds the O projection,
    ``attention+o_residual``, and its phases are :func:`stage_phases`'). A timeline module carries its own labels
    (``TIMELINE_LABELS``), which :meth:`megabake.runtime.MegakernelDecoder.stage_timeline` reads."""
    options = options or BuildOptions()

    def named(prefix: str, stage: Stage) -> list[str]:
        if phases:
            return [f"{prefix}{stage.name}.{phase}" for phase in stage_phases(plan, stage, options)]
        if _fused_layer_stage(options, stage) and stage.kind == "attention":
            return [f"{prefix}{stage.name}+{_o_stage(plan).name}"]
        return [] if _fused_layer_stage(options, stage) and stage.name == "o_residual" else [f"{prefix}{stage.name}"]

    names = [n for s in plan.stages if s.scope == "prologue" for n in named("", s)]
    for layer in range(plan.dims.layers):
        names += [n for s in plan.stages if s.scope == "layer" for n in named(f"layer{layer}.", s)]
    names += [n for s in plan.stages if s.scope == "epilogue" for n in named("", s)]
    return names


def stage_phases(plan: Plan, stage: Stage, options: BuildOptions | None = None) -> list[str]:
    """The phases a ``timeline="phases"`` build clocks in one stage: each body call (the staging of a GEMV's
    input rows, the GEMV, ...; thread 0 of CTA 0 stores the clock when its own warp is done), then, before a grid
    barrier, ``prefetch`` (the next GEMV's L2 prefetch / preload) where there is one, and ``barrier`` (the wait:
    CTA 0 against the slowest CTA). In a ``fused_o`` build (``options``) the attention stage has two phases,
    ``<its body>|fused_attention_o`` (a fused step runs the latter) and ``split_barrier`` (the wait of a step of
    several splits; nothing in a fused step), and the O projection's body phases are empty in a fused step, whose
    arrival at the O stage's barrier comes right after ``fused_attention_o``. With ``fused_split`` the attention
    stage has two phases too, ``<its body>|fused_attention_o`` and ``split_o_block`` (the wait for the KV group's
    items, their merge and the W_O block: nothing in a fused step), and the O stage only its prefetch and barrier."""
    options = options or BuildOptions()
    if _fused_layer_stage(options, stage) and stage.kind == "attention":
        body = _stage_calls(plan, stage, options)[0][0]
        if options.fused_split:  # one interval: the split items, then split_o_block; or fused_attention_o
            return [f"{body}|fused_attention_o", "split_o_block"]
        return [f"{body}|fused_attention_o", "split_barrier"]
    if options.fused_split and _fused_layer_stage(options, stage) and stage.name == "o_residual":
        return (["prefetch"] if _prefetch_phase(plan, stage, options) else []) + ["barrier"]
    calls = _stage_calls(plan, stage, options)
    bodies = [body for body, _ in calls]
    # a body called twice in one stage (the prologue's zero_rows of mlp_acc and of o_count) is told apart by the
    # buffer it is given first: every phase keeps its own label
    names = [f"{body}({call.split('(', 1)[1].split(',')[0].strip()})" if bodies.count(body) > 1 else body
             for body, call in calls]
    if _ends_at_a_barrier(stage, options):
        names += (["prefetch"] if _prefetch_phase(plan, stage, options) else []) + ["barrier"]
    return names


def _fused_layer_stage(options: BuildOptions, stage: Stage) -> bool:
    return options.fused_o and stage.scope == "layer"


def _o_stage(plan: Plan) -> Stage:
    return next(s for s in plan.stages if s.scope == "layer" and s.name == "o_residual")


def _timeline_store(w: _Writer, indent: int, enabled: bool, slot: str, every_cta: bool = False) -> None:
    """Store ``%globaltimer`` in ``barrier[slot]`` (thread 0 of CTA 0), or with ``every_cta`` in each CTA's own
    row, ``barrier[cta * TIMELINE_STRIDE + slot]``, once every warp of that CTA got there."""
    if enabled and every_cta:
        w("cute.arch.sync_threads()", indent)
        w("if tidx == 0:", indent)
        w(f"barrier[cta * TIMELINE_STRIDE + {slot}] = cute.arch.globaltimer()", indent + 1)
    elif enabled:
        w("if cta == 0 and tidx == 0:", indent)
        w(f"barrier[{slot}] = cute.arch.globaltimer()", indent + 1)


WATCHDOG_POLLS = 1 << 22  # polls of a watchdog build's barrier before a CTA gives up (~3 s at ~0.7 us per poll)
# how a CTA meets the others at a grid barrier: "split" (the default: bodies.grid_arrive before the calls issued
# ahead of the wait, bodies.grid_wait after them), "atom" (bodies.grid_barrier: arrive and wait in one call, the
# default until session 27), "red" (bodies.grid_barrier_red: a fire-and-forget arrival after the launch's first
# barrier, acquire polls) or "red-fence" (the same with relaxed polls and one acquire fence)
BARRIER_ARRIVALS = {"atom": "bodies.grid_barrier(barrier, tidx, CTAS)",
                    "red": "bodies.grid_barrier_red(barrier, bar_next, tidx, CTAS, False)",
                    "red-fence": "bodies.grid_barrier_red(barrier, bar_next, tidx, CTAS, True)",
                    "split": "bodies.grid_wait(barrier, bar_next, tidx, CTAS)"}
# barrier="split": the arrival (bodies.grid_arrive) comes right after a stage's writes, before the calls issued ahead
# of the wait (_before_barrier_calls: ring fill, L2 prefetches, register preloads of weights; none writes global
# memory, and the attention preload, which reads the KV cache that the next stage appends to, stays before it), so
# the last CTA's arrival is not queued behind its own ring fill. H200, session 27 (scripts/gpu_tune.py --per-cta):
# with one call, a barrier's latency (last arrival to first release) was 0.6-0.7 us after attention, where nothing
# is issued ahead of the wait, and 1.2-2.9 us after GEMVs whose successor fills its ring there; split, a CTA's mean
# wait after its prefetch phase fell from 225 to 170 us per step (Llama-3.2-1B at 16) and from 530 to 416 us
# (Phi-3-mini at 4000). GPU ms per step, atom -> split: Llama-3.2-1B at 16 0.767 -> 0.748, SmolLM-135M at 16
# 0.388 -> 0.369, OLMo-2-1B at 4000 1.008 -> 0.991, Phi-3-mini at 4000 2.470 -> 2.460, the same logits.
SPLIT_ARRIVAL = "bodies.grid_arrive(barrier, bar_next, tidx, CTAS)"
WARP_SIZE = 32  # threads of a warp: warp 0 holds thread 0, which arrives at and polls every grid barrier
DEFAULT_BARRIER = "split"
# before-barrier calls that read global memory the next stage writes: they stay ahead of a split barrier's arrival
_BEFORE_ARRIVAL = ("bodies.attention_preload(",)


# L2 prefetch of the next GEMV's first tiles before each grid barrier, bytes over the whole grid (at least one tile
# per warp), where the next GEMV does not fill its cp.async ring before the barrier (:func:`default_prefetch_bytes`):
# L2 is 50-60 MB on H100/H200. ``generate(plan, prefetch_bytes=N)`` sets N for every stage (gpu_tune.py ``--builds
# pf0 pf16mb pf32mb``).
PREFETCH_BUDGET_BYTES = 16 << 20


# where a bulk_down build's W_down copies go instead of the MLP's barrier (codegen.generate's early_down): right after
# the arrival before attention, or right after that barrier's wait (at the start of attention's interval)
EARLY_DOWN_MODES = (None, "arrival", "wait")


@dataclass(frozen=True)
class BuildOptions:
    """Code-generation choices that change module.py but not the plan (same buffers, same plan hash): the grid
    barrier's call (``BARRIER_ARRIVALS`` or a watchdog's; a split barrier's wait, after its ``arrival``), the K/V
    L2 prefetch (:func:`_before_barrier_calls`; at most ``kv_prefetch_rows`` rows per work item:
    :func:`default_kv_prefetch_rows`) and
    the split-KV merge's preload (``bodies.split_kv_attention``), the K/V prefetch into L1 instead of L2
    (``kv_prefetch_l1``, a candidate, off by default) and the spread split-KV merge (``spread_merge``, with
    ``bodies.split_kv_counts_reset`` after the barrier that follows attention). :func:`generate` picks the two
    merge options per plan (:func:`default_merge`). The split-KV head slices (the plan's ``head_slices``) are
    the module's ``HEAD_SLICES`` constant: ``generate(plan, head_slices=False)`` sets it to 1 (one item per KV
    group at every context, as before session 18); ``LONG_SLICES`` lets long contexts deal smaller slices over
    fewer splits (``plan.attention.split_schedule``; ``generate(plan, long_slices=False)``: short contexts only,
    as in session 18)."""

    barrier: str = BARRIER_ARRIVALS["atom"]
    kv_prefetch: bool = True
    kv_prefetch_l1: bool = False
    kv_prefetch_rows: int = 0  # the K/V prefetch's cap in rows per work item (generate fills it in)
    merge_preload: bool = False
    spread_merge: bool = False
    fold_splits: int = 0  # fold_merge: the O projection's staging merges up to this many active splits (0: off)
    prefetch_bytes: int | None = None  # L2 prefetch of the next GEMV's tiles per barrier (None: per stage)
    clock_every_cta: bool = False  # a TIMELINE_PER_CTA build: every CTA stores its phase clocks
    arrival: str | None = None  # a split barrier's arrival (SPLIT_ARRIVAL), emitted before the before-barrier calls
    mma_attention: bool = False  # split-KV items of 2-8 query heads on the tensor cores (generate: on where they fit)
    mma_schedule: bool = False  # every split-KV dealing weighs those items by their chunk alone (MMA_SLICES)
    mma_wide: bool = False  # ... and items of heads of 256 dims there too (MMA_WIDE)
    fused_o: bool = False  # steps within MIN_CHUNK run attention and the O projection in one interval (codegen.fused)
    fused_kv_smem: bool = False  # ... scoring their cached K/V rows from shared memory (codegen.fused)
    fused_mlp: bool = False  # a layer's gate/up and down GEMVs in one interval (codegen.fused_mlp)
    fused_split: bool = False  # fused_o: split steps' O projection in attention's interval too (split_o_block)
    loader: LoaderGeometry | None = None  # loader_warp: warp WARPS streams the weights (codegen.loader)
    spare_ring: bool = False  # warp 0 fills its ring after a barrier's wait, not ahead of it (_spare_ring_calls)
    bulk_down: bool = False  # fused_mlp: W_down columns by cp.async.bulk from the packed w_down_cta
    early_down: str | None = None  # bulk_down: those copies at attention's barrier ("arrival" / "wait"), not the MLP's


# A KV group's outputs (query heads per KV head x head_dim) from which the spread merge is the default: on the H200
# (session 17, position 2000 / 4000) it took gemma-2b (2048 outputs) from 1.918 to 1.787 ms per step, while the
# preloaded last-arrival merge was faster for SmolLM-135M (192: 0.483 vs 0.493 ms) and even for Llama-3.2-1B
# (256: 0.932 vs 0.930 ms, noise).
SPREAD_MERGE_MIN_OUTPUTS = 1024


def merge_preload_fits(plan: Plan) -> bool:
    """The preload keeps 2 x splits floats per head (each split's max and sum) in the attention scratch."""
    return 2 * kv_splits(plan) <= (plan.dims.head_dim + 2) * plan.warps


def spread_merge_fits(plan: Plan) -> bool:
    """The spread merge meets in 3 x threads floats of the attention scratch."""
    group = plan.dims.n_heads // plan.dims.n_kv_heads
    return not kv_splits(plan) or 3 * plan.threads <= (plan.dims.head_dim + 2) * group * plan.warps


FOLD_MAX_SPLITS = 8  # fold_merge: the most active splits whose partials the O projection's staging merges
FOLD_MAX_BYTES = 80 * 1024  # ... and the most partial bytes each CTA then reads (batch x heads x splits x (D + 2))


def fold_splits(plan: Plan) -> int:
    """The most active splits a ``fold_merge`` build leaves unmerged for the O projection's staging to merge
    (``bodies.merge_splits_to_smem``): at most ``FOLD_MAX_SPLITS`` and ``FOLD_MAX_BYTES`` of partials per CTA
    (SmolLM-1.7B: all 4 of its splits, 33 KB; OLMo-2-1B: 8 of 8, 65 KB); 0 or 1 means it cannot fold."""
    d = plan.dims
    per_split = plan.batch * d.n_heads * (d.head_dim + 2) * 4
    return min(kv_splits(plan), FOLD_MAX_SPLITS, FOLD_MAX_BYTES // per_split)


# group_fold (session 59): a fused_split build's O blocks merge only their own KV group's partials
# (bodies.split_o_block), so they can take more active splits than the staging merge of every head: up to this many
# (_merge_group_partials holds 6 floats a split per thread). Qwen3-0.6B and Llama-3.2-1B at batch 1 deal 16 splits
# at 1000-4000 positions: with 8 their items merge by the last arrival first, a chain of round trips more.
GROUP_FOLD_MAX_SPLITS = 16


def group_fold_splits(plan: Plan) -> int:
    """The most active splits a ``group_fold`` build leaves unmerged for its O blocks (``GROUP_FOLD_MAX_SPLITS``)."""
    return min(kv_splits(plan), GROUP_FOLD_MAX_SPLITS)


def default_group_fold(plan: Plan, fold_merge: bool, fused_split: bool) -> bool:
    """Whether a default build lets its O blocks merge up to :func:`group_fold_splits` splits of their group: where
    the ``group_fold`` feature is enabled (:func:`megabake.plan.feature_enabled`; GPU-verified in session 60, so the
    default), the build
    folds the merge, runs fused_split and the group's limit is above :func:`fold_splits` (elsewhere the module would
    be the same). H100, session 59, GPU ms per step (gpu_tune, default -> group-fold; rel-L2 1e-6, the fp32 order of
    the merge): Qwen3-0.6B at 4000 0.903 -> 0.874 and at 1000 0.766 -> 0.740, Llama-3.2-1B at 4000 1.027 -> 1.004."""
    return (feature_enabled("group_fold") and fold_merge and fused_split
            and group_fold_splits(plan) > fold_splits(plan))


FOLD_MERGE = True  # the default since session 24 (measured in session 23, docs/PERF.md); False: merge in attention


def default_fold_merge(plan: Plan, spread_merge: bool) -> bool:
    """Whether a default build folds the split-KV merge into the O projection's staging: where ``FOLD_MERGE`` is
    on, attention is split, the spread merge is off and :func:`fold_splits` allows 2+. H200, session 23, GPU ms
    per step unfolded -> folded: SmolLM-1.7B at 2027 1.331 -> 1.311, SmolLM-135M at 2000 0.474 -> 0.451,
    Qwen2.5-0.5B at 4000 0.693 -> 0.669, OLMo-2-1B / Phi-3-mini at 4000 -0.7% / -0.5%, nowhere slower; the full GPU
    suite passed with it as the default in session 24."""
    return FOLD_MERGE and not spread_merge and fold_splits(plan) >= 2


def default_merge(plan: Plan) -> tuple[bool, bool]:
    """(merge_preload, spread_merge) of a default build: the preload wherever it fits (same bits as the plain
    last-arrival merge, one L2 round trip instead of three: SmolLM-135M at 2000 positions 0.503 -> 0.483 ms, H200
    session 17); the spread merge for groups of ``SPREAD_MERGE_MIN_OUTPUTS`` outputs or more (the one-KV-head
    Gemmas), which then runs wherever enough splits are active and the preloaded merge elsewhere."""
    group_outputs = plan.dims.n_heads // plan.dims.n_kv_heads * plan.dims.head_dim
    spread = bool(kv_splits(plan)) and group_outputs >= SPREAD_MERGE_MIN_OUTPUTS and spread_merge_fits(plan)
    return merge_preload_fits(plan), spread


KV_PIPELINE_MIN_HEAD_DIM = 128  # narrower heads measured no gain from the K/V pipeline (default_kv_pipeline)
KV_FENCE = 2  # the module's KV_PIPELINE in a kv_fence build (bodies.KV_FENCE: _online_softmax_chunk's load modes)
MMA_TWO_BUFFERS = 2  # the module's MMA_ATTENTION in an mma_two_buffers build (bodies.MMA_TWO_BUFFERS)
MMA_EARLY_KV = 3  # ... and its MMA_ATTENTION / FUSED_MMA in an early_kv build (bodies.MMA_EARLY_KV)
MMA_EARLY_L1 = 4  # ... in an early_kv="l1" build (bodies.MMA_EARLY_L1)
EARLY_KV_MODES = (False, True, "l1")


SPLIT_CAP_MIN_GROUP_HEADS = 7  # the smallest KV group (query heads) the capped schedule was measured to win on


def split_cap_fits_group(group_heads: int, head_dim: int) -> bool:
    """A KV group of ``group_heads`` query heads of ``head_dim`` the ``split_cap`` feature may deal: one tensor-core
    item holds it (``plan.attention.mma_attention_fits``, as :func:`fused_mma_fits`) and it has at least
    ``SPLIT_CAP_MIN_GROUP_HEADS`` heads. Among the presets only Qwen2.5-0.5B's groups (7 heads of 64) qualify, so
    the feature changes no other preset's module."""
    return group_heads >= SPLIT_CAP_MIN_GROUP_HEADS and mma_attention_fits(group_heads, head_dim)


def _split_cap_applies(plan: Plan) -> bool:
    """The ``split_cap`` feature is enabled (:func:`megabake.plan.feature_enabled`: in ``GPU_VERIFIED_FEATURES`` since
    session 64, so by default), the plan deals more than ``GROUP_FOLD_MAX_SPLITS`` splits a KV group (among the
    presets, at batch 1: Qwen2.5-0.5B 66, SmolLM-135M 44), the group is one the feature may deal
    (:func:`split_cap_fits_group`: one tensor-core item, ``SPLIT_CAP_MIN_GROUP_HEADS`` query heads or more) and the
    cap keeps one split per head slice.
    The group size is where it was measured to win (H100, session 63, GPU ms, default -> the capped schedule):
    Qwen2.5-0.5B's 7-head groups at 16 / 1000 / 4000 0.532 -> 0.535 / 0.597 -> 0.586 / 0.649 -> 0.621, SmolLM-135M's
    3-head groups 0.345 -> 0.347 / 0.401 -> 0.410 / 0.424 -> 0.413 at 16 / 1000 / 2000 (a 2% loss at 1000), so
    SmolLM-135M keeps the default dealing (benchmarks/results/2026-12-07-h100-session63)."""
    group_heads = plan.dims.n_heads // plan.dims.n_kv_heads
    if not (feature_enabled("split_cap") and kv_splits(plan) > GROUP_FOLD_MAX_SPLITS
            and split_cap_fits_group(group_heads, plan.dims.head_dim)):
        return False
    tiling = next(s.tiling for s in plan.stages if s.kind == "attention")
    return GROUP_FOLD_MAX_SPLITS >= max(2, tiling.head_slices)


def default_mma_schedule(plan: Plan, *, mma_attention: bool, fused_o: bool | None, split_cap: int | bool | None,
                         spread_merge: bool, barrier: str, fold_blocked: bool = False) -> bool:
    """Whether ``generate(plan, mma_schedule=None)`` deals split-KV attention for the tensor cores (whole KV
    groups over shorter chunks) with ``fused_o`` kept on: where :func:`_split_cap_applies`, the tensor cores are
    on, the build can fuse (:func:`megabake.codegen.fused.fused_o_refusal`), neither ``fused_o`` nor ``split_cap``
    is turned off and nothing the cap's group_fold needs is (``fold_blocked``: the caller turned off fold_merge,
    fused_split or group_fold, or asked for fused_kv_smem); :func:`default_split_cap` then caps that dealing at
    ``GROUP_FOLD_MAX_SPLITS``.
    That pair is what the ``split_cap`` feature builds because it is the pair that won: H100, session 62, GPU ms,
    Qwen2.5-0.5B b1 c4096, default -> fused-mma-schedule-cap16 (the cap alone; the schedule alone) at 16 0.541 ->
    0.544 (-; 0.538), 1000 0.600 -> 0.587 (0.643; 0.585), 4000 0.654 -> 0.627 (0.631; 0.690)
    (benchmarks/results/2026-12-07-h100-session62). False elsewhere: the schedule alone stays out of the default
    (:func:`default_fused_o`)."""
    return (mma_attention and fused_o is not False and split_cap is not False and not fold_blocked
            and _split_cap_applies(plan)
            and fused_o_refusal(plan, spread_merge=spread_merge, split_barrier=barrier == "split") is None)


def default_split_cap(plan: Plan, group_fold: bool, mma_schedule: bool) -> int | None:
    """The ``split_cap`` a default build deals with: ``GROUP_FOLD_MAX_SPLITS`` where :func:`_split_cap_applies`
    and the build runs ``group_fold`` on the tensor-core schedule (``mma_schedule``, :func:`default_mma_schedule`),
    so the O blocks merge every split of a long context themselves (no item merges by the last arrival); None
    elsewhere (no cap). The cap without the schedule is not a default: it lost 7% at 1000 positions on
    Qwen2.5-0.5B b1 (H100, session 62: 0.600 -> 0.643 ms)."""
    return GROUP_FOLD_MAX_SPLITS if group_fold and mma_schedule and _split_cap_applies(plan) else None


def _dealt_splits(plan: Plan, split_cap: int | bool | None) -> int:
    """The splits a ``split_cap`` build deals per KV group (``plan.attention.capped_splits``); 0 without a cap
    (None or False: generate resolves None to :func:`default_split_cap` first)."""
    if split_cap is None or split_cap is False:
        return 0
    if not kv_splits(plan):
        raise ValueError("split_cap deals split-KV attention over fewer splits, but this plan's attention is not "
                         "split: build without it")
    tiling = next(s.tiling for s in plan.stages if s.kind == "attention")
    least = max(2, tiling.head_slices)
    if isinstance(split_cap, bool) or not isinstance(split_cap, int) or split_cap < least:
        raise ValueError(f"split_cap={split_cap!r}: the dealing needs 2 splits at least and one per head slice "
                         f"({tiling.head_slices} in this plan); pass an int of {least} or more")
    return capped_splits(plan, split_cap)


def default_kv_pipeline(plan: Plan) -> bool:
    """Whether a default build loads each split-KV loop iteration's K/V rows one iteration ahead (same bits): for
    one query head per KV head (no head slices) with heads of ``KV_PIPELINE_MIN_HEAD_DIM`` or more (a lane group
    of 16+ lanes per cached row: a warp holds at most 2 rows per pass and the loop is latency-bound). H200,
    session 21, GPU ms per step: OLMo-2-1B (16/16 heads x 128) at 4000 1.194 -> 1.075 (attention 306 -> 210 us
    on CTA 0). Off where it did not pay: Phi-3-mini (32/32 x 96) at 4000 2.577 vs 2.586, SmolLM-1.7B (32/32 x 64)
    at 2000 1.328 vs 1.342, SmolLM-135M at 2000 0.471 vs 0.480, Qwen2.5-0.5B at 4000 0.705 vs 0.722."""
    one_query_head = plan.dims.n_heads == plan.dims.n_kv_heads
    return bool(kv_splits(plan)) and one_query_head and plan.dims.head_dim >= KV_PIPELINE_MIN_HEAD_DIM


def default_kv_fence(plan: Plan, kv_pipeline: bool) -> bool:
    """Whether a default build issues each split-KV lane-group iteration's K/V rows together behind a warp fence
    (``kv_fence``, the same bits): where the ``kv_fence`` feature is enabled (:func:`megabake.plan.feature_enabled`;
    in ``GPU_VERIFIED_FEATURES`` since session 58), attention is split and the K/V pipeline does not load those rows
    one iteration ahead instead. H100, session 58, GPU ms per step (gpu_tune, plain loop -> fence): Qwen2.5-0.5B at
    4000 0.637 -> 0.621, SmolLM-135M at 2000 0.419 -> 0.412, Phi-3-mini at 4000 3.113 -> 3.065 (its attention
    interval on CTA 0 439 -> 391 us)."""
    return feature_enabled("kv_fence") and bool(kv_splits(plan)) and not kv_pipeline


def default_mma_attention(plan: Plan, head_slices: bool = True) -> bool:
    """Whether a default build scores and sums split-KV items of 2-8 query heads of 64 or 128 dims on the tensor
    cores (``bodies._mma_softmax_chunk``): wherever the plan deals such items (``plan.attention.mma_attention_items``).
    H200, session 33, GPU ms per step against the lane-group loop (``mma_attention=False``): batch 8 Qwen2.5-0.5B at
    4000 1.144 -> 0.978, SmolLM-135M at 2027 0.766 -> 0.687, Llama-3.2-1B at 4000 1.592 -> 1.389; batch 1 (1-head
    slices at long contexts, so mostly the same bits) Qwen2.5-0.5B at 16 0.522 -> 0.511 and at 4000 0.627 -> 0.608,
    Qwen3-0.6B at 4000 0.852 -> 0.836 (benchmarks/results/2026-12-04-h200-session33)."""
    return bool(mma_attention_items(plan, head_slices))


# Session 35 measured the fused build faster on four presets (default_fused_o); session 36 ran the GPU suite with
# it as the default. False goes back to the split build of sessions 1-35 for every plan.
FUSED_O_DEFAULT = True


def fused_mma_fits(plan: Plan) -> bool:
    """A fused step's whole KV group fits the tensor-core item (2-8 query heads of 64 or 128 dims)."""
    return mma_attention_fits(plan.dims.n_heads // plan.dims.n_kv_heads, plan.dims.head_dim)


def default_fused_o(plan: Plan, *, spread_merge: bool = False, barrier: str = DEFAULT_BARRIER,
                    mma_schedule: bool = False, mma_attention: bool = True) -> bool:
    """Whether ``generate(plan, fused_o=None)`` fuses short-context steps' attention and O projection: where
    ``FUSED_O_DEFAULT`` is on, the build can (:func:`megabake.codegen.fused.fused_o_refusal` finds nothing, no
    ``mma_schedule``) and the fused groups run on the tensor cores (``mma_attention`` on and
    :func:`fused_mma_fits`), the build the H200 measured faster. Session 35, GPU ms per step at position 16
    (graph replay; default -> fused on the tensor cores, and the fp32 lane-group loop's fused build): SmolLM-135M
    0.365 -> 0.335 (lane 0.360), Llama-3.2-1B 0.764 -> 0.737 (0.754), Qwen3-0.6B 0.625 -> 0.607 (0.613),
    Qwen2.5-0.5B 0.509 -> 0.499 (0.551: a 7-head group on the lane loop is slower than seven 1-head items); Qwen3
    at 1000, where steps are split, 0.728 -> 0.725 (benchmarks/results/2026-12-05-h200-session35). An explicit
    ``fused_o=True, mma_schedule=True`` builds (GPU tests pass, session 46) but is slower where it differs, so
    mma_schedule stays out of the default: H100, GPU ms, default -> fused with mma_schedule, SmolLM-135M @2000
    0.423 -> 0.451, Qwen2.5-0.5B @4000 0.673 -> 0.681, the same at 16
    (benchmarks/results/2026-12-06-h100-session46)."""
    return (FUSED_O_DEFAULT and not mma_schedule and mma_attention and fused_mma_fits(plan)
            and fused_o_refusal(plan, spread_merge=spread_merge, split_barrier=barrier == "split") is None)


def default_mma_wide(plan: Plan, head_slices: bool = True, mma_attention: bool | None = None) -> bool:
    """Whether ``generate(plan, mma_wide=None)`` puts split-KV items of heads of 256 dims on the tensor cores: where
    the plan deals such items, ``mma_attention`` is not turned off, and the ``mma_wide`` kernel feature is enabled
    (``plan.feature_enabled``: in ``GPU_VERIFIED_FEATURES`` since its GPU tests and the whole GPU suite with it on
    passed, session 42 on an H100). Session 42, H100, graph-replayed GPU ms of gemma-2b at position 4000: batch 8
    3.113 -> 2.623 (attention on CTA 0 765 -> 402 us), batch 1 2.059 -> 1.977
    (benchmarks/results/2026-12-05-h100-session42)."""
    return mma_attention is not False and _deals_wide_items(plan, head_slices) and feature_enabled("mma_wide")


def _deals_wide_items(plan: Plan, head_slices: bool) -> bool:
    """The plan deals split-KV items of heads of 256 dims that an ``mma_wide`` build puts on the tensor cores."""
    return plan.dims.head_dim in MMA_ATT_WIDE_HEAD_DIMS and bool(mma_attention_items(plan, head_slices, wide=True))


def _check_mma_wide(plan: Plan, head_slices: bool, mma_attention: bool | None) -> None:
    """``generate(plan, mma_wide=True)``'s refusals: it needs heads of 256 dims in items the tensor cores take."""
    group = plan.dims.n_heads // plan.dims.n_kv_heads
    if not _deals_wide_items(plan, head_slices):
        raise ValueError(f"mma_wide puts split-KV items of 2-8 query heads of {MMA_ATT_WIDE_HEAD_DIMS[0]} dims on "
                         f"the tensor cores, but this plan deals none ({group} heads of {plan.dims.head_dim} dims per "
                         f"KV group{'' if kv_splits(plan) else ', no split-KV attention'}): build without it")
    if mma_attention is False:
        raise ValueError("mma_wide widens mma_attention's tensor-core items: it needs mma_attention on (or None)")


def generate(plan: Plan, *, plan_hash: str | None = None, timeline: bool | str = False,
             self_contained: bool = True, watchdog: bool = False, barrier: str | None = None,
             kv_prefetch: bool = True, kv_prefetch_l1: bool = False, kv_prefetch_rows: int | None = None,
             merge_preload: bool | None = None,
             spread_merge: bool | None = None, head_slices: bool = True,
             long_slices: bool = LONG_SLICES, pass_chunks: bool = PASS_CHUNKS,
             kv_pipeline: bool | None = None, kv_fence: bool | None = None, fold_merge: bool | None = None,
             group_fold: bool | None = None,
             prefetch_bytes: int | None = None, mma_attention: bool | None = None,
             mma_schedule: bool | None = None, mma_two_buffers: bool = False, early_kv: bool | str = False,
             split_cap: int | bool | None = None, fused_o: bool | None = None,
             fused_kv_smem: bool = False,
             fused_mma: bool | None = None, mma_wide: bool | None = None,
             fused_mlp: bool | None = None, fused_split: bool | None = None, spare_loads: bool | None = None,
             spare_ring: bool | None = None, bulk_down: bool | None = None,
             early_down: str | None = None, loader_warp: bool | None = None,
             loader_inflight: int | None = None, loader_warpgroup: bool = True,
             loader_qkv_inflight: int | None = None, loader_qkv_ring: bool = True,
             loader_gates: tuple[str, ...] | None = None, loader_drain: bool | None = None) -> GeneratedModule:
    """module.py of ``plan``. ``merge_preload`` / ``spread_merge``: None picks them per plan
    (:func:`default_merge`); True asks for one (refused where the attention scratch cannot hold it), False
    leaves it out (both False: the plain last-arrival merge of sessions 10-16). ``head_slices=False`` deals
    split-KV attention one item per (split, batch, KV head) at every context (``plan.attention``);
    ``long_slices=False`` slices only short contexts, as in session 18; ``pass_chunks`` rounds split-KV chunks to
    whole CTA passes (``plan.chunk_quantum``, a candidate; session 42's ``split_quantum``, chunks of 128 / 256
    positions for gemma-2b, lost on an H100 in session 43 and was removed); ``kv_pipeline`` loads each split-KV loop
    iteration's K/V rows one iteration ahead (``bodies._online_softmax_chunk``, the same bits; None picks it per
    plan: :func:`default_kv_pipeline`); ``kv_fence`` (session 57; not with ``kv_pipeline``) issues each iteration's
    K and V rows together behind a scheduling fence instead (one memory round trip per iteration, not two; the same
    bits; None picks it per plan: :func:`default_kv_fence`);
    ``fold_merge`` leaves steps with 2..:func:`fold_splits` active splits
    unmerged and merges their partials in the O projection's staging (no arrival counter, no last-arrival chain;
    None picks it per plan: :func:`default_fold_merge`); ``group_fold`` (session 59; it needs fold_merge and
    fused_split) lets a fused_split build's O blocks merge up to :func:`group_fold_splits` active splits of their
    group (not :func:`fold_splits`), so its items merge only above that (None: :func:`default_group_fold`, on where
    it changes the module, since session 60); ``prefetch_bytes`` is the L2 prefetch of the next GEMV's
    first tiles issued before each grid barrier, in bytes over the whole grid, for every stage (0: none; at least
    one tile per warp otherwise: :func:`_prefetch_call`; None picks it per stage: :func:`default_prefetch_bytes`);
    ``barrier`` is how CTAs meet at grid barriers (``BARRIER_ARRIVALS``; None: ``DEFAULT_BARRIER``, or a watchdog's);
    ``kv_prefetch_rows`` caps the K/V prefetch at that many cached rows per CTA (None:
    :func:`default_kv_prefetch_rows`, one chunk). ``mma_attention`` (session 32; None: :func:`default_mma_attention`,
    on wherever it applies) scores and sums the split-KV items of 2-8 query heads of 64 or 128 dims on the tensor
    cores (``bodies._mma_softmax_chunk``: the query and the probabilities rounded to bf16, so close to the
    lane-group loop's logits, not equal; False: the lane-group loop for every item); True is refused where no
    item the plan can deal has such a shape (``plan.attention.mma_attention_items``); ``mma_schedule`` (with it)
    lets every split-KV dealing weigh those items by their chunk alone (their heads come nearly free on the
    tensor cores), so long contexts deal whole groups over more, shorter splits (``plan.attention.split_schedule``'s
    ``mma_slices``); ``mma_two_buffers`` (with it, a candidate, session 58; heads of 64 or 128 dims) keeps a warp's
    two K/V sets in two buffers that take its steps in turn, so its first two steps' loads are in flight together
    (the same bits); ``early_kv`` (with it, a candidate, session 59) issues a warp's first 16-key step of K/V before
    its item's query is roped (where those rows are all below this step's position, which the roping appends), so the
    query's round trip and the first K/V round trip overlap; in split-KV items and in fused steps (``FUSED_MMA``);
    the same bits; ``early_kv="l1"`` prefetches those rows' lines into L1 there instead, which holds no registers
    (the loader builds' 168 spill with the first set held across the roping); H100, session 60, GPU ms, default /
    early_kv / "l1": Llama-3.2-1B at 4000 1.017 / 1.045 / 1.023, at 16 0.940 / 0.944 / 0.942, so both stay off.
    ``split_cap`` (session 60; Qwen2.5-0.5B b1's default since session 64) deals split-KV attention over at most
    that many splits per KV group (the module's ``KV_SPLITS``; the items and buffers keep the plan's layout,
    ``plan.attention.capped_splits``): fewer, longer chunks, so with ``group_fold`` the O blocks merge every split
    themselves where the plan has more than 16 (Qwen2.5-0.5B b1: 66); refused below the plan's head slices or 2;
    the runtime's reference executor deals alike;
    None: :func:`default_split_cap` (16 where the ``split_cap`` feature is enabled and it changes the dealing of a
    ``mma_schedule`` build, else no cap), False: no cap. ``mma_schedule=None``: :func:`default_mma_schedule` (on
    where the ``split_cap`` feature applies: Qwen2.5-0.5B b1 among the presets; there ``fused_o=None`` means on).
    ``fused_o`` (session 34, measured
    faster in session 35): a step whose context fits the first split-KV chunk runs its attention and the O
    projection in one barrier interval (``bodies.fused_attention_o``; one grid barrier less per layer), other steps
    as before; refused where
    :func:`megabake.codegen.fused.fused_o_refusal` names a reason (None: :func:`default_fused_o`, on where it
    applies with its groups on the tensor cores: the default since session 36).
    ``fused_kv_smem`` (with it) also copies each fused step's cached K/V rows into shared memory before the barrier
    (:func:`megabake.codegen.fused.fused_kv_refusal`). ``fused_mma`` (with ``fused_o`` and ``mma_attention``) scores
    a fused step's whole KV group on the tensor cores (the query and probabilities rounded to bf16, as every
    tensor-core item; refused where the group is not 2-8 heads of 64 or 128 dims); False on the fp32 lane-group
    loop (logits within fp32 order of the default's split path); None: on wherever it fits. ``mma_wide`` (session
    41; GPU-verified in session 42) also puts split-KV items of 2-8 query heads of 256 dims (Gemma) on the tensor
    cores (``bodies._mma_softmax_chunk`` loading each step's K/V at the step; ``mma_attention`` then defaults to
    on); refused where the plan deals no such item; None: :func:`default_mma_wide` (on wherever the plan deals
    such items); False: the lane-group loop. Fused steps keep their groups of 256 on the lane-group loop.
    ``fused_mlp`` (session 43; the default since session 45 where its W_down copies are 64 bits or wider, the whole
    GPU suite having passed with it on, on the H200; H200 GPU ms with fused_split: SmolLM-135M 0.334 -> 0.327 at
    16, 0.410 -> 0.404 at 2000, Qwen3-0.6B 0.618 -> 0.610 at 16; H100 at 16 in session 43: +7.2% Qwen2.5-0.5B,
    whose copies are 32 bits): every layer's gate/up and down projections in one
    barrier interval (one grid barrier less per layer at every context): each CTA takes a block of the
    intermediate width, its down-projection partials meet in an int64 fixed-point accumulator (deterministic,
    not the default's fp32 order: close to it, not equal; :mod:`megabake.codegen.fused_mlp`); it needs
    ``fused_o``; refused where :func:`megabake.codegen.fused_mlp.fused_mlp_refusal` names a reason; None:
    :func:`megabake.codegen.fused_mlp.default_fused_mlp` (where the ``fused_mlp`` feature is enabled, the build can,
    and a CTA's W_down columns copy at least 64 bits wide; in ``GPU_VERIFIED_FEATURES``).
    ``fused_split`` (session 44; the default since session 45, where the whole GPU suite passed with it on, on an
    H100; H100 GPU ms: SmolLM-135M -4% at 1000 and 2000, Qwen2.5-0.5B / Qwen3-0.6B -1% at 4000, same at 16):
    with ``fused_o``, the steps of several splits run
    their O projection in attention's interval too (``bodies.split_o_block``: each CTA waits for its KV group's
    split-KV items on a per-group counter, merges that group's partials and multiplies its W_O block into
    ``o_part``), so every step has one grid barrier less per layer; refused where
    :func:`megabake.codegen.fused.fused_split_refusal` names a reason; None: on where fused_o is, fused_kv_smem is
    off and the ``fused_split`` feature is enabled (in ``GPU_VERIFIED_FEATURES``).
    ``spare_loads`` / ``spare_ring`` (session 48; None: on where they apply, since session 49, when the whole GPU
    suite passed with them on, on an H100: the ``spare_warp`` feature is in ``GPU_VERIFIED_FEATURES``;
    bit-identical logits, H100 GPU ms -1% to -3%: docs/PERF.md "Session 48") keep warp 0, whose thread 0 polls the
    grid barrier, free of copies in flight while it polls (``scripts/gpu_copy_probe.py``: a barrier releases
    0.5-1.0 us sooner when the polling warp issued none): ``spare_loads`` leaves a fused build's CTA-wide
    pre-barrier copies (``bodies.fused_o_load``, ``bodies.mlp_down_load``) to threads 32.. (it needs ``fused_o``);
    ``spare_ring`` moves warp 0's own ring prefills from ahead of each wait to right after it (the other warps'
    stay ahead: :func:`_spare_ring_calls`). ``bulk_down`` (session 48; it needs ``fused_mlp``; None: on where
    fused_mlp is, since session 49, as ``spare_warp``) copies each CTA's W_down
    columns from a packed copy of W_down (``w_down_cta``, each CTA's columns contiguous, which the runtime derives
    from ``w_down``: ``DERIVED_BUFFERS``) by a few ``cp.async.bulk``
    of warp 0 completing on an mbarrier (``bodies.mlp_down_bulk``), instead of ``bodies.mlp_down_load``'s cp.async
    of every row's slice: the same bytes in shared memory, so the same logits bit for bit. ``early_down`` (session
    49 candidate, off by default; it needs ``bulk_down``; one of ``EARLY_DOWN_MODES``) issues those bulk copies at
    the barrier before attention instead of the one before the MLP (``s_down`` is free once the layer before has
    run its down projection), right after its arrival (``"arrival"``) or its wait (``"wait"``), so they land while
    attention, which leaves DRAM mostly idle at short contexts, runs: the same bytes, the same bits (H100 GPU ms
    within about 1% on SmolLM-135M and Qwen3-0.6B: docs/PERF.md "Session 49"). ``loader_warp`` (session 51;
    None: :func:`megabake.codegen.loader.default_loader_warp`, on where the ``loader_warp`` feature is enabled, not
    yet GPU-verified, and a layer streams at least 16 MB; it then turns fused_mlp and bulk_down on where they are not
    given; :mod:`megabake.codegen.loader`) adds a ninth warp per CTA that streams the weights of
    the QKV, gate/up and LM head GEMVs through a ring of 16 KB slots, and the W_O block and W_down columns into
    buffers of their own, in consumption order and across grid barriers, with at most ``loader_inflight`` units of
    the layers' streams in flight (None: ``DEFAULT_INFLIGHT``, 1) (``bodies/loader.py``); the consumer warps meet at
    named barrier 1; with
    ``loader_warpgroup`` (on by default) the loader warp has a warpgroup of its own (384 threads, 3 warps of it idle),
    which lowers its registers with setmaxnreg so the consumers can raise theirs to 232 (288 threads leave 168);
    ``loader_qkv_inflight`` bounds the QKV stream's units in flight apart (None: ``loader_inflight``);
    ``loader_qkv_ring`` (on by default) gives the QKV rows a ring of their own, which the loader fills with the next
    layer's rows right after this layer's O block, during attention (False: one ring for all, as first measured).
    ``loader_gates`` (session 52, with the QKV ring; a subset of :data:`megabake.codegen.loader.LOADER_GATES`) makes
    the loader wait for the consumers' grid arrival after the QKV GEMV ("qkv"), a split step's attention
    ("attention", or "items": only until the CTA's split-KV items are done, a candidate) and / or the MLP ("mlp")
    before it issues the copies that follow in its order, so fewer are in
    flight when a barrier's release runs (None: :func:`megabake.codegen.loader.default_loader_gates`, ("qkv",) plus
    "attention" where a layer's K/V cache at capacity is a quarter of its weights, or () without the QKV ring);
    ``loader_drain`` makes it wait for the W_O block and the W_down columns to land before it goes on (None:
    ``DEFAULT_DRAIN``, on). It
    needs the fused default (fused_o, fused_split, fused_mlp, bulk_down) and a self-contained module; the same bits
    as that build; refused where :func:`megabake.codegen.loader.loader_refusal` names a reason."""
    if watchdog and timeline:
        raise ValueError("a watchdog build has no timeline: build them separately")
    if barrier is not None and barrier not in BARRIER_ARRIVALS:
        raise ValueError(f"barrier={barrier!r}: use one of {sorted(BARRIER_ARRIVALS)}")
    if watchdog and barrier is not None:
        raise ValueError(f"a watchdog build has its own barrier (bodies.grid_barrier_watched): leave out "
                         f"barrier={barrier!r}")
    barrier = "atom" if watchdog else barrier or DEFAULT_BARRIER
    if kv_prefetch_l1 and not kv_prefetch:
        raise ValueError("kv_prefetch_l1 picks where the K/V prefetch lands: it needs kv_prefetch=True")
    if kv_prefetch_rows is not None and (isinstance(kv_prefetch_rows, bool) or not isinstance(kv_prefetch_rows, int)
                                         or kv_prefetch_rows < 1):
        raise ValueError(f"kv_prefetch_rows={kv_prefetch_rows!r}: give the K/V prefetch's cap in cached rows per "
                         "work item, an int >= 1 (kv_prefetch=False leaves the prefetch out)")
    kv_prefetch_rows = default_kv_prefetch_rows(plan) if kv_prefetch_rows is None else kv_prefetch_rows
    if prefetch_bytes is not None and (isinstance(prefetch_bytes, bool) or not isinstance(prefetch_bytes, int)
                                       or prefetch_bytes < 0):
        raise ValueError(f"prefetch_bytes={prefetch_bytes!r}: give the L2 prefetch budget per barrier in bytes, an "
                         "int >= 0 (0: no L2 prefetch of the next GEMV's tiles)")
    if merge_preload and not merge_preload_fits(plan):
        raise ValueError(f"merge_preload keeps 2 x {kv_splits(plan)} splits' max and sum per head in the attention "
                         f"scratch, which holds {(plan.dims.head_dim + 2) * plan.warps}: build without it")
    if spread_merge and not spread_merge_fits(plan):
        scratch = (plan.dims.head_dim + 2) * (plan.dims.n_heads // plan.dims.n_kv_heads) * plan.warps
        raise ValueError(f"spread_merge meets in 3 x {plan.threads} floats of the attention scratch, which holds "
                         f"{scratch} for this model: build without it")
    preload_default, spread_default = default_merge(plan)
    merge_preload = preload_default if merge_preload is None else merge_preload
    spread_merge = spread_default if spread_merge is None else spread_merge
    fold_merge = default_fold_merge(plan, spread_merge) if fold_merge is None else fold_merge
    folded = fold_splits(plan) if fold_merge else 0
    if fold_merge and (folded < 2 or spread_merge):
        why = ("the spread merge is on (spread_merge=False turns it off)" if spread_merge else
               f"at most {folded} split(s) of partials fit {FOLD_MAX_BYTES} bytes per CTA" if kv_splits(plan) else
               "attention is not split")
        raise ValueError(f"fold_merge needs 2+ splits to fold and no spread merge, but {why}: build without it")
    if kv_fence and kv_pipeline:
        raise ValueError("kv_fence issues each split-KV iteration's K/V rows together; kv_pipeline loads them one "
                         "iteration ahead instead: build with one of them")
    kv_pipeline = default_kv_pipeline(plan) if kv_pipeline is None else kv_pipeline
    kv_fence = default_kv_fence(plan, kv_pipeline) if kv_fence is None else kv_fence
    kv_pipeline = KV_FENCE if kv_fence else kv_pipeline  # the module's KV_PIPELINE: a load mode (False / True / 2)
    mma_wide = default_mma_wide(plan, head_slices, mma_attention) if mma_wide is None else mma_wide
    if mma_wide:
        _check_mma_wide(plan, head_slices, mma_attention)
    if mma_attention is None:
        mma_attention = True if mma_wide else default_mma_attention(plan, head_slices)
    if mma_attention and not mma_attention_items(plan, head_slices, wide=mma_wide):
        group = plan.dims.n_heads // plan.dims.n_kv_heads
        why = f"groups of {group} x {plan.dims.head_dim}" if kv_splits(plan) else "no split-KV attention"
        raise ValueError("mma_attention puts split-KV items of 2-8 query heads of 64 or 128 dims on the tensor "
                         f"cores, but this plan deals none ({why}): build without it")
    if mma_two_buffers and not mma_attention:
        raise ValueError("mma_two_buffers loads the tensor-core items' K/V into two buffers: it needs "
                         "mma_attention on")
    if early_kv not in EARLY_KV_MODES:
        raise ValueError(f"early_kv={early_kv!r}: use one of {EARLY_KV_MODES}")
    if early_kv and not mma_attention:
        raise ValueError("early_kv issues the tensor-core items' first K/V loads early: it needs mma_attention on")
    if early_kv and mma_two_buffers:
        raise ValueError("early_kv and mma_two_buffers are two K/V load modes of the tensor-core items: build with "
                         "one of them")
    if mma_two_buffers and plan.dims.head_dim not in (64, 128):
        raise ValueError(f"mma_two_buffers is for heads of 64 or 128 dims (heads of {plan.dims.head_dim} load each "
                         "step's K/V at the step): build without it")
    scheduled = mma_schedule is None and default_mma_schedule(
        plan, mma_attention=bool(mma_attention), fused_o=fused_o, split_cap=split_cap, spread_merge=spread_merge,
        barrier=barrier, fold_blocked=not fold_merge or fused_split is False or group_fold is False or fused_kv_smem,
    )  # the split_cap feature's pair: the tensor-core schedule with fused_o kept on, capped below
    mma_schedule = scheduled if mma_schedule is None else mma_schedule
    if mma_schedule and not mma_attention:
        raise ValueError("mma_schedule deals split-KV items for the tensor cores: it needs mma_attention=True")
    mma_slices = mma_slice_mask(plan, head_slices, wide=mma_wide) if mma_schedule else 0
    if fused_o is None:
        fused_o = scheduled or default_fused_o(plan, spread_merge=spread_merge, barrier=barrier,
                                               mma_schedule=mma_schedule, mma_attention=mma_attention)
    if fused_o:
        why = fused_o_refusal(plan, spread_merge=spread_merge, split_barrier=barrier == "split")
        if why:
            raise ValueError(f"fused_o runs attention and the O projection in one interval, but {why}: build "
                             "without it")
    if fused_mma is None:
        fused_mma = bool(fused_o and mma_attention and fused_mma_fits(plan))
    if fused_mma:
        group = plan.dims.n_heads // plan.dims.n_kv_heads
        why = ("it needs fused_o=True" if not fused_o else "it needs mma_attention=True" if not mma_attention else
               None if fused_mma_fits(plan) else
               f"a KV group of {group} x {plan.dims.head_dim} is not 2-8 heads of 64 or 128 dims")
        if why:
            raise ValueError(f"fused_mma scores a fused step's whole KV group on the tensor cores, but {why}: build "
                             "without it")
    if fused_kv_smem:
        why = "it needs fused_o=True" if not fused_o else fused_kv_refusal(plan)
        if why:
            raise ValueError(f"fused_kv_smem copies a fused step's cached K/V rows into shared memory, but {why}: "
                             "build without it")
    if loader_warp is None:
        loader_warp = _default_loader(plan, fused_o=bool(fused_o), fused_mlp=fused_mlp, bulk_down=bulk_down,
                                      fused_split=fused_split, fused_kv_smem=fused_kv_smem, early_down=early_down,
                                      spare=bool(spare_loads or spare_ring), barrier=barrier,
                                      self_contained=self_contained, watchdog=watchdog, warpgroup=loader_warpgroup)
    if loader_warp and fused_o and fused_mlp is not False:  # it streams the fused MLP, W_down by bulk copies
        fused_mlp = True
        bulk_down = True if bulk_down is None else bulk_down
    if fused_mlp is None:
        fused_mlp = default_fused_mlp(plan, fused_o=bool(fused_o))
    if fused_mlp:
        why = fused_mlp_refusal(plan, fused_o=fused_o)
        if why:
            raise ValueError(f"fused_mlp runs the gate/up and down projections in one interval, but {why}: build "
                             "without it")
    if loader_warp and (spare_loads or spare_ring):
        raise ValueError("spare_loads / spare_ring move the consumers' copies, and a loader_warp build has none: "
                         "build without them")
    if spare_loads is None:
        spare_loads = bool(fused_o) and feature_enabled("spare_warp") and not loader_warp
    if spare_ring is None:
        spare_ring = feature_enabled("spare_warp") and not loader_warp
    if bulk_down is None:
        bulk_down = bool(fused_mlp) and feature_enabled("bulk_down")
    if spare_loads and not fused_o:
        raise ValueError("spare_loads keeps warp 0 out of a fused build's W_O / W_down copies, but this build is not "
                         "fused_o: build without it")
    if bulk_down and not fused_mlp:
        raise ValueError("bulk_down copies a fused_mlp build's W_down columns by cp.async.bulk, but this build is not "
                         "fused_mlp: build without it")
    if early_down not in EARLY_DOWN_MODES:
        raise ValueError(f"early_down={early_down!r}: use one of {EARLY_DOWN_MODES}")
    if early_down and not bulk_down:
        raise ValueError("early_down issues a bulk_down build's W_down copies at attention's barrier, but this build "
                         "is not bulk_down: build without it")
    if fused_split is None:
        fused_split = bool(fused_o) and not fused_kv_smem and feature_enabled("fused_split")
    if fused_split:
        why = fused_split_refusal(plan, fused_o=fused_o, fused_kv_smem=fused_kv_smem)
        if why:
            raise ValueError(f"fused_split runs every step's O projection in attention's interval, but {why}: build "
                             "without it")
    if group_fold is None:
        group_fold = default_group_fold(plan, fold_merge, bool(fused_split))
    if group_fold:
        if not (fold_merge and fused_split):
            raise ValueError("group_fold lets a fused_split build's O blocks merge more splits of their KV group: it "
                             "needs fold_merge and fused_split on")
        folded = group_fold_splits(plan)
    dealt_splits = _dealt_splits(plan, default_split_cap(plan, group_fold, bool(mma_schedule)) if split_cap is None
                                 else split_cap)
    if loader_warp:  # the measured pacing (codegen.loader.default_loader_gates ...) where it is not given
        loader_gates = (default_loader_gates(plan) if loader_qkv_ring else ()) if loader_gates is None else loader_gates
        loader_inflight = DEFAULT_INFLIGHT if loader_inflight is None else loader_inflight
        loader_drain = DEFAULT_DRAIN if loader_drain is None else loader_drain
    loader = _checked_loader(plan, bool(loader_warp), loader_inflight, loader_qkv_inflight, loader_qkv_ring,
                             loader_warpgroup, self_contained, watchdog, loader_gates or (), bool(loader_drain),
                             fused_o=bool(fused_o), fused_split=bool(fused_split), fused_mlp=bool(fused_mlp),
                             bulk_down=bool(bulk_down), fused_kv_smem=fused_kv_smem, early_down=early_down,
                             barrier=barrier)
    arguments = (kernel_arguments(plan) + (list(FUSED_O_BUFFERS) if fused_o else [])
                 + (list(FUSED_MLP_BUFFERS) if fused_mlp else []) + (list(FUSED_SPLIT_BUFFERS) if fused_split else [])
                 + (list(BULK_DOWN_BUFFERS) if bulk_down else []))
    plan_hash = plan_hash or plan.hash
    w = _Writer(keyword_calls=True)
    _header(w, plan, plan_hash, arguments, self_contained, head_slices, long_slices, pass_chunks,
            kv_pipeline, folded, MMA_TWO_BUFFERS if mma_two_buffers else _early_mode(early_kv) or mma_attention,
            mma_slices, fused_o, fused_kv_smem, _early_mode(early_kv) if early_kv and fused_mma else fused_mma,
            mma_wide, fused_mlp, fused_split, spare_loads, bulk_down, loader, dealt_splits)
    prologue = [s for s in plan.stages if s.scope == "prologue"]
    per_layer = [s for s in plan.stages if s.scope == "layer"]
    epilogue = [s for s in plan.stages if s.scope == "epilogue"]
    phases = timeline in (TIMELINE_PHASES, TIMELINE_PER_CTA)
    every_cta = timeline == TIMELINE_PER_CTA
    if timeline not in (False, True, TIMELINE_PHASES, TIMELINE_PER_CTA):
        raise ValueError(f"timeline={timeline!r}: use False, True (a clock per stage), {TIMELINE_PHASES!r} or "
                         f"{TIMELINE_PER_CTA!r}")
    options = BuildOptions(barrier=("bodies.grid_barrier_watched(barrier, tidx, CTAS, cta, WATCH_POLLS)" if watchdog
                                    else BARRIER_ARRIVALS[barrier]), kv_prefetch=kv_prefetch,
                           kv_prefetch_l1=kv_prefetch_l1, kv_prefetch_rows=kv_prefetch_rows,
                           merge_preload=merge_preload, spread_merge=spread_merge,
                           fold_splits=folded, prefetch_bytes=prefetch_bytes, clock_every_cta=every_cta,
                           arrival=SPLIT_ARRIVAL if barrier == "split" else None, mma_attention=mma_attention,
                           mma_schedule=mma_schedule, fused_o=fused_o, fused_kv_smem=fused_kv_smem,
                           mma_wide=mma_wide, fused_mlp=fused_mlp, fused_split=fused_split, spare_ring=spare_ring,
                           bulk_down=bulk_down, early_down=early_down, loader=loader)
    labels = timeline_labels(plan, phases, options) if timeline else []
    if every_cta:
        w(f"TIMELINE_STRIDE = {1 + len(labels)}  "
          "# barrier[cta * TIMELINE_STRIDE + 1 + k]: CTA cta's k=0 kernel start, k>0 end of interval k (ns)")
        w("TIMELINE_SLOTS = TIMELINE_STRIDE * CTAS")
        w("TIMELINE_PER_CTA = True  # each CTA clocks a phase once all its warps are done (codegen.TIMELINE_PER_CTA)")
    elif timeline:
        w(f"TIMELINE_SLOTS = {1 + len(labels)}  "
          "# barrier[1 + k]: k=0 kernel start, k>0 end of interval k (ns)")
    if phases:
        w("TIMELINE_PHASES = True  # intervals are the phases of each stage (codegen.stage_phases)")
    if timeline:
        w("# the interval names, in slot order (codegen.timeline_labels of this build)")
        w("TIMELINE_LABELS = (")
        for line in _packed([repr(label) for label in labels], indent=1):
            w(line)
        w(")")
    if watchdog:
        w("WATCH_SLOTS = 2 * CTAS  # barrier[1 + 2 * cta]: arrivals, barrier[2 + 2 * cta]: first barrier given up at")
        w(f"WATCH_POLLS = {WATCHDOG_POLLS}  # polls before a CTA stops waiting at a grid barrier")
    if timeline or watchdog:
        w("")
    w("@cute.kernel")
    w("def megakernel(")
    for line in _packed([f"{a}: cute.Tensor" for a in arguments], indent=1):
        w(line)
    w("):")
    w('"""One decode step: embedding, every layer, final norm, LM head, in-place KV append."""', 1)
    w("tidx, _, _ = cute.arch.thread_idx()", 1)
    w("cta, _, _ = cute.arch.block_idx()", 1)
    w("lane = tidx % 32", 1)
    w("gwarp = cta * WARPS + tidx // 32", 1)
    if any(st.tiling.kind == "rows" and st.tiling.spread for st in plan.stages):
        w("swarp = (tidx // 32) * CTAS + cta  # CTA-major tile order of spread GEMV stages", 1)
    w("smem = cutlass.memory.SmemAllocator()", 1)
    w("s_vec = smem.allocate_tensor(", 1)
    w(f"{_staging_type(plan)}, cute.make_layout((BATCH, VEC_WIDTH), stride=(VEC_WIDTH, 1)), byte_alignment=16)", 2)
    w("s_red = smem.allocate_tensor(Float32, cute.make_layout(RED_SCRATCH), byte_alignment=16)", 1)
    w("s_att = smem.allocate_tensor(Float32, cute.make_layout(ATT_SCRATCH), byte_alignment=16)", 1)
    if any(s.tiling.mma > 1 for s in plan.stages):
        w("# where the split tensor-core GEMV's partial sums meet: [warp, sequence, row of the 8-row tile]", 1)
        w("s_part = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 8, 8), stride=(64, 8, 1)), "
          "byte_alignment=16)", 1)
    if _ring_stages(plan)[0] and not loader:
        w("# per-warp cp.async rings of the streamed GEMV stages", 1)
        w("s_ring = smem.allocate_tensor(", 1)
        w("w_qkv.element_type,", 2)
        w("cute.make_layout((WARPS, RING_STAGES, RING_VECTORS, 32, 8),", 2)
        w("stride=(RING_STAGES * RING_VECTORS * 256, RING_VECTORS * 256, 256, 8, 1)),", 3)
        w("byte_alignment=16)", 2)
    if fused_mlp:
        for line in _FUSED_MLP_DECLARATIONS + (_BULK_DOWN_DECLARATIONS if bulk_down else []):
            w(line, 1)
    if loader:
        for line in (_LOADER_DECLARATIONS + (_LOADER_QKV_DECLARATIONS if loader.qkv_slots else [])
                     + (_LOADER_GATE_DECLARATIONS if loader.gates else []) + _LOADER_START):
            w(line, 1)
    for line in _preload_registers(plan):
        w(line, 1)
    if _attention_preloads(plan):
        w("pre_kv = cute.make_rmem_tensor(cute.make_layout(2 * 8), k_cache.element_type)  # first K, V rows", 1)
        w("s_new = cute.make_tensor(s_vec.iterator, cute.make_layout(2 * HEAD_DIM))  # this step's k, v (fp32)", 1)
    if barrier != "atom":
        w("bar_next = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Int64)  # next grid-barrier target", 1)
        w("bar_next[0] = cutlass.Int64(0)  # 0: the launch's first barrier asks the counter", 1)
    w("pos = position[0]", 1)
    if loader:
        w("if tidx < THREADS:  # the consumer warps (warp WARPS is the loader: the else branch at the end)", 1)
        w.base = 1
        if loader.warpgroup:
            w("cute.arch.setmaxregister_increase(REGISTERS[0])", 1)
    _timeline_store(w, 1, bool(timeline), "1", every_cta)
    if phases:
        _phase_timed_stages(w, plan, prologue, per_layer, epilogue, options)
    else:
        for i, stage in enumerate(prologue):
            _stage(w, plan, stage, 1, layer_var=None, options=options)
            _timeline_store(w, 1, timeline, str(2 + i))
        w("for layer in range(LAYERS):", 1)
        if fused_o:
            _write_fused_o_step(w, plan)
        clocked = [s for s in per_layer if not (fused_o and s.name == "o_residual")]  # in attention's interval
        for stage in per_layer:
            _stage(w, plan, stage, 2, layer_var="layer", options=options)
            if stage in clocked:
                j = clocked.index(stage)
                _timeline_store(w, 2, timeline, f"{2 + len(prologue) + j} + layer * {len(clocked)}")
        for e, stage in enumerate(epilogue):
            _stage(w, plan, stage, 1, layer_var=None, options=options)
            _timeline_store(w, 1, timeline, str(2 + len(prologue) + len(clocked) * plan.dims.layers + e))
    if loader:
        w.base = 0
        _write_loader_program(w, plan, loader)
    copies = w.text.count("bodies.loader_down(" if loader else
                          "bodies.mlp_down_bulk(" if bulk_down else "bodies.mlp_down_load(")
    branches = 2 if loader and _split_gate(loader) is not None else 1  # split and fused steps' order
    if fused_mlp and copies != branches:
        raise AssertionError("a fused_mlp build must copy its W_down columns once per layer, before the MLP's barrier; "
                             f"it emitted {copies} copies in {branches} branches (codegen._fused_mlp_before)")
    w("")
    _launcher(w, arguments)
    if self_contained:
        _append_bodies(w, called_bodies(w.text))
        check_top_level_names(w.text)
    if loader:
        _consumer_barriers(w)
    source_map = {
        "schema_version": 1,
        "module": "module.py",
        "plan_hash": plan_hash,
        "entries": w.entries,
    }
    return GeneratedModule(source=w.text, source_map=source_map, arguments=arguments,
                           codegen={"loader_warp": loader_record(loader)} if loader else {})


def _packed(items: list[str], indent: int) -> list[str]:
    """``items`` joined by ", " onto lines of at most :data:`LINE_WIDTH` at ``indent`` levels (trailing commas)."""
    prefix, lines, current = "    " * indent, [], ""
    for item in items:
        if current and len(prefix) + len(current) + len(item) + 2 > LINE_WIDTH:
            lines.append(prefix + current.rstrip())
            current = ""
        current += item + ", "
    return lines + [prefix + current.rstrip()]


def _header(w: _Writer, plan: Plan, plan_hash: str, arguments: list[str], self_contained: bool,
            head_slices: bool = True, long_slices: bool = True, pass_chunks: bool = False,
            kv_pipeline: bool | int = False, folded: int = 0, mma_attention: bool | int = False, mma_slices: int = 0,
            fused_o: bool = False, fused_kv_smem: bool = False, fused_mma: bool = False,
            mma_wide: bool = False, fused_mlp: bool = False, fused_split: bool = False,
            spare_loads: bool = False, bulk_down: bool = False, loader: LoaderGeometry | None = None,
            dealt_splits: int = 0) -> None:
    d = plan.dims
    w(f'"""Generated by MegaBake from plan {plan_hash[:16]}. Do not edit: re-bake instead.')
    w("")
    w(f"Model: hidden {d.hidden}, {d.layers} layers, {d.n_heads}/{d.n_kv_heads} heads x {d.head_dim}, "
      f"intermediate {d.intermediate}, vocab {d.vocab}.")
    per_step = plan.barriers_per_step - (d.layers if fused_mlp else 0)
    barriers = (f"{per_step - d.layers} grid barriers per step (fused_o, fused_split)" if fused_split else
                f"{per_step} grid barriers per step ({per_step - d.layers} where the context fits MIN_CHUNK: "
                "fused_o)" if fused_o else f"{per_step} grid barriers per step")
    w(f"Bucket: batch {plan.batch}, KV capacity {plan.capacity}. Grid {plan.ctas} x {plan.threads} threads, "
      f"{barriers}.")
    if self_contained:
        w("")
        w("Self-contained: the device routines the kernel calls as bodies.<name> are copied at the end of this file")
        w(f"from megabake.codegen.bodies (MegaBake {_megabake_version()}); it needs CuTe DSL, not MegaBake.")
    w('"""')
    w("import cutlass")
    w("import cutlass.cute as cute")
    w("import cuda.bindings.driver as cuda")
    w("from cutlass import Float32")
    w("")
    if not self_contained:
        w("from megabake.codegen import bodies")
        w("")
    w(f'PLAN_HASH = "{plan_hash}"')
    w("ARGUMENTS = [")
    for line in _packed([repr(a) for a in arguments], indent=1):
        w(line)
    w("]")
    consts = {
        "BATCH": plan.batch, "CAPACITY": plan.capacity, "HIDDEN": d.hidden, "LAYERS": d.layers,
        "N_HEADS": d.n_heads, "N_KV_HEADS": d.n_kv_heads, "HEAD_DIM": d.head_dim, "Q_ROWS": d.q_rows,
        "QKV_ROWS": d.qkv_rows, "INTER": d.intermediate, "VOCAB": d.vocab, "CTAS": plan.ctas,
        "THREADS": plan.threads, "WARPS": plan.warps, "TOTAL_WARPS": plan.ctas * plan.warps,
    }
    splits = kv_splits(plan)
    scratch = smem_floats(d, plan.batch, plan.capacity, plan.threads, bool(splits),
                          plan.down_input == "global" or fused_mlp)  # fused_mlp stages no intermediate row
    consts.update({"VEC_WIDTH": scratch["vec_width"], "RED_SCRATCH": scratch["red"], "ATT_SCRATCH": scratch["att"]})
    if splits:
        attention = next(s.tiling for s in plan.stages if s.kind == "attention")
        consts.update({"KV_SPLITS": dealt_splits or splits, "ATT_UNROLL": attention.unroll,
                       "MIN_CHUNK": attention.per_tile,
                       "HEAD_SLICES": max(1, attention.head_slices) if head_slices else 1,
                       "LONG_SLICES": long_slices, "CHUNK_QUANTUM": chunk_quantum(plan, pass_chunks),
                       "KV_PIPELINE": kv_pipeline})
        if folded:
            consts["FOLD_SPLITS"] = folded
        if mma_attention:
            consts["MMA_ATTENTION"] = mma_attention  # True, or MMA_TWO_BUFFERS / MMA_EARLY_KV (a K/V load mode)
        if mma_slices:
            consts["MMA_SLICES"] = mma_slices
        if mma_wide:
            consts["MMA_WIDE"] = True
    ring_stages, ring_vectors = _ring_stages(plan)
    if ring_stages and not loader:
        consts.update({"RING_STAGES": ring_stages, "RING_VECTORS": ring_vectors})
    if fused_o:
        geometry = fused_geometry(plan)
        consts.update({"FUSED_O_BLOCKS": geometry.blocks, "FUSED_O_BLOCK_ROWS": geometry.block_rows,
                       "FUSED_KV_SMEM": fused_kv_smem, "FUSED_MMA": fused_mma,
                       "COPY_SKIP": WARP_SIZE if spare_loads else 0})
    if fused_split:
        consts["FUSED_SPLIT"] = True
    if fused_mlp:
        mlp = mlp_geometry(plan)
        up = next(s for s in plan.stages if s.scope == "layer" and s.name == "norm_gate_up")
        consts.update({"FUSED_MLP": True, "MLP_PER_CTA": mlp.per_cta, "MLP_CHUNKS": mlp.chunks,
                       "MLP_LOAD_BITS": mlp.load_bits, "MLP_TILES": mlp.tiles(up.tiling.per_tile),
                       "MLP_BULK": bulk_down})
        if bulk_down:
            consts["MLP_BULK_BYTES"] = bulk_copy_bytes(mlp)
    for name, value in consts.items():
        w(f"{name} = {value}")
    if fused_o:
        w("# fp32 buffers of a fused_o build beyond the plan's (the runtime allocates them): name -> shape")
        extra = f"'o_mid': (1, {d.hidden}), 'o_part': ({d.n_kv_heads}, {d.hidden})"
        if fused_mlp:
            extra += f", 'mlp_acc': ({d.layers + 1}, {d.hidden + ACC_PAD})"
        if fused_split:
            extra += f", 'o_count': ({d.layers}, {d.n_kv_heads})"
        if bulk_down:
            extra += f", 'w_down_cta': ({d.layers}, {mlp.chunks}, {d.hidden * mlp.per_cta})"
        w(f"EXTRA_BUFFERS = {{{extra}}}")
        dtypes = ([] if not fused_mlp else ["'mlp_acc': 'int64'"]) + ([] if not fused_split else ["'o_count': 'int64'"])
        dtypes += ["'w_down_cta': 'bfloat16'"] if bulk_down else []
        if dtypes:
            w(f"EXTRA_BUFFER_DTYPES = {{{', '.join(dtypes)}}}  # the others are fp32")
        if bulk_down:
            w("# buffers the runtime derives from a weight after packing it: name -> (weight, its columns per block);")
            w("# w_down_cta[layer, c] holds w_down[layer, :, c * MLP_PER_CTA:(c + 1) * MLP_PER_CTA], row-major")
            w("DERIVED_BUFFERS = {'w_down_cta': ('w_down', MLP_PER_CTA)}")
    w(f"EPS = {d.eps!r}")
    w(f"ATTN_SCALE = {d.attn_scale!r}")
    if d.embed_scale != 1.0:
        w(f"EMBED_SCALE = {d.embed_scale!r}  # x = embedding(ids) * EMBED_SCALE")
    if d.rotary_dim:
        w(f"ROTARY_DIM = {d.rotary_dim}  # partial rotary: features [0, ROTARY_DIM) of a head rotate, the rest pass")
    if d.final_softcap:
        w(f"FINAL_SOFTCAP = {d.final_softcap!r}  # logits = FINAL_SOFTCAP * tanh(logits / FINAL_SOFTCAP)")
    w(f"ROWS_PER_TILE = {{{', '.join(repr(s.name) + ': ' + str(s.tiling.per_tile) for s in plan.stages if s.tiling.kind == 'rows')}}}")
    w("# 16-byte loads in flight per lane and row")
    unrolls = ", ".join(f"{s.name!r}: {s.tiling.unroll}" for s in plan.stages if s.tiling.kind == "rows")
    w(f"GEMV_UNROLL = {{{unrolls}}}")
    splits_mma = ", ".join(f"{s.name!r}: {s.tiling.mma}" for s in plan.stages if s.tiling.mma)
    if splits_mma:
        w("# tensor-core GEMV stages: warps of a CTA that share one 8-row tile (each reduces a slice of K)")
        w(f"MMA_SPLIT = {{{splits_mma}}}")
    w("GRID = (CTAS, 1, 1)")
    if loader:
        _loader_constants(w, loader)
    else:
        w("BLOCK = (THREADS, 1, 1)")
    if loader:
        w(f"SMEM_BYTES = {loader.smem_bytes}  # the staged rows and scratch, the W_O block, the W_down columns, "
          "LOADER_SLOTS ring slots, their mbarriers + alignment")
    elif fused_mlp:
        w(f"SMEM_BYTES = {mlp_smem_bytes(plan, bulk_down)}  # the plan's {plan.smem_bytes}, VEC_WIDTH without the "
          "intermediate width, + 2 * HIDDEN * MLP_PER_CTA (W_down columns) + alignment" + bulk_down * " + mbarrier")
    elif plan.staging_dtype == "float32":
        w(f"SMEM_BYTES = {plan.smem_bytes}  # 4 * (BATCH * VEC_WIDTH + RED_SCRATCH + ATT_SCRATCH) + alignment")
    else:
        w(f"SMEM_BYTES = {plan.smem_bytes}  # 2 * BATCH * VEC_WIDTH (bf16 staging: fp32 rows do not fit) "
          "+ 4 * (RED_SCRATCH + ATT_SCRATCH) + alignment")
    w("")
    w("")


def _staging_type(plan: Plan) -> str:
    """The CuTe type of the staged GEMV input rows (``plan.staging_dtype``)."""
    return {"float32": "Float32", "bfloat16": "cutlass.BFloat16"}[plan.staging_dtype]


def _entry(plan: Plan, stage: Stage, layer_var, kind: str, name: str) -> dict:
    if stage.scope == "layer":
        ops = [op for layer in plan.layers for op in layer.ops[stage.name]]
        fx = [n for layer in plan.layers for n in layer.fx_nodes[stage.name]]
        modules = sorted({m for layer in plan.layers for m in layer.hf_modules[stage.name]})
    else:
        keys = [r for r in stage.roles if r in plan.globals]
        ops = [op for k in keys for op in plan.globals[k]["ops"]]
        fx = [n for k in keys for n in plan.globals[k]["fx_nodes"]]
        modules = sorted({m for k in keys for m in plan.globals[k]["hf_modules"]})
    return {"kind": kind, "stage": stage.index, "name": name, "ir_ops": ops, "fx_nodes": fx, "hf_modules": modules}


def _stage(w: _Writer, plan: Plan, stage: Stage, indent: int, layer_var, clocks: list[str] | None = None,
           options: BuildOptions = BuildOptions()) -> None:
    """One stage's body calls and the grid barrier after it (``options.barrier``: its call); ``clocks`` (a phases
    timeline): the barrier slot each phase's end is stored in (:func:`stage_phases`)."""
    def clock() -> None:
        if clocks:
            _timeline_store(w, indent, True, clocks.pop(0), options.clock_every_cta)

    fused = _fused_layer_stage(options, stage)
    if fused and stage.name == "o_residual":
        return  # emitted inside the attention stage's interval (_fused_attention_stages)
    if fused and stage.kind == "attention":
        write = _fused_split_stages if options.fused_split else _fused_attention_stages
        write(w, plan, stage, indent, layer_var, options, clocks)
        return
    prefix = "layer[*]." if stage.scope == "layer" else ""
    w.begin(_entry(plan, stage, layer_var, "barrier_interval", f"{prefix}{stage.name}"))
    w(f"# ---- stage {stage.index}: {stage.name} ({stage.scope}) ----", indent)
    previous = next((s for s in plan.stages if s.index == stage.index - 1), None)
    if options.spread_merge and previous is not None and previous.kind == "attention" and kv_splits(plan):
        w(f"bodies.split_kv_counts_reset({ATTN_COUNT}, cta, tidx, BATCH * N_KV_HEADS * HEAD_SLICES, THREADS)",
          indent)
    for body, call in _stage_calls(plan, stage, options):
        w.begin(_entry(plan, stage, layer_var, "body_call", f"{prefix}{stage.name}.{body}"))
        w(call, indent)
        w.end()
        clock()
    if _ends_at_a_barrier(stage, options):
        before = _stage_before_calls(plan, stage, options)
        reads = [call for call in before if call.startswith(_BEFORE_ARRIVAL)]
        loads_fused_o = _loads_fused_o(plan, stage, options)
        after = []
        if loads_fused_o and options.loader:  # the loader warp copies the W_O block
            for call in [options.arrival] + before:
                w(call, indent)
        elif loads_fused_o:
            assert not reads, reads  # split-KV plans have no attention preload (plan.build_plan refuses it)
            _write_fused_o_loads(w, [options.arrival] + before, indent, every_step=options.fused_split)
        else:
            ahead, after = _spare_ring_calls(before, options)
            for call in reads + ([options.arrival] if options.arrival else []) + [c for c in ahead if c not in reads]:
                w(call, indent)
        if before or loads_fused_o:  # _prefetch_phase
            clock()
        _write_wait(w, options, indent, after)
        if loads_fused_o and options.early_down == "wait":
            w(_MLP_DOWN_BULK, indent)  # early_down: the copies land during attention
        clock()
    w.end()


def _stage_calls(plan: Plan, stage: Stage, options: BuildOptions) -> list[tuple[str, str]]:
    """(body name, call) of one stage's interval as ``options`` build it (not a fused_o build's attention stage,
    which :func:`_fused_attention_stages` writes)."""
    calls = _body_calls(plan, stage, options.merge_preload, options.spread_merge, options.fold_splits,
                        options.mma_attention, options.mma_schedule, options.mma_wide)
    if _fused_layer_stage(options, stage):
        calls = _fused_o_calls(plan, stage, calls)
    if options.fused_mlp:
        calls = _fused_mlp_calls(plan, stage, calls, options.bulk_down)
    if options.fused_split:
        calls = _fused_split_calls(stage, calls)
    if options.loader:
        calls = _loader_stage_calls(stage, calls, options.loader)
    return calls


_RING_PREFILL = "bodies.gemv_ring_prefill("
# a ring prefill call: (up to its `active` argument) (active) (the rest, from its warp count on)
_RING_PREFILL_ACTIVE = re.compile(r"^(bodies\.gemv_ring_prefill\(.*?, lane, )(.*?)(, (?:TOTAL_)?WARPS, .*)$")


def _spare_ring_calls(calls: list[str], options: BuildOptions) -> tuple[list[str], list[str]]:
    """(ahead, after) of the calls issued between a split barrier's arrival and its wait: without
    ``options.spare_ring``, all of them ahead. With it, each ring prefill (``bodies.gemv_ring_prefill``) stays ahead
    for warps 1.. only (warp 0 commits its groups empty, so thread 0 polls with nothing of its own in flight) and
    comes again in ``after``, for warp 0, right after the wait (:func:`_write_wait`). Warp 0 then has its groups
    in the same order as before (empty ones first), so the GEMV's ``cp.async.wait_group`` counts still hold."""
    if not options.spare_ring:
        return calls, []
    ahead, after = [], []
    for call in calls:
        match = _RING_PREFILL_ACTIVE.match(call) if call.startswith(_RING_PREFILL) else None
        if match is None:
            ahead.append(call)
            continue
        head, active, tail = match.groups()
        ahead.append(f"{head}cutlass.min(tidx // {WARP_SIZE}, 1) * ({active}){tail}")
        after.append(call)
    return ahead, after


def _write_wait(w: _Writer, options: BuildOptions, indent: int, after: list[str]) -> None:
    """The grid barrier's wait (``options.barrier``), then warp 0's deferred ring prefills
    (:func:`_spare_ring_calls`)."""
    w(options.barrier, indent)
    if after:
        w(f"if tidx < {WARP_SIZE}:  # spare_ring: warp 0 fills its ring once it has polled", indent)
        for call in after:
            w(call, indent + 1)


def _ends_at_a_barrier(stage: Stage, options: BuildOptions) -> bool:
    """A grid barrier ends this stage's interval (a fused_mlp build's gate/up stage goes on into the MLP's)."""
    return stage.barrier_after and not (options.fused_mlp and stage.scope == "layer" and stage.name == "norm_gate_up")


def _stage_before_calls(plan: Plan, stage: Stage, options: BuildOptions) -> list[str]:
    if options.loader:  # the loader warp streams every weight: only the K/V prefetch stays
        before = _stage_before_calls(plan, stage, replace(options, loader=None))
        gate = options.loader.gate_index(stage.name) if stage.scope == "layer" else None
        arrive = [] if gate is None else [f"bodies.gate_arrive(s_gate, {gate}, tidx)"]
        return arrive + [call for call in before if not call.startswith(_LOADER_DROPPED)]
    before = _before_barrier_calls(plan, stage, options.kv_prefetch, options.kv_prefetch_l1, options.prefetch_bytes,
                                   options.kv_prefetch_rows, options.mma_schedule)
    if not options.fused_mlp:
        return before
    before = _fused_mlp_before(before, options.bulk_down, options.early_down)
    if options.early_down == "arrival" and _loads_fused_o(plan, stage, options):
        return [_MLP_DOWN_BULK] + before  # first after the arrival: the copies have all of attention to land
    return before


def _early_mode(early_kv: bool | str) -> int:
    """The module's MMA_ATTENTION / FUSED_MMA of an ``early_kv`` build (0: not one)."""
    return {True: MMA_EARLY_KV, "l1": MMA_EARLY_L1}.get(early_kv, 0)


def _loads_fused_o(plan: Plan, stage: Stage, options: BuildOptions) -> bool:
    """The stage before a fused_o build's attention: a fused step copies its W_O block before that barrier."""
    following = next((s for s in plan.stages if s.index == stage.index + 1), None)
    return _fused_layer_stage(options, stage) and following is not None and following.kind == "attention"


def _prefetch_phase(plan: Plan, stage: Stage, options: BuildOptions) -> bool:
    """Something is issued between this stage's arrival and its wait (a phases timeline clocks it as ``prefetch``)."""
    return bool(_stage_before_calls(plan, stage, options)) or _loads_fused_o(plan, stage, options)


# ------------------------------------------------------------------------------ fused_o builds (codegen.fused)
_O_RING_PREFILL = "bodies.gemv_ring_prefill(w_o["


def _write_fused_o_step(w: _Writer, plan: Plan) -> None:
    """``fo``, at the top of a fused_o build's layer loop: whether this step runs attention and O fused."""
    w(f"fo = bodies.fused_o_step(pos, {_first_key(plan)}, MIN_CHUNK)  # 1: the context fits one chunk; the O "
      "projection runs in attention's interval", 2)


def _write_fused_o_loads(w: _Writer, calls: list[str], indent: int, every_step: bool = False) -> None:
    """The calls between the arrival after the QKV projection and its wait, in a ``fused_o`` build: a fused step
    copies its W_O block into the ring's shared memory (``bodies.fused_o_load``) instead of the O projection's
    ring fill, which the other steps keep; with ``every_step`` (fused_split: no step has that ring fill) every
    step copies its block."""
    load = ("bodies.fused_o_load(w_o[layer, None, None], k_cache[layer, None, None, None, None], "
            "v_cache[layer, None, None, None, None], s_ring, pos, cta, tidx, N_HEADS, N_KV_HEADS, HEAD_DIM, HIDDEN, "
            "FUSED_O_BLOCKS, FUSED_O_BLOCK_ROWS, MIN_CHUNK, FUSED_KV_SMEM, THREADS, COPY_SKIP)")
    prefill = [call for call in calls if call.startswith(_O_RING_PREFILL)]
    for call in calls:
        if call.startswith(_O_RING_PREFILL):
            continue
        w(call, indent)
    if every_step:
        w(load, indent)
        return
    w("if fo == 1:", indent)
    w(load, indent + 1)
    if prefill:
        w("else:", indent)
        for call in prefill:
            w(call, indent + 1)


def _fused_o_calls(plan: Plan, stage: Stage, calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A ``fused_o`` build's body calls of the gate/up and down stages: the gate/up staging adds the fused step's
    O partials to x and stores that residual in ``o_mid`` (``bodies.rmsnorm_partials_to_smem``); the down
    projection adds its output to ``o_mid`` into x (written as its bias: the same sum, the same bits)."""
    if stage.name == "norm_gate_up":
        assert calls[0][0] == "rmsnorm_to_smem", calls  # fused_o_refusal: pre-norm layouts only
        slot = norm_slot(spec_of(stage, plan).vector.norm_role, plan)
        staging = ("rmsnorm_partials_to_smem",
                   f"bodies.rmsnorm_partials_to_smem(x, o_mid, o_part, norms[layer, {slot}, None], s_vec, s_red, cta, "
                   "tidx, fo, N_KV_HEADS, HIDDEN, CTAS, THREADS, EPS)")
        return [staging] + calls[1:]
    if stage.name == "down_residual":
        spec = spec_of(stage, plan)
        gemv = spec.gemv
        rows, cols = DIMENSION_CONSTANTS[gemv.rows], DIMENSION_CONSTANTS[gemv.cols]
        down = _gemv(f"{gemv.weight}[layer, None, None]", gemv.out, rows, cols, stage, False, bias_row="o_mid[0, None]")
        body = calls[1][1].split("(")[0].removesuffix("_bias")  # the same GEMV (its _bias form where it has one)
        assert down.split("(")[0].removesuffix("_bias") == body, (calls, down)
        return [calls[0], (calls[1][0], down)] + calls[2:]
    return calls


def _fused_attention_stages(w: _Writer, plan: Plan, attention: Stage, indent: int, layer_var,
                            options: BuildOptions, clocks: list[str] | None = None) -> None:
    """The attention stage of a ``fused_o`` build and, in steps of more than one split (``fo == 0``), the O
    projection's stage after it, as the default build runs them; a fused step (``fo == 1``) runs
    ``bodies.fused_attention_o`` and goes on to the gate/up GEMV's ring fill after one arrival. ``clocks`` (a
    phases timeline): the slots of both stages' phases (:func:`stage_phases`), each stored in every step (the
    ``fo == 0`` block is closed for the store and opened again)."""
    def clock(reopen: bool) -> None:
        if clocks:
            _timeline_store(w, indent, True, clocks.pop(0), options.clock_every_cta)
            if reopen:
                w("if fo == 0:", indent)

    o_stage = _o_stage(plan)
    w.begin(_entry(plan, attention, layer_var, "barrier_interval", f"layer[*].{attention.name}"))
    w(f"# ---- stage {attention.index}: {attention.name} ({attention.scope}); with {o_stage.name} where fo == 1 ----",
      indent)
    fused_call = _fused_attention_call(plan)
    body, call = _stage_calls(plan, attention, options)[0]
    w("if fo == 1:", indent)
    w.begin(_entry(plan, attention, layer_var, "body_call", "layer[*].attention.fused_attention_o"))
    w(fused_call, indent + 1)
    w.end()
    w("else:", indent)
    w.begin(_entry(plan, attention, layer_var, "body_call", f"layer[*].attention.{body}"))
    w(call, indent + 1)
    w.end()
    clock(reopen=False)
    w(options.arrival, indent)
    w("if fo == 0:", indent)
    before = _before_barrier_calls(plan, attention, options.kv_prefetch, options.kv_prefetch_l1,
                                   options.prefetch_bytes, options.kv_prefetch_rows, options.mma_schedule)
    ahead, after = _spare_ring_calls(before, options)
    for call in ahead:
        w(call, indent + 1)
    _write_wait(w, options, indent + 1, after)
    clock(reopen=True)
    w.end()
    w.begin(_entry(plan, o_stage, layer_var, "barrier_interval", f"layer[*].{o_stage.name}"))
    w(f"# ---- stage {o_stage.index}: {o_stage.name} ({o_stage.scope}); only where fo == 0 ----", indent + 1)
    for body, call in _stage_calls(plan, o_stage, options):
        w.begin(_entry(plan, o_stage, layer_var, "body_call", f"layer[*].{o_stage.name}.{body}"))
        w(call, indent + 1)
        w.end()
        clock(reopen=True)
    w(options.arrival, indent + 1)
    before = _stage_before_calls(plan, o_stage, options)
    ahead, after = _spare_ring_calls(before, options)
    for call in ahead:
        w(call, indent)
    if before:
        clock(reopen=False)
    _write_wait(w, options, indent, after)
    clock(reopen=False)
    w.end()


def _fused_attention_call(plan: Plan) -> str:
    return (f"bodies.fused_attention_o(qkv, {_qk_norm_argument(plan)}, {_rope_arguments(plan)}, "
            "k_cache[layer, None, None, None, None], v_cache[layer, None, None, None, None], s_ring, o_part, "
            f"pos, {_first_key(plan)}, s_att, cta, "
            f"tidx, N_HEADS, N_KV_HEADS, HEAD_DIM, THREADS, ATTN_SCALE, {plan.has_head_norms}, EPS, ATT_UNROLL, "
            f"{'ROTARY_DIM' if plan.dims.rotary_dim else 'HEAD_DIM'}, {plan.dims.whole_qk_norm}, KV_PIPELINE, "
            "FUSED_MMA, HIDDEN, FUSED_O_BLOCKS, FUSED_O_BLOCK_ROWS, MIN_CHUNK, FUSED_KV_SMEM)")


# ------------------------------------------------------------------------------ fused_split builds (codegen.fused)
def _fused_split_calls(stage: Stage, calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A ``fused_split`` build's body calls beyond fused_o's: the prologue zeroes the per-group arrival counters
    (``o_count``), and the gate/up staging always sums the O partials (every step wrote them)."""
    if stage.scope == "prologue":
        return calls + [("zero_rows", "bodies.zero_rows(o_count, cta, tidx, LAYERS, N_KV_HEADS, CTAS, THREADS)")]
    if stage.name == "norm_gate_up":
        name, call = calls[0]
        assert name == "rmsnorm_partials_to_smem" and ", fo, N_KV_HEADS, " in call, calls
        return [(name, call.replace(", fo, N_KV_HEADS, ", ", 1, N_KV_HEADS, "))] + calls[1:]
    return calls


def _fused_split_stages(w: _Writer, plan: Plan, attention: Stage, indent: int, layer_var, options: BuildOptions,
                        clocks: list[str] | None = None) -> None:
    """The attention stage of a ``fused_split`` build with the O projection in its interval at every step: a
    fused step runs ``bodies.fused_attention_o``, any other its split-KV items (counting each into its KV group's
    ``o_count`` row) and then ``bodies.split_o_block``; both then arrive, issue the O stage's calls before the
    barrier (the gate/up ring fill) and wait. ``clocks`` (a phases timeline): the slots of both stages' phases
    (:func:`stage_phases`), the first stored between the items and ``split_o_block``."""
    def clock() -> None:
        if clocks:
            _timeline_store(w, indent, True, clocks.pop(0), options.clock_every_cta)

    o_stage = _o_stage(plan)
    w.begin(_entry(plan, attention, layer_var, "barrier_interval", f"layer[*].{attention.name}"))
    w(f"# ---- stage {attention.index}: {attention.name} ({attention.scope}) with {o_stage.name} (fused_split) ----",
      indent)
    body, call = _stage_calls(plan, attention, options)[0]
    assert body == "split_kv_attention" and call.endswith(")"), (body, call)
    counted = call[:-1] + ", group_counts=o_count[layer, None], count_groups=True)"
    o_block = (f"bodies.split_o_block(attn, {ATTN_PART}, o_count[layer, None], s_ring, s_att, o_part, pos, "
               f"{_first_key(plan)}, cta, tidx, N_HEADS, N_KV_HEADS, HEAD_DIM, HIDDEN, THREADS, KV_SPLITS, MIN_CHUNK, "
               f"CHUNK_QUANTUM, HEAD_SLICES, LONG_SLICES, {options.fold_splits}, FUSED_O_BLOCKS, FUSED_O_BLOCK_ROWS"
               f"{_mma_slices_argument(options.mma_schedule)})")
    fused_call = _fused_attention_call(plan)
    items_gate = options.loader.gate_index(ITEMS_GATE) if options.loader else None
    # loader_gates "items": one phase a layer, after the CTA's items in a split step (where the loader waits for it)
    arrive = [] if items_gate is None else [f"bodies.gate_arrive(s_gate, {items_gate}, tidx)"]
    if options.loader:  # the W_O block is the loader's: wait for the layer's phase, read s_wo, release it
        o_block, fused_call = o_block.replace(", s_ring, ", ", s_wo, "), fused_call.replace(", s_ring, ", ", s_wo, ")
        w(f"bodies.wait_block(s_wo_full, {layer_var} % 2, o_block)", indent)
    w("if fo == 1:", indent)
    w.begin(_entry(plan, attention, layer_var, "body_call", "layer[*].attention.fused_attention_o"))
    for call in [fused_call] + arrive:
        w(call, indent + 1)
    w.end()
    w("else:", indent)
    w.begin(_entry(plan, attention, layer_var, "body_call", f"layer[*].attention.{body}"))
    for call in [counted] + arrive:
        w(call, indent + 1)
    w.end()
    if clocks:  # a phases timeline clocks the items apart from split_o_block (the same calls, in the same order)
        clock()
        w("if fo == 0:", indent)
    w.begin(_entry(plan, o_stage, layer_var, "body_call", f"layer[*].{o_stage.name}.split_o_block"))
    w(o_block, indent + 1)
    w.end()
    if options.loader:
        w("bodies.release_block(s_wo_empty, tidx, o_block, False)  # after _o_block_rows' CTA barrier", indent)
    clock()
    w.end()
    w.begin(_entry(plan, o_stage, layer_var, "barrier_interval", f"layer[*].{o_stage.name}"))
    w(f"# ---- stage {o_stage.index}: {o_stage.name} ({o_stage.scope}): in attention's interval ----", indent)
    w(options.arrival, indent)
    before = _stage_before_calls(plan, o_stage, options)
    ahead, after = _spare_ring_calls(before, options)
    for call in ahead:
        w(call, indent)
    if before:
        clock()
    _write_wait(w, options, indent, after)
    clock()
    w.end()


# ------------------------------------------------------------------------------ loader_warp builds (codegen.loader)
def _default_loader(plan: Plan, *, fused_o: bool, fused_mlp: bool | None, bulk_down: bool | None,
                    fused_split: bool | None, fused_kv_smem: bool, early_down: str | None, spare: bool, barrier: str,
                    self_contained: bool, watchdog: bool, warpgroup: bool) -> bool:
    """Whether ``generate(plan, loader_warp=None)`` builds the loader warp: where none of the build's other options
    rules it out and :func:`megabake.codegen.loader.default_loader_warp` picks it (fused_mlp and bulk_down then
    default to on)."""
    if (not fused_o or fused_mlp is False or bulk_down is False or fused_split is False or fused_kv_smem or spare
            or not self_contained or watchdog or (warpgroup and plan.threads % WARPGROUP)):
        return False
    if fused_mlp_refusal(plan, fused_o=True) or fused_split_refusal(plan, fused_o=True):
        return False
    split = bool(fused_split) or feature_enabled("fused_split")  # given (True) or the plan's default
    return default_loader_warp(plan, fused_o=True, fused_split=split, fused_mlp=True, bulk_down=True,
                               fused_kv_smem=False, early_down=early_down, barrier=barrier)


def _checked_loader(plan: Plan, loader_warp: bool, inflight: int | None, qkv_inflight: int | None, qkv_ring: bool,
                    warpgroup: bool, self_contained: bool, watchdog: bool, gates: tuple[str, ...], drain: bool,
                    **choices) -> LoaderGeometry | None:
    """A loader_warp build's geometry (None without it), or the reason it cannot build (ValueError)."""
    if not loader_warp:
        if gates or drain:
            raise ValueError("loader_gates / loader_drain pace the loader warp: build with loader_warp=True")
        return None
    if isinstance(gates, str) or any(g not in LOADER_GATES for g in gates) or len(set(gates)) != len(gates):
        raise ValueError(f"loader_gates={gates!r}: give a tuple of distinct names from {sorted(LOADER_GATES)}")
    if "items" in gates and "attention" in gates:
        raise ValueError("loader_gates 'items' and 'attention' both hold a split step's copies (until the CTA's "
                         "split-KV items are done, or until it arrived after attention): give one of them")
    if gates and not qkv_ring:
        raise ValueError("loader_gates pace the QKV ring's layout (the next layer's QKV rows after this layer's "
                         "arrival): build with loader_qkv_ring=True")
    for name, value in (("loader_inflight", inflight), ("loader_qkv_inflight", qkv_inflight)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}={value!r}: give the units the loader keeps in flight, an int >= 0 "
                             "(0: as many as the ring holds)")
    why = loader_refusal(plan, qkv_ring=qkv_ring, **choices)
    if why is None and not self_contained:
        why = "its module rewrites the CTA barriers of the bodies it copies: it must be self-contained"
    if why is None and watchdog:
        why = "a watchdog build's barrier is not written for it"
    if why:
        raise ValueError(f"loader_warp streams the weights from a ninth warp, but {why}: build without it")
    if warpgroup and plan.threads % WARPGROUP:
        raise ValueError(f"loader_warpgroup gives the consumers whole warpgroups of {WARPGROUP} threads; this plan runs "
                         f"{plan.threads}: build with loader_warpgroup=False")
    geometry = replace(loader_geometry(plan, inflight, qkv_ring, len(gates)), warpgroup=warpgroup,
                       gates=tuple(g for g in LOADER_GATES if g in gates), drain=bool(drain))
    if qkv_inflight is not None:
        streams = tuple(replace(s, inflight=qkv_inflight) if s.stage == "norm_qkv" else s for s in geometry.streams)
        geometry = replace(geometry, streams=streams)
    for name, value, slots in (("loader_inflight", inflight, geometry.slots),
                               ("loader_qkv_inflight", qkv_inflight, geometry.ring_slots("norm_qkv"))):
        if value and value >= slots:
            raise ValueError(f"{name}={value}: the ring has {slots} slots; keep it below that "
                             "(0: as many as the ring holds)")
    assert all(s.inflight < geometry.ring_slots(s.stage) for s in geometry.streams), geometry
    return geometry


def _loader_constants(w: _Writer, loader: LoaderGeometry) -> None:
    """The module constants of a loader_warp build (the streams in consumption order: codegen.loader.Stream)."""
    def table(field: str) -> str:
        return ", ".join(f"{s.stage!r}: {getattr(s, field)}" for s in loader.streams)

    w(f"LOADER_SLOTS = {loader.slots}  # ring slots of 16 KB (bodies.SLOT_BYTES) the loader warp streams through")
    w("# per streamed stage: rows a CTA owns, rows per unit (one slot), units, units in flight at most (0: the ring)")
    w(f"LOADER_PER_CTA = {{{table('per_cta')}}}")
    w(f"LOADER_UNIT_ROWS = {{{table('unit_rows')}}}")
    w(f"LOADER_UNITS = {{{table('units')}}}")
    w(f"LOADER_INFLIGHT = {{{table('inflight')}}}")
    if loader.qkv_slots:
        w(f"LOADER_QKV_SLOTS = {loader.qkv_slots}  # the QKV rows' ring of their own, one slot per unit")
        w(f"LAYER_UNITS = {loader.layer_units}  # units a layer streams through the shared ring (its gate/up rows)")
    else:
        w(f"LAYER_UNITS = {loader.layer_units}  # units a layer streams (its QKV, then its gate/up rows)")
    if loader.gates:
        w(f"LOADER_GATES = {loader.gates!r}  # the arrivals the loader waits for (codegen.loader.LOADER_GATES)")
        w(f"LOADER_GATE_COUNT = {len(loader.gates)}")
    if loader.drain:
        w("LOADER_DRAIN = True  # the loader waits for the W_O block and the W_down columns to land")
    if loader.warpgroup:
        w(f"LOADER_THREADS = {loader.extra_threads}  # the loader warp (warp WARPS) and the idle rest of its warpgroup")
        w(f"REGISTERS = ({CONSUMER_REGISTERS}, {PRODUCER_REGISTERS})  # setmaxnreg: consumer warpgroups, the loader's")
    else:
        w(f"LOADER_THREADS = {loader.extra_threads}  # the loader warp (warp WARPS)")
    w("BLOCK = (THREADS + LOADER_THREADS, 1, 1)")


_LOADER_DECLARATIONS = [
    "# loader_warp: the ring the loader warp streams the QKV, gate/up and LM head rows through (a slot's full",
    "# mbarrier: its bytes landed; empty: every consumer warp read it), the W_O block's buffer and the mbarriers of",
    "# it and of s_down (one phase per layer); o_block / mlp_block: 1 where this CTA has a W_O block / W_down block",
    "s_slots = smem.allocate_tensor(",
    "    w_qkv.element_type, cute.make_layout(LOADER_SLOTS * SLOT_BYTES // 2), byte_alignment=128)",
    "s_wo = smem.allocate_tensor(",
    "    w_o.element_type, cute.make_layout(FUSED_O_BLOCK_ROWS * N_HEADS // N_KV_HEADS * HEAD_DIM), byte_alignment=128)",
    "s_full = smem.allocate_tensor(cutlass.Int64, cute.make_layout(LOADER_SLOTS), byte_alignment=8)",
    "s_empty = smem.allocate_tensor(cutlass.Int64, cute.make_layout(LOADER_SLOTS), byte_alignment=8)",
    "s_wo_full = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=8)",
    "s_wo_empty = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=8)",
    "s_down_empty = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=8)",
    "if tidx == 0:",
    "    for slot in cutlass.range_constexpr(LOADER_SLOTS):",
    "        cute.arch.mbarrier_init(s_full.iterator + slot, 1)",
    "        cute.arch.mbarrier_init(s_empty.iterator + slot, WARPS)",
    "    cute.arch.mbarrier_init(s_wo_full.iterator, 1)",
    "    cute.arch.mbarrier_init(s_wo_empty.iterator, 1)",
    "    cute.arch.mbarrier_init(s_down_empty.iterator, WARPS)",
    "cute.arch.mbarrier_init_fence()",
]
# after every loader mbarrier is initialised (the QKV ring's too): no warp may touch one before
_LOADER_START = [
    "cute.arch.barrier(barrier_id=0, number_of_threads=THREADS + LOADER_THREADS)  # all see the mbarriers initialised",
    "o_block = cutlass.max(cutlass.min(FUSED_O_BLOCKS - cta // N_KV_HEADS, 1), 0)",
    "mlp_block = cutlass.max(cutlass.min(MLP_CHUNKS - cta, 1), 0)",
]
_LOADER_QKV_DECLARATIONS = [
    "# loader_qkv_ring: the QKV rows' ring of their own (unit u of every layer in slot u)",
    "s_qslots = smem.allocate_tensor(",
    "    w_qkv.element_type, cute.make_layout(LOADER_QKV_SLOTS * SLOT_BYTES // 2), byte_alignment=128)",
    "s_qfull = smem.allocate_tensor(cutlass.Int64, cute.make_layout(LOADER_QKV_SLOTS), byte_alignment=8)",
    "s_qempty = smem.allocate_tensor(cutlass.Int64, cute.make_layout(LOADER_QKV_SLOTS), byte_alignment=8)",
    "if tidx == 0:",
    "    for slot in cutlass.range_constexpr(LOADER_QKV_SLOTS):",
    "        cute.arch.mbarrier_init(s_qfull.iterator + slot, 1)",
    "        cute.arch.mbarrier_init(s_qempty.iterator + slot, WARPS)",
    "cute.arch.mbarrier_init_fence()",
]
_LOADER_GATE_DECLARATIONS = [
    "# loader_gates: the mbarriers thread 0 arrives on after the grid arrivals the loader waits for (one a layer)",
    "s_gate = smem.allocate_tensor(cutlass.Int64, cute.make_layout(LOADER_GATE_COUNT), byte_alignment=8)",
    "if tidx == 0:",
    "    for gate in cutlass.range_constexpr(LOADER_GATE_COUNT):",
    "        cute.arch.mbarrier_init(s_gate.iterator + gate, 1)",
    "cute.arch.mbarrier_init_fence()",
]
_LOADER_SEQ = {"norm_qkv": "layer * LAYER_UNITS", "norm_gate_up": "layer * LAYER_UNITS + LOADER_UNITS['norm_qkv']",
               "norm_lm_head": "LAYERS * LAYER_UNITS"}
# loader_qkv_ring: the QKV rows count units in a sequence of their own, the shared ring only the gate/up and LM head's
_LOADER_QKV_RING_SEQ = {"norm_qkv": "layer * LOADER_UNITS['norm_qkv']", "norm_gate_up": "layer * LAYER_UNITS",
                        "norm_lm_head": "LAYERS * LAYER_UNITS"}
_LOADER_DROPPED = ("bodies.gemv_ring_prefill(", "bodies.prefetch_rows(", "bodies.mlp_down_bulk(",
                   "bodies.mlp_down_load(", "bodies.fused_o_load(")
_LOADER_O_BLOCK = ("bodies.loader_o_block(w_o[layer, None, None], s_wo, s_wo_full, s_wo_empty, layer, cta, lane, "
                   "N_HEADS, N_KV_HEADS, HEAD_DIM, HIDDEN, FUSED_O_BLOCKS, FUSED_O_BLOCK_ROWS)")
_LOADER_O_DRAIN = "bodies.wait_block(s_wo_full, layer % 2, o_block)  # loader_drain: the W_O block landed"
_LOADER_DOWN_DRAIN = "bodies.wait_block(s_down_bar, layer % 2, mlp_block)  # loader_drain: the W_down columns landed"
_LOADER_DOWN = ("bodies.loader_down(w_down_cta[layer, mchunk, None], s_down, s_down_bar, s_down_empty, layer, cta, "
                "lane, MLP_CHUNKS, MLP_PER_CTA, HIDDEN, MLP_BULK_BYTES)")


def _call_arguments(call: str) -> list[str]:
    """The positional arguments of a ``bodies.f(...)`` call, as source text."""
    node = ast.parse(call.strip()).body[0].value
    return [ast.get_source_segment(call.strip(), arg) for arg in node.args]


def _loader_calls(stage: Stage, streamed: str, loader: LoaderGeometry) -> tuple[str, str]:
    """(the consumers' ``bodies.gemv_slots`` call, the loader's ``bodies.loader_rows`` call) of a streamed GEMV
    stage, from its ``bodies.gemv_rows_streamed`` call (the same weight view, output, bias and gated write)."""
    (weight, _ring, bias, source, out, _warp, _lane, _warps, rows, cols, batch, _per_tile, accumulate, _unroll,
     has_bias, _stages, _prefilled, act) = _call_arguments(streamed)
    name = stage.name
    group = 2 if act != "0" else 1
    row0 = "cutlass.min(cta // MLP_CHUNKS, 1) * 2 * MLP_PER_CTA" if name == "norm_gate_up" else \
        f"cta * LOADER_PER_CTA[{name!r}]"
    own = bool(loader.qkv_slots) and name == "norm_qkv"
    ring, slots = (("s_qslots, s_qfull, s_qempty", "LOADER_QKV_SLOTS") if own else
                   ("s_slots, s_full, s_empty", "LOADER_SLOTS"))
    seq = (_LOADER_QKV_RING_SEQ if loader.qkv_slots else _LOADER_SEQ)[name]
    tail = f"LOADER_PER_CTA[{name!r}], LOADER_UNIT_ROWS[{name!r}], LOADER_UNITS[{name!r}], {slots}"
    consume = (f"bodies.gemv_slots({ring}, {seq}, {source}, {out}, {bias}, {row0}, tidx // 32, lane, {rows}, {cols}, "
               f"{batch}, {group}, {tail}, WARPS, {accumulate}, {has_bias}, {act})")
    load = (f"bodies.loader_rows({weight}, {ring}, {seq}, {row0}, lane, {rows}, {cols}, {tail}, "
            f"LOADER_INFLIGHT[{name!r}])")
    return consume, load


def _loader_stage_calls(stage: Stage, calls: list[tuple[str, str]], loader: LoaderGeometry) -> list[tuple[str, str]]:
    """A loader_warp build's body calls: each streamed GEMV reads the ring (``bodies.gemv_slots``), and the fused
    MLP's consumers release ``s_down`` after their down partials."""
    out = []
    for name, call in calls:
        if name == "gemv_rows_streamed":
            out.append(("gemv_slots", _loader_calls(stage, call, loader)[0]))
            continue
        out.append((name, call))
        if name == "mlp_down_partial":
            out.append(("release_block", "bodies.release_block(s_down_empty, tidx, mlp_block, True)"))
    return out


def _write_loader_program(w: _Writer, plan: Plan, loader: LoaderGeometry) -> None:
    """The loader warp's program (the else branch of the kernel's consumer test): every stream's copies in the order
    the consumers read them: per layer the QKV rows, the W_O block, the gate/up rows and the W_down columns, then the
    LM head's rows. With a QKV ring of its own (``loader.qkv_slots``) the next layer's QKV rows come right after the
    layer's W_O block (their slots free once this layer's QKV GEMV read them: during attention), then the W_down
    columns, then the gate/up rows."""
    plain = BuildOptions(fused_o=True, fused_mlp=True, fused_split=True, bulk_down=True)

    def rows(stage_name: str) -> str:
        stage = next(s for s in plan.stages if s.name == stage_name)
        streamed = [call for name, call in _stage_calls(plan, stage, plain) if name == "gemv_rows_streamed"]
        assert len(streamed) == 1, (stage.name, streamed)
        return _loader_calls(stage, streamed[0], loader)[1]

    w("else:  # warp WARPS, the loader: the weights in consumption order, never at a grid barrier", 1)
    if loader.warpgroup:
        w("cute.arch.setmaxregister_decrease(REGISTERS[1])", 2)
        w("if tidx < THREADS + 32:  # the rest of the loader's warpgroup has nothing to do", 2)
        w.base = 1
    qkv = rows("norm_qkv")
    if loader.qkv_slots:
        w(re.sub(r"\blayer\b", "0", qkv), 2)
    qkv_gate, mlp_gate = loader.gate_index("norm_qkv"), loader.gate_index("down_residual")
    w("for layer in range(LAYERS):", 2)
    if not loader.qkv_slots:
        w(qkv, 3)
    if mlp_gate is not None:
        w("if layer > 0:  # loader_gates 'mlp': once this CTA arrived after the layer before's MLP", 3)
        w(f"cute.arch.mbarrier_wait(s_gate.iterator + {mlp_gate}, (layer - 1) % 2)", 4)
    w(_LOADER_O_BLOCK, 3)
    if loader.drain:
        w(_LOADER_O_DRAIN, 3)
    if qkv_gate is not None:
        w("# loader_gates 'qkv': the copies below wait until this CTA arrived after the layer's QKV GEMV", 3)
        w(f"cute.arch.mbarrier_wait(s_gate.iterator + {qkv_gate}, layer % 2)", 3)
    split_gate = _split_gate(loader)
    base = 3
    if split_gate is not None:
        until = ("this CTA's split-KV items are done" if loader.gate_index(ITEMS_GATE) is not None
                 else "this CTA arrived after attention")
        w(f"# loader_gates {loader.gates[split_gate]!r}: a split step waits until {until}, then issues the", 3)
        w("# copies in the order they are read: the gate/up rows, the W_down columns, the next layer's QKV rows", 3)
        w(f"if bodies.fused_o_step(pos, {_first_key(plan)}, MIN_CHUNK) == 0:", 3)
        w(f"cute.arch.mbarrier_wait(s_gate.iterator + {split_gate}, layer % 2)", 4)
        w(rows("norm_gate_up"), 4)
        _write_loader_down(w, loader, 4)
        _write_loader_next_qkv(w, qkv, 4)
        w("else:", 3)
        base = 4
    if loader.qkv_slots:
        _write_loader_next_qkv(w, qkv, base)
        _write_loader_down(w, loader, base)
        w(rows("norm_gate_up"), base)
    else:
        w(rows("norm_gate_up"), 3)
        w(_LOADER_DOWN, 3)
    if mlp_gate is not None:
        w(f"cute.arch.mbarrier_wait(s_gate.iterator + {mlp_gate}, (LAYERS - 1) % 2)  # after the last layer's MLP", 2)
    w(rows("norm_lm_head"), 2)
    w.base = 0


def _split_gate(loader: LoaderGeometry) -> int | None:
    """The gate a split step's loader copies wait at (``loader_gates`` "attention" or "items"), or None."""
    attention = loader.gate_index("o_residual")
    return attention if attention is not None else loader.gate_index(ITEMS_GATE)


def _write_loader_next_qkv(w: _Writer, qkv: str, base: int) -> None:
    """The loader's copies of the next layer's QKV rows, into the slots this layer's QKV GEMV has read."""
    w("if layer + 1 < LAYERS:  # the next layer's QKV rows, into the slots this layer's QKV GEMV has read", base)
    w(re.sub(r"\blayer\b", "(layer + 1)", qkv), base + 1)


def _write_loader_down(w: _Writer, loader: LoaderGeometry, base: int) -> None:
    """The loader's copy of the layer's W_down columns (and, with ``loader.drain``, its wait for them to land)."""
    w(_LOADER_DOWN, base)
    if loader.drain:
        w(_LOADER_DOWN_DRAIN, base)


_CTA_BARRIER = "cute.arch.sync_threads()"
_CONSUMER_BARRIER = "cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)"


def _consumer_barriers(w: _Writer) -> None:
    """A loader_warp module's CTA barriers, in the kernel and in the bodies it copied, meet the ``THREADS`` consumer
    threads only (named barrier 1): the loader warp never waits at them."""
    w.lines = [line.replace(_CTA_BARRIER, _CONSUMER_BARRIER) for line in w.lines]


# ------------------------------------------------------------------------------ fused_mlp builds (codegen.fused_mlp)
_FUSED_MLP_DECLARATIONS = [
    "# fused_mlp: this CTA's W_down columns and activations, the block of the intermediate width it owns, and its",
    "# warps' index in that block's (gate, up) tiles (on CTAs without a block: past the last, so they have none)",
    "s_down = smem.allocate_tensor(",
    "    w_down.element_type, cute.make_layout((HIDDEN, MLP_PER_CTA), stride=(MLP_PER_CTA, 1)), byte_alignment=16)",
    "s_act = cute.make_tensor(s_att.iterator, cute.make_layout((1, MLP_PER_CTA), stride=(MLP_PER_CTA, 1)))",
    "mchunk = cutlass.min(cta, MLP_CHUNKS - 1)",
    "mwarp = tidx // 32 + cta // MLP_CHUNKS * MLP_TILES",
]
# bulk_down: the mbarrier the W_down bulk copies complete on, one phase per layer (initialised once per launch)
_BULK_DOWN_DECLARATIONS = [
    "s_down_bar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=8)",
    "if tidx == 0:",
    "    cute.arch.mbarrier_init(s_down_bar.iterator, 1)",
    "cute.arch.mbarrier_init_fence()",
]
# this CTA's (gate, up) row pairs of the layer's packed gate/up weight
_MLP_UP_ROWS = "cute.local_tile(w_gate_up[layer, None, None], (2 * MLP_PER_CTA, HIDDEN), (mchunk, 0))"


_MLP_DOWN_BULK = ("bodies.mlp_down_bulk(w_down_cta[layer, mchunk, None], s_down, s_down_bar, cta, tidx, MLP_CHUNKS, "
                  "MLP_PER_CTA, HIDDEN, MLP_BULK_BYTES)")


def _fused_mlp_before(calls: list[str], bulk_down: bool = False, early_down: str | None = None) -> list[str]:
    """The calls before the barrier that precedes a ``fused_mlp`` layer's MLP: the gate/up ring is filled with this
    CTA's own row pairs, and its W_down columns are copied into ``s_down`` (``bulk_down``: from the packed
    ``w_down_cta`` by cp.async.bulk; ``early_down``: not here, at attention's barrier, :func:`_stage_before_calls`;
    the L2 prefetch of the grid-wide dealing, which asks for nothing at the default budget, is left out)."""
    out = []
    for call in calls:
        if call.startswith("bodies.prefetch_rows(w_gate_up["):
            continue
        if call.startswith("bodies.gemv_ring_prefill(w_gate_up["):
            tail = call.split("TOTAL_WARPS, ", 1)[1].split(", ", 2)[2]  # per_tile, unroll, stages)
            out.append(f"bodies.gemv_ring_prefill({_MLP_UP_ROWS}, {_RING}, mwarp, lane, 1, WARPS, 2 * MLP_PER_CTA, "
                       f"HIDDEN, {tail}")
            if not early_down:
                out.append(_MLP_DOWN_BULK if bulk_down else
                           "bodies.mlp_down_load(w_down[layer, None, None], s_down, cta, tidx, MLP_CHUNKS, "
                           "MLP_PER_CTA, HIDDEN, MLP_LOAD_BITS, THREADS, COPY_SKIP)")
            continue
        out.append(call)
    return out


def _fused_mlp_calls(plan: Plan, stage: Stage, calls: list[tuple[str, str]],
                     bulk_down: bool = False) -> list[tuple[str, str]]:
    """A ``fused_mlp`` build's body calls: the embedding goes to ``o_mid`` (the accumulator's row 0 stays zero) and
    the accumulator is zeroed; the staging of every GEMV whose input is the residual x reads o_mid + the
    accumulator row of the layer before (and stores x); the gate/up stage computes this CTA's activations into
    ``s_act`` and adds its down-projection partials into the layer's accumulator row; the down stage has no
    body (its barrier stays: it ends the MLP's interval)."""
    if stage.scope == "prologue":
        (name, call), = calls  # pre-norm layouts (fused_o_refusal): the embedding alone
        assert name.startswith("embed_gather") and "(embed, tokens, x, " in call, calls
        return [(name, call.replace("(embed, tokens, x, ", "(embed, tokens, o_mid, ")),
                ("zero_rows", f"bodies.zero_rows(mlp_acc, cta, tidx, LAYERS + 1, HIDDEN + {ACC_PAD}, CTAS, THREADS)")]
    spec = spec_of(stage, plan)
    if spec.gemv is None:
        return calls
    if stage.name == "down_residual":
        return []
    if stage.name == "norm_gate_up":
        assert calls[0][0] == "rmsnorm_partials_to_smem" and calls[1][0] == "gemv_rows_streamed", calls
        up = (f"bodies.gemv_rows_streamed({_MLP_UP_ROWS}, {_RING}, s_act, s_vec, s_act, mwarp, lane, WARPS, "
              "2 * MLP_PER_CTA, HIDDEN, BATCH, ROWS_PER_TILE['norm_gate_up'], False, GEMV_UNROLL['norm_gate_up'], "
              f"False, {stage.tiling.stages}, True, {GATED_ACT_CODES[plan.dims.act]})")
        down = ("bodies.mlp_down_partial(s_down, s_act, mlp_acc[layer + 1, None], cta, tidx, MLP_CHUNKS, MLP_PER_CTA, "
                f"HIDDEN, THREADS, {'s_down_bar' if bulk_down else 's_down'}, layer % 2, MLP_BULK)")
        return [calls[0], ("gemv_rows_streamed", up),
                ("sync_threads", "cute.arch.sync_threads()  # s_act and s_down complete in the whole CTA"),
                ("mlp_down_partial", down)] + calls[2:]
    vector = spec.vector
    if vector.kind == "rmsnorm" and vector.source == "x":
        assert calls[0][0] == "rmsnorm_to_smem", calls
        final = vector.norm_role == "final_norm"
        weight = "final_norm" if final else f"norms[layer, {norm_slot(vector.norm_role, plan)}, None]"
        row = "LAYERS" if final else "layer"
        return [("rmsnorm_from_acc_to_smem",
                 f"bodies.rmsnorm_from_acc_to_smem(o_mid, mlp_acc[{row}, None], x, {weight}, s_vec, s_red, cta, tidx, "
                 "HIDDEN, CTAS, THREADS, EPS)")] + calls[1:]
    return calls


def _phase_timed_stages(w: _Writer, plan: Plan, prologue: list[Stage], per_layer: list[Stage],
                        epilogue: list[Stage], options: BuildOptions) -> None:
    """The stages of a ``timeline="phases"`` build: a clock after every phase, into consecutive slots (the layer
    loop's slots repeat every ``per_layer_slots``)."""
    slot = 2
    for stage in prologue:
        count = len(stage_phases(plan, stage, options))
        _stage(w, plan, stage, 1, layer_var=None, clocks=[str(slot + k) for k in range(count)], options=options)
        slot += count
    per_layer_slots = sum(len(stage_phases(plan, stage, options)) for stage in per_layer)
    layer_clocks, offset = {}, 0
    for stage in per_layer:
        count = len(stage_phases(plan, stage, options))
        layer_clocks[stage.name] = [f"{slot + offset + k} + layer * {per_layer_slots}" for k in range(count)]
        offset += count
    w("for layer in range(LAYERS):", 1)
    if options.fused_o:
        _write_fused_o_step(w, plan)
    for stage in per_layer:
        clocks = layer_clocks[stage.name]
        if _fused_layer_stage(options, stage) and stage.kind == "attention":  # it writes the O stage's phases too
            clocks = clocks + layer_clocks[_o_stage(plan).name]
        _stage(w, plan, stage, 2, layer_var="layer", clocks=clocks, options=options)
    slot += per_layer_slots * plan.dims.layers
    for stage in epilogue:
        count = len(stage_phases(plan, stage, options))
        _stage(w, plan, stage, 1, layer_var=None, clocks=[str(slot + k) for k in range(count)], options=options)
        slot += count


def _gemv(weight: str, out: str, rows: str, cols: str, stage: Stage, accumulate: bool, bias: str | None = None,
          gated: int = 0, bias_row: str | None = None, source: str = "s_vec") -> str:
    """The GEMV call of a stage; ``source``: the input rows it reads (the staged ``s_vec``, or on the tensor cores
    a global bf16 buffer: ``Plan.down_input``)."""
    if stage.tiling.mma:
        bias_arg = f"{bias}[layer, None]" if bias else out  # out: an unused stand-in when there is no bias
        part = "s_part" if stage.tiling.mma > 1 else "s_att"  # s_att: an unused stand-in when nothing splits
        return (f"bodies.gemv_rows_mma({weight}, {bias_arg}, {source}, {part}, {out}, cta, tidx, CTAS, WARPS, {rows}, "
                f"{cols}, BATCH, MMA_SPLIT[{stage.name!r}], {accumulate}, GEMV_UNROLL[{stage.name!r}], {bool(bias)}, "
                f"{gated})")
    args = (f"{out}, {_warp_index(stage)}, lane, TOTAL_WARPS, {rows}, {cols}, BATCH, ROWS_PER_TILE[{stage.name!r}], "
            f"{accumulate}, GEMV_UNROLL[{stage.name!r}]")
    bias_arg = f"{bias}[layer, None]" if bias else out  # out: an unused stand-in when there is no bias
    if bias_row:  # a row of its own (fused_o: the down projection's residual o_mid), added as the bias is
        bias, bias_arg = bias_row, bias_row
    if stage.tiling.stages:  # the cp.async ring; gated: the gate/up stage's gated write (+ringS+gated)
        return (f"bodies.gemv_rows_streamed({weight}, {_RING}, {bias_arg}, s_vec, {args}, {bool(bias)}, "
                f"{stage.tiling.stages}, {stage.tiling.preload}, {gated})")
    if stage.tiling.pipeline:
        pre = f"pre_{stage.name}" if stage.tiling.preload else out  # out: unused unless preloaded
        return (f"bodies.gemv_rows_pipelined({weight}, {pre}, {bias_arg}, s_vec, {args}, {bool(bias)}, "
                f"{stage.tiling.preload})")
    if stage.tiling.preload:
        return f"bodies.gemv_rows_pre({weight}, pre_{stage.name}, {bias_arg}, s_vec, {args}, {bool(bias)})"
    if gated:  # +gated on the plain register tiling (the plan refuses it with +pipeline or a register preload)
        return f"bodies.gemv_rows_gated({weight}, {bias_arg}, s_vec, {args}, {bool(bias)}, {gated})"
    if bias:
        return f"bodies.gemv_rows_bias({weight}, {bias_arg}, s_vec, {args})"
    return f"bodies.gemv_rows({weight}, s_vec, {args})"


_LAYER_INDEX = {"first": "0", "same": "layer", "next": "cutlass.min(layer + 1, LAYERS - 1)"}


def _next_gemv(plan: Plan, stage: Stage) -> tuple[str, str] | None:
    """The next GEMV after the barrier that ends ``stage`` (stage table): (its weight expression, its stage name)."""
    found = next_gemv(stage.name, plan)
    if found is None:
        return None
    spec, relation = found
    return f"{spec.gemv.weight}[{_LAYER_INDEX[relation]}, None, None]", spec.name


_RING = "s_ring[tidx // 32, None, None, None, None]"  # this warp's cp.async ring


def _preload_registers(plan: Plan) -> list[str]:
    """Kernel-start declarations of the register tiles of preloading GEMV stages (none by default)."""
    lines = []
    for stage in plan.stages:
        if stage.tiling.kind == "rows" and stage.tiling.preload and not stage.tiling.stages:
            width = stage.tiling.per_tile * stage.tiling.unroll
            lines.append(f"pre_{stage.name} = cute.make_rmem_tensor(cute.make_layout(8 * {width}), "
                         f"{spec_of(stage, plan).gemv.weight}.element_type)  # first K chunk, loaded before the barrier")
    return lines


def _attention_preloads(plan: Plan) -> bool:
    return any(s.kind == "attention" and s.tiling.preload for s in plan.stages)


def _before_barrier_calls(plan: Plan, stage: Stage, kv_prefetch: bool = False, to_l1: bool = False,
                          prefetch_bytes: int | None = None, kv_prefetch_rows: int | None = None,
                          mma_schedule: bool = False) -> list[str]:
    """Issued before a CTA waits at the barrier that ends ``stage``: the next GEMV's L2 prefetch, its register
    preload when that stage preloads, and the attention's first K/V rows when attention preloads.

    ``kv_prefetch`` (the default since session 16; ``generate(plan, kv_prefetch=False)`` leaves it out): before
    the barrier that precedes split-KV attention, each CTA also asks L2 for the cached K/V rows of its first
    attention work item (``bodies.split_kv_prefetch``; H200: -10 us per step on SmolLM-135M, 0 on Llama-3.2-1B,
    same logits), at most ``kv_prefetch_rows`` of them (None: :func:`default_kv_prefetch_rows`). That stage always
    has the next GEMV's prefetch too, so its ``prefetch`` phase
    (:func:`stage_phases`) exists either way."""
    calls = []
    following = next((s for s in plan.stages if s.index == stage.index + 1), None)
    if kv_prefetch and following is not None and following.kind == "attention" and kv_splits(plan):
        rows = kv_prefetch_rows or default_kv_prefetch_rows(plan)
        calls.append(_kv_prefetch_call(plan, to_l1, rows, mma_schedule))
    if following is not None and following.kind == "attention" and _attention_preloads(plan):
        calls.append("bodies.attention_preload(k_cache[layer, None, None, None, None], v_cache[layer, None, None, "
                     "None, None], pre_kv, pos, cta, tidx, BATCH, N_HEADS, N_KV_HEADS, HEAD_DIM)")
    prefetch = _prefetch_call(plan, stage, prefetch_bytes)
    if prefetch is None:
        return calls
    calls.append(prefetch)
    weight, next_name = _next_gemv(plan, stage)
    next_stage = next(s for s in plan.stages if s.name == next_name)
    if next_stage.tiling.preload and next_stage.tiling.stages:
        rows, cols = _gemv_shape(plan, next_name)
        # after the last layer's last GEMV comes the LM head, not the next layer's first GEMV: copy nothing there
        active = "cutlass.min(LAYERS - 1 - layer, 1)" if next_gemv(stage.name, plan)[1] == "next" else "1"
        calls.append(f"bodies.gemv_ring_prefill({weight}, {_RING}, {_warp_index(next_stage)}, lane, {active}, "
                     f"TOTAL_WARPS, {rows}, {cols}, {next_stage.tiling.per_tile}, {next_stage.tiling.unroll}, "
                     f"{next_stage.tiling.stages})")
    elif next_stage.tiling.preload:
        rows, cols = _gemv_shape(plan, next_name)
        calls.append(f"bodies.gemv_preload({weight}, pre_{next_name}, {_warp_index(next_stage)}, lane, TOTAL_WARPS, "
                     f"{rows}, {cols}, {next_stage.tiling.per_tile}, {next_stage.tiling.unroll})")
    return calls


def default_kv_prefetch_rows(plan: Plan) -> int:
    """The K/V prefetch's cap in cached rows per work item in a default build: the shortest split chunk
    (``MIN_CHUNK``), so every step whose context fits one chunk prefetches its item whole, as the uncapped
    prefetch of sessions 16-28 did, and a long context asks for no more than that. H200, session 29, GPU ms per
    step at 4000 with the uncapped prefetch -> none: Phi-3-mini 2.435 -> 2.347, Qwen3-0.6B 0.878 -> 0.840 (its QKV
    stage streamed weights at 3.15 vs 4.00 TB/s while every CTA asked for its whole item, up to the layer's whole
    K/V cache over the grid)."""
    if not kv_splits(plan):
        return 1
    return next(s.tiling for s in plan.stages if s.kind == "attention").per_tile


def _mma_slices_argument(mma_schedule: bool) -> str:
    """The keyword that hands an ``mma_schedule`` build's dealing to a body that calls ``split_schedule``
    (attention, its K/V prefetch, the folded merge: they must deal alike); nothing otherwise."""
    return ", mma_slices=MMA_SLICES" if mma_schedule else ""


def _kv_prefetch_call(plan: Plan, to_l1: bool = False, max_rows: int = 1, mma_schedule: bool = False) -> str:
    """L2 (``to_l1``: L1) prefetch of the first ``max_rows`` cached K/V rows of this CTA's first split-KV work
    item (as ``split_kv_attention`` deals them)."""
    return ("bodies.split_kv_prefetch(k_cache[layer, None, None, None, None], v_cache[layer, None, None, None, None], "
            f"pos, {_first_key(plan)}, cta, tidx, BATCH, N_KV_HEADS, HEAD_DIM, THREADS, KV_SPLITS, MIN_CHUNK, "
            f"CHUNK_QUANTUM, HEAD_SLICES, LONG_SLICES, {to_l1}, {max_rows}"
            f"{_mma_slices_argument(mma_schedule)})")


def _gemv_shape(plan: Plan, stage_name: str) -> tuple[int, int]:
    gemv = next(spec_of(s, plan) for s in plan.stages if s.name == stage_name).gemv
    return getattr(plan.dims, gemv.rows), getattr(plan.dims, gemv.cols)


def default_prefetch_bytes(next_stage: Stage) -> int:
    """The L2 prefetch budget of a default build before the barrier that precedes GEMV ``next_stage``: none where
    that GEMV fills its cp.async ring before the barrier (``preload`` + ``stages``: the ring's copies already ask
    for its first chunks), ``PREFETCH_BUDGET_BYTES`` elsewhere. H200, session 26, GPU ms per step with the 16 MB
    prefetch everywhere (the default until then) -> none: Phi-3-mini at 4000 2.561 -> 2.456 (gate/up's interval,
    which prefetched a 34 MB round of down's 32 KB tiles, 889 -> 774 us on CTA 0), Llama-3.2-1B at 16 0.816 ->
    0.760; 32 and 48 MB were slower still (2.649 / 2.776, 0.844 / 0.859). Kept before GEMVs that do not fill a
    ring (the plain, register-preloaded and tensor-core tilings), where it was not re-measured."""
    ring_prefilled = next_stage.tiling.preload and next_stage.tiling.stages
    return 0 if ring_prefilled else PREFETCH_BUDGET_BYTES


def _prefetch_call(plan: Plan, stage: Stage, budget: int | None = None) -> str | None:
    """L2 prefetch of the next GEMV's first tiles, issued before waiting at the barrier: as many tiles per warp as
    ``budget`` bytes over the whole grid allow, at least one; a call that asks for none where ``budget`` is 0 (it
    keeps the stage's phases the same in every build); None: :func:`default_prefetch_bytes`."""
    found = _next_gemv(plan, stage)
    if found is None:
        return None
    weight, next_name = found
    rows, cols = _gemv_shape(plan, next_name)
    next_stage = next(s for s in plan.stages if s.name == next_name)
    budget = default_prefetch_bytes(next_stage) if budget is None else budget
    per_tile = next_stage.tiling.per_tile
    total_warps = plan.ctas * plan.warps
    tile_bytes = per_tile * cols * 2
    tiles_per_warp = -(-next_stage.tiling.tiles // total_warps)
    max_tiles = min(tiles_per_warp, max(1, budget // (tile_bytes * total_warps))) if budget else 0
    return (f"bodies.prefetch_rows({weight}, {_warp_index(next_stage)}, lane, TOTAL_WARPS, {rows}, {cols}, {per_tile}, "
            f"{max_tiles})")


def _warp_index(stage: Stage) -> str:
    """The index a GEMV stage's tiles are dealt by: warp-major ``gwarp`` or CTA-major ``swarp``."""
    return "swarp" if stage.tiling.spread else "gwarp"


def _attention_call(plan: Plan, merge_preload: bool = False, spread_merge: bool = False,
                    folded: int = 0, mma_attention: bool = False, mma_schedule: bool = False,
                    mma_wide: bool = False) -> tuple[str, str]:
    if kv_splits(plan):
        return ("split_kv_attention",
                f"bodies.split_kv_attention(qkv, {_qk_norm_argument(plan)}, {_rope_arguments(plan)}, "
                "k_cache[layer, None, None, None, None], "
                f"v_cache[layer, None, None, None, None], attn, {ATTN_PART}, {ATTN_COUNT}, pos, {_first_key(plan)}, "
                "s_att, cta, tidx, "
                f"BATCH, N_HEADS, N_KV_HEADS, HEAD_DIM, CTAS, THREADS, ATTN_SCALE, {plan.has_head_norms}, EPS, "
                f"KV_SPLITS, ATT_UNROLL, MIN_CHUNK, CHUNK_QUANTUM, "
                f"{'ROTARY_DIM' if plan.dims.rotary_dim else 'HEAD_DIM'}, "
                f"{plan.dims.whole_qk_norm}, {merge_preload}, {spread_merge}, HEAD_SLICES, LONG_SLICES, KV_PIPELINE"
                f"{', FOLD_SPLITS' if folded else ''}{', mma_attention=MMA_ATTENTION' if mma_attention else ''}"
                f"{_mma_slices_argument(mma_schedule)}{', mma_wide=MMA_WIDE' if mma_wide else ''})")
    caches = (f"{_rope_arguments(plan)}, k_cache[layer, None, None, None, None], "
              "v_cache[layer, None, None, None, None], "
              "attn, pos, s_att, s_red, cta, tidx, BATCH, N_HEADS, N_KV_HEADS, HEAD_DIM, CAPACITY, CTAS, THREADS, "
              "ATTN_SCALE")
    if _attention_preloads(plan):
        norms = "qk_norms[layer, None, None]" if plan.has_head_norms else "qkv"
        early = caches.replace("s_att, s_red, cta", "s_att, s_red, s_new, pre_kv, cta")
        return ("decode_attention_early",
                f"bodies.decode_attention_early(qkv, {norms}, {early}, {plan.has_head_norms}, EPS)")
    if plan.has_head_norms:
        return "decode_attention_qk_norm", f"bodies.decode_attention_qk_norm(qkv, qk_norms[layer, None, None], {caches}, EPS)"
    return "decode_attention", f"bodies.decode_attention(qkv, {caches})"


def _qk_norm_argument(plan: Plan) -> str:
    """The split-KV attention's q/k norm weights: the layer's per-head ones, its whole-projection ones (OLMo-2), or
    ``qkv`` as an unused stand-in."""
    if plan.dims.whole_qk_norm:
        return "qk_norms[layer, None]"
    return "qk_norms[layer, None, None]" if plan.has_head_norms else "qkv"


def _rope_arguments(plan: Plan) -> str:
    """The layer's cos, sin tables: the one pair, or the layer's own of several (``rope_table[layer]``)."""
    if plan.has_rope_tables:
        return f"rope_cos[{ROPE_TABLE}[layer], None, None], rope_sin[{ROPE_TABLE}[layer], None, None]"
    return "rope_cos, rope_sin"


def _first_key(plan: Plan) -> str:
    """The first cached position attention sees: 0, or the start of the layer's sliding window."""
    return f"cutlass.max(pos + 1 - {ATTN_WINDOW}[layer], 0)" if plan.has_windows else "0"


def _ring_stages(plan: Plan) -> tuple[int, int]:
    """(stages, vectors per lane and stage) of the per-warp cp.async ring; (0, 0) when no stage streams."""
    return ring_shape(s.tiling for s in plan.stages if s.tiling.kind == "rows")


def _gemv_label(plan: Plan, stage: Stage) -> str:
    if stage.tiling.mma:
        return "gemv_rows_mma"
    if stage.tiling.stages:
        return "gemv_rows_streamed"
    if stage.tiling.pipeline:
        return "gemv_rows_pipelined"
    if stage.tiling.preload:
        return "gemv_rows_pre"
    return "gemv_rows_bias" if plan.bias_of(stage.name) else "gemv_rows"


def _vector_call(plan: Plan, spec: StageSpec, folded: int = 0, mma_schedule: bool = False) -> tuple[str, str]:
    """The body call that stages a GEMV stage's fp32 input row(s) in ``s_vec`` (``folded``: the attention
    output's staging merges the split-KV partials attention left unmerged)."""
    vector, width = spec.vector, DIMENSION_CONSTANTS[spec.vector.width]
    if vector.kind == "copy" and vector.source == "attn" and folded:
        return ("merge_splits_to_smem",
                f"bodies.merge_splits_to_smem(attn, {ATTN_PART}, s_vec, pos, {_first_key(plan)}, tidx, BATCH, N_HEADS, "
                "HEAD_DIM, THREADS, KV_SPLITS, MIN_CHUNK, CHUNK_QUANTUM, HEAD_SLICES, LONG_SLICES, FOLD_SPLITS"
                f"{_mma_slices_argument(mma_schedule)})")
    if vector.kind == "residual_norm":
        return "residual_norm_to_smem", _residual_norm_call(plan, vector, width)
    if vector.kind == "rmsnorm":
        slot = "final_norm" if vector.norm_role == "final_norm" else norm_slot(vector.norm_role, plan)
        weight = "final_norm" if slot == "final_norm" else f"norms[layer, {slot}, None]"
        return ("rmsnorm_to_smem",
                f"bodies.rmsnorm_to_smem({vector.source}, {weight}, s_vec, s_red, tidx, BATCH, {width}, THREADS, EPS)")
    if vector.kind == "copy":
        return "copy_to_smem", f"bodies.copy_to_smem({vector.source}, s_vec, tidx, BATCH, {width}, THREADS)"
    body = ACTIVATIONS[plan.dims.act]
    if plan.dims.act == "silu":
        return body, f"bodies.{body}({vector.source}, s_vec, tidx, BATCH, {width}, THREADS)"
    tanh = plan.dims.act == "gelu_tanh"
    return body, f"bodies.{body}({vector.source}, s_vec, tidx, BATCH, {width}, THREADS, approximate={tanh})"


_DELTA_LAYER = {"same": "layer", "previous": "cutlass.max(layer - 1, 0)", "last": "LAYERS - 1"}


def _residual_norm_call(plan: Plan, vector, width: str) -> str:
    """Post-norm layouts: stage norm(source + post_norm(delta)); one CTA stores the new residual."""
    post = f"norms[{_DELTA_LAYER[vector.delta_layer]}, {norm_slot(vector.delta_norm_role, plan)}, None]"
    if not vector.norm_role:  # OLMo-2: the staged row is the new residual; pre_weight is an unused stand-in
        pre = "final_norm"
    elif vector.norm_role == "final_norm":
        pre = "final_norm"
    else:
        pre = f"norms[layer, {norm_slot(vector.norm_role, plan)}, None]"
    out = vector.write_back or vector.source  # source: an unused stand-in when nothing is stored
    return (f"bodies.residual_norm_to_smem({vector.source}, {vector.delta}, {post}, {pre}, {out}, s_vec, s_red, cta, "
            f"tidx, BATCH, {width}, THREADS, EPS, {bool(vector.write_back)}, {bool(vector.norm_role)})")


def _gemv_stage_calls(plan: Plan, stage: Stage, folded: int = 0,
                      mma_schedule: bool = False) -> list[tuple[str, str]]:
    spec = spec_of(stage, plan)
    gemv = spec.gemv
    weight = f"{gemv.weight}[layer, None, None]" if spec.per_layer else gemv.weight
    rows, cols = DIMENSION_CONSTANTS[gemv.rows], DIMENSION_CONSTANTS[gemv.cols]
    bias = plan.bias_of(stage.name) if spec.per_layer else None
    gated = GATED_ACT_CODES[plan.dims.act] if gemv.gated else 0  # the gate/up GEMV applies the activation
    out, source, staged = gemv.out, "s_vec", True
    if plan.down_input == "global":  # the gated write goes to the bf16 DOWN_INPUT rows; the down GEMV reads them
        out = DOWN_INPUT if gemv.gated else out
        if stage.name == "down_residual":
            source, staged = DOWN_INPUT, False
    calls = [_vector_call(plan, spec, folded, mma_schedule)] if staged else []
    calls.append((_gemv_label(plan, stage),
                  _gemv(weight, out, rows, cols, stage, gemv.accumulate, bias, gated, source=source)))
    if spec.scope == "epilogue" and plan.dims.final_softcap:
        calls.append(("softcap_rows", f"bodies.softcap_rows({gemv.out}, {_warp_index(stage)}, lane, TOTAL_WARPS, "
                                      f"{rows}, BATCH, ROWS_PER_TILE[{stage.name!r}], FINAL_SOFTCAP)"))
    return calls


def _body_calls(plan: Plan, stage: Stage, merge_preload: bool = False,
                spread_merge: bool = False, folded: int = 0, mma_attention: bool = False,
                mma_schedule: bool = False, mma_wide: bool = False) -> list[tuple[str, str]]:
    """(body name, call text) of one stage, from the stage table (the merge options: :class:`BuildOptions`)."""
    spec = spec_of(stage, plan)
    if spec.gemv is not None:
        return _gemv_stage_calls(plan, stage, folded, mma_schedule)
    if stage.kind == "attention":
        return [_attention_call(plan, merge_preload, spread_merge, folded, mma_attention, mma_schedule, mma_wide)]
    if spec.writes != ("x",):  # post-norm layouts: the residual starts in x_mid, the pending MLP output is zero
        target, pending = spec.writes
        scaled = "_scaled" if plan.dims.embed_scale != 1.0 else ""
        scale = ", EMBED_SCALE" if scaled else ""
        return [(f"embed_gather{scaled}", f"bodies.embed_gather{scaled}(embed, tokens, {target}, cta, tidx, BATCH, HIDDEN, "
                                          f"CTAS, THREADS{scale})"),
                ("zero_rows", f"bodies.zero_rows({pending}, cta, tidx, BATCH, HIDDEN, CTAS, THREADS)")]
    if plan.dims.embed_scale != 1.0:
        return [("embed_gather_scaled", "bodies.embed_gather_scaled(embed, tokens, x, cta, tidx, BATCH, HIDDEN, CTAS, "
                                        "THREADS, EMBED_SCALE)")]
    return [("embed_gather", "bodies.embed_gather(embed, tokens, x, cta, tidx, BATCH, HIDDEN, CTAS, THREADS)")]


def _launcher(w: _Writer, arguments: list[str]) -> None:
    w("@cute.jit")
    w("def launch(")
    for line in _packed([f"{a}: cute.Tensor" for a in arguments] + ["stream: cuda.CUstream"], indent=1):
        w(line)
    w("):")
    w('"""Host side: one cooperative launch of the persistent megakernel."""', 1)
    w("megakernel(", 1)
    for line in _packed(list(arguments), indent=2):
        w(line)
    w(").launch(grid=GRID, block=BLOCK, smem=SMEM_BYTES, stream=stream, cooperative=True)", 1)


# ------------------------------------------------------------------------------ self-contained module.py
BODIES_DIR = Path(__file__).resolve().parent / "bodies"
BODY_FILES = ("common.py", "sync.py", "staging.py", "gemv.py", "attention.py", "split_attention.py",
              "mlp.py", "loader.py")  # = bodies'


def bodies_source() -> str:
    """The device routines as one text (read as text: no import, so generating a module never needs CuTe DSL):
    ``common.py`` whole (docstring, imports, constants), then each other file of ``BODY_FILES`` from its first
    statement after its import block on (its docstring and imports, relative ones included, are left out),
    three newlines apart. Routines are copied into module.py in this order."""
    texts = [(BODIES_DIR / BODY_FILES[0]).read_text().rstrip("\n")]
    for name in BODY_FILES[1:]:
        texts.append(_after_imports((BODIES_DIR / name).read_text()).strip("\n"))
    return "\n\n\n".join(texts) + "\n"


def _after_imports(text: str) -> str:
    """``text`` from the line after its last top-level import statement (docstring and imports dropped)."""
    body = ast.parse(text).body
    last = max(node.end_lineno for node in body if isinstance(node, (ast.Import, ast.ImportFrom)))
    return "".join(text.splitlines(keepends=True)[last:])
_BODY_CALL = re.compile(r"\bbodies\.([A-Za-z_]\w*)")
_BANNER = "# " + "=" * 108


def _megabake_version() -> str:
    from .. import __version__

    return __version__


@dataclass(frozen=True)
class Routines:
    """The top-level statements of the bodies source: its imports, and per defined name (function or
    constant), in source order, the index of its statement, its text (with the comments and blank lines
    between it and the statement before it) and the top-level names it refers to."""

    imports: list[str]
    index: dict[str, int]
    text: dict[str, str]
    refs: dict[str, set[str]]


def parse_routines(source: str) -> Routines:
    """Split the bodies' text (:func:`bodies_source`) into :class:`Routines`."""
    lines = source.splitlines()
    imports, index, text, refs = [], {}, {}, {}
    previous_end = 0
    for position, node in enumerate(ast.parse(source).body):
        start, previous_end = previous_end + 1, node.end_lineno
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                imports.append(ast.get_source_segment(source, node))
            continue
        for name in _defined_names(node):
            index[name] = position
            text[name] = "\n".join(lines[start - 1:node.end_lineno])
            refs[name] = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - {name}
    return Routines(imports, index, text, refs)


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [t.id for t in targets if isinstance(t, ast.Name)]
    return []


def called_bodies(kernel_text: str) -> list[str]:
    """The ``bodies.<name>`` routines a generated kernel calls, sorted."""
    return sorted(set(_BODY_CALL.findall(kernel_text)))


def needed_routines(routines: Routines, called: list[str]) -> list[str]:
    """``called`` plus every top-level name they reach, in the order of the bodies source."""
    missing = [name for name in called if name not in routines.text]
    if missing:
        raise ValueError(f"generated kernel calls bodies.{missing[0]}, which megabake/codegen/bodies does not define")
    needed, todo = set(), list(called)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(ref for ref in routines.refs[name] if ref in routines.text)
    return [name for name in routines.text if name in needed]


def _append_bodies(w: _Writer, called: list[str]) -> None:
    w("")
    w("")
    w(bodies_appendix(called))


def bodies_appendix(called: list[str]) -> str:
    """The appendix of a self-contained module: banner, the routines' imports, the routines ``called`` needs
    (verbatim, in source order), and the class ``bodies`` that binds the called ones to the names the kernel
    uses (a class, so no import is needed, unlike a namespace object)."""
    routines = parse_routines(bodies_source())
    w = _Writer()
    w(_BANNER)
    w(f"# Device routines, copied verbatim from megabake/codegen/bodies/__init__.py (MegaBake {_megabake_version()}):")
    w("# the ones the kernel above calls as bodies.<name>, and what they call, in source order. Do not edit:")
    w("# re-bake instead. Everything above this banner is generated from the plan.")
    w(_BANNER)
    for line in routines.imports:
        w(line)
    previous = None
    for name in needed_routines(routines, called):
        position = routines.index[name]
        if position == previous:  # one statement that defines several names
            continue
        if previous is not None and position == previous + 1:  # the next statement: keep the source's spacing
            w(routines.text[name])
        else:
            w("")
            w("")
            w(routines.text[name].strip("\n"))
        previous = position
    w("")
    w("")
    w("class bodies:")
    w('"""The routines above, under the names the kernel calls them by (bodies.<name>)."""', 1)
    w("")
    for name in called:
        w(f"{name} = staticmethod({name})", 1)
    return w.text.rstrip("\n")


def check_top_level_names(source: str) -> None:
    """A generated module binds every top-level name once (imports aside): a copied routine or constant
    must never shadow a plan constant, or the kernel would silently read the wrong one."""
    seen: set[str] = set()
    for node in ast.parse(source).body:
        for name in _defined_names(node):
            if name in seen:
                raise ValueError(f"generated module.py defines {name!r} twice: a copied device routine or "
                                 "constant collides with a generated name; rename it in megabake/codegen/bodies")
            seen.add(name)
