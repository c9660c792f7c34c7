"""GEMV: weight rows over warps (plain, register-preloaded, pipelined, cp.async-ring streamed, tensor-core
mma.sync for bf16-staged batches) and reductions.

Part of megabake/codegen/bodies (see its __init__ for the contract); code generation copies these
routines into module.py in the order of ``megabake.codegen.bodies.BODY_FILES``."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32, Int64

from .common import VEC, WARP
from .staging import GELU_TANH_C, INV_SQRT2


# -------------------------------------------------------------------------------------------- GEMV
def _staged_input(s_vec: cute.Tensor, b: int, kv: Int32):
    """The kv-th VEC-wide slice of sequence b's staged input row, in fp32 (bf16-staged buckets convert).
    Plain Python, run while the calling body is traced: the dtype test costs nothing on the device."""
    xv = cute.zipped_divide(s_vec[b, None], (VEC,))[(None, kv)].load()
    if s_vec.element_type != Float32:
        xv = xv.to(Float32)
    return xv


@cute.jit
def _gemv_chunk(weight: cute.Tensor, s_vec: cute.Tensor, acc: cute.Tensor, tile: Int32, kv: Int32,
                rows: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int]):
    for r in cutlass.range_constexpr(per_tile):
        row = cutlass.min(tile * per_tile + r, rows - 1)
        w = cute.zipped_divide(weight[row, None], (VEC,))[(None, kv)].load().to(Float32)
        for b in cutlass.range_constexpr(batch):
            xv = _staged_input(s_vec, b, kv)
            acc[r * batch + b] = acc[r * batch + b] + (w * xv).reduce(
                cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)


@cute.jit
def _gemv_rows(weight: cute.Tensor, s_vec: cute.Tensor, out: cute.Tensor, bias: cute.Tensor, gwarp: Int32,
               lane: Int32, total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int],
               cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
               accumulate: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int],
               has_bias: cutlass.Constexpr[bool], act: cutlass.Constexpr[int]):
    """out[b, r] (+)= sum_k weight[r, k] * s_vec[b, k] for the rows of the tiles this warp owns.

    Tile t covers rows [t*per_tile, (t+1)*per_tile) and belongs to global warp t % total_warps. Each lane
    reads 16-byte vectors; ``unroll`` x ``per_tile`` independent loads per lane are in flight per step of
    the K loop (fully unrolled bodies, compile-time K), accumulation is fp32, the warp reduces with
    shuffles, and lane 0 writes (each output element has exactly one owner), adding ``bias[row]`` (fp32)
    when ``has_bias``; a non-zero ``act`` writes the gated product instead (:func:`_gemv_write`).
    """
    tiles = (rows + per_tile - 1) // per_tile
    kvecs = cols // VEC
    chunk = WARP * unroll
    full_chunks = kvecs // chunk
    tail = kvecs - full_chunks * chunk
    acc = cute.make_rmem_tensor(cute.make_layout(per_tile * batch), Float32)
    for tile in range(gwarp, tiles, total_warps):
        for i in cutlass.range_constexpr(per_tile * batch):
            acc[i] = Float32(0.0)
        for c in range(full_chunks):
            for u in cutlass.range_constexpr(unroll):
                _gemv_chunk(weight, s_vec, acc, tile, c * chunk + u * WARP + lane, rows, batch, per_tile)
        if cutlass.const_expr(tail > 0):
            for u in cutlass.range_constexpr((tail + WARP - 1) // WARP):
                kv = full_chunks * chunk + u * WARP + lane
                if kv < kvecs:
                    _gemv_chunk(weight, s_vec, acc, tile, kv, rows, batch, per_tile)
        _gemv_write(acc, out, bias, tile, lane, rows, batch, per_tile, accumulate, has_bias, act)


@cute.jit
def _gemv_write(acc: cute.Tensor, out: cute.Tensor, bias: cute.Tensor, tile: Int32, lane: Int32,
                rows: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                accumulate: cutlass.Constexpr[bool], has_bias: cutlass.Constexpr[bool],
                act: cutlass.Constexpr[int]):
    """Warp-reduce each row's partial sums; lane 0 writes (adds the bias, accumulates into a residual).

    A non-zero ``act`` (``plan.stages.GATED_ACT_CODES``: the gate/up stage's gated write, tiling ``+gated``)
    reads the tile's packed rows as (gate, up) pairs, gate row i at 2i and up row i at 2i + 1, and writes
    act(gate) * up once at ``out[b, i]`` (:func:`_gemv_write_gated`): the down stage copies that row instead
    of evaluating the activation in every CTA (``accumulate`` is unused: the gate/up output is written)."""
    if cutlass.const_expr(act):
        _gemv_write_gated(acc, out, bias, tile, lane, rows, batch, per_tile, has_bias, act)
    else:
        for r in cutlass.range_constexpr(per_tile):
            row = tile * per_tile + r
            for b in cutlass.range_constexpr(batch):
                total = cute.arch.warp_reduction_sum(acc[r * batch + b])
                if lane == 0 and row < rows:
                    if cutlass.const_expr(has_bias):
                        total = total + bias[row]
                    if cutlass.const_expr(accumulate):
                        out[b, row] = out[b, row] + total
                    else:
                        out[b, row] = total


def preload_groups(cols: int, unroll: int) -> int:
    """K groups (32 lanes x 16 bytes) of a tile's first chunk that :func:`gemv_preload` holds in registers."""
    return min(unroll, (cols // VEC + WARP - 1) // WARP)


@cute.jit
def gemv_preload(weight: cute.Tensor, pre: cute.Tensor, gwarp: Int32, lane: Int32,
                 total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
                 per_tile: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int]):
    """Load the first K chunk of this warp's first tile of a coming GEMV into registers ``pre``
    (``per_tile * unroll`` 16-byte vectors, flat).

    Weights do not depend on the stages before: issued before a grid barrier, these loads are in flight
    during the wait and the next stage's staging, so the GEMV starts with data in hand
    (:func:`gemv_rows_pre`). Indices are clamped: a warp without a tile loads a valid row it never uses.
    """
    tiles = (rows + per_tile - 1) // per_tile
    kvecs = cols // VEC
    tile = cutlass.min(gwarp, tiles - 1)
    for r in cutlass.range_constexpr(per_tile):
        row = cutlass.min(tile * per_tile + r, rows - 1)
        for u in cutlass.range_constexpr(preload_groups(cols, unroll)):
            kv = cutlass.min(u * WARP + lane, kvecs - 1)
            cute.zipped_divide(pre, (VEC,))[(None, r * unroll + u)].store(
                cute.zipped_divide(weight[row, None], (VEC,))[(None, kv)].load())


@cute.jit
def _gemv_chunk_pre(pre: cute.Tensor, s_vec: cute.Tensor, acc: cute.Tensor, u: cutlass.Constexpr[int], kv: Int32,
                    batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int]):
    """:func:`_gemv_chunk` on preloaded weight vectors (same arithmetic, same order)."""
    for r in cutlass.range_constexpr(per_tile):
        w = cute.zipped_divide(pre, (VEC,))[(None, r * unroll + u)].load().to(Float32)
        for b in cutlass.range_constexpr(batch):
            xv = _staged_input(s_vec, b, kv)
            acc[r * batch + b] = acc[r * batch + b] + (w * xv).reduce(
                cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)


@cute.jit
def gemv_rows_pre(weight: cute.Tensor, pre: cute.Tensor, bias: cute.Tensor, s_vec: cute.Tensor, out: cute.Tensor,
                  gwarp: Int32, lane: Int32, total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int],
                  cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                  accumulate: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int],
                  has_bias: cutlass.Constexpr[bool]):
    """:func:`gemv_rows` (``bias`` used when ``has_bias``) whose first tile's first K chunk comes from the
    registers :func:`gemv_preload` filled; every lane sums its vectors in the same order, so results are
    bit-identical to :func:`gemv_rows`."""
    tiles = (rows + per_tile - 1) // per_tile
    kvecs = cols // VEC
    chunk = WARP * unroll
    full_chunks = kvecs // chunk
    tail = kvecs - full_chunks * chunk
    acc = cute.make_rmem_tensor(cute.make_layout(per_tile * batch), Float32)
    if gwarp < tiles:
        for i in cutlass.range_constexpr(per_tile * batch):
            acc[i] = Float32(0.0)
        for u in cutlass.range_constexpr(preload_groups(cols, unroll)):
            kv = u * WARP + lane
            if cutlass.const_expr((u + 1) * WARP <= kvecs):
                _gemv_chunk_pre(pre, s_vec, acc, u, kv, batch, per_tile, unroll)
            elif kv < kvecs:
                _gemv_chunk_pre(pre, s_vec, acc, u, kv, batch, per_tile, unroll)
        for c in range(1, full_chunks):
            for u in cutlass.range_constexpr(unroll):
                _gemv_chunk(weight, s_vec, acc, gwarp, c * chunk + u * WARP + lane, rows, batch, per_tile)
        if cutlass.const_expr(tail > 0 and full_chunks > 0):
            for u in cutlass.range_constexpr((tail + WARP - 1) // WARP):
                kv = full_chunks * chunk + u * WARP + lane
                if kv < kvecs:
                    _gemv_chunk(weight, s_vec, acc, gwarp, kv, rows, batch, per_tile)
        _gemv_write(acc, out, bias, gwarp, lane, rows, batch, per_tile, accumulate, has_bias, 0)
    _gemv_rows(weight, s_vec, out, bias, gwarp + total_warps, lane, total_warps, rows, cols, batch, per_tile,
               accumulate, unroll, has_bias, 0)  # the warp's later tiles, loaded as usual


@cute.jit
def _chunk_vector(weight: cute.Tensor, tile: Int32, kbase: Int32, lane: Int32, r: cutlass.Constexpr[int],
                  u: cutlass.Constexpr[int], rows: cutlass.Constexpr[int], kvecs: cutlass.Constexpr[int],
                  per_tile: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int]):
    """The 16-byte weight vector ``kbase + u*32 + lane`` of row ``r`` of ``tile``, as a view. Rows and
    vectors past the end are clamped (read, never used), so no access needs a branch."""
    row = cutlass.min(tile * per_tile + r, rows - 1)
    kv = kbase + u * WARP + lane
    if cutlass.const_expr(kvecs % (WARP * unroll) != 0):
        kv = cutlass.min(kv, kvecs - 1)
    return cute.zipped_divide(weight[row, None], (VEC,))[(None, kv)]


