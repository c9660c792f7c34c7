"""Decode attention, unsplit: one (batch, head) per CTA over the whole cache (the attention-preload layout).

Part of megabake/codegen/bodies (see its __init__ for the contract); code generation copies these
routines into module.py in the order of ``megabake.codegen.bodies.BODY_FILES``."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32, Int64

from .common import VEC, WARP


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
