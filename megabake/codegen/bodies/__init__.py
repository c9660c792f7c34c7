"""CuTe DSL device bodies that generated megakernels call (inlined ``@cute.jit`` functions).

Contract: every body is a pure device routine over ``cute.Tensor`` views and compile-time sizes. They run
inside one persistent cooperative kernel: work is distributed as grid-stride loops over CTAs or global
warps, stages are separated by :func:`grid_barrier`, and shared-memory scratch is passed in by the caller.
All arithmetic is fp32; weights and the KV cache are bf16 and are read with 16-byte vector loads where the
layout allows. Bodies never allocate and never synchronise the grid themselves (except grid_barrier).

The CPU reference executor (``megabake.plan.reference``) mirrors each body; keep the two in step.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32, Int64

WARP = 32
VEC = 8  # bf16 elements per 16-byte load


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


# --------------------------------------------------------------------------------------- embedding
@cute.jit
def embed_gather(embed: cute.Tensor, tokens: cute.Tensor, x: cute.Tensor, cta: Int32, tidx: Int32,
                 batch: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                 ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """x[b, :] = float(embed[tokens[b], :]) over all CTAs' threads."""
    for i in range(cta * threads + tidx, batch * hidden, ctas * threads):
        b = i // hidden
        h = i - b * hidden
        x[b, h] = embed[tokens[b], h].to(Float32)


@cute.jit
def embed_gather_scaled(embed: cute.Tensor, tokens: cute.Tensor, x: cute.Tensor, cta: Int32, tidx: Int32,
                        batch: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                        ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                        scale: cutlass.Constexpr[float]):
    """x[b, :] = float(embed[tokens[b], :]) * scale (Gemma's sqrt(hidden) normalizer) over all CTAs' threads."""
    for i in range(cta * threads + tidx, batch * hidden, ctas * threads):
        b = i // hidden
        h = i - b * hidden
        x[b, h] = embed[tokens[b], h].to(Float32) * scale


# -------------------------------------------------------------------------------- vector staging
# Staging reads fp32 activations that other CTAs just wrote (L2 hits, but ~0.5-1 us each round trip). Each
# thread owns SLOTS = ceil(width / 4 / threads) 16-byte vectors and issues all of its loads before using
# any of them (clamped indices keep the loads unconditional), so a staging costs one L2 latency, not SLOTS.
F32_VEC = 4  # fp32 elements per 16-byte load


@cute.jit
def _f32_vec(t: cute.Tensor, idx: Int32):
    """The idx-th 16-byte vector (4 x fp32) view of a contiguous fp32 row."""
    return cute.zipped_divide(t, (F32_VEC,))[(None, idx)]


@cute.jit
def rmsnorm_to_smem(x: cute.Tensor, weight: cute.Tensor, s_vec: cute.Tensor, s_red: cute.Tensor, tidx: Int32,
                    batch: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                    threads: cutlass.Constexpr[int], eps: cutlass.Constexpr[float]):
    """s_vec[b, :hidden] = x[b] * rsqrt(mean(x[b]^2) + eps) * weight (every CTA recomputes it)."""
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    nvec = hidden // F32_VEC
    slots = (nvec + threads - 1) // threads
    values = []
    for b in cutlass.range_constexpr(batch):
        row = []
        for j in cutlass.range_constexpr(slots):
            row.append(_f32_vec(x[b, None], cutlass.min(tidx + j * threads, nvec - 1)).load())
        values.append(row)
    scales = []
    for j in cutlass.range_constexpr(slots):
        scales.append(_f32_vec(weight, cutlass.min(tidx + j * threads, nvec - 1)).load())
    for b in cutlass.range_constexpr(batch):
        partial = Float32(0.0)
        for j in cutlass.range_constexpr(slots):
            square = (values[b][j] * values[b][j]).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            if cutlass.const_expr((j + 1) * threads <= nvec):
                partial = partial + square
            elif tidx + j * threads < nvec:
                partial = partial + square
        partial = cute.arch.warp_reduction_sum(partial)
        if lane == 0:
            s_red[b * warps + warp] = partial
    cute.arch.sync_threads()
    for b in cutlass.range_constexpr(batch):
        total = Float32(0.0)
        for w in cutlass.range_constexpr(warps):
            total = total + s_red[b * warps + w]
        inv = cute.math.rsqrt(total * (1.0 / hidden) + eps)
        for j in cutlass.range_constexpr(slots):
            idx = tidx + j * threads
            if cutlass.const_expr((j + 1) * threads <= nvec):
                _f32_vec(s_vec[b, None], idx).store(values[b][j] * inv * scales[j])
            elif idx < nvec:
                _f32_vec(s_vec[b, None], idx).store(values[b][j] * inv * scales[j])
    cute.arch.sync_threads()