@cute.jit
def _load_chunk(weight: cute.Tensor, buf: cute.Tensor, tile: Int32, kbase: Int32, lane: Int32,
                rows: cutlass.Constexpr[int], kvecs: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                unroll: cutlass.Constexpr[int]):
    """Issue the 16-byte loads of one K chunk (:func:`_chunk_vector`) of ``tile`` into the registers ``buf``
    (flat ``r * unroll + u``, the layout of :func:`gemv_preload`)."""
    for r in cutlass.range_constexpr(per_tile):
        for u in cutlass.range_constexpr(unroll):
            cute.zipped_divide(buf, (VEC,))[(None, r * unroll + u)].store(
                _chunk_vector(weight, tile, kbase, lane, r, u, rows, kvecs, per_tile, unroll).load())


@cute.jit
def gemv_rows_pipelined(weight: cute.Tensor, pre: cute.Tensor, bias: cute.Tensor, s_vec: cute.Tensor,
                        out: cute.Tensor, gwarp: Int32, lane: Int32, total_warps: cutlass.Constexpr[int],
                        rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int],
                        per_tile: cutlass.Constexpr[int], accumulate: cutlass.Constexpr[bool],
                        unroll: cutlass.Constexpr[int], has_bias: cutlass.Constexpr[bool],
                        preloaded: cutlass.Constexpr[bool]):
    """:func:`gemv_rows` with a software-pipelined K loop: the warp's (tile, chunk) steps run as one loop, and
    each step issues the loads of the next step (the next tile's first chunk included) before it reduces the
    chunk in hand, so two chunks per warp are in flight and no tile boundary drains the pipe.

    When K is not a whole number of chunks, the last chunk of a tile is partial: its loads are clamped and
    each lane adds only the vectors below K, as :func:`gemv_rows` does for its tail. With ``preloaded`` the
    first chunk comes from the registers :func:`gemv_preload` filled before the barrier (``pre``; unused
    otherwise). Every lane sums its vectors in the order :func:`gemv_rows` does, so results are
    bit-identical to it.
    """
    tiles = (rows + per_tile - 1) // per_tile
    chunk = WARP * unroll
    kvecs = cols // VEC
    chunks = (kvecs + chunk - 1) // chunk
    width = VEC * per_tile * unroll
    steps = (tiles - gwarp + total_warps - 1) // total_warps * chunks  # 0 for a warp without a tile
    cur = cute.make_rmem_tensor(cute.make_layout(width), weight.element_type)
    nxt = cute.make_rmem_tensor(cute.make_layout(width), weight.element_type)
    acc = cute.make_rmem_tensor(cute.make_layout(per_tile * batch), Float32)
    for i in cutlass.range_constexpr(per_tile * batch):
        acc[i] = Float32(0.0)
    if cutlass.const_expr(preloaded):
        cur.store(pre.load())
    elif gwarp < tiles:
        _load_chunk(weight, cur, gwarp, 0, lane, rows, kvecs, per_tile, unroll)
    for step in range(steps):
        # The next step's loads go out before this step's arithmetic. The last step reloads its own chunk
        # (an L2 hit) instead of branching: a conditional load would keep a third register tile live.
        after = cutlass.min(step + 1, steps - 1)
        _load_chunk(weight, nxt, gwarp + after // chunks * total_warps, after % chunks * chunk, lane, rows, kvecs,
                    per_tile, unroll)
        cute.arch.sync_warp()  # a scheduling fence: ptxas may otherwise sink these loads below the FFMAs
        c = step % chunks
        for u in cutlass.range_constexpr(unroll):
            kv = c * chunk + u * WARP + lane
            if cutlass.const_expr(kvecs % chunk == 0):
                _gemv_chunk_pre(cur, s_vec, acc, u, kv, batch, per_tile, unroll)
            elif kv < kvecs:  # the partial last chunk of a tile
                _gemv_chunk_pre(cur, s_vec, acc, u, kv, batch, per_tile, unroll)
        if c == chunks - 1:
            _gemv_write(acc, out, bias, gwarp + step // chunks * total_warps, lane, rows, batch, per_tile,
                        accumulate, has_bias, 0)
            for i in cutlass.range_constexpr(per_tile * batch):
                acc[i] = Float32(0.0)
        cur.store(nxt.load())


