"""Decode-attention tiling: split-KV (flash decoding) or one (batch, head) per CTA, and its workspace.

Contract: ``attention_tiling(dims, batch, ctas, threads, split_kv)`` is the attention stage's :class:`Tiling`:
``kv_splits`` deals (split, batch, KV head) items over CTAs, each split covering at least ``SPLIT_KV_MIN_CHUNK``
cached positions (short contexts stay in one split; at most ``(head_dim + 2) * warps`` splits, the merge
weights [group, splits] reuse the warps' partial scratch), partial softmax results merged exactly through
``ATTN_PART`` by the last arrival counted in ``ATTN_COUNT``; ``heads`` gives each (batch, head) one CTA (the
layout attention preload needs). ``kv_splits(plan or tiling)`` is the number of splits per group (0 unsplit).

Head slices: where a KV group has several query heads, the tiling also records ``head_slices`` (the largest
divisor of the group's query heads that is at most the splits): at a step whose ``active`` splits leave room
(``active * head_slices <= splits``, :func:`slices_at`), each (split, batch, KV head) item is dealt as
``head_slices`` items of ``group / head_slices`` query heads each, so a short context is not one CTA per KV group
doing every head of it (gemma-2b: 8 query heads on one KV head). Every slice of the split that holds this step's
position appends the same new key and value; each (group, slice) merges its own heads, with its own counter in
``ATTN_COUNT``. Per head the sums are the same as unsliced, in the same order.

Long contexts (:func:`split_schedule`, session 19): where the splits are all in use, a step may still deal
``s`` slices (any divisor of ``head_slices``) over fewer, longer splits (at most ``splits // s`` of them) when
that gives each item less work, positions x query heads: SmolLM-135M at 2000 positions reads 128 positions for
3 heads per item unsliced and 256 positions for 1 head with 3 slices. Where the short-context rule above deals
slices, this one deals the same (the same chunk, the same bits). ``LONG_SLICES`` / ``PASS_CHUNKS`` are the
default dealing that both the kernel's default build and the reference executor read; ``chunk_quantum(plan)`` is
what chunks are rounded to (whole ``per_tile`` chunks, or with ``PASS_CHUNKS``, a candidate, whole CTA passes).

Tensor cores (session 32; the default build since session 33): ``mma_attention_items(plan)`` are the item sizes
that ``codegen.generate(plan)`` scores and sums with MMAs (:func:`mma_attention_fits`; ``mma_attention=False``:
the lane-group loop for every item); ``mma_slice_mask(plan)`` marks their slice counts, which
``split_schedule(..., mma_slices=...)`` (an ``mma_schedule`` build, a candidate) weighs by their chunk alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from .model import WARP, Buffer, ModelDims, Plan, Stage, Tiling


SPLIT_KV_UNROLL = 4  # K and V rows in flight per lane group and iteration
SPLIT_KV_MIN_CHUNK = 64  # fewest positions per split (rounded up to a CTA pass x unroll: 128 at head_dim 64);
# short contexts stay in one split (no merge). H200, gemma-2b at 4000 positions: 64 -> 1.972 ms, 128 -> 2.025
ATTN_PART = "attn_part"  # split-KV partials [B, heads, splits, head_dim + 2]: accumulator, max, sum
ATTN_COUNT = "attn_count"  # split-KV arrival counters [B * kv_heads * head slices] (int32, reset after use)
LONG_SLICES = True  # the default dealing deals head slices at long contexts too (split_schedule): the kernel's
# default build (codegen.generate's long_slices) and the reference executor read it, so they deal alike
MMA_ATT_MAX_HEADS = 8  # query heads per item that split-KV attention on the tensor cores takes (the default build
# since session 33, codegen.default_mma_attention: the M rows 0..7 of m16n8k16; bodies.mma_attention_fits mirrors it)
MMA_ATT_HEAD_DIMS = (64, 128)
MMA_ATT_WIDE_HEAD_DIMS = (256,)  # heads the tensor-core item also takes in an ``mma_wide`` build (session 41, the
# default since session 42: Gemma's heads of 256 dims; bodies._mma_softmax_chunk without the next step's loads ahead)
MMA_ATT_KEYS = 16  # cached keys per warp and step on the tensor cores (bodies.MMA_ATT_KEYS; the reference mirrors it)
PASS_CHUNKS = False  # a candidate (session 19; H200 session 21: within noise): chunks in whole CTA passes
# instead of whole per_tile chunks (chunk_quantum); read like LONG_SLICES by the kernel's default and the reference


def attention_tiling(dims: ModelDims, batch: int, ctas: int, threads: int, split_kv: bool) -> Tiling:
    if not split_kv:
        return Tiling("heads", batch * dims.n_heads, 1, batch * dims.n_heads)
    groups = batch * dims.n_kv_heads
    warps = threads // WARP
    splits = max(1, min(ctas // groups, (dims.head_dim + 2) * warps))  # the merge's weights fit the warps' scratch
    step = cta_pass(dims, threads) * SPLIT_KV_UNROLL
    min_chunk = -(-SPLIT_KV_MIN_CHUNK // step) * step
    return Tiling("kv_splits", groups, min_chunk, groups * splits, unroll=SPLIT_KV_UNROLL,
                  head_slices=_head_slices(dims.n_heads // dims.n_kv_heads, splits))


def cta_pass(dims: ModelDims, threads: int) -> int:
    """Cached positions one pass of a CTA covers in ``bodies._online_softmax_chunk``: a lane group per row (its
    lanes padded to a power of two), so 32 / lane group rows per warp."""
    lane_slots = 1 << (dims.head_dim // 8 - 1).bit_length()
    return threads // WARP * (WARP // lane_slots)


def chunk_quantum(plan: Plan, pass_chunks: bool = PASS_CHUNKS) -> int:
    """What a split-KV chunk longer than the minimum is rounded up to: whole ``per_tile`` chunks (CTA pass x
    unroll), or with ``pass_chunks`` whole CTA passes (SmolLM-135M at 2000 positions in 3 one-head slices: 13
    chunks of 160 instead of 8 of 256; the loop already ends mid-unroll where a chunk does)."""
    tiling = next(s.tiling for s in plan.stages if s.kind == "attention")
    return cta_pass(plan.dims, plan.threads) if pass_chunks else tiling.per_tile


def _head_slices(group: int, splits: int) -> int:
    """The largest divisor of ``group`` query heads that is at most ``splits`` (0 where that is 1: no slices)."""
    slices = max(s for s in range(1, group + 1) if group % s == 0 and s <= splits)
    return slices if slices > 1 else 0


def split_chunk(visible: int, splits: int, minimum: int, quantum: int | None = None) -> int:
    """Positions per split-KV item when ``visible`` positions are cut into at most ``splits`` items: the fewest
    that do it, rounded up to a multiple of ``quantum`` (default ``minimum``), at least ``minimum`` (as the
    kernel: ``bodies.split_chunk``)."""
    quantum = quantum or minimum
    per_split = -(-visible // splits)
    return max(-(-per_split // quantum) * quantum, minimum)


def split_chunks(tiling: Tiling, visible: int, quantum: int | None = None,
                 splits: int | None = None) -> tuple[int, int]:
    """(positions per split, active splits) of a split-KV step over ``visible`` positions with one item per
    (split, batch, KV head): the positions over the splits (``splits``, default the tiling's: a ``split_cap``
    build deals fewer), rounded up to whole ``quantum`` (default ``per_tile``) chunks."""
    chunk = split_chunk(visible, splits or kv_splits(tiling), tiling.per_tile, quantum)
    return chunk, -(-visible // chunk)


def slices_at(tiling: Tiling, active: int, splits: int | None = None) -> int:
    """Head slices of a split-KV step with ``active`` splits under the short-context rule: the tiling's
    ``head_slices`` while they fit in the items (``active * head_slices <= splits``, default the tiling's), else 1."""
    slices = tiling.head_slices
    return slices if slices > 1 and active * slices <= (splits or kv_splits(tiling)) else 1


@dataclass(frozen=True)
class SplitStep:
    """How one split-KV step deals its ``visible`` positions: ``active`` chunks of ``chunk`` positions, each
    chunk as ``slices`` items of group / slices query heads."""

    chunk: int
    active: int
    slices: int


def split_schedule(tiling: Tiling, visible: int, long_slices: bool = LONG_SLICES,
                   quantum: int | None = None, mma_slices: int = 0, splits: int | None = None) -> SplitStep:
    """The kernel's dealing of a split-KV step (``bodies.split_schedule``; ``quantum``: :func:`chunk_quantum`,
    default the tiling's ``per_tile``). Without ``long_slices``: the chunks of :func:`split_chunks`, sliced by
    :func:`slices_at`. With it, each divisor ``s`` of ``head_slices`` is tried with its smallest chunk that needs
    at most ``splits // s`` splits, and the one whose items do the least work (chunk x heads per item) is dealt,
    the fewest slices on a tie. Where the first rule slices, both agree. ``mma_slices`` (:func:`mma_slice_mask`,
    an ``mma_schedule`` build): bit ``s`` set where items of ``s`` slices run on the tensor cores, whose work is
    then the chunk alone. ``splits`` (a ``split_cap`` build, :func:`capped_splits`): the splits dealt, default the
    tiling's."""
    splits = splits or kv_splits(tiling)
    chunk, active = split_chunks(tiling, visible, quantum, splits)
    slices = slices_at(tiling, active, splits)
    if not long_slices or tiling.head_slices <= 1:
        return SplitStep(chunk, active, slices)
    best = None
    for s in range(1, tiling.head_slices + 1):
        if tiling.head_slices % s == 0:
            size = split_chunk(visible, splits // s, tiling.per_tile, quantum)
            work = size * (1 if (mma_slices >> s) & 1 else tiling.head_slices // s)
            if best is None or work < best[0]:
                best = (work, size, s)
    _, chunk, slices = best
    return SplitStep(chunk, -(-visible // chunk), slices)


def kv_splits(plan_or_tiling) -> int:
    """Splits per (batch, KV head) of a split-KV attention tiling (0 when attention is not split)."""
    tiling = plan_or_tiling
    if isinstance(plan_or_tiling, Plan):
        tiling = next(s.tiling for s in plan_or_tiling.stages if s.kind == "attention")
    return tiling.tiles // tiling.units if tiling.kind == "kv_splits" else 0


def capped_splits(plan_or_tiling, cap: int) -> int:
    """The splits a ``split_cap`` build (``codegen.generate(plan, split_cap=cap)``, a candidate) deals per (batch,
    KV head): the tiling's, at most ``cap``. Its items and buffers keep the tiling's layout; the dealing
    (:func:`split_schedule` with ``splits``) cuts the visible keys into fewer, longer chunks, so fewer items are
    active (Qwen2.5-0.5B b1 at 4000 with ``mma_schedule``: 16 splits of 7 heads x 256 keys, merged by the O blocks,
    instead of 32 of 7 heads x 128, merged by the last arrival first). ``codegen.generate`` refuses a cap below the
    tiling's ``head_slices`` (each slice count needs a split) or 2."""
    return min(kv_splits(plan_or_tiling), cap)


def mma_attention_fits(heads: int, head_dim: int, wide: bool = False) -> bool:
    """Whether a split-KV item of ``heads`` query heads of ``head_dim`` runs on the tensor cores in an
    ``mma_attention`` build (``bodies._mma_softmax_chunk``): 2 to 8 heads (one alone keeps the lane-group loop),
    64 or 128 dims, or with ``wide`` (an ``mma_wide`` build) also 256. The kernel's copy of this rule is
    ``bodies.mma_attention_fits``."""
    dims = MMA_ATT_HEAD_DIMS + (MMA_ATT_WIDE_HEAD_DIMS if wide else ())
    return 2 <= heads <= MMA_ATT_MAX_HEADS and head_dim in dims


def mma_attention_items(plan: Plan, head_slices: bool = True, wide: bool = False) -> list[int]:
    """The item sizes (query heads) the plan's split-KV attention can deal that an ``mma_attention`` build puts
    on the tensor cores: the group, and each of its head slices (``group / s`` for every divisor ``s`` of
    ``head_slices``; with ``head_slices=False`` the group only); ``wide``: in an ``mma_wide`` build."""
    mask, group = mma_slice_mask(plan, head_slices, wide), plan.dims.n_heads // plan.dims.n_kv_heads
    return sorted({group // s for s in range(1, mask.bit_length()) if (mask >> s) & 1}, reverse=True)


def mma_slice_mask(plan: Plan, head_slices: bool = True, wide: bool = False) -> int:
    """Bit ``s`` set for each slice count ``s`` the plan's split-KV attention can deal whose items (``group / s``
    query heads) run on the tensor cores in an ``mma_attention`` build (:func:`mma_attention_fits`; ``wide``: an
    ``mma_wide`` build): the ``mma_slices`` of :func:`split_schedule` and of the kernel's
    (``generate(plan, mma_schedule=True)``)."""
    if not kv_splits(plan):
        return 0
    tiling = next(s.tiling for s in plan.stages if s.kind == "attention")
    group = plan.dims.n_heads // plan.dims.n_kv_heads
    slices = max(1, tiling.head_slices) if head_slices else 1
    return sum(1 << s for s in range(1, slices + 1)
               if slices % s == 0 and mma_attention_fits(group // s, plan.dims.head_dim, wide))


def split_kv_buffers(dims: ModelDims, batch: int, stages: list[Stage]) -> list[Buffer]:
    tiling = next(s.tiling for s in stages if s.kind == "attention")
    splits = kv_splits(tiling)
    if not splits:
        return []
    return [Buffer(ATTN_PART, "workspace", "float32", [batch, dims.n_heads, splits, dims.head_dim + 2]),
            Buffer(ATTN_COUNT, "sync", "int32", [batch * dims.n_kv_heads * max(1, tiling.head_slices)])]


def check_attention_preload(dims: ModelDims, batch: int, ctas: int) -> None:
    if batch * dims.n_heads > ctas:
        raise PlanError(f"attention preload needs at most one (batch, head) tile per CTA: {batch} x {dims.n_heads} "
                        f"heads > {ctas} CTAs; bake without it or with a smaller batch")
    if dims.n_heads < 2:
        raise PlanError("attention preload keeps the new K/V row in the GEMV staging buffer, which needs n_heads >= 2")
