"""Grid barrier and L2 prefetch: how the persistent kernel's CTAs meet between stages.

Part of megabake/codegen/bodies (see its __init__ for the contract); code generation copies these
routines into module.py in the order of ``megabake.codegen.bodies.BODY_FILES``."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32, Int64

from .common import WARP


# ----------------------------------------------------------------------------------------- barrier
@cute.jit
def grid_barrier(barrier: cute.Tensor, tidx: Int32, ctas: cutlass.Constexpr[int]):
    """Counting grid barrier with an epoch: never reset, survives CUDA-graph replay.

    The counter only grows (64-bit: no wrap in practice). The old value returned by this CTA's release
    arrival says which generation it is in, so it waits (acquire loads) for the next multiple of ``ctas``.
    ``bar.sync`` before the arrival orders the CTA's writes before thread 0's release (cumulativity);
    ``bar.sync`` after the acquire makes everyone's writes visible to the whole CTA.
    """
    cute.arch.sync_threads()
    if tidx == 0:
        ptr = barrier.iterator.llvm_ptr
        old = cute.arch.atomic_add(ptr, Int64(1), sem="release", scope="gpu")
        target = (old // ctas + 1) * ctas
        current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
        while current < target:
            current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
    cute.arch.sync_threads()


@cute.jit
def grid_barrier_red(barrier: cute.Tensor, next_target: cute.Tensor, tidx: Int32, ctas: cutlass.Constexpr[int],
                     relaxed_polls: cutlass.Constexpr[bool]):
    """:func:`grid_barrier` with a fire-and-forget arrival (``generate(plan, barrier="red")`` or ``"red-fence"``,
    candidates measured against the default). Thread 0 keeps the counter value it waits for next in
    ``next_target`` (a one-element register tensor, 0 before the launch's first barrier), so only that first
    barrier needs the atomic's return value (which generation this launch is in); the others arrive with
    ``red.release.gpu.add`` and start polling at once, without an L2 round trip first. Polls are acquire loads,
    or with ``relaxed_polls`` relaxed loads and one ``fence.acq_rel.gpu`` after the last (a relaxed load followed
    by that fence is an acquire pattern in the PTX memory model).
    """
    cute.arch.sync_threads()
    if tidx == 0:
        ptr = barrier.iterator.llvm_ptr
        target = next_target[0]
        if target == Int64(0):
            old = cute.arch.atomic_add(ptr, Int64(1), sem="release", scope="gpu")
            target = (old // ctas + 1) * ctas
        else:
            cute.arch.red(ptr, Int64(1), op="add", dtype="u64", sem="release", scope="gpu")  # s64 add: no PTX form
        next_target[0] = target + ctas
        if cutlass.const_expr(relaxed_polls):
            current = cute.arch.load(ptr, Int64, sem="relaxed", scope="gpu")
            while current < target:
                current = cute.arch.load(ptr, Int64, sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        else:
            current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
            while current < target:
                current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
    cute.arch.sync_threads()


@cute.jit
def grid_arrive(barrier: cute.Tensor, next_target: cute.Tensor, tidx: Int32, ctas: cutlass.Constexpr[int]):
    """The arrival half of a split grid barrier (the default since session 27, ``codegen.DEFAULT_BARRIER``): this CTA's
    writes are done, so thread 0 arrives now (the launch's first barrier with an atomic that says which generation
    this launch is in, later ones with a fire-and-forget ``red.release.gpu.add``) and leaves the counter value to
    wait for in ``next_target``. The code between this and :func:`grid_wait` (the next GEMV's ring fill, L2
    prefetches) must not write global memory that another CTA reads after the barrier; it then runs while the
    arrival travels, instead of in front of it.
    """
    cute.arch.sync_threads()
    if tidx == 0:
        ptr = barrier.iterator.llvm_ptr
        target = next_target[0]
        if target == Int64(0):
            old = cute.arch.atomic_add(ptr, Int64(1), sem="release", scope="gpu")
            target = (old // ctas + 1) * ctas
        else:
            cute.arch.red(ptr, Int64(1), op="add", dtype="u64", sem="release", scope="gpu")  # s64 add: no PTX form
        next_target[0] = target


@cute.jit
def grid_wait(barrier: cute.Tensor, next_target: cute.Tensor, tidx: Int32, ctas: cutlass.Constexpr[int]):
    """The waiting half of a split grid barrier (:func:`grid_arrive`): thread 0 polls (acquire loads) until the
    counter reaches ``next_target`` and moves it to the next barrier's target; ``bar.sync`` then makes every
    CTA's writes visible to the whole CTA."""
    if tidx == 0:
        ptr = barrier.iterator.llvm_ptr
        target = next_target[0]
        current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
        while current < target:
            current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
        next_target[0] = target + ctas
    cute.arch.sync_threads()


@cute.jit
def grid_barrier_watched(barrier: cute.Tensor, tidx: Int32, ctas: cutlass.Constexpr[int], cta: Int32,
                         max_polls: cutlass.Constexpr[int]):
    """:func:`grid_barrier` of a watchdog build (``generate(plan, watchdog=True)``, a debugging variant): a CTA
    that polls more than ``max_polls`` times gives up waiting, so a deadlocked step ends instead of hanging. Per
    CTA, ``barrier[1 + 2 * cta]`` counts its arrivals and ``barrier[2 + 2 * cta]`` holds
    the ordinal (1-based) of the first barrier it gave up at, so the host sees which CTAs never arrived where.
    """
    cute.arch.sync_threads()
    if tidx == 0:
        ptr = barrier.iterator.llvm_ptr
        old = cute.arch.atomic_add(ptr, Int64(1), sem="release", scope="gpu")
        target = (old // ctas + 1) * ctas
        arrivals = barrier[1 + 2 * cta] + Int64(1)
        barrier[1 + 2 * cta] = arrivals
        current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
        polls = Int32(0)
        gave_up = Int32(0)
        while current < target:
            current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
            polls = polls + 1
            if polls > max_polls:
                current = target
                gave_up = Int32(1)
        if gave_up == 1 and barrier[2 + 2 * cta] == Int64(0):
            barrier[2 + 2 * cta] = arrivals
    cute.arch.sync_threads()


@cute.jit
def prefetch_rows(weight: cute.Tensor, gwarp: Int32, lane: Int32, total_warps: cutlass.Constexpr[int],
                  rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                  max_tiles: cutlass.Constexpr[int]):
    """Ask L2 for the first ``max_tiles`` weight tiles this warp owns in the next GEMV stage.

    Issued just before a grid barrier: weights do not depend on the barrier, so their DRAM latency and
    bandwidth overlap the wait. One ``prefetch.global.L2`` per 128-byte line, spread over the lanes.
    """
    lines_per_row = (cols * 2 + 127) // 128
    tiles = (rows + per_tile - 1) // per_tile
    if cutlass.const_expr(max_tiles > 0):
        for i in cutlass.range_constexpr(max_tiles):
            tile = gwarp + i * total_warps
            if tile < tiles:
                for r in cutlass.range_constexpr(per_tile):
                    row = cutlass.min(tile * per_tile + r, rows - 1)
                    for line in range(lane, lines_per_row, WARP):
                        ptr = weight[row, None].iterator + line * 64
                        cute.arch.prefetch(ptr.llvm_ptr, cache_level="L2")