@cute.jit
def _copy_chunk(weight: cute.Tensor, ring: cute.Tensor, slot: Int32, tile: Int32, kbase: Int32, lane: Int32,
                rows: cutlass.Constexpr[int], kvecs: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                unroll: cutlass.Constexpr[int]):
    """cp.async the 16-byte vectors of one K chunk (:func:`_chunk_vector`) of ``tile`` into ring ``slot``:
    vector ``r * unroll + u`` of each lane lands in ``ring[slot, r * unroll + u, lane, :]``."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), weight.element_type,
                               num_bits_per_copy=128)
    for r in cutlass.range_constexpr(per_tile):
        for u in cutlass.range_constexpr(unroll):
            cute.copy(atom, _chunk_vector(weight, tile, kbase, lane, r, u, rows, kvecs, per_tile, unroll),
                      cute.zipped_divide(ring[slot, r * unroll + u, lane, None], (VEC,))[(None, 0)])


@cute.jit
def _gemv_chunk_ring(ring: cute.Tensor, slot: Int32, s_vec: cute.Tensor, acc: cute.Tensor, u: cutlass.Constexpr[int],
                     kv: Int32, lane: Int32, batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                     unroll: cutlass.Constexpr[int]):
    """:func:`_gemv_chunk` on weight vectors from ring ``slot`` (same arithmetic, same order)."""
    for r in cutlass.range_constexpr(per_tile):
        w = cute.zipped_divide(ring[slot, r * unroll + u, lane, None], (VEC,))[(None, 0)].load().to(Float32)
        for b in cutlass.range_constexpr(batch):
            xv = _staged_input(s_vec, b, kv)
            acc[r * batch + b] = acc[r * batch + b] + (w * xv).reduce(
                cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)


@cute.jit
def _fill_ring(weight: cute.Tensor, ring: cute.Tensor, gwarp: Int32, lane: Int32, steps: Int32,
               chunks: cutlass.Constexpr[int], total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int],
               kvecs: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int],
               stages: cutlass.Constexpr[int]):
    """Copy the first ``stages - 1`` steps' chunks into ring slots 0.. (one committed group per step, empty
    past ``steps``)."""
    for ahead in cutlass.range_constexpr(stages - 1):
        if ahead < steps:
            _copy_chunk(weight, ring, ahead, gwarp + ahead // chunks * total_warps, ahead % chunks * WARP * unroll,
                        lane, rows, kvecs, per_tile, unroll)
        cute.arch.cp_async_commit_group()


@cute.jit
def gemv_ring_prefill(weight: cute.Tensor, ring: cute.Tensor, gwarp: Int32, lane: Int32, active: Int32,
                      total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
                      per_tile: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int],
                      stages: cutlass.Constexpr[int]):
    """Issued before a grid barrier: start copying the first ``stages - 1`` chunks of the coming streamed GEMV
    into this warp's ring (weights do not depend on the stages before), so they land during the wait and the
    next stage's staging. ``active`` 0 copies nothing (the last layer's down stage, whose "next" QKV GEMV
    does not exist) but still commits the groups, which complete at once."""
    tiles = (rows + per_tile - 1) // per_tile
    chunks = (cols // VEC + WARP * unroll - 1) // (WARP * unroll)
    steps = (tiles - gwarp + total_warps - 1) // total_warps * chunks * active
    _fill_ring(weight, ring, gwarp, lane, steps, chunks, total_warps, rows, cols // VEC, per_tile, unroll, stages)


@cute.jit
def gemv_rows_streamed(weight: cute.Tensor, ring: cute.Tensor, bias: cute.Tensor, s_vec: cute.Tensor,
                       out: cute.Tensor, gwarp: Int32, lane: Int32, total_warps: cutlass.Constexpr[int],
                       rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int],
                       per_tile: cutlass.Constexpr[int], accumulate: cutlass.Constexpr[bool],
                       unroll: cutlass.Constexpr[int], has_bias: cutlass.Constexpr[bool],
                       stages: cutlass.Constexpr[int], prefilled: cutlass.Constexpr[bool],
                       act: cutlass.Constexpr[int]):
    """:func:`gemv_rows` streaming its weights through this warp's shared-memory ring ``ring`` ([stages,
    vectors, 32 lanes, 8]): cp.async keeps ``stages - 1`` chunks (the next tiles' included) in flight while
    the warp reduces the current one, without holding registers for them.

    Every lane reads back only the vectors it copied itself, so ``cp.async.wait_group`` is the only
    synchronisation: no barrier, no mbarrier. Each step commits one group (empty past the last step), so
    ``wait_group(stages - 1)`` always means "this step's chunk has landed". The slot refilled at a step is
    the one reduced at the step before, by the same lane. Partial last chunks, the order of the sums and
    the writes are those of :func:`gemv_rows_pipelined`: results are bit-identical to :func:`gemv_rows`.
    With ``prefilled``, :func:`gemv_ring_prefill` already copied (and committed) the first ``stages - 1``
    chunks before the barrier that precedes this stage. A non-zero ``act`` is the gated write (tiling
    ``+ringS+gated``, :func:`_gemv_write`).
    """
    tiles = (rows + per_tile - 1) // per_tile
    chunk = WARP * unroll
    kvecs = cols // VEC
    chunks = (kvecs + chunk - 1) // chunk
    steps = (tiles - gwarp + total_warps - 1) // total_warps * chunks  # 0 for a warp without a tile
    acc = cute.make_rmem_tensor(cute.make_layout(per_tile * batch), Float32)
    for i in cutlass.range_constexpr(per_tile * batch):
        acc[i] = Float32(0.0)
    if cutlass.const_expr(not prefilled):
        _fill_ring(weight, ring, gwarp, lane, steps, chunks, total_warps, rows, kvecs, per_tile, unroll, stages)
    for step in range(steps):
        ahead = step + stages - 1
        if ahead < steps:
            _copy_chunk(weight, ring, ahead % stages, gwarp + ahead // chunks * total_warps, ahead % chunks * chunk,
                        lane, rows, kvecs, per_tile, unroll)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(stages - 1)
        slot = step % stages
        c = step % chunks
        for u in cutlass.range_constexpr(unroll):
            kv = c * chunk + u * WARP + lane
            if cutlass.const_expr(kvecs % chunk == 0):
                _gemv_chunk_ring(ring, slot, s_vec, acc, u, kv, lane, batch, per_tile, unroll)
            elif kv < kvecs:  # the partial last chunk of a tile
                _gemv_chunk_ring(ring, slot, s_vec, acc, u, kv, lane, batch, per_tile, unroll)
        if c == chunks - 1:
            _gemv_write(acc, out, bias, gwarp + step // chunks * total_warps, lane, rows, batch, per_tile,
                        accumulate, has_bias, act)
            for i in cutlass.range_constexpr(per_tile * batch):
                acc[i] = Float32(0.0)
    cute.arch.cp_async_wait_group(0)  # nothing in flight into the ring when the next GEMV stage refills it


@cute.jit
def gemv_rows(weight: cute.Tensor, s_vec: cute.Tensor, out: cute.Tensor, gwarp: Int32, lane: Int32,
              total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
              batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
              accumulate: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int]):
    """out[b, r] (+)= sum_k weight[r, k] * s_vec[b, k] over the rows this warp owns (see :func:`_gemv_rows`)."""
    _gemv_rows(weight, s_vec, out, out, gwarp, lane, total_warps, rows, cols, batch, per_tile, accumulate, unroll,
               False, 0)


@cute.jit
def gemv_rows_bias(weight: cute.Tensor, bias: cute.Tensor, s_vec: cute.Tensor, out: cute.Tensor, gwarp: Int32,
                   lane: Int32, total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int],
                   cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                   accumulate: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int]):
    """:func:`gemv_rows` plus a per-row fp32 bias (a linear layer with a bias, e.g. Qwen2's q/k/v)."""
    _gemv_rows(weight, s_vec, out, bias, gwarp, lane, total_warps, rows, cols, batch, per_tile, accumulate, unroll,
               True, 0)


@cute.jit
def gemv_rows_gated(weight: cute.Tensor, bias: cute.Tensor, s_vec: cute.Tensor, out: cute.Tensor, gwarp: Int32,
                    lane: Int32, total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int],
                    cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                    accumulate: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int],
                    has_bias: cutlass.Constexpr[bool], act: cutlass.Constexpr[int]):
    """The gate/up GEMV with the activation in its write (tiling ``+gated``): the packed rows pair gate row i
    (row 2i) with up row i (row 2i + 1), so a tile of an even ``per_tile`` holds whole pairs and lane 0 writes
    act(gate) * up once, at ``out[b, i]`` (:func:`_gemv_write`, ``act`` non-zero)."""
    _gemv_rows(weight, s_vec, out, bias, gwarp, lane, total_warps, rows, cols, batch, per_tile, accumulate, unroll,
               has_bias, act)


