"""GEMV tilings: how each GEMV stage spreads over warps, and the default the plan picks.

Contract: :class:`GemvTuning` is one GEMV stage's tiling (rows per tile, 16-byte loads in flight, CTA-major
order, preload before the barrier, register pipeline or cp.async ring of ``stages``); ``GemvTuning.parse`` reads
its text form (``2x4+spread+preload+ring4``). ``default_tuning(threads, other_smem_bytes)`` is what
``build_plan`` uses when no tuning is given: the deepest streaming ring (4..2 stages) that fits next to the rest
of the kernel's shared memory, else the plain register tiling ``DEFAULT_TUNING``. ``ring_shape`` /
``ring_bytes`` size the per-warp ring; ``check_pipeline`` / ``check_ring`` refuse tilings that cannot run (a
:class:`PlanError` naming the limit and the fix). No tiling changes numerics (each lane's summation order is
the same: bit-identical logits, checked on the H200), except the tensor-core GEMV (``+mma``, experimental): the
MMA sums K in its own order. ``mma_split`` picks how many warps of a CTA share its 8-row tiles and
``mma_unroll`` its loads in flight; ``mma_bytes`` sizes the shared memory where split partial sums meet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import PlanError
from .stages import GEMV_STAGES

WARP = 32
HOPPER_SMEM_PER_BLOCK = 227 * 1024  # opt-in maximum of dynamic shared memory per CTA on SM90
MMA_ROWS = 8  # output rows per tensor-core GEMV tile (the N of mma.sync.m16n8k16; bodies/gemv.py)
MMA_MAX_BATCH = 8  # sequences per tile: rows of the MMA's A operand that the kernel uses
MMA_K_STEP = 32  # K elements per MMA step of a warp: 4 lanes x 8 bf16 per output row


@dataclass(frozen=True)
class GemvTuning:
    """How a GEMV stage spreads over warps: rows per warp tile, 16-byte loads in flight per lane and row,
    whether tiles go CTA-major (``spread``) instead of warp-major, whether the first K chunk is loaded
    before the preceding barrier (``preload``), whether the K loop keeps the next chunk's loads in flight
    while it reduces the current one (``pipeline``, in registers) or streams weights through a per-warp
    cp.async ring of ``stages`` chunks in shared memory. None of it changes numerics."""

    per_tile: int = 2
    unroll: int = 4
    spread: bool = False  # CTA-major tile order (see Tiling.spread)
    preload: bool = False  # first chunk in registers before the preceding barrier (see Tiling.preload)
    pipeline: bool = False  # next chunk's loads in flight while reducing this one (see Tiling.pipeline)
    stages: int = 0  # cp.async shared-memory ring of this depth (see Tiling.stages); 0: registers
    mma: bool = False  # tensor-core GEMV (mma.sync, tiles of 8 rows; see Tiling.mma): bf16-staged buckets only
    gated: bool = False  # gate/up stage only: the GEMV applies the activation as it writes (see Tiling.gated)

    def __post_init__(self):
        if not 1 <= self.per_tile <= 8 or not 1 <= self.unroll <= 32:
            raise PlanError(f"GEMV tuning per_tile={self.per_tile}, unroll={self.unroll} is outside "
                            "per_tile 1..8, unroll 1..32")
        if self.stages and not 2 <= self.stages <= 8:
            raise PlanError(f"GEMV tuning stages={self.stages}: a cp.async ring needs 2..8 stages (0: off)")
        if self.stages and self.pipeline:
            raise PlanError("GEMV tuning: a cp.async ring (stages) replaces the register pipeline; use stages with "
                            "pipeline=False")
        if self.mma and (self.per_tile != MMA_ROWS or self.spread or self.preload or self.pipeline or self.stages):
            raise PlanError(f"GEMV tuning {self.spec}: the tensor-core GEMV (mma) takes tiles of {MMA_ROWS} rows and "
                            f"no other flag (it pipelines its own K loop), e.g. {MMA_ROWS}x8+mma")
        if self.gated and (self.mma or self.pipeline or (self.preload and not self.stages) or self.per_tile % 2):
            raise PlanError(f"GEMV tuning {self.spec}: +gated (the activation in the gate/up GEMV's write) runs on "
                            "the plain register tiling or the cp.async ring, with an even number of rows per tile "
                            "(a gate row and its up row), e.g. 2x4+gated or 2x4+spread+preload+ring4+gated; +mma "
                            "applies the activation by itself")

    SPEC_FORM = ("PER_TILExUNROLL[+spread][+preload][+pipeline][+ringSTAGES], e.g. 2x4+spread+preload+ring4, "
                 "8xUNROLL+mma (tensor cores), or 2xUNROLL[...]+gated (activation in the gate/up write)")

    @property
    def spec(self) -> str:
        """The compact text form that :meth:`parse` reads (``2x4+spread+ring4``)."""
        flags = [name for name in ("spread", "preload", "pipeline") if getattr(self, name)]
        flags += [f"ring{self.stages}"] if self.stages else []
        flags += ["mma"] if self.mma else []
        flags += ["gated"] if self.gated else []
        return "+".join([f"{self.per_tile}x{self.unroll}", *flags])

    @classmethod
    def parse(cls, spec: str) -> "GemvTuning":
        """A tiling from its text form (:attr:`spec`); a clear :class:`PlanError` for anything else."""
        head, *flags = spec.strip().lower().split("+")
        match = re.fullmatch(r"(\d+)x(\d+)", head)
        if not match:
            raise PlanError(f"tiling {spec!r} is not of the form {cls.SPEC_FORM}")
        options: dict = {}
        for flag in flags:
            ring = re.fullmatch(r"ring(\d+)", flag)
            if flag in ("spread", "preload", "pipeline", "mma", "gated"):
                options[flag] = True
            elif ring:
                options["stages"] = int(ring.group(1))
            else:
                raise PlanError(f"tiling {spec!r}: unknown flag {flag!r}; the form is {cls.SPEC_FORM}")
        return cls(int(match.group(1)), int(match.group(2)), **options)


DEFAULT_TUNING = {name: GemvTuning() for name in GEMV_STAGES}  # the plain register tiling (fallback)
# The default when no tuning is given: weights streamed through a 4-stage cp.async ring, CTA-major tiles, the
# first chunk loaded before the barrier (H200, split-KV attention, 2026-12-01: -3.6% SmolLM-135M, -6.6%
# Llama-3.2-1B GPU time per step at positions 16-4000; docs/PERF.md). A bucket whose shared memory cannot
# hold 4 stages gets the deepest ring that fits (3 or 2), else the plain tiling.
STREAMING_DEFAULT = GemvTuning(2, 4, spread=True, preload=True, stages=4)


def streaming_tuning(stages: int) -> dict[str, GemvTuning]:
    """``STREAMING_DEFAULT`` with ``stages`` for every GEMV stage (0: the plain tiling); the LM head never
    preloads (no barrier precedes it inside the layer loop)."""
    if not stages:
        return dict(DEFAULT_TUNING)
    tiling = replace(STREAMING_DEFAULT, stages=stages)
    return {name: replace(tiling, preload=False) if name == "norm_lm_head" else tiling for name in GEMV_STAGES}


def default_tuning(threads: int, other_smem_bytes: int) -> dict[str, GemvTuning]:
    """The deepest streaming ring (4..2 stages) that fits next to ``other_smem_bytes``, else the plain tiling."""
    for stages in range(STREAMING_DEFAULT.stages, 1, -1):
        tuning = streaming_tuning(stages)
        if other_smem_bytes + ring_bytes(tuning.values(), threads) + 16 <= HOPPER_SMEM_PER_BLOCK:
            return tuning
    return streaming_tuning(0)


RING_VECTOR_BYTES = 32 * 16  # one 16-byte vector per lane of a warp


def ring_shape(tilings) -> tuple[int, int]:
    """(stages, vectors per lane and stage) of the per-warp cp.async ring that the streamed GEMV stages among
    ``tilings`` (GemvTuning or Tiling objects) share; (0, 0) when none streams."""
    streamed = [t for t in tilings if t.stages]
    if not streamed:
        return 0, 0
    return max(t.stages for t in streamed), max(t.per_tile * t.unroll for t in streamed)


def ring_bytes(tilings, threads: int) -> int:
    stages, slots = ring_shape(tilings)
    return threads // WARP * stages * slots * RING_VECTOR_BYTES


PIPELINE_MAX_VECTORS = 8  # per_tile x unroll of a pipelined GEMV: two register tiles of these per lane
PIPELINE_MAX_THREADS = 256  # the pipelined kernel uses ~250 registers per thread (sm_90a, Llama-1B shape)


def check_pipeline(tuning: dict[str, GemvTuning], threads: int) -> None:
    """A pipelined K loop holds two register tiles per lane, which bounds the tile and the CTA size."""
    for stage in GEMV_STAGES:
        chosen = tuning[stage]
        if chosen.pipeline and chosen.per_tile * chosen.unroll > PIPELINE_MAX_VECTORS:
            raise PlanError(f"GEMV stage {stage}: a pipelined K loop holds two tiles of per_tile x unroll = "
                            f"{chosen.per_tile * chosen.unroll} 16-byte vectors per lane; at most "
                            f"{PIPELINE_MAX_VECTORS} fit in registers (e.g. per_tile 2, unroll 4)")
        if chosen.pipeline and threads > PIPELINE_MAX_THREADS:
            raise PlanError(f"GEMV stage {stage}: a pipelined K loop needs ~250 registers per thread, so at most "
                            f"{PIPELINE_MAX_THREADS} threads per CTA (got {threads})")


def check_ring(tuning: dict[str, GemvTuning], threads: int, other_bytes: int) -> int:
    """Shared-memory bytes of the cp.async ring (with its alignment), checked against what the rest leaves."""
    ring = ring_bytes(tuning.values(), threads)
    if not ring:
        return 0
    if other_bytes + ring + 16 > HOPPER_SMEM_PER_BLOCK:
        stages, slots = ring_shape(tuning.values())
        room = (HOPPER_SMEM_PER_BLOCK - other_bytes - 16) // (threads // WARP * slots * RING_VECTOR_BYTES)
        fix = f"use stages <= {room}" if room >= 2 else "use stages=0 (no ring fits)"
        raise PlanError(f"a cp.async ring of {stages} stages x {slots} vectors per lane needs {ring} bytes of shared "
                        f"memory per CTA next to the kernel's {other_bytes}, over Hopper's {HOPPER_SMEM_PER_BLOCK}; "
                        f"{fix}, or fewer rows per tile x unroll")
    return ring + 16


MMA_SPLITS = (1, 2, 4, 8)  # warps of a CTA that share one tensor-core GEMV tile (each takes a slice of K)
MMA_SPLIT_SLACK = 0.03  # take the fewest warps per tile whose share of busy warps is this close to the best


def mma_split(rows: int, cols: int, ctas: int, warps: int) -> int:
    """Warps per 8-row tile of a tensor-core GEMV: few tiles (a 2048-row projection is 256 tiles for ~1000
    warps) split K so that every warp streams; the fewest warps whose busy share is within
    ``MMA_SPLIT_SLACK`` of the best (each extra warp per tile costs two CTA barriers per tile round)."""
    tiles = -(-rows // MMA_ROWS)
    options = [s for s in MMA_SPLITS if warps % s == 0 and cols % (MMA_K_STEP * s) == 0]
    if not options:
        raise PlanError(f"the tensor-core GEMV reduces K in steps of {MMA_K_STEP}; a reduction length of {cols} is not "
                        "a multiple of it: bake without +mma")

    def busy(split: int) -> float:
        per_round = ctas * (warps // split)
        return tiles / (-(-tiles // per_round) * per_round)

    best = max(busy(s) for s in options)
    return next(s for s in options if busy(s) >= best - MMA_SPLIT_SLACK)


def mma_unroll(cols: int, split: int, wanted: int) -> int:
    """The most 16-byte loads per lane and K step, at most ``wanted``, that divide a warp's slice of K."""
    steps = cols // split // MMA_K_STEP
    return max(u for u in range(1, max(1, wanted) + 1) if steps % u == 0)


def mma_bytes(tilings, threads: int) -> int:
    """Shared memory where a CTA's split tensor-core partial sums meet ([warps, 8 sequences, 8 rows] fp32, with
    its alignment); 0 when no stage splits."""
    if not any(getattr(t, "mma", 0) > 1 for t in tilings):
        return 0
    return mma_partials_bytes(threads)


def mma_partials_bytes(threads: int) -> int:
    """The bytes of :func:`mma_bytes` when some stage splits K across warps (the most the partial sums take)."""
    return threads // WARP * MMA_MAX_BATCH * MMA_ROWS * 4 + 16