@cute.jit
def copy_to_smem(src: cute.Tensor, s_vec: cute.Tensor, tidx: Int32, batch: cutlass.Constexpr[int],
                 width: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """s_vec[b, :width] = src[b, :width]."""
    nvec = width // F32_VEC
    slots = (nvec + threads - 1) // threads
    for b in cutlass.range_constexpr(batch):
        values = []
        for j in cutlass.range_constexpr(slots):
            values.append(_f32_vec(src[b, None], cutlass.min(tidx + j * threads, nvec - 1)).load())
        for j in cutlass.range_constexpr(slots):
            idx = tidx + j * threads
            if cutlass.const_expr((j + 1) * threads <= nvec):
                _f32_vec(s_vec[b, None], idx).store(values[j])
            elif idx < nvec:
                _f32_vec(s_vec[b, None], idx).store(values[j])
    cute.arch.sync_threads()


@cute.jit
def silu_mul_to_smem(gate_up: cute.Tensor, s_vec: cute.Tensor, tidx: Int32, batch: cutlass.Constexpr[int],
                     inter: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """s_vec[b, i] = silu(gate_up[b, i]) * gate_up[b, inter + i]."""
    nvec = inter // F32_VEC
    slots = (nvec + threads - 1) // threads
    for b in cutlass.range_constexpr(batch):
        gates = []
        ups = []
        for j in cutlass.range_constexpr(slots):
            idx = cutlass.min(tidx + j * threads, nvec - 1)
            gates.append(_f32_vec(gate_up[b, None], idx).load())
            ups.append(_f32_vec(gate_up[b, None], idx + nvec).load())
        for j in cutlass.range_constexpr(slots):
            idx = tidx + j * threads
            g = gates[j]
            act = g / (1.0 + cute.math.exp(-g)) * ups[j]
            if cutlass.const_expr((j + 1) * threads <= nvec):
                _f32_vec(s_vec[b, None], idx).store(act)
            elif idx < nvec:
                _f32_vec(s_vec[b, None], idx).store(act)
    cute.arch.sync_threads()


GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)
INV_SQRT2 = 0.7071067811865476


@cute.jit
def gelu_mul_to_smem(gate_up: cute.Tensor, s_vec: cute.Tensor, tidx: Int32, batch: cutlass.Constexpr[int],
                     inter: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                     approximate: cutlass.Constexpr[bool]):
    """s_vec[b, i] = gelu(gate_up[b, i]) * gate_up[b, inter + i]; ``approximate``: the tanh form (Gemma's
    gelu_pytorch_tanh), else the erf form."""
    nvec = inter // F32_VEC
    slots = (nvec + threads - 1) // threads
    for b in cutlass.range_constexpr(batch):
        gates = []
        ups = []
        for j in cutlass.range_constexpr(slots):
            idx = cutlass.min(tidx + j * threads, nvec - 1)
            gates.append(_f32_vec(gate_up[b, None], idx).load())
            ups.append(_f32_vec(gate_up[b, None], idx + nvec).load())
        for j in cutlass.range_constexpr(slots):
            idx = tidx + j * threads
            g = gates[j]
            if cutlass.const_expr(approximate):
                act = 0.5 * g * (1.0 + cute.math.tanh(GELU_TANH_C * (g + 0.044715 * g * g * g))) * ups[j]
            else:
                act = 0.5 * g * (1.0 + cute.math.erf(g * INV_SQRT2)) * ups[j]
            if cutlass.const_expr((j + 1) * threads <= nvec):
                _f32_vec(s_vec[b, None], idx).store(act)
            elif idx < nvec:
                _f32_vec(s_vec[b, None], idx).store(act)
    cute.arch.sync_threads()


# -------------------------------------------------------------------------------------------- GEMV
@cute.jit
def _gemv_chunk(weight: cute.Tensor, s_vec: cute.Tensor, acc: cute.Tensor, tile: Int32, kv: Int32,
                rows: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int]):
    for r in cutlass.range_constexpr(per_tile):
        row = cutlass.min(tile * per_tile + r, rows - 1)
        w = cute.zipped_divide(weight[row, None], (VEC,))[(None, kv)].load().to(Float32)
        for b in cutlass.range_constexpr(batch):
            xv = cute.zipped_divide(s_vec[b, None], (VEC,))[(None, kv)].load()
            acc[r * batch + b] = acc[r * batch + b] + (w * xv).reduce(
                cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)


