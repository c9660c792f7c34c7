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
from cutlass import Float32, Int32, Int64

WARP = 32
VEC = 8  # bf16 elements per 16-byte load


# ----------------------------------------------------------------------------------------- barrier
@cute.jit
def grid_barrier(barrier: cute.Tensor, tidx: Int32, ctas: cutlass.Constexpr[int]):
    """Counting grid barrier with an epoch: never reset, survives CUDA-graph replay.

    The counter only grows; the value returned by this CTA's arrival tells which generation it is in,
    so the target is the next multiple of ``ctas`` (64-bit: no wrap in practice).
    """
    cute.arch.sync_threads()
    if tidx == 0:
        ptr = barrier.iterator.llvm_ptr
        cute.arch.fence_acq_rel_gpu()
        old = cute.arch.atomic_add(ptr, Int64(1), sem="acq_rel", scope="gpu")
        target = (old // ctas + 1) * ctas
        current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
        while current < target:
            current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
        cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()


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


# -------------------------------------------------------------------------------- vector staging
@cute.jit
def rmsnorm_to_smem(x: cute.Tensor, weight: cute.Tensor, s_vec: cute.Tensor, s_red: cute.Tensor, tidx: Int32,
                    batch: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                    threads: cutlass.Constexpr[int], eps: cutlass.Constexpr[float]):
    """s_vec[b, :hidden] = x[b] * rsqrt(mean(x[b]^2) + eps) * weight (every CTA recomputes it)."""
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    for b in cutlass.range_constexpr(batch):
        partial = Float32(0.0)
        for i in range(tidx, hidden, threads):
            v = x[b, i]
            s_vec[b, i] = v
            partial = partial + v * v
        partial = cute.arch.warp_reduction_sum(partial)
        if lane == 0:
            s_red[b * warps + warp] = partial
    cute.arch.sync_threads()
    for b in cutlass.range_constexpr(batch):
        total = Float32(0.0)
        for w in cutlass.range_constexpr(warps):
            total = total + s_red[b * warps + w]
        inv = cute.math.rsqrt(total * (1.0 / hidden) + eps)
        for i in range(tidx, hidden, threads):
            s_vec[b, i] = s_vec[b, i] * inv * weight[i]
    cute.arch.sync_threads()


@cute.jit
def copy_to_smem(src: cute.Tensor, s_vec: cute.Tensor, tidx: Int32, batch: cutlass.Constexpr[int],
                 width: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """s_vec[b, :width] = src[b, :width]."""
    for b in cutlass.range_constexpr(batch):
        for i in range(tidx, width, threads):
            s_vec[b, i] = src[b, i]
    cute.arch.sync_threads()


@cute.jit
def silu_mul_to_smem(gate_up: cute.Tensor, s_vec: cute.Tensor, tidx: Int32, batch: cutlass.Constexpr[int],
                     inter: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """s_vec[b, i] = silu(gate_up[b, i]) * gate_up[b, inter + i]."""
    for b in cutlass.range_constexpr(batch):
        for i in range(tidx, inter, threads):
            g = gate_up[b, i]
            s_vec[b, i] = g / (1.0 + cute.math.exp(-g)) * gate_up[b, inter + i]
    cute.arch.sync_threads()


# -------------------------------------------------------------------------------------------- GEMV
@cute.jit
def gemv_rows(weight: cute.Tensor, s_vec: cute.Tensor, out: cute.Tensor, gwarp: Int32, lane: Int32,
              total_warps: cutlass.Constexpr[int], rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
              batch: cutlass.Constexpr[int], per_tile: cutlass.Constexpr[int],
              accumulate: cutlass.Constexpr[bool]):
    """out[b, r] (+)= sum_k weight[r, k] * s_vec[b, k] for the rows of the tiles this warp owns.

    Tile t covers rows [t*per_tile, (t+1)*per_tile) and belongs to global warp t % total_warps. Each lane
    reads 16-byte vectors of ``per_tile`` rows per iteration (independent loads in flight), accumulates in
    fp32, and the warp reduces with shuffles; lane 0 writes (each output element has one owner).
    """
    tiles = (rows + per_tile - 1) // per_tile
    kvecs = cols // VEC
    acc = cute.make_rmem_tensor(cute.make_layout(per_tile * batch), Float32)
    for tile in range(gwarp, tiles, total_warps):
        for i in cutlass.range_constexpr(per_tile * batch):
            acc[i] = Float32(0.0)
        for kv in range(lane, kvecs, WARP):
            for r in cutlass.range_constexpr(per_tile):
                row = cutlass.min(tile * per_tile + r, rows - 1)
                w = cute.zipped_divide(weight[row, None], (VEC,))[(None, kv)].load().to(Float32)
                for b in cutlass.range_constexpr(batch):
                    xv = cute.zipped_divide(s_vec[b, None], (VEC,))[(None, kv)].load()
                    acc[r * batch + b] = acc[r * batch + b] + (w * xv).reduce(
                        cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        for r in cutlass.range_constexpr(per_tile):
            row = tile * per_tile + r
            for b in cutlass.range_constexpr(batch):
                total = cute.arch.warp_reduction_sum(acc[r * batch + b])
                if lane == 0 and row < rows:
                    if cutlass.const_expr(accumulate):
                        out[b, row] = out[b, row] + total
                    else:
                        out[b, row] = total


# --------------------------------------------------------------------------------------- attention
@cute.jit
def decode_attention(qkv: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor, k_cache: cute.Tensor,
                     v_cache: cute.Tensor, attn: cute.Tensor, pos: Int32, s_att: cute.Tensor, cta: Int32,
                     tidx: Int32, batch: cutlass.Constexpr[int], n_heads: cutlass.Constexpr[int],
                     n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                     ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                     scale: cutlass.Constexpr[float]):
    """RoPE + KV append + single-query attention over positions [0, pos] for each (batch, head) tile.

    The CTA of a tile ropes q and the new k itself, keeps the new k/v (rounded to the cache dtype) in
    shared memory and uses them for slot ``pos``; the first q head of each KV group also writes them to
    the cache (other CTAs never read slot ``pos`` of this step, so there is no race). Warps split the
    positions and keep an online softmax each; the partial results merge through shared memory.

    s_att layout (fp32): [0,D) q | [D,2D) k_new | [2D,3D) v_new | then per warp: m, l, acc[D].
    """
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    group = n_heads // n_kv_heads
    half = head_dim // 2
    per_lane = head_dim // WARP
    q_rows = n_heads * head_dim
    kv_rows = n_kv_heads * head_dim
    stride = head_dim + 2
    base = 3 * head_dim
    for tile in range(cta, batch * n_heads, ctas):
        b = tile // n_heads
        head = tile - b * n_heads
        kvh = head // group
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
            s_att[d] = qkv[b, q_off + d] * c + sign * qkv[b, q_off + partner] * s
            k_new = (qkv[b, k_off + d] * c + sign * qkv[b, k_off + partner] * s).to(k_cache.element_type)
            v_new = qkv[b, v_off + d].to(v_cache.element_type)
            s_att[head_dim + d] = k_new.to(Float32)
            s_att[2 * head_dim + d] = v_new.to(Float32)
            if head % group == 0:
                k_cache[b, kvh, pos, d] = k_new
                v_cache[b, kvh, pos, d] = v_new
        cute.arch.sync_threads()
        m = -Float32.inf
        l = Float32(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout(per_lane), Float32)
        for e in cutlass.range_constexpr(per_lane):
            acc[e] = Float32(0.0)
        for t in range(warp, pos + 1, warps):
            dot = Float32(0.0)
            for e in cutlass.range_constexpr(per_lane):
                d = lane * per_lane + e
                k_val = s_att[head_dim + d]
                if t < pos:
                    k_val = k_cache[b, kvh, t, d].to(Float32)
                dot = dot + s_att[d] * k_val
            score = cute.arch.warp_reduction_sum(dot) * scale
            m_new = cute.arch.fmax(m, score)
            correction = cute.math.exp(m - m_new)
            p = cute.math.exp(score - m_new)
            l = l * correction + p
            for e in cutlass.range_constexpr(per_lane):
                d = lane * per_lane + e
                v_val = s_att[2 * head_dim + d]
                if t < pos:
                    v_val = v_cache[b, kvh, t, d].to(Float32)
                acc[e] = acc[e] * correction + p * v_val
            m = m_new
        slot = base + warp * stride
        if lane == 0:
            s_att[slot] = m
            s_att[slot + 1] = l
        for e in cutlass.range_constexpr(per_lane):
            s_att[slot + 2 + lane * per_lane + e] = acc[e]
        cute.arch.sync_threads()
        if tidx < head_dim:
            m_all = -Float32.inf
            for w in cutlass.range_constexpr(warps):
                m_all = cute.arch.fmax(m_all, s_att[base + w * stride])
            denom = Float32(0.0)
            numer = Float32(0.0)
            for w in cutlass.range_constexpr(warps):
                weight = cute.math.exp(s_att[base + w * stride] - m_all)
                denom = denom + s_att[base + w * stride + 1] * weight
                numer = numer + s_att[base + w * stride + 2 + tidx] * weight
            attn[b, head * head_dim + tidx] = numer / denom
        cute.arch.sync_threads()
