"""Short-context attention computed in every CTA, straight into the O projection's staged input row.

Part of megabake/codegen/bodies (see its __init__ for the contract); code generation copies these
routines into module.py in the order of ``megabake.codegen.bodies.BODY_FILES``.

A candidate (``generate(plan, short_attention=N)``, off by default): while the step sees fewer than ``N``
positions, no CTA runs split-KV attention and the grid barrier after attention is skipped; instead every CTA
computes every head's attention itself (a few KB of cached K/V from L2 per CTA at short contexts) as the O
projection's staging, and CTA 0 appends this step's key and value to the cache. Same math as
:func:`split_kv_attention` with one split (RoPE from the fp32 tables, QK norms, the key and value rounded to the
cache's dtype before use), in a different fp32 summation order."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import VEC, WARP
from .split_attention import ATT_NEG, _merge_into


@cute.jit
def _short_rope_slice(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                      out: cute.Tensor, b: Int32, offset: Int32, which: Int32, inv_whole: Float32, pos: Int32,
                      row_slice: Int32, live: Float32, lane_slots: cutlass.Constexpr[int],
                      head_dim: cutlass.Constexpr[int], rotary_dim: cutlass.Constexpr[int],
                      has_qk_norm: cutlass.Constexpr[bool], whole_qk_norm: cutlass.Constexpr[bool],
                      eps: cutlass.Constexpr[float], scale: Float32):
    """``out[e]`` = the roped (and QK-normed) feature ``row_slice * VEC + e`` of the head whose row starts at
    ``offset`` of ``qkv[b]``, times ``scale``. A per-head norm (Qwen3) reduces over the lane group (every lane
    group of the warp computes the same head); a whole-projection norm (OLMo-2) passes its ``inv_whole``.
    ``which`` picks the q (0) or k (1) norm weights."""
    half = rotary_dim // 2
    x = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
    xp = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
    for e in cutlass.range_constexpr(VEC):
        d = row_slice * VEC + e
        partner = d + half
        if d >= half:
            partner = d - half
        x[e] = qkv[b, offset + d]
        xp[e] = qkv[b, offset + partner]
    inv = inv_whole
    if cutlass.const_expr(has_qk_norm and not whole_qk_norm):
        total = Float32(0.0)
        for e in cutlass.range_constexpr(VEC):
            total = total + x[e] * x[e]
        total = total * live  # a spare lane (head_dim 96) holds a repeat of the last slice
        step = lane_slots // 2
        while cutlass.const_expr(step > 0):
            total = total + cute.arch.shuffle_sync_bfly(total, step)
            step //= 2
        inv = cute.math.rsqrt(total * (1.0 / head_dim) + eps)
    for e in cutlass.range_constexpr(VEC):
        d = row_slice * VEC + e
        partner = d + half
        sign = Float32(-1.0)
        if d >= half:
            partner = d - half
            sign = Float32(1.0)
        x_d = x[e]
        x_p = xp[e]
        if cutlass.const_expr(whole_qk_norm):
            x_d = x_d * inv * qk_norm[offset + d]
            x_p = x_p * inv * qk_norm[offset + partner]
        elif cutlass.const_expr(has_qk_norm):
            x_d = x_d * inv * qk_norm[which, d]
            x_p = x_p * inv * qk_norm[which, partner]
        out[e] = (x_d * rope_cos[pos, d] + sign * x_p * rope_sin[pos, d]) * scale


@cute.jit
def _whole_inverse_rms(qkv: cute.Tensor, b: Int32, first: Int32, count: cutlass.Constexpr[int], lane: Int32,
                       eps: cutlass.Constexpr[float]) -> Float32:
    """rsqrt(mean(qkv[b, first : first + count]^2) + eps) over one warp (OLMo-2's whole q / k projection norm)."""
    total = Float32(0.0)
    for i in range(lane, count, WARP):
        value = qkv[b, first + i]
        total = total + value * value
    total = cute.arch.warp_reduction_sum(total)
    return cute.math.rsqrt(total / Float32(count) + eps)


@cute.jit
def _short_score(q: cute.Tensor, h: cutlass.Constexpr[int], key: cute.Tensor, live: Float32,
                 lane_slots: cutlass.Constexpr[int]) -> Float32:
    """q[:, h] . key over the lane group's slices (butterfly over the lane group)."""
    part = Float32(0.0)
    for e in cutlass.range_constexpr(VEC):
        part = part + q[e, h] * key[e]
    part = part * live
    step = lane_slots // 2
    while cutlass.const_expr(step > 0):
        part = part + cute.arch.shuffle_sync_bfly(part, step)
        step //= 2
    return part


@cute.jit
def short_attention_to_smem(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                            k_cache: cute.Tensor, v_cache: cute.Tensor, s_vec: cute.Tensor, pos: Int32,
                            first_key: Int32, cta: Int32, tidx: Int32, batch: cutlass.Constexpr[int],
                            n_heads: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                            head_dim: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                            scale: cutlass.Constexpr[float], has_qk_norm: cutlass.Constexpr[bool],
                            eps: cutlass.Constexpr[float], rotary_dim: cutlass.Constexpr[int],
                            whole_qk_norm: cutlass.Constexpr[bool], unroll: cutlass.Constexpr[int]):
    """``s_vec[b, head * head_dim + d]`` = attention output of every query head over positions [first_key, pos]
    (module doc): one warp per (batch, KV head) group, its lane groups over the cached positions (``unroll`` rows
    each in flight), every query head of the group scored against each loaded key row (GQA packing), online
    softmax per head and lane group, merged across the warp's lane groups by shuffles. This step's key and value
    come from ``qkv`` (roped, rounded to the cache dtype) in registers, not from the cache: CTA 0 appends them
    (its lane group 0), and no other CTA waits for that write. Ends with a CTA barrier (``s_vec`` complete)."""
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    group = n_heads // n_kv_heads
    q_rows = n_heads * head_dim
    kv_rows = n_kv_heads * head_dim
    lanes_per_pos = head_dim // VEC
    lane_slots = 1 << (lanes_per_pos - 1).bit_length()  # a lane group: lanes_per_pos padded to a power of two
    pos_per_warp = WARP // lane_slots
    grp = lane // lane_slots
    sub = lane - grp * lane_slots
    row_slice = sub
    live = Float32(1.0)
    if cutlass.const_expr(lane_slots != lanes_per_pos):
        row_slice = cutlass.min(sub, lanes_per_pos - 1)
        if sub >= lanes_per_pos:
            live = Float32(0.0)
    q = cute.make_rmem_tensor(cute.make_layout((VEC, group)), Float32)
    q_head = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
    k_new = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
    v_new = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
    kf = cute.make_rmem_tensor(cute.make_layout((VEC, unroll)), Float32)
    vf = cute.make_rmem_tensor(cute.make_layout((VEC, unroll)), Float32)
    scores = cute.make_rmem_tensor(cute.make_layout(unroll), Float32)
    m = cute.make_rmem_tensor(cute.make_layout(group), Float32)
    l = cute.make_rmem_tensor(cute.make_layout(group), Float32)
    acc = cute.make_rmem_tensor(cute.make_layout(group * VEC), Float32)
    other = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
    for g in range(warp, batch * n_kv_heads, warps):
        b = g // n_kv_heads
        kvh = g - b * n_kv_heads
        inv_q = Float32(1.0)
        inv_k = Float32(1.0)
        if cutlass.const_expr(whole_qk_norm):
            inv_q = _whole_inverse_rms(qkv, b, Int32(0), q_rows, lane, eps)
            inv_k = _whole_inverse_rms(qkv, b, Int32(q_rows), kv_rows, lane, eps)
        for h in cutlass.range_constexpr(group):
            _short_rope_slice(qkv, qk_norm, rope_cos, rope_sin, q_head, b, (kvh * group + h) * head_dim, Int32(0),
                              inv_q, pos, row_slice, live, lane_slots, head_dim, rotary_dim, has_qk_norm,
                              whole_qk_norm, eps, Float32(scale))
            for e in cutlass.range_constexpr(VEC):
                q[e, h] = q_head[e]
        _short_rope_slice(qkv, qk_norm, rope_cos, rope_sin, k_new, b, q_rows + kvh * head_dim, Int32(1), inv_k, pos,
                          row_slice, live, lane_slots, head_dim, rotary_dim, has_qk_norm, whole_qk_norm, eps,
                          Float32(1.0))
        for e in cutlass.range_constexpr(VEC):  # what the cache holds: the dtype's rounding
            d = row_slice * VEC + e
            k_new[e] = k_new[e].to(k_cache.element_type).to(Float32)
            v_new[e] = qkv[b, q_rows + kv_rows + kvh * head_dim + d].to(v_cache.element_type).to(Float32)
        if cta == 0 and grp == 0 and sub < lanes_per_pos:
            for e in cutlass.range_constexpr(VEC):
                d = row_slice * VEC + e
                k_cache[b, kvh, pos, d] = k_new[e].to(k_cache.element_type)
                v_cache[b, kvh, pos, d] = v_new[e].to(v_cache.element_type)
        for h in cutlass.range_constexpr(group):
            m[h] = Float32(ATT_NEG)
            l[h] = Float32(0.0)
            for e in cutlass.range_constexpr(VEC):
                acc[h * VEC + e] = Float32(0.0)
        keys = k_cache[b, kvh, None, None]
        values = v_cache[b, kvh, None, None]
        for base in range(first_key, pos, pos_per_warp * unroll):  # the cached rows [first_key, pos)
            for u in cutlass.range_constexpr(unroll):
                t = cutlass.min(base + grp + u * pos_per_warp, pos - 1)
                kf[(None, u)].store(cute.zipped_divide(keys[t, None], (VEC,))[(None, row_slice)].load().to(Float32))
                vf[(None, u)].store(cute.zipped_divide(values[t, None], (VEC,))[(None, row_slice)].load().to(Float32))
            for h in cutlass.range_constexpr(group):
                top = m[h]
                for u in cutlass.range_constexpr(unroll):
                    part = _short_score(q, h, kf[(None, u)], live, lane_slots)
                    score = Float32(ATT_NEG)
                    if base + grp + u * pos_per_warp < pos:
                        score = part
                    scores[u] = score
                    top = cute.arch.fmax(top, score)
                correction = cute.math.exp(m[h] - top)
                total = l[h] * correction
                for e in cutlass.range_constexpr(VEC):
                    acc[h * VEC + e] = acc[h * VEC + e] * correction
                for u in cutlass.range_constexpr(unroll):
                    p = Float32(0.0)
                    if base + grp + u * pos_per_warp < pos:
                        p = cute.math.exp(scores[u] - top)
                    total = total + p
                    for e in cutlass.range_constexpr(VEC):
                        acc[h * VEC + e] = acc[h * VEC + e] + p * vf[e, u]
                m[h] = top
                l[h] = total
        for h in cutlass.range_constexpr(group):  # this step's position: lane group 0 only
            part = _short_score(q, h, k_new, live, lane_slots)
            score = Float32(ATT_NEG)
            if grp == 0:
                score = part
            top = cute.arch.fmax(m[h], score)
            correction = cute.math.exp(m[h] - top)
            p = Float32(0.0)
            if grp == 0:
                p = cute.math.exp(score - top)
            l[h] = l[h] * correction + p
            for e in cutlass.range_constexpr(VEC):
                acc[h * VEC + e] = acc[h * VEC + e] * correction + p * v_new[e]
            m[h] = top
        for h in cutlass.range_constexpr(group):  # lane groups of the warp: butterfly merge, then lane group 0 writes
            offset = lane_slots
            while cutlass.const_expr(offset < WARP):
                m_o = cute.arch.shuffle_sync_bfly(m[h], offset)
                l_o = cute.arch.shuffle_sync_bfly(l[h], offset)
                for e in cutlass.range_constexpr(VEC):
                    other[e] = cute.arch.shuffle_sync_bfly(acc[h * VEC + e], offset)
                _merge_into(m, l, acc, h, m_o, l_o, other)
                offset *= 2
            if grp == 0 and sub < lanes_per_pos:
                inverse = Float32(1.0) / l[h]
                for e in cutlass.range_constexpr(VEC):
                    column = (kvh * group + h) * head_dim + row_slice * VEC + e
                    if cutlass.const_expr(s_vec.element_type == Float32):
                        s_vec[b, column] = acc[h * VEC + e] * inverse
                    else:
                        s_vec[b, column] = (acc[h * VEC + e] * inverse).to(s_vec.element_type)
    cute.arch.sync_threads()