@cute.jit
def _gemv_rows(weight: cute.Tensor, s_vec: cute.Tensor, out: cute.Tensor, bias: cute.Tensor, gwarp: Int32,
               lane: Int32, total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int],
               cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
               accumulate: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int],
               has_bias: cutlass.Constexpr[bool]):
    """out[b, r] (+)= sum_k weight[r, k] * s_vec[b, k] for the rows of the tiles this warp owns.

    Tile t covers rows [t*per_tile, (t+1)*per_tile) and belongs to global warp t % total_warps. Each lane
    reads 16-byte vectors; ``unroll`` x ``per_tile`` independent loads per lane are in flight per step of
    the K loop (fully unrolled bodies, compile-time K), accumulation is fp32, the warp reduces with
    shuffles, and lane 0 writes (each output element has exactly one owner), adding ``bias[row]`` (fp32)
    when ``has_bias``.
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
        _gemv_write(acc, out, bias, tile, lane, rows, batch, per_tile, accumulate, has_bias)


@cute.jit
def _gemv_write(acc: cute.Tensor, out: cute.Tensor, bias: cute.Tensor, tile: Int32, lane: Int32,
                rows: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                accumulate: cutlass.Constexpr[bool], has_bias: cutlass.Constexpr[bool]):
    """Warp-reduce each row's partial sums; lane 0 writes (adds the bias, accumulates into a residual)."""
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
            xv = cute.zipped_divide(s_vec[b, None], (VEC,))[(None, kv)].load()
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
        _gemv_write(acc, out, bias, gwarp, lane, rows, batch, per_tile, accumulate, has_bias)
    _gemv_rows(weight, s_vec, out, bias, gwarp + total_warps, lane, total_warps, rows, cols, batch, per_tile,
               accumulate, unroll, has_bias)  # the warp's later tiles, loaded as usual


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
                        accumulate, has_bias)
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
            xv = cute.zipped_divide(s_vec[b, None], (VEC,))[(None, kv)].load()
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
                       stages: cutlass.Constexpr[int], prefilled: cutlass.Constexpr[bool]):
    """:func:`gemv_rows` streaming its weights through this warp's shared-memory ring ``ring`` ([stages,
    vectors, 32 lanes, 8]): cp.async keeps ``stages - 1`` chunks (the next tiles' included) in flight while
    the warp reduces the current one, without holding registers for them.

    Every lane reads back only the vectors it copied itself, so ``cp.async.wait_group`` is the only
    synchronisation: no barrier, no mbarrier. Each step commits one group (empty past the last step), so
    ``wait_group(stages - 1)`` always means "this step's chunk has landed". The slot refilled at a step is
    the one reduced at the step before, by the same lane. Partial last chunks, the order of the sums and
    the writes are those of :func:`gemv_rows_pipelined`: results are bit-identical to :func:`gemv_rows`.
    With ``prefilled``, :func:`gemv_ring_prefill` already copied (and committed) the first ``stages - 1``
    chunks before the barrier that precedes this stage.
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
                        accumulate, has_bias)
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
               False)


@cute.jit
def gemv_rows_bias(weight: cute.Tensor, bias: cute.Tensor, s_vec: cute.Tensor, out: cute.Tensor, gwarp: Int32,
                   lane: Int32, total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int],
                   cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
                   accumulate: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int]):
    """:func:`gemv_rows` plus a per-row fp32 bias (a linear layer with a bias, e.g. Qwen2's q/k/v)."""
    _gemv_rows(weight, s_vec, out, bias, gwarp, lane, total_warps, rows, cols, batch, per_tile, accumulate, unroll,
               True)


# --------------------------------------------------------------------------------------- attention
@cute.jit
def _block_reduce(value: Float32, s_red: cute.Tensor, tidx: Int32, warps: cutlass.Constexpr[int],
                  is_max: cutlass.Constexpr[bool]) -> Float32:
    """Reduce one float over the CTA (max or sum); every thread gets the result."""
    lane = tidx % WARP
    warp = tidx // WARP
    if cutlass.const_expr(is_max):
        value = cute.arch.warp_reduction_max(value)
    else:
        value = cute.arch.warp_reduction_sum(value)
    if lane == 0:
        s_red[warp] = value
    cute.arch.sync_threads()
    result = s_red[0]
    for w in cutlass.range_constexpr(1, warps):
        if cutlass.const_expr(is_max):
            result = cute.arch.fmax(result, s_red[w])
        else:
            result = result + s_red[w]
    cute.arch.sync_threads()
    return result


@cute.jit
def decode_attention(qkv: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor, k_cache: cute.Tensor,
                     v_cache: cute.Tensor, attn: cute.Tensor, pos: Int32, s_att: cute.Tensor,
                     s_red: cute.Tensor, cta: Int32, tidx: Int32, batch: cutlass.Constexpr[int],
                     n_heads: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                     head_dim: cutlass.Constexpr[int], capacity: cutlass.Constexpr[int],
                     ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                     scale: cutlass.Constexpr[float]):
    """RoPE + KV append + single-query attention (see :func:`_decode_attention`)."""
    _decode_attention(qkv, qkv, rope_cos, rope_sin, k_cache, v_cache, attn, pos, s_att, s_red, cta, tidx, batch,
                      n_heads, n_kv_heads, head_dim, capacity, ctas, threads, scale, False, 0.0, s_att, s_att, False)


@cute.jit
def decode_attention_qk_norm(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor,
                             rope_sin: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, attn: cute.Tensor,
                             pos: Int32, s_att: cute.Tensor, s_red: cute.Tensor, cta: Int32, tidx: Int32,
                             batch: cutlass.Constexpr[int], n_heads: cutlass.Constexpr[int],
                             n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                             capacity: cutlass.Constexpr[int], ctas: cutlass.Constexpr[int],
                             threads: cutlass.Constexpr[int], scale: cutlass.Constexpr[float],
                             eps: cutlass.Constexpr[float]):
    """:func:`decode_attention` with Qwen3's per-head RMSNorm of q and k (weights ``qk_norm[0|1, :]``) before RoPE."""
    _decode_attention(qkv, qk_norm, rope_cos, rope_sin, k_cache, v_cache, attn, pos, s_att, s_red, cta, tidx,
                      batch, n_heads, n_kv_heads, head_dim, capacity, ctas, threads, scale, True, eps, s_att, s_att,
                      False)


@cute.jit
def decode_attention_early(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                           k_cache: cute.Tensor, v_cache: cute.Tensor, attn: cute.Tensor, pos: Int32,
                           s_att: cute.Tensor, s_red: cute.Tensor, s_new: cute.Tensor, pre_kv: cute.Tensor,
                           cta: Int32, tidx: Int32, batch: cutlass.Constexpr[int], n_heads: cutlass.Constexpr[int],
                           n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                           capacity: cutlass.Constexpr[int], ctas: cutlass.Constexpr[int],
                           threads: cutlass.Constexpr[int], scale: cutlass.Constexpr[float],
                           has_qk_norm: cutlass.Constexpr[bool], eps: cutlass.Constexpr[float]):
    """:func:`decode_attention` (or its Qwen3 form) whose first key/value rows per lane group come from the
    registers :func:`attention_preload` filled before the barrier, and this step's new row from shared memory
    ``s_new`` (2 x head_dim fp32): one global round trip per head instead of three at short positions."""
    _decode_attention(qkv, qk_norm, rope_cos, rope_sin, k_cache, v_cache, attn, pos, s_att, s_red, cta, tidx,
                      batch, n_heads, n_kv_heads, head_dim, capacity, ctas, threads, scale, has_qk_norm, eps, s_new,
                      pre_kv, True)


@cute.jit
def _head_inv_rms(qkv: cute.Tensor, b: Int32, offset: Int32, s_red: cute.Tensor, tidx: Int32,
                  head_dim: cutlass.Constexpr[int], warps: cutlass.Constexpr[int],
                  eps: cutlass.Constexpr[float]) -> Float32:
    """rsqrt(mean(qkv[b, offset:offset + head_dim]^2) + eps), on every thread of the CTA."""
    value = Float32(0.0)
    if tidx < head_dim:
        value = qkv[b, offset + tidx]
    total = _block_reduce(value * value, s_red, tidx, warps, False)
    return cute.math.rsqrt(total * (1.0 / head_dim) + eps)


@cute.jit
def _record_score(qv, kv, s_score: cute.Tensor, t: Int32, index: Int32, pos: Int32, sub: Int32, local_max: Float32,
                  lanes_per_pos: cutlass.Constexpr[int], scale: cutlass.Constexpr[float]) -> Float32:
    """Dot q with one key across its lane group, scale, store the score of position ``t`` when the lane group's
    ``index`` is within [0, pos]; running max."""
    part = (qv * kv).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
    offset = lanes_per_pos // 2
    while cutlass.const_expr(offset > 0):
        part = part + cute.arch.shuffle_sync_bfly(part, offset)
        offset //= 2
    score = part * scale
    if sub == 0 and index <= pos:
        s_score[t] = score
        local_max = cute.arch.fmax(local_max, score)
    return local_max


@cute.jit
def _accumulate_pv(acc: cute.Tensor, vv, p: Float32):
    for e in cutlass.range_constexpr(VEC):
        acc[e] = acc[e] + p * vv[e]


@cute.jit
def _blend_early(pre_kv: cute.Tensor, which: cutlass.Constexpr[int], s_new: cute.Tensor, vec: Int32, cached):
    """The preloaded K or V row (``cached``: a position < pos) or this step's row from shared memory, as fp32.

    Both operands are finite and the selector is exactly 0 or 1, so the blend returns one of them bit for bit.
    """
    keep = Float32(0.0)
    if cached:
        keep = Float32(1.0)
    early = cute.zipped_divide(pre_kv, (VEC,))[(None, which)].load().to(Float32)
    fresh = cute.zipped_divide(s_new, (VEC,))[(None, vec)].load()
    return early * keep + fresh * (1.0 - keep)


@cute.jit
def attention_preload(k_cache: cute.Tensor, v_cache: cute.Tensor, pre_kv: cute.Tensor, pos: Int32, cta: Int32,
                      tidx: Int32, batch: cutlass.Constexpr[int], n_heads: cutlass.Constexpr[int],
                      n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int]):
    """Before the barrier that precedes attention: this lane group's first K and V rows (positions < pos are
    from earlier steps and do not depend on this one) into registers ``pre_kv`` (K vector, then V vector).
    Needs one (batch, head) tile per CTA at most; a position >= pos is clamped and never used."""
    lane = tidx % WARP
    warp = tidx // WARP
    lanes_per_pos = head_dim // VEC
    grp = lane // lanes_per_pos
    sub = lane - grp * lanes_per_pos
    tile = cutlass.min(cta, batch * n_heads - 1)
    b = tile // n_heads
    kvh = (tile - b * n_heads) // (n_heads // n_kv_heads)
    t = cutlass.min(warp * (WARP // lanes_per_pos) + grp, cutlass.max(pos - 1, 0))
    cute.zipped_divide(pre_kv, (VEC,))[(None, 0)].store(
        cute.zipped_divide(k_cache[b, kvh, t, None], (VEC,))[(None, sub)].load())
    cute.zipped_divide(pre_kv, (VEC,))[(None, 1)].store(
        cute.zipped_divide(v_cache[b, kvh, t, None], (VEC,))[(None, sub)].load())


@cute.jit
def _decode_attention(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                      k_cache: cute.Tensor, v_cache: cute.Tensor, attn: cute.Tensor, pos: Int32,
                      s_att: cute.Tensor, s_red: cute.Tensor, cta: Int32, tidx: Int32,
                      batch: cutlass.Constexpr[int], n_heads: cutlass.Constexpr[int],
                      n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                      capacity: cutlass.Constexpr[int], ctas: cutlass.Constexpr[int],
                      threads: cutlass.Constexpr[int], scale: cutlass.Constexpr[float],
                      has_qk_norm: cutlass.Constexpr[bool], eps: cutlass.Constexpr[float],
                      s_new: cute.Tensor, pre_kv: cute.Tensor, early_kv: cutlass.Constexpr[bool]):
    """RoPE + KV append + single-query attention over positions [0, pos] for each (batch, q head) tile.

    Every CTA of a KV group ropes the new k itself and writes the same bytes (k, v rounded to the cache
    dtype) into slot ``pos`` of its layer's cache, then synchronises and reads the cache normally; the
    duplicate writes store identical values, and no CTA reads slot ``pos`` before its own write.
    Positions are spread over lane groups (head_dim/8 lanes read one 16-byte-vectorised row): scores go
    to shared memory, a CTA-wide max/sum gives the softmax, and P @ V merges across groups and warps.

    With ``has_qk_norm`` (Qwen3) each head's q and k are RMS-normalised over head_dim (two CTA reductions)
    and scaled by ``qk_norm[0|1, :]`` before RoPE.

    s_att layout (fp32): [0, D) roped q | [D, D + capacity) scores | then warps x D partial outputs.
    """
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    group = n_heads // n_kv_heads
    half = head_dim // 2
    q_rows = n_heads * head_dim
    kv_rows = n_kv_heads * head_dim
    lanes_per_pos = head_dim // VEC
    pos_per_warp = WARP // lanes_per_pos
    grp = lane // lanes_per_pos
    sub = lane - grp * lanes_per_pos
    s_q = cute.make_tensor(s_att.iterator, cute.make_layout(head_dim))
    s_score = cute.make_tensor(s_att.iterator + head_dim, cute.make_layout(capacity))
    s_part = cute.make_tensor(s_att.iterator + head_dim + capacity, cute.make_layout((head_dim, warps)))
    for tile in range(cta, batch * n_heads, ctas):
        b = tile // n_heads
        head = tile - b * n_heads
        kvh = head // group
        q_inv = Float32(1.0)
        k_inv = Float32(1.0)
        if cutlass.const_expr(has_qk_norm):
            q_inv = _head_inv_rms(qkv, b, head * head_dim, s_red, tidx, head_dim, warps, eps)
            k_inv = _head_inv_rms(qkv, b, q_rows + kvh * head_dim, s_red, tidx, head_dim, warps, eps)
        if tidx < head_dim:
            d = tidx
            partner = d + half
            sign = Float32(-1.0)
            if d >= half:
                partner = d - half
                sign = Float32(1.0)
            c = rope_cos[pos, d]
            s = rope_sin[pos, d]
            q_off = head * head_dim
            k_off = q_rows + kvh * head_dim
            v_off = q_rows + kv_rows + kvh * head_dim
            if cutlass.const_expr(has_qk_norm):
                q_d = qkv[b, q_off + d] * q_inv * qk_norm[0, d]
                q_p = qkv[b, q_off + partner] * q_inv * qk_norm[0, partner]
                k_d = qkv[b, k_off + d] * k_inv * qk_norm[1, d]
                k_p = qkv[b, k_off + partner] * k_inv * qk_norm[1, partner]
                s_q[d] = q_d * c + sign * q_p * s
                k_new = (k_d * c + sign * k_p * s).to(k_cache.element_type)
            else:
                s_q[d] = qkv[b, q_off + d] * c + sign * qkv[b, q_off + partner] * s
                k_new = (qkv[b, k_off + d] * c + sign * qkv[b, k_off + partner] * s).to(k_cache.element_type)
            k_cache[b, kvh, pos, d] = k_new
            v_new = qkv[b, v_off + d].to(v_cache.element_type)
            v_cache[b, kvh, pos, d] = v_new
            if cutlass.const_expr(early_kv):
                s_new[d] = k_new.to(Float32)
                s_new[head_dim + d] = v_new.to(Float32)
        cute.arch.sync_threads()
        keys = k_cache[b, kvh, None, None]
        values = v_cache[b, kvh, None, None]
        qv = cute.zipped_divide(s_q, (VEC,))[(None, sub)].load()
        local_max = -Float32.inf
        first = warp * pos_per_warp
        if cutlass.const_expr(early_kv):  # first iteration from registers (rows < pos) / shared memory (pos)
            if first <= pos:
                local_max = _record_score(qv, _blend_early(pre_kv, 0, s_new, sub, first + grp < pos), s_score,
                                          cutlass.min(first + grp, pos), first + grp, pos, sub, local_max,
                                          lanes_per_pos, scale)
            first = first + warps * pos_per_warp
        for base in range(first, pos + 1, warps * pos_per_warp):
            t = cutlass.min(base + grp, pos)
            kv = cute.zipped_divide(keys[t, None], (VEC,))[(None, sub)].load().to(Float32)
            local_max = _record_score(qv, kv, s_score, t, base + grp, pos, sub, local_max, lanes_per_pos, scale)
        row_max = _block_reduce(local_max, s_red, tidx, warps, True)
        local_sum = Float32(0.0)
        for t in range(tidx, pos + 1, threads):
            p = cute.math.exp(s_score[t] - row_max)
            s_score[t] = p
            local_sum = local_sum + p
        denom = _block_reduce(local_sum, s_red, tidx, warps, False)
        acc = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        for e in cutlass.range_constexpr(VEC):
            acc[e] = Float32(0.0)
        first = warp * pos_per_warp
        if cutlass.const_expr(early_kv):
            if first + grp <= pos:
                _accumulate_pv(acc, _blend_early(pre_kv, 1, s_new, sub + lanes_per_pos, first + grp < pos),
                               s_score[first + grp])
            first = first + warps * pos_per_warp
        for base in range(first, pos + 1, warps * pos_per_warp):
            t = base + grp
            if t <= pos:
                vv = cute.zipped_divide(values[t, None], (VEC,))[(None, sub)].load().to(Float32)
                p = s_score[t]
                for e in cutlass.range_constexpr(VEC):
                    acc[e] = acc[e] + p * vv[e]
        for e in cutlass.range_constexpr(VEC):
            total = acc[e]
            offset = lanes_per_pos
            while cutlass.const_expr(offset < WARP):
                total = total + cute.arch.shuffle_sync_bfly(total, offset)
                offset *= 2
            if grp == 0:
                s_part[sub * VEC + e, warp] = total
        cute.arch.sync_threads()
        if tidx < head_dim:
            out = Float32(0.0)
            for w in cutlass.range_constexpr(warps):
                out = out + s_part[tidx, w]
            attn[b, head * head_dim + tidx] = out / denom
        cute.arch.sync_threads()


# ------------------------------------------------------------------------------ split-KV (flash) decoding
ATT_NEG = -1.0e30  # "no position yet": finite, so merging two empty partial softmaxes gives 0, never NaN


@cute.jit
def _rope_group(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                k_cache: cute.Tensor, v_cache: cute.Tensor, s_q: cute.Tensor, s_inv: cute.Tensor, b: Int32,
                kvh: Int32, pos: Int32, owns_new: Int32, tidx: Int32, n_heads: cutlass.Constexpr[int],
                n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                threads: cutlass.Constexpr[int], scale: cutlass.Constexpr[float],
                has_qk_norm: cutlass.Constexpr[bool], eps: cutlass.Constexpr[float]):
    """The group's roped queries (pre-scaled by ``scale``) into ``s_q`` [group * head_dim]; the CTA whose split
    holds ``pos`` (``owns_new``) also ropes this step's key and appends it and the value to the cache.
    With ``has_qk_norm`` (Qwen3) q and k are RMS-normalised per head first (one warp per head)."""
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    group = n_heads // n_kv_heads
    half = head_dim // 2
    q_rows = n_heads * head_dim
    kv_rows = n_kv_heads * head_dim
    if cutlass.const_expr(has_qk_norm):
        for h in range(warp, group + 1, warps):
            offset = q_rows + kvh * head_dim
            if h < group:
                offset = (kvh * group + h) * head_dim
            total = Float32(0.0)
            for i in cutlass.range_constexpr(head_dim // WARP):
                value = qkv[b, offset + lane + i * WARP]
                total = total + value * value
            total = cute.arch.warp_reduction_sum(total)
            if lane == 0:
                s_inv[h] = cute.math.rsqrt(total * (1.0 / head_dim) + eps)
        cute.arch.sync_threads()
    for i in range(tidx, (group + 1) * head_dim, threads):
        h = i // head_dim
        d = i - h * head_dim
        partner = d + half
        sign = Float32(-1.0)
        if d >= half:
            partner = d - half
            sign = Float32(1.0)
        c = rope_cos[pos, d]
        s = rope_sin[pos, d]
        offset = q_rows + kvh * head_dim
        if h < group:
            offset = (kvh * group + h) * head_dim
        x_d = qkv[b, offset + d]
        x_p = qkv[b, offset + partner]
        if cutlass.const_expr(has_qk_norm):
            which = 1
            if h < group:
                which = 0
            x_d = x_d * s_inv[h] * qk_norm[which, d]
            x_p = x_p * s_inv[h] * qk_norm[which, partner]
        roped = x_d * c + sign * x_p * s
        if h < group:
            s_q[i] = roped * scale
        elif owns_new != 0:
            k_cache[b, kvh, pos, d] = roped.to(k_cache.element_type)
            v_cache[b, kvh, pos, d] = qkv[b, q_rows + kv_rows + kvh * head_dim + d].to(v_cache.element_type)
    cute.arch.sync_threads()


@cute.jit
def _merge_into(m: cute.Tensor, l: cute.Tensor, acc: cute.Tensor, h: cutlass.Constexpr[int], m_o: Float32,
                l_o: Float32, acc_o: cute.Tensor):
    """Partial softmax (m, l, acc) of head ``h`` merged with (m_o, l_o, acc_o): exact, order of a tree."""
    m_new = cute.arch.fmax(m[h], m_o)
    ca = cute.math.exp(m[h] - m_new)
    cb = cute.math.exp(m_o - m_new)
    l[h] = l[h] * ca + l_o * cb
    for e in cutlass.range_constexpr(VEC):
        acc[h * VEC + e] = acc[h * VEC + e] * ca + acc_o[e] * cb
    m[h] = m_new


@cute.jit
def _online_softmax_chunk(keys: cute.Tensor, values: cute.Tensor, s_q: cute.Tensor, m: cute.Tensor,
                          l: cute.Tensor, acc: cute.Tensor, first: Int32, end: Int32, grp: Int32, sub: Int32,
                          group: cutlass.Constexpr[int], lanes_per_pos: cutlass.Constexpr[int],
                          stride: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int]):
    """Lane group ``grp`` of a warp takes positions first + grp, first + grp + stride, ... < end: ``unroll`` K and
    V rows in flight, every query head of the group scored against each key row once loaded (GQA packing),
    online softmax per head. The loop bounds depend on the warp only (``first``), never on the lane group:
    every lane runs the same iterations, so the lane-group shuffles stay converged; positions past ``end``
    load a clamped row and are masked out."""
    kf = cute.make_rmem_tensor(cute.make_layout((VEC, unroll)), Float32)
    vf = cute.make_rmem_tensor(cute.make_layout((VEC, unroll)), Float32)
    scores = cute.make_rmem_tensor(cute.make_layout(unroll), Float32)
    for base in range(first, end, stride * unroll):
        for u in cutlass.range_constexpr(unroll):
            t = cutlass.min(base + grp + u * stride, end - 1)
            kf[(None, u)].store(cute.zipped_divide(keys[t, None], (VEC,))[(None, sub)].load().to(Float32))
            vf[(None, u)].store(cute.zipped_divide(values[t, None], (VEC,))[(None, sub)].load().to(Float32))
        for h in cutlass.range_constexpr(group):
            qv = cute.zipped_divide(s_q, (VEC,))[(None, h * lanes_per_pos + sub)].load()
            top = m[h]
            for u in cutlass.range_constexpr(unroll):
                part = Float32(0.0)
                for e in cutlass.range_constexpr(VEC):
                    part = part + qv[e] * kf[e, u]
                offset = lanes_per_pos // 2
                while cutlass.const_expr(offset > 0):
                    part = part + cute.arch.shuffle_sync_bfly(part, offset)
                    offset //= 2
                score = Float32(ATT_NEG)
                if base + grp + u * stride < end:
                    score = part
                scores[u] = score
                top = cute.arch.fmax(top, score)
            correction = cute.math.exp(m[h] - top)
            total = l[h] * correction
            for e in cutlass.range_constexpr(VEC):
                acc[h * VEC + e] = acc[h * VEC + e] * correction
            for u in cutlass.range_constexpr(unroll):
                p = Float32(0.0)
                if base + grp + u * stride < end:
                    p = cute.math.exp(scores[u] - top)
                total = total + p
                for e in cutlass.range_constexpr(VEC):
                    acc[h * VEC + e] = acc[h * VEC + e] + p * vf[e, u]
            m[h] = top
            l[h] = total


@cute.jit
def split_kv_attention(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                       k_cache: cute.Tensor, v_cache: cute.Tensor, attn: cute.Tensor, part: cute.Tensor,
                       counts: cute.Tensor, pos: Int32, s_att: cute.Tensor, cta: Int32, tidx: Int32,
                       batch: cutlass.Constexpr[int], n_heads: cutlass.Constexpr[int],
                       n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                       ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                       scale: cutlass.Constexpr[float], has_qk_norm: cutlass.Constexpr[bool],
                       eps: cutlass.Constexpr[float], splits: cutlass.Constexpr[int],
                       unroll: cutlass.Constexpr[int], min_chunk: cutlass.Constexpr[int]):
    """Flash decoding: RoPE + KV append + attention over positions [0, pos], the cached keys split across CTAs.

    Work items are (split, batch, KV head), split-major, dealt to CTAs. At this step the ``pos + 1`` positions
    are cut into ``active`` chunks of ``chunk`` positions (a multiple of ``min_chunk``, which is the positions
    one CTA pass covers x ``unroll``: short contexts stay in one split). An active item ropes its group's
    queries, scores every cached key row once for all the group's query heads (GQA packing), keeps an online
    softmax (max, sum, accumulator) per head and lane group, and merges them across lane groups (shuffles) and
    warps (shared memory). With one active split it writes the normalised output; otherwise it stores its
    partial (acc, max, sum) in ``part[b, head, split, :]``, and the last item of its group to arrive (an
    acq_rel counter in ``counts``, reset by that item) merges every split's partial into ``attn``.

    s_att layout (fp32): [0, G*D) roped q | 8 slots: per-head inverse RMS (Qwen3) | flag | then
    (D + 2) x G x warps partial outputs (accumulator, max, sum).
    """
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    group = n_heads // n_kv_heads
    lanes_per_pos = head_dim // VEC
    pos_per_warp = WARP // lanes_per_pos
    grp = lane // lanes_per_pos
    sub = lane - grp * lanes_per_pos
    stride = warps * pos_per_warp
    width = head_dim + 2
    groups = batch * n_kv_heads
    s_q = cute.make_tensor(s_att.iterator, cute.make_layout(group * head_dim))
    s_inv = cute.make_tensor(s_att.iterator + group * head_dim, cute.make_layout(group + 1))
    s_flag = cute.make_tensor(s_att.iterator + group * head_dim + 8 * ((group + 8) // 8), cute.make_layout(1))
    s_part = cute.make_tensor(s_att.iterator + group * head_dim + 8 * ((group + 8) // 8) + 8,
                              cute.make_layout((width, group, warps)))
    n = pos + 1
    chunk = (n + splits - 1) // splits
    chunk = cutlass.max(((chunk + min_chunk - 1) // min_chunk) * min_chunk, min_chunk)
    active = (n + chunk - 1) // chunk
    m = cute.make_rmem_tensor(cute.make_layout(group), Float32)
    l = cute.make_rmem_tensor(cute.make_layout(group), Float32)
    acc = cute.make_rmem_tensor(cute.make_layout(group * VEC), Float32)
    other = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
    for item in range(cta, groups * splits, ctas):
        split = item // groups
        g = item - split * groups
        if split < active:
            b = g // n_kv_heads
            kvh = g - b * n_kv_heads
            start = split * chunk
            end = cutlass.min(start + chunk, n)
            owns_new = Int32(0)
            if end == n:
                owns_new = Int32(1)
            _rope_group(qkv, qk_norm, rope_cos, rope_sin, k_cache, v_cache, s_q, s_inv, b, kvh, pos, owns_new,
                        tidx, n_heads, n_kv_heads, head_dim, threads, scale, has_qk_norm, eps)
            for h in cutlass.range_constexpr(group):
                m[h] = Float32(ATT_NEG)
                l[h] = Float32(0.0)
            for e in cutlass.range_constexpr(group * VEC):
                acc[e] = Float32(0.0)
            _online_softmax_chunk(k_cache[b, kvh, None, None], v_cache[b, kvh, None, None], s_q, m, l, acc,
                                  start + warp * pos_per_warp, end, grp, sub, group, lanes_per_pos, stride, unroll)
            for h in cutlass.range_constexpr(group):  # lane groups of a warp: butterfly merge
                offset = lanes_per_pos
                while cutlass.const_expr(offset < WARP):
                    m_o = cute.arch.shuffle_sync_bfly(m[h], offset)
                    l_o = cute.arch.shuffle_sync_bfly(l[h], offset)
                    for e in cutlass.range_constexpr(VEC):
                        other[e] = cute.arch.shuffle_sync_bfly(acc[h * VEC + e], offset)
                    _merge_into(m, l, acc, h, m_o, l_o, other)
                    offset *= 2
                if grp == 0:
                    for e in cutlass.range_constexpr(VEC):
                        s_part[sub * VEC + e, h, warp] = acc[h * VEC + e]
                    if sub == 0:
                        s_part[head_dim, h, warp] = m[h]
                        s_part[head_dim + 1, h, warp] = l[h]
            cute.arch.sync_threads()
            for i in range(tidx, group * head_dim, threads):  # warps: merge, then output or partial
                h = i // head_dim
                d = i - h * head_dim
                top = s_part[head_dim, h, 0]
                for w in cutlass.range_constexpr(1, warps):
                    top = cute.arch.fmax(top, s_part[head_dim, h, w])
                total = Float32(0.0)
                out = Float32(0.0)
                for w in cutlass.range_constexpr(warps):
                    weight = cute.math.exp(s_part[head_dim, h, w] - top)
                    total = total + s_part[head_dim + 1, h, w] * weight
                    out = out + s_part[d, h, w] * weight
                head = kvh * group + h
                if active == 1:
                    attn[b, head * head_dim + d] = out / total
                else:
                    part[b, head, split, d] = out
                    if d == 0:
                        part[b, head, split, head_dim] = top
                        part[b, head, split, head_dim + 1] = total
            if active > 1:
                _merge_splits(attn, part, counts, s_flag, b, kvh, g, active, tidx, group, head_dim, threads)
            cute.arch.sync_threads()


@cute.jit
def _merge_splits(attn: cute.Tensor, part: cute.Tensor, counts: cute.Tensor, s_flag: cute.Tensor, b: Int32,
                  kvh: Int32, g: Int32, active: Int32, tidx: Int32, group: cutlass.Constexpr[int],
                  head_dim: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """Arrive at group ``g``'s counter (release: this CTA's partials first); the last of ``active`` arrivals
    (acquire: everyone's partials visible) resets the counter and merges the partials into ``attn``."""
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.fence_acq_rel_gpu()
        old = cute.arch.atomic_add((counts.iterator + g).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
        flag = Float32(0.0)
        if old == active - 1:
            flag = Float32(1.0)
            counts[g] = Int32(0)
        s_flag[0] = flag
    cute.arch.sync_threads()
    if s_flag[0] > 0.5:
        for i in range(tidx, group * head_dim, threads):
            h = i // head_dim
            d = i - h * head_dim
            head = kvh * group + h
            top = part[b, head, 0, head_dim]
            for s in range(1, active):
                top = cute.arch.fmax(top, part[b, head, s, head_dim])
            total = Float32(0.0)
            out = Float32(0.0)
            for s in range(active):
                weight = cute.math.exp(part[b, head, s, head_dim] - top)
                total = total + part[b, head, s, head_dim + 1] * weight
                out = out + part[b, head, s, d] * weight
            attn[b, head * head_dim + d] = out / total