@cute.jit
def _gemv_write_gated(acc: cute.Tensor, out: cute.Tensor, bias: cute.Tensor, tile: Int32, lane: Int32,
                      rows: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                      has_bias: cutlass.Constexpr[bool], act: cutlass.Constexpr[int]):
    """Warp-reduce each (gate, up) row pair of the tile; lane 0 adds the biases and writes act(gate) * up at the
    pair's index (``act``: ``plan.stages.GATED_ACT_CODES``, :func:`_gated_act`)."""
    for r in cutlass.range_constexpr(per_tile // 2):
        row = tile * per_tile + 2 * r
        for b in cutlass.range_constexpr(batch):
            gate = cute.arch.warp_reduction_sum(acc[2 * r * batch + b])
            up = cute.arch.warp_reduction_sum(acc[(2 * r + 1) * batch + b])
            if lane == 0 and row < rows:
                if cutlass.const_expr(has_bias):
                    gate = gate + bias[row]
                    up = up + bias[row + 1]
                out[b, row // 2] = _gated_act(gate, up, act)


@cute.jit
def softcap_rows(out: cute.Tensor, gwarp: Int32, lane: Int32, total_warps: cutlass.Constexpr[int],
                 rows: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                 cap: cutlass.Constexpr[float]):
    """out[b, row] = cap * tanh(out[b, row] / cap) for the rows this warp's GEMV tiles wrote (same tile order):
    lane 0 wrote them and lane 0 rewrites them, so no synchronisation is needed (Gemma 2's final soft-capping)."""
    tiles = (rows + per_tile - 1) // per_tile
    if lane == 0:
        for tile in range(gwarp, tiles, total_warps):
            for r in cutlass.range_constexpr(per_tile):
                row = tile * per_tile + r
                if row < rows:
                    for b in cutlass.range_constexpr(batch):
                        out[b, row] = cap * cute.math.tanh(out[b, row] * (1.0 / cap))


# ------------------------------------------------------------------------------- tensor-core GEMV
# Batched GEMV on the tensor cores (bf16-staged buckets, batch <= 8): one mma.sync.m16n8k16 multiplies a
# 16 x 16 block of staged inputs (rows = sequences, 8 of 16 used) by 16 x 8 weights (columns = 8 output rows)
# into fp32, so a weight element costs no conversion and no FMA per sequence. The K order inside a dot product
# is free: lane (g, t) = (lane // 4, lane % 4) loads the 16-byte vector t of output row g's weights and of
# sequence g's staged row (same 8 k), and feeds k = 8t + 4m + {0, 1} to MMA slots 2t + {0, 1} and
# k = 8t + 4m + {2, 3} to slots 2t + 8 + {0, 1} of the m-th of two MMAs, for A and B alike. Lane (g, t) then
# holds out[sequence g, rows 2t, 2t + 1] of the tile. Rows of A past the batch (and 8..15) only feed output
# rows that are never written.
MMA_ROWS = 8  # output rows per tile: the N of m16n8k16
MMA_LANES_PER_ROW = 4  # lanes (16-byte vectors) side by side on one row per K step


@cute.jit
def _load_mma_chunk(weight: cute.Tensor, buf: cute.Tensor, row: Int32, kv0: Int32, tig: Int32,
                    unroll: cutlass.Constexpr[int]):
    """Vectors ``kv0 + u * 4 + tig`` (u < unroll) of weight row ``row`` into the registers ``buf``."""
    for u in cutlass.range_constexpr(unroll):
        cute.zipped_divide(buf, (VEC,))[(None, u)].store(
            cute.zipped_divide(weight[row, None], (VEC,))[(None, kv0 + u * MMA_LANES_PER_ROW + tig)].load())


@cute.jit
def _mma_chunk(atom, buf: cute.Tensor, s_vec: cute.Tensor, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
               seq: Int32, kv0: Int32, tig: Int32, unroll: cutlass.Constexpr[int]):
    """Two MMAs per 16-byte vector of ``buf`` against the same 8 k of staged row ``seq`` (module comment)."""
    for u in cutlass.range_constexpr(unroll):
        xv = cute.zipped_divide(s_vec[seq, None], (VEC,))[(None, kv0 + u * MMA_LANES_PER_ROW + tig)].load()
        for m in cutlass.range_constexpr(2):
            a[0] = xv[4 * m]
            a[1] = xv[4 * m + 1]
            a[4] = xv[4 * m + 2]
            a[5] = xv[4 * m + 3]
            for i in cutlass.range_constexpr(4):
                b[i] = buf[u * VEC + 4 * m + i]
            cute.gemm(atom, acc, a, b, acc)


@cute.jit
def gemv_rows_mma(weight: cute.Tensor, bias: cute.Tensor, s_vec: cute.Tensor, s_part: cute.Tensor, out: cute.Tensor,
                  cta: Int32, tidx: Int32, ctas: cutlass.Constexpr[int], warps: cutlass.Constexpr[int],
                  rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int],
                  ksplit: cutlass.Constexpr[int], accumulate: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int],
                  has_bias: cutlass.Constexpr[bool], gated: cutlass.Constexpr[int]):
    """out[b, r] (+)= sum_k weight[r, k] * s_vec[b, k] on the tensor cores (bf16 ``s_vec``, fp32 accumulation).

    Tiles of 8 output rows; ``ksplit`` warps of a CTA share a tile, each reducing cols / ksplit of K, and
    the CTA's warps // ksplit groups take tiles ``round * ctas * groups + group * ctas + cta``. A warp's
    (round, K step) pairs run as one software-pipelined loop: each step issues the next step's ``unroll``
    loads per lane (the next round's first included) before its MMAs. With ``ksplit`` > 1 the partial sums
    meet in ``s_part`` ([warps, 8, 8] fp32) and the group's first warp adds them in warp order
    (deterministic), then writes: out += (``accumulate``), + bias[row] (``has_bias``). Every warp runs the same
    steps (CTA-wide barriers inside); cols % (32 * ksplit * unroll) == 0 (``plan.tuning.mma_unroll``).
    ``gated`` > 0 (the activation's ``plan.stages.GATED_ACT_CODES`` code): each tile holds 4 gate rows then the
    4 matching up rows (``plan.stages.gated_act_layout``), and out[b, tile * 4 + i] = act(gate_i) * up_i (bias
    added to both first), rounded to bf16 where ``out`` is bf16 (``Plan.down_input == "global"``). ``s_vec`` is
    the staged bf16 rows in shared memory, or such rows in global memory (that plan's down GEMV).
    """
    lane = tidx % WARP
    warp = tidx // WARP
    gid = lane // MMA_LANES_PER_ROW
    tig = lane % MMA_LANES_PER_ROW
    groups = warps // ksplit
    group = warp // ksplit
    part = warp % ksplit
    tiles = (rows + MMA_ROWS - 1) // MMA_ROWS
    per_round = ctas * groups
    rounds = (tiles + per_round - 1) // per_round
    part_vecs = cols // VEC // ksplit
    step_vecs = MMA_LANES_PER_ROW * unroll
    steps = part_vecs // step_vecs
    total = rounds * steps
    seq = cutlass.min(gid, batch - 1)
    kbase = part * part_vecs
    first = group * ctas + cta  # this warp's tile in round 0
    atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)))
    acc = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
    a = cute.make_rmem_tensor(cute.make_layout((8, 1, 1)), cutlass.BFloat16)
    b = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), cutlass.BFloat16)
    for i in cutlass.range_constexpr(8):
        a[i] = cutlass.BFloat16(0.0)
    cur = cute.make_rmem_tensor(cute.make_layout(VEC * unroll), weight.element_type)
    nxt = cute.make_rmem_tensor(cute.make_layout(VEC * unroll), weight.element_type)
    _load_mma_chunk(weight, cur, cutlass.min(first * MMA_ROWS + gid, rows - 1), kbase, tig, unroll)
    for flat in range(total):
        rnd = flat // steps
        step = flat % steps
        tile = rnd * per_round + first
        # the next step's loads go out first; the last step reloads its own chunk (an L2 hit) instead of branching
        ahead = cutlass.min(flat + 1, total - 1)
        ahead_row = cutlass.min((ahead // steps * per_round + first) * MMA_ROWS + gid, rows - 1)
        _load_mma_chunk(weight, nxt, ahead_row, kbase + ahead % steps * step_vecs, tig, unroll)
        cute.arch.sync_warp()  # a scheduling fence: keep these loads above the MMAs
        if step == 0:
            for i in cutlass.range_constexpr(4):
                acc[i] = Float32(0.0)
        _mma_chunk(atom, cur, s_vec, acc, a, b, seq, kbase + step * step_vecs, tig, unroll)
        cur.store(nxt.load())
        if step == steps - 1:  # the same step for every warp of the CTA: the barriers below are uniform
            _mma_write(acc, s_part, bias, out, tile, warp, part, gid, tig, rows, batch, ksplit, accumulate,
                       has_bias, gated)


MMA_GATED = 4  # gate rows (then as many up rows) per 8-row tile of a gated GEMV (plan.stages.GATED_BLOCK)


@cute.jit
def _gated_act(gate: Float32, up: Float32, act: cutlass.Constexpr[int]) -> Float32:
    """act(gate) * up as the staging bodies compute it (silu_mul_to_smem, gelu_mul_to_smem), for one element;
    ``act``: 1 silu, 2 tanh GELU, 3 erf GELU (``plan.stages.GATED_ACT_CODES``)."""
    result = gate / (1.0 + cute.math.exp(-gate)) * up
    if cutlass.const_expr(act == 2):
        result = 0.5 * gate * (1.0 + cute.math.tanh(GELU_TANH_C * (gate + 0.044715 * gate * gate * gate))) * up
    if cutlass.const_expr(act == 3):
        result = 0.5 * gate * (1.0 + cute.math.erf(gate * INV_SQRT2)) * up
    return result


@cute.jit
def _mma_write(acc: cute.Tensor, s_part: cute.Tensor, bias: cute.Tensor, out: cute.Tensor, tile: Int32, warp: Int32,
               part: Int32, gid: Int32, tig: Int32, rows: cutlass.Constexpr[int], batch: cutlass.Constexpr[int],
               ksplit: cutlass.Constexpr[int], accumulate: cutlass.Constexpr[bool], has_bias: cutlass.Constexpr[bool],
               gated: cutlass.Constexpr[int]):
    """Lane (g, t) of a tile's first warp writes out[g, tile rows 2t, 2t + 1], the ``ksplit`` warps' partial sums
    added in warp order (through ``s_part``, between two CTA barriers) when the tile's K is split. Gated: lanes
    t = 0, 1 hold gate rows 2t, 2t + 1 of the tile, lanes t + 2 the matching up rows; a butterfly shuffle brings
    the up value over and lane t writes act(gate) * up at columns tile * 4 + 2t, + 1."""
    if cutlass.const_expr(ksplit > 1):
        for e in cutlass.range_constexpr(2):
            s_part[warp, gid, 2 * tig + e] = acc[e]
        cute.arch.sync_threads()
        if part == 0:
            for e in cutlass.range_constexpr(2):
                total = Float32(0.0)
                for p in cutlass.range_constexpr(ksplit):
                    total = total + s_part[warp + p, gid, 2 * tig + e]
                acc[e] = total
    if cutlass.const_expr(gated > 0):
        if part == 0:  # warp-uniform: every lane of the warp takes part in the shuffle
            for e in cutlass.range_constexpr(2):
                value = acc[e]
                if cutlass.const_expr(has_bias):
                    value = value + bias[cutlass.min(tile * MMA_ROWS + 2 * tig + e, rows - 1)]
                up = cute.arch.shuffle_sync_bfly(value, 2)
                if tile * MMA_ROWS < rows and gid < batch and tig < 2:
                    if cutlass.const_expr(out.element_type == cutlass.BFloat16):  # a global down input (bf16)
                        out[gid, tile * MMA_GATED + 2 * tig + e] = _gated_act(value, up, gated).to(cutlass.BFloat16)
                    else:
                        out[gid, tile * MMA_GATED + 2 * tig + e] = _gated_act(value, up, gated)
    elif part == 0 and tile * MMA_ROWS < rows and gid < batch:
        for e in cutlass.range_constexpr(2):
            out_row = tile * MMA_ROWS + 2 * tig + e
            if out_row < rows:
                total = acc[e]
                if cutlass.const_expr(has_bias):
                    total = total + bias[out_row]
                if cutlass.const_expr(accumulate):
                    out[gid, out_row] = out[gid, out_row] + total
                else:
                    out[gid, out_row] = total
    if cutlass.const_expr(ksplit > 1):
        cute.arch.sync_threads()  # s_part is free again
