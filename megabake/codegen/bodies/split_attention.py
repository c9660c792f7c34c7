"""Split-KV (flash) decode attention: cached keys split across CTAs, partial softmaxes merged exactly.

Part of megabake/codegen/bodies (see its __init__ for the contract); code generation copies these
routines into module.py in the order of ``megabake.codegen.bodies.BODY_FILES``."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32, Int64

from .common import VEC, WARP
from .staging import F32_VEC, _f32_vec, _stage_store, copy_to_smem


# ------------------------------------------------------------------------------ split-KV (flash) decoding
ATT_NEG = -1.0e30  # "no position yet": finite, so merging two empty partial softmaxes gives 0, never NaN
MERGE_UNROLL = 8  # split partials each thread loads at once per output when the last arrival merges the splits
PRELOAD_LOADS = 16  # partial outputs a thread loads before the merge weights exist (_merge_splits' preload)
SPREAD_LANES = 8  # threads per output that share out a group's splits in the spread merge (_merge_spread)
SPREAD_LOADS = 8  # splits each of them loads at once (8 x 8: up to 64 splits in one L2 round trip)


@cute.jit
def _rope_group(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                k_cache: cute.Tensor, v_cache: cute.Tensor, s_q: cute.Tensor, s_inv: cute.Tensor, b: Int32,
                kvh: Int32, head0: Int32, pos: Int32, owns_new: Int32, tidx: Int32, n_heads: cutlass.Constexpr[int],
                n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                threads: cutlass.Constexpr[int], scale: cutlass.Constexpr[float],
                has_qk_norm: cutlass.Constexpr[bool], eps: cutlass.Constexpr[float],
                rotary_dim: cutlass.Constexpr[int], whole_qk_norm: cutlass.Constexpr[bool],
                group: cutlass.Constexpr[int], s_keys: cute.Tensor, s_values: cute.Tensor,
                kv_smem: cutlass.Constexpr[bool]):
    """Query heads ``head0 .. head0 + group - 1`` of KV head ``kvh`` (all its query heads, or one head slice of
    them), roped and pre-scaled by ``scale``, into ``s_q`` [group * head_dim]; a CTA whose split holds ``pos``
    (``owns_new``) also ropes this step's key and appends it and the value to the cache (with head slices, every
    slice of that split writes the same bits).
    With ``has_qk_norm`` (Qwen3) q and k are RMS-normalised per head first (one warp per head); with
    ``whole_qk_norm`` too (OLMo-2) over the whole q and k projections (warp 0 and the last warp; ``qk_norm`` is
    then the layer's [q_rows + kv_rows] weights, at the offsets of the qkv row). Feature d pairs
    with d +- rotary_dim / 2; past ``rotary_dim`` (partial rotary) the tables hold cos 1 and sin 0. With
    ``kv_smem`` the appended key and value also go to row ``pos`` of ``s_keys`` / ``s_values``, the group's
    cached rows in shared memory (:func:`fused_o_load`)."""
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    half = rotary_dim // 2
    q_rows = n_heads * head_dim
    kv_rows = n_kv_heads * head_dim
    if cutlass.const_expr(whole_qk_norm):
        if warp == 0 or warp == warps - 1:
            first = 0
            count = q_rows
            if warp != 0:
                first = q_rows
                count = kv_rows
            total = Float32(0.0)
            for i in range(lane, count, WARP):
                value = qkv[b, first + i]
                total = total + value * value
            total = cute.arch.warp_reduction_sum(total)
            if lane == 0:
                s_inv[warp // (warps - 1)] = cute.math.rsqrt(total / Float32(count) + eps)
        cute.arch.sync_threads()
    elif cutlass.const_expr(has_qk_norm):
        for h in range(warp, group + 1, warps):
            offset = q_rows + kvh * head_dim
            if h < group:
                offset = (head0 + h) * head_dim
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
            offset = (head0 + h) * head_dim
        x_d = qkv[b, offset + d]
        x_p = qkv[b, offset + partner]
        if cutlass.const_expr(whole_qk_norm):
            which = 1
            if h < group:
                which = 0
            x_d = x_d * s_inv[which] * qk_norm[offset + d]
            x_p = x_p * s_inv[which] * qk_norm[offset + partner]
        elif cutlass.const_expr(has_qk_norm):
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
            if cutlass.const_expr(kv_smem):
                s_keys[pos, d] = roped.to(k_cache.element_type)
                s_values[pos, d] = qkv[b, q_rows + kv_rows + kvh * head_dim + d].to(v_cache.element_type)
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


KV_LOOKAHEAD = 1  # _online_softmax_chunk's K/V load modes (the module's KV_PIPELINE): next iteration's rows ahead
KV_FENCE = 2  # ... this iteration's rows together behind a fence (0 / False: the plain loop)


@cute.jit
def _online_softmax_chunk(keys: cute.Tensor, values: cute.Tensor, s_q: cute.Tensor, m: cute.Tensor,
                          l: cute.Tensor, acc: cute.Tensor, first: Int32, end: Int32, grp: Int32, sub: Int32,
                          group: cutlass.Constexpr[int], lanes_per_pos: cutlass.Constexpr[int],
                          stride: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int],
                          pipeline: cutlass.Constexpr[int]):
    """Lane group ``grp`` of a warp takes positions first + grp, first + grp + stride, ... < end: ``unroll`` K and
    V rows in flight, every query head of the group scored against each key row once loaded (GQA packing),
    online softmax per head. The loop bounds depend on the warp only (``first``), never on the lane group:
    every lane runs the same iterations, so the lane-group shuffles stay converged; positions past ``end``
    load a clamped row and are masked out. When ``lanes_per_pos`` is not a power of two (head_dim 96: 12) a lane
    group spans the next power of two and its spare lanes load a clamped slice and score 0.

    ``pipeline`` (a candidate, session 19): the next iteration's K and V rows are loaded (as stored, bf16) before
    this iteration's rows are scored, so their latency overlaps the arithmetic instead of following it (long
    chunks: OLMo-2-1B at 4000 positions runs 8 iterations per item). Same values, same arithmetic order: the
    same bits. ``pipeline`` is a K/V load mode: ``KV_LOOKAHEAD`` (1, or True) is that pipeline; ``KV_FENCE`` (2, a
    candidate, session 57) issues this iteration's K and V rows together, as stored, behind a scheduling fence, then
    converts them: one memory round trip per iteration, where ptxas issues half of the plain loop's (0, or False)
    loads after arithmetic that waits for the first ones (two; ``scripts/sass_inspect.py --loops-with MUFU``),
    without the pipeline's second set of rows in registers. The same bits in every mode."""
    lookahead = pipeline == KV_LOOKAHEAD
    fence = pipeline == KV_FENCE
    lane_slots = 1 << (lanes_per_pos - 1).bit_length()
    row_slice = sub
    live = Float32(1.0)
    if cutlass.const_expr(lane_slots != lanes_per_pos):
        row_slice = cutlass.min(sub, lanes_per_pos - 1)
        if sub >= lanes_per_pos:
            live = Float32(0.0)
    kf = cute.make_rmem_tensor(cute.make_layout((VEC, unroll)), Float32)
    vf = cute.make_rmem_tensor(cute.make_layout((VEC, unroll)), Float32)
    scores = cute.make_rmem_tensor(cute.make_layout(unroll), Float32)
    kn = cute.make_rmem_tensor(cute.make_layout((VEC, unroll)), keys.element_type)  # lookahead: next rows
    vn = cute.make_rmem_tensor(cute.make_layout((VEC, unroll)), values.element_type)
    if cutlass.const_expr(lookahead):
        for u in cutlass.range_constexpr(unroll):
            t0 = cutlass.min(first + grp + u * stride, end - 1)
            kn[(None, u)].store(cute.zipped_divide(keys[t0, None], (VEC,))[(None, row_slice)].load())
            vn[(None, u)].store(cute.zipped_divide(values[t0, None], (VEC,))[(None, row_slice)].load())
    for base in range(first, end, stride * unroll):
        if cutlass.const_expr(lookahead):
            for u in cutlass.range_constexpr(unroll):
                kf[(None, u)].store(kn[(None, u)].load().to(Float32))
                vf[(None, u)].store(vn[(None, u)].load().to(Float32))
            for u in cutlass.range_constexpr(unroll):  # the next iteration's rows (clamped past the end: unused)
                tn = cutlass.min(base + stride * unroll + grp + u * stride, end - 1)
                kn[(None, u)].store(cute.zipped_divide(keys[tn, None], (VEC,))[(None, row_slice)].load())
                vn[(None, u)].store(cute.zipped_divide(values[tn, None], (VEC,))[(None, row_slice)].load())
            cute.arch.sync_warp()  # a scheduling fence: the compiler otherwise sinks these loads past the scores
        elif cutlass.const_expr(fence):
            for u in cutlass.range_constexpr(unroll):  # this iteration's rows, K and V, all issued before any score
                t = cutlass.min(base + grp + u * stride, end - 1)
                kn[(None, u)].store(cute.zipped_divide(keys[t, None], (VEC,))[(None, row_slice)].load())
                vn[(None, u)].store(cute.zipped_divide(values[t, None], (VEC,))[(None, row_slice)].load())
            cute.arch.sync_warp()  # a scheduling fence: keep every load above the scores that wait for the first
            for u in cutlass.range_constexpr(unroll):
                kf[(None, u)].store(kn[(None, u)].load().to(Float32))
                vf[(None, u)].store(vn[(None, u)].load().to(Float32))
        else:
            for u in cutlass.range_constexpr(unroll):
                t = cutlass.min(base + grp + u * stride, end - 1)
                kf[(None, u)].store(cute.zipped_divide(keys[t, None], (VEC,))[(None, row_slice)].load().to(Float32))
                vf[(None, u)].store(cute.zipped_divide(values[t, None], (VEC,))[(None, row_slice)].load().to(Float32))
        for h in cutlass.range_constexpr(group):
            qv = cute.zipped_divide(s_q, (VEC,))[(None, h * lanes_per_pos + row_slice)].load()
            top = m[h]
            for u in cutlass.range_constexpr(unroll):
                part = Float32(0.0)
                for e in cutlass.range_constexpr(VEC):
                    part = part + qv[e] * kf[e, u]
                if cutlass.const_expr(lane_slots != lanes_per_pos):
                    part = part * live
                offset = lane_slots // 2
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


# Split-KV attention on the tensor cores (``generate(plan, mma_attention=True)``, a candidate since session 32): the
# query heads of an item are the M rows of mma.sync.m16n8k16 (rows 8..15 unused), so each cached key costs a few
# MMAs for every head at once instead of a dot product, a shuffle tree and an online-softmax update per head.
# A warp takes 16 keys per step (two 8-key tiles). Scores S = Q K^T: lane (g, t) = (lane // 4, lane % 4) loads
# 16-byte vector t of each 32-dim block of key g's row (tile 0: key g, tile 1: key 8 + g) and feeds dims
# 8t + 4m + {0, 1} to K slots 2t + {0, 1} and 8t + 4m + {2, 3} to slots 2t + 8 + {0, 1} of the m-th of two MMAs,
# the query alike (the K order inside a dot product is free, as in gemv_rows_mma); it then holds head g's scores
# of keys 2t, 2t + 1 of each tile. Output O^T = V^T P^T: the MMA's M is 16 dims, its K the 16 keys, its N the
# heads. Lane (g, t) loads vector g of each 64-dim block of keys 2t, 2t + 1, 8 + 2t, 9 + 2t (dims 64c + 8g ..
# + 7), so the A fragment of MMA j takes dims 64c + 8g + 2j (row g) and + 1 (row g + 8) of those keys: register
# moves, no shuffle; its B fragment is the lane's own probabilities (head g, keys 2t, 2t + 1 of both tiles), bf16.
# Lane (g, t) accumulates heads 2t, 2t + 1 at dims 64c + 8g + 2j (+ 1). Scores and sums are fp32; the query and
# the probabilities are rounded to bf16 as the MMA takes them (what eager bf16 attention does too).
MMA_ATT_KEYS = 16  # cached keys per warp and step
MMA_ATT_MAX_HEADS = 8  # query heads per item (the M rows of m16n8k16 a lane group of 4 lanes holds)


def mma_attention_fits(heads: int, head_dim: int, wide: bool = False) -> bool:
    """Whether an item of ``heads`` query heads of ``head_dim`` runs on the tensor cores in an
    ``mma_attention`` build (2 to 8 heads: one head alone keeps the lane-group loop; 64 or 128 dims, and with
    ``wide``, an ``mma_wide`` build, also 256)."""
    return 2 <= heads <= MMA_ATT_MAX_HEADS and head_dim in ((64, 128, 256) if wide else (64, 128))


@cute.jit
def _mma_load_kv(keys: cute.Tensor, values: cute.Tensor, kbuf: cute.Tensor, vbuf: cute.Tensor, kb: Int32,
                 end: Int32, g: Int32, t: Int32, head_dim: cutlass.Constexpr[int]):
    """Step ``kb``'s K and V vectors of lane (g, t) into registers (rows past ``end`` clamped: scored as 0)."""
    kblocks = head_dim // 32
    vblocks = head_dim // 64
    for tile in cutlass.range_constexpr(2):
        row = cutlass.min(kb + tile * 8 + g, end - 1)
        for c in cutlass.range_constexpr(kblocks):
            cute.zipped_divide(kbuf, (VEC,))[(None, tile * kblocks + c)].store(
                cute.zipped_divide(keys[row, None], (VEC,))[(None, 4 * c + t)].load())
    for r in cutlass.range_constexpr(4):
        row = cutlass.min(kb + (r // 2) * 8 + 2 * t + r % 2, end - 1)
        for c in cutlass.range_constexpr(vblocks):
            cute.zipped_divide(vbuf, (VEC,))[(None, r * vblocks + c)].store(
                cute.zipped_divide(values[row, None], (VEC,))[(None, 8 * c + g)].load())


MMA_TWO_BUFFERS = 2  # _mma_softmax_chunk's two K/V buffers (an mma_two_buffers build; True: one set a step ahead)
MMA_EARLY_KV = 3  # ... one set a step ahead, a warp's first set issued before the item's query is roped (early_kv)
MMA_EARLY_L1 = 4  # ... one set a step ahead, a warp's first set's lines prefetched into L1 before the roping


@cute.jit
def _mma_first_step_l1(keys: cute.Tensor, values: cute.Tensor, kb: Int32, end: Int32, pos: Int32, lane: Int32,
                       head_dim: cutlass.Constexpr[int]):
    """Ask this SM's L1 for the K and V lines of 16-key step ``kb``'s rows below ``pos`` and ``end`` (one
    ``prefetch.global.L1`` per 128-byte line over the warp's lanes). Those rows are not written during the launch, so
    L1 (not coherent across SMs) holds their current bytes; row ``pos`` is left out (the roping appends it)."""
    elements_per_line = 128 * 8 // keys.element_type.width
    lines_per_row = (head_dim + elements_per_line - 1) // elements_per_line
    for i in cutlass.range_constexpr(0, MMA_ATT_KEYS * lines_per_row, WARP):
        row = kb + (i + lane) // lines_per_row
        line = (i + lane) % lines_per_row
        if i + lane < MMA_ATT_KEYS * lines_per_row and row < cutlass.min(pos, end):
            cute.arch.prefetch((keys[row, None].iterator + line * elements_per_line).llvm_ptr, cache_level="L1")
            cute.arch.prefetch((values[row, None].iterator + line * elements_per_line).llvm_ptr, cache_level="L1")


@cute.jit
def _mma_step(kbuf: cute.Tensor, vbuf: cute.Tensor, q: cute.Tensor, a_q: cute.Tensor, a_v: cute.Tensor,
              b: cute.Tensor, score: cute.Tensor, probs: cute.Tensor, out: cute.Tensor, kb: Int32, end: Int32,
              top: Float32, total: Float32, t: Int32, head_dim: cutlass.Constexpr[int]):
    """One 16-key step of :func:`_mma_softmax_chunk` from the K/V fragments in ``kbuf`` / ``vbuf``: the scores of
    keys kb .. kb + 15 (those at ``end`` or past it masked), the online softmax's new (max, sum) returned, and the
    accumulator ``out`` rescaled and summed with P·V."""
    kblocks = head_dim // 32
    vblocks = head_dim // 64
    atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)))
    new_top = top
    for tile in cutlass.range_constexpr(2):
        for i in cutlass.range_constexpr(4):
            score[i] = Float32(0.0)
        for c in cutlass.range_constexpr(kblocks):
            for m in cutlass.range_constexpr(2):
                a_q[0] = q[c * VEC + 4 * m]
                a_q[1] = q[c * VEC + 4 * m + 1]
                a_q[4] = q[c * VEC + 4 * m + 2]
                a_q[5] = q[c * VEC + 4 * m + 3]
                for i in cutlass.range_constexpr(4):
                    b[i] = kbuf[(tile * kblocks + c) * VEC + 4 * m + i]
                cute.gemm(atom, score, a_q, b, score)
        for e in cutlass.range_constexpr(2):
            value = Float32(ATT_NEG)
            if kb + tile * 8 + 2 * t + e < end:
                value = score[e]
            probs[tile * 2 + e] = value
            new_top = cute.arch.fmax(new_top, value)
    new_top = cute.arch.fmax(new_top, cute.arch.shuffle_sync_bfly(new_top, 1))
    new_top = cute.arch.fmax(new_top, cute.arch.shuffle_sync_bfly(new_top, 2))
    correction = cute.math.exp(top - new_top)
    total = total * correction
    for i in cutlass.range_constexpr(4):
        p = Float32(0.0)
        if kb + (i // 2) * 8 + 2 * t + i % 2 < end:
            p = cute.math.exp(probs[i] - new_top)
        total = total + p
        b[i] = p.to(cutlass.BFloat16)
    scale_lo = cute.arch.shuffle_sync(correction, 8 * t)  # heads 2t and 2t + 1 live in lanes 8t, 8t + 4
    scale_hi = cute.arch.shuffle_sync(correction, 8 * t + 4)
    for c in cutlass.range_constexpr(vblocks):
        for j in cutlass.range_constexpr(4):
            for r in cutlass.range_constexpr(4):  # keys 2t, 2t + 1, 8 + 2t, 9 + 2t
                a_v[(r % 2) + 4 * (r // 2)] = vbuf[(r * vblocks + c) * VEC + 2 * j]
                a_v[(r % 2) + 4 * (r // 2) + 2] = vbuf[(r * vblocks + c) * VEC + 2 * j + 1]
            acc = out[None, None, None, c * 4 + j]
            acc[0] = acc[0] * scale_lo
            acc[1] = acc[1] * scale_hi
            acc[2] = acc[2] * scale_lo
            acc[3] = acc[3] * scale_hi
            cute.gemm(atom, acc, a_v, b, acc)
    return new_top, total


@cute.jit
def _mma_softmax_chunk(keys: cute.Tensor, values: cute.Tensor, s_q: cute.Tensor, s_part: cute.Tensor,
                       first: Int32, end: Int32, warp: Int32, lane: Int32, heads: cutlass.Constexpr[int],
                       head_dim: cutlass.Constexpr[int], warps: cutlass.Constexpr[int],
                       two_buffers: cutlass.Constexpr[bool] = False, early: cutlass.Constexpr[bool] = False,
                       kfirst: cute.Tensor = None, vfirst: cute.Tensor = None, loaded: Int32 = 0):
    """Keys [first, end) of one item on the tensor cores (module comment above ``MMA_ATT_KEYS``): warp ``warp``
    takes the 16-key steps first + 16 (warp + i x warps), its next step's K/V loads issued before this step's
    MMAs (:func:`_mma_step`), and keeps an online softmax per head; then it writes its partial (accumulator, max,
    sum) per head into ``s_part[:, h, warp]``, the layout the lane-group loop's warps leave there, for the same
    merge. Heads of 256 dims (an ``mma_wide`` build) load each step's K/V at the step instead: a step's K, V and
    output fragments already hold ~190 registers per lane, and a second K/V set would spill (the same sums either
    way). ``two_buffers`` (a candidate, session 58; heads of 64 / 128) keeps the same two K/V sets in two fixed
    buffers that take steps in turn, two steps per loop iteration: both of a warp's first two steps are in flight
    before the first MMA, where the single look-ahead copies the next set into the current one and so cannot issue
    the next loads before the current ones land (a warp's item of 2 steps waited two round trips). The same steps in
    the same order: the same bits. Two sets of 128-dim rows do not fit the loader build's 168 registers (Qwen3-0.6B
    spills 688 bytes, local ptxas); heads of 64 dims fit without spills (Llama-3.2-1B, SmolLM-135M b8, Qwen2.5-0.5B
    b8). ``early`` (session 59, heads of 64 / 128, one set ahead): the caller holds the first step's set in
    ``kfirst`` / ``vfirst``, already requested where ``loaded`` is 1 (:func:`_item_warp_partials` issues it before
    the query is roped, where the step's rows are all below this step's position); the same loads, the same bits."""
    g = lane // 4
    t = lane % 4
    kblocks = head_dim // 32
    vblocks = head_dim // 64
    ahead = head_dim <= 128  # the next step's K/V loaded during this step's MMAs
    a_q = cute.make_rmem_tensor(cute.make_layout((8, 1, 1)), cutlass.BFloat16)
    a_v = cute.make_rmem_tensor(cute.make_layout((8, 1, 1)), cutlass.BFloat16)
    b = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), cutlass.BFloat16)
    score = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
    probs = cute.make_rmem_tensor(cute.make_layout(4), Float32)
    q = cute.make_rmem_tensor(cute.make_layout(VEC * kblocks), cutlass.BFloat16)
    kbuf = cute.make_rmem_tensor(cute.make_layout(VEC * 2 * kblocks), keys.element_type)
    vbuf = cute.make_rmem_tensor(cute.make_layout(VEC * 4 * vblocks), values.element_type)
    if cutlass.const_expr(early):
        knext = kfirst
        vnext = vfirst
    else:
        knext = cute.make_rmem_tensor(cute.make_layout(VEC * 2 * kblocks), keys.element_type)
        vnext = cute.make_rmem_tensor(cute.make_layout(VEC * 4 * vblocks), values.element_type)
    out = cute.make_rmem_tensor(cute.make_layout((4, 1, 1, 4 * vblocks)), Float32)
    live = Float32(0.0)
    if g < heads:
        live = Float32(1.0)
    head = cutlass.min(g, heads - 1)
    for c in cutlass.range_constexpr(kblocks):  # head g's query, dims 32c + 8t .. + 7, as A fragments' values
        qv = cute.zipped_divide(s_q, (VEC,))[(None, head * (head_dim // VEC) + 4 * c + t)].load()
        cute.zipped_divide(q, (VEC,))[(None, c)].store((qv * live).to(cutlass.BFloat16))
    for i in cutlass.range_constexpr(8):
        a_q[i] = cutlass.BFloat16(0.0)
    for i in cutlass.range_constexpr(16 * vblocks):
        out[i] = Float32(0.0)
    top = Float32(ATT_NEG)
    total = Float32(0.0)
    stride = warps * MMA_ATT_KEYS
    if cutlass.const_expr(ahead and two_buffers):
        _mma_load_kv(keys, values, kbuf, vbuf, first + warp * MMA_ATT_KEYS, end, g, t, head_dim)
        _mma_load_kv(keys, values, knext, vnext, first + warp * MMA_ATT_KEYS + stride, end, g, t, head_dim)
        for kb in range(first + warp * MMA_ATT_KEYS, end, 2 * stride):
            top, total = _mma_step(kbuf, vbuf, q, a_q, a_v, b, score, probs, out, kb, end, top, total, t, head_dim)
            _mma_load_kv(keys, values, kbuf, vbuf, kb + 2 * stride, end, g, t, head_dim)
            if kb + stride < end:
                top, total = _mma_step(knext, vnext, q, a_q, a_v, b, score, probs, out, kb + stride, end, top,
                                       total, t, head_dim)
                _mma_load_kv(keys, values, knext, vnext, kb + 3 * stride, end, g, t, head_dim)
    else:
        if cutlass.const_expr(ahead and early):
            if loaded == 0:
                _mma_load_kv(keys, values, knext, vnext, first + warp * MMA_ATT_KEYS, end, g, t, head_dim)
        elif cutlass.const_expr(ahead):
            _mma_load_kv(keys, values, knext, vnext, first + warp * MMA_ATT_KEYS, end, g, t, head_dim)
        for kb in range(first + warp * MMA_ATT_KEYS, end, stride):
            if cutlass.const_expr(ahead):
                kbuf.store(knext.load())
                vbuf.store(vnext.load())
                _mma_load_kv(keys, values, knext, vnext, kb + stride, end, g, t, head_dim)
                cute.arch.sync_warp()  # a scheduling fence: keep the next step's loads above this step's MMAs
            else:
                _mma_load_kv(keys, values, kbuf, vbuf, kb, end, g, t, head_dim)
            top, total = _mma_step(kbuf, vbuf, q, a_q, a_v, b, score, probs, out, kb, end, top, total, t, head_dim)
    total = total + cute.arch.shuffle_sync_bfly(total, 1)
    total = total + cute.arch.shuffle_sync_bfly(total, 2)
    if t == 0 and g < heads:
        s_part[head_dim, g, warp] = top
        s_part[head_dim + 1, g, warp] = total
    for c in cutlass.range_constexpr(vblocks):
        for j in cutlass.range_constexpr(4):
            base = (c * 4 + j) * 4
            d = 64 * c + 8 * g + 2 * j
            if 2 * t < heads:
                s_part[d, 2 * t, warp] = out[base]
                s_part[d + 1, 2 * t, warp] = out[base + 2]
            if 2 * t + 1 < heads:
                s_part[d, 2 * t + 1, warp] = out[base + 1]
                s_part[d + 1, 2 * t + 1, warp] = out[base + 3]


def split_chunk(visible: Int32, splits: cutlass.Constexpr[int], min_chunk: cutlass.Constexpr[int],
                quantum: cutlass.Constexpr[int]) -> Int32:
    """Positions per split-KV work item at this step: ``visible`` positions over ``splits`` items, rounded up to
    a multiple of ``quantum`` (``min_chunk``, or a CTA pass: ``plan.chunk_quantum``), at least ``min_chunk``
    (short contexts stay in one item). Shared by :func:`split_kv_prefetch` and :func:`split_kv_attention`, which
    must deal the same chunks."""
    chunk = (visible + splits - 1) // splits
    return cutlass.max(((chunk + quantum - 1) // quantum) * quantum, min_chunk)


@cute.jit
def split_schedule(visible: Int32, splits: cutlass.Constexpr[int], min_chunk: cutlass.Constexpr[int],
                   quantum: cutlass.Constexpr[int], head_slices: cutlass.Constexpr[int],
                   long_slices: cutlass.Constexpr[bool], mma_slices: cutlass.Constexpr[int] = 0):
    """(chunk, active, slices) of a split-KV step over ``visible`` positions, as ``plan.attention.split_schedule``
    deals them (the reference executor mirrors it): ``active`` chunks of ``chunk`` positions, each as ``slices``
    items of group / slices query heads. Without ``long_slices`` the chunks of :func:`split_chunk` over every
    split, sliced by ``head_slices`` where ``active * head_slices <= splits``. With it, each divisor ``s`` of
    ``head_slices`` with its smallest chunk over at most ``splits // s`` splits, the least work per item (chunk x
    heads) winning, the fewest slices on a tie. ``mma_slices`` (a candidate, ``generate(plan, mma_schedule=True)``):
    bit ``s`` set where items of ``s`` slices run on the tensor cores (:func:`_mma_softmax_chunk`), whose work is
    then the chunk alone (its heads come nearly free). Shared by :func:`split_kv_prefetch` and
    :func:`split_kv_attention`, which must deal the same items."""
    chunk = split_chunk(visible, splits, min_chunk, quantum)
    active = (visible + chunk - 1) // chunk
    slices = Int32(1)
    if cutlass.const_expr(head_slices > 1):
        if cutlass.const_expr(long_slices):
            least = chunk * (1 if (mma_slices >> 1) & 1 else head_slices)
            for s in cutlass.range_constexpr(2, head_slices + 1):
                if cutlass.const_expr(head_slices % s == 0):
                    size = split_chunk(visible, splits // s, min_chunk, quantum)
                    weight = 1 if (mma_slices >> s) & 1 else head_slices // s
                    if size * weight < least:
                        least = size * weight
                        chunk = size
                        slices = Int32(s)
            active = (visible + chunk - 1) // chunk
        else:
            if active * head_slices <= splits:
                slices = Int32(head_slices)
    return chunk, active, slices


@cute.jit
def split_kv_prefetch(k_cache: cute.Tensor, v_cache: cute.Tensor, pos: Int32, first_key: Int32, cta: Int32,
                      tidx: Int32, batch: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                      head_dim: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                      splits: cutlass.Constexpr[int], min_chunk: cutlass.Constexpr[int],
                      quantum: cutlass.Constexpr[int], head_slices: cutlass.Constexpr[int],
                      long_slices: cutlass.Constexpr[bool], to_l1: cutlass.Constexpr[bool],
                      max_rows: cutlass.Constexpr[int], mma_slices: cutlass.Constexpr[int] = 0):
    """Ask L2 (``to_l1``: L1, a candidate) for the first ``max_rows`` cached K and V rows of this CTA's first
    :func:`split_kv_attention` work item (same dealing, :func:`split_schedule`: item ``cta``, split-major; same
    chunking of positions [first_key, pos]), one ``prefetch.global`` per 128-byte line over the CTA's
    threads. The cap (``codegen.kv_prefetch_rows``) keeps a long context's prefetch from competing with the
    weight stream of the GEMV before the barrier; a short context's item fits in it whole.

    Issued before the grid barrier that precedes attention (the default build since session 16):
    the cached rows do not depend on that barrier, so their DRAM latency overlaps the wait and attention's loads
    hit L2. This step's row (``pos``) is not written yet and is left out. A prefetch has no effect on results.
    With ``to_l1`` the lines land in this SM's L1, so attention's first loads need no L2 round trip: the rows
    below ``pos`` are not written during the launch (L1 is not coherent across SMs), and this CTA's own write of
    row ``pos`` is visible to it after its ``bar.sync`` whatever L1 holds."""
    groups = batch * n_kv_heads
    n = pos + 1
    visible = n - first_key
    chunk, active, slices = split_schedule(visible, splits, min_chunk, quantum, head_slices, long_slices, mma_slices)
    split = cta // (groups * slices)
    if cta < groups * splits and split < active:
        g = (cta - split * groups * slices) // slices
        b = g // n_kv_heads
        kvh = g - b * n_kv_heads
        start = first_key + split * chunk
        end = cutlass.min(cutlass.min(start + chunk, pos), start + max_rows)  # the chunk's first cached rows
        elements_per_line = 128 * 8 // k_cache.element_type.width
        lines_per_row = (head_dim + elements_per_line - 1) // elements_per_line
        for i in range(start * lines_per_row + tidx, end * lines_per_row, threads):
            row = i // lines_per_row
            line = i - row * lines_per_row
            if cutlass.const_expr(to_l1):
                cute.arch.prefetch((k_cache[b, kvh, row, None].iterator + line * elements_per_line).llvm_ptr,
                                   cache_level="L1")
                cute.arch.prefetch((v_cache[b, kvh, row, None].iterator + line * elements_per_line).llvm_ptr,
                                   cache_level="L1")
            else:
                cute.arch.prefetch((k_cache[b, kvh, row, None].iterator + line * elements_per_line).llvm_ptr,
                                   cache_level="L2")
                cute.arch.prefetch((v_cache[b, kvh, row, None].iterator + line * elements_per_line).llvm_ptr,
                                   cache_level="L2")


@cute.jit
def split_kv_attention(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                       k_cache: cute.Tensor, v_cache: cute.Tensor, attn: cute.Tensor, part: cute.Tensor,
                       counts: cute.Tensor, pos: Int32, first_key: Int32, s_att: cute.Tensor, cta: Int32, tidx: Int32,
                       batch: cutlass.Constexpr[int], n_heads: cutlass.Constexpr[int],
                       n_kv_heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                       ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                       scale: cutlass.Constexpr[float], has_qk_norm: cutlass.Constexpr[bool],
                       eps: cutlass.Constexpr[float], splits: cutlass.Constexpr[int],
                       unroll: cutlass.Constexpr[int], min_chunk: cutlass.Constexpr[int],
                       quantum: cutlass.Constexpr[int], rotary_dim: cutlass.Constexpr[int],
                       whole_qk_norm: cutlass.Constexpr[bool], merge_preload: cutlass.Constexpr[bool],
                       spread_merge: cutlass.Constexpr[bool], head_slices: cutlass.Constexpr[int],
                       long_slices: cutlass.Constexpr[bool], kv_pipeline: cutlass.Constexpr[bool],
                       merge_above: cutlass.Constexpr[int] = 1, mma_attention: cutlass.Constexpr[bool] = False,
                       mma_slices: cutlass.Constexpr[int] = 0, mma_wide: cutlass.Constexpr[bool] = False,
                       group_counts: cute.Tensor = None, count_groups: cutlass.Constexpr[bool] = False):
    """Flash decoding: RoPE + KV append + attention over positions [first_key, pos], the cached keys split across
    CTAs (``first_key`` is 0, or where the layer's sliding window starts). ``merge_preload``: the merging item
    loads its first partials at once (:func:`_merge_splits`). ``spread_merge``: every active item of a group
    merges a slice of its outputs (:func:`_merge_spread`) where that takes at most two passes, instead of the last
    arrival merging them all. ``codegen.default_merge`` picks both per plan. ``merge_above``: the items merge only
    where more than that many splits are active; with 2..``merge_above`` (``generate(plan, fold_merge=True)``, the
    default since session 24) they only store their partials, and the next stage's staging merges them
    (:func:`merge_splits_to_smem`). ``mma_attention`` (a candidate): items of 2-8 query heads of 64 or 128 dims
    score and sum their keys on the tensor cores (:func:`_mma_softmax_chunk`); ``mma_slices`` deals with them in
    mind (:func:`split_schedule`); ``mma_wide`` (a candidate, session 41) also puts heads of 256 dims there.
    ``count_groups`` (``generate(plan, fused_split=True)``, a candidate): each item, once its partial (or its
    merge) is written, adds 1 to ``group_counts[KV head]`` (release), which :func:`split_o_block` waits on.

    Work items are (split, batch, KV head), split-major, dealt to CTAs. At this step the ``pos + 1 - first_key``
    visible positions are cut into ``active`` chunks of ``chunk`` positions (at least ``min_chunk``, which is the
    positions one CTA pass covers x ``unroll``: short contexts stay in one split; a multiple of ``quantum``, that
    or a CTA pass), each dealt as ``slices``
    items (split, batch, KV head, slice) of ``group / slices`` query heads (:func:`split_schedule`: at short
    contexts ``head_slices`` while they fit the items; with ``long_slices`` also fewer, longer splits of
    smaller slices where that gives each item less work), so more CTAs share the step's attention:
    :func:`_split_kv_items` is the same code for a slice as for a whole group, built once per slice count the
    schedule can deal.
    """
    group = n_heads // n_kv_heads
    visible = pos + 1 - first_key
    chunk, active, slices = split_schedule(visible, splits, min_chunk, quantum, head_slices, long_slices, mma_slices)
    if cutlass.const_expr(head_slices <= 1):
        _split_kv_items(qkv, qk_norm, rope_cos, rope_sin, k_cache, v_cache, attn, part, counts, pos, first_key,
                        chunk, active, s_att, cta, tidx, batch, n_heads, n_kv_heads, head_dim, ctas, threads, scale,
                        has_qk_norm, eps, splits, unroll, rotary_dim, whole_qk_norm, merge_preload, spread_merge,
                        group, 1, kv_pipeline, merge_above, mma_attention, mma_wide, group_counts, count_groups)
    else:
        for s in cutlass.range_constexpr(1, head_slices + 1):
            if cutlass.const_expr(head_slices % s == 0 and (long_slices or s == 1 or s == head_slices)):
                if slices == s:
                    _split_kv_items(qkv, qk_norm, rope_cos, rope_sin, k_cache, v_cache, attn, part, counts, pos,
                                    first_key, chunk, active, s_att, cta, tidx, batch, n_heads, n_kv_heads,
                                    head_dim, ctas, threads, scale, has_qk_norm, eps, splits, unroll, rotary_dim,
                                    whole_qk_norm, merge_preload, spread_merge, group // s, s, kv_pipeline,
                                    merge_above, mma_attention, mma_wide, group_counts, count_groups)


def _item_scratch(s_att: cute.Tensor, heads: int, head_dim: int, warps: int):
    """(s_q, s_inv, s_flag, s_part) of a split-KV work item of ``heads`` query heads inside the attention scratch
    ``s_att`` (layout: :func:`_split_kv_items`). Plain Python, run while the calling body is traced."""
    s_q = cute.make_tensor(s_att.iterator, cute.make_layout(heads * head_dim))
    s_inv = cute.make_tensor(s_att.iterator + heads * head_dim, cute.make_layout(heads + 1))
    s_flag = cute.make_tensor(s_att.iterator + heads * head_dim + 8 * ((heads + 8) // 8), cute.make_layout(1))
    s_part = cute.make_tensor(s_att.iterator + heads * head_dim + 8 * ((heads + 8) // 8) + 8,
                              cute.make_layout((head_dim + 2, heads, warps)))
    return s_q, s_inv, s_flag, s_part


@cute.jit
def _item_warp_partials(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                        k_cache: cute.Tensor, v_cache: cute.Tensor, s_att: cute.Tensor, b: Int32, kvh: Int32,
                        vkvh: Int32, pos: Int32, start: Int32, end: Int32, tidx: Int32,
                        n_heads: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                        head_dim: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                        scale: cutlass.Constexpr[float], has_qk_norm: cutlass.Constexpr[bool],
                        eps: cutlass.Constexpr[float], unroll: cutlass.Constexpr[int],
                        rotary_dim: cutlass.Constexpr[int], whole_qk_norm: cutlass.Constexpr[bool],
                        heads: cutlass.Constexpr[int], kv_pipeline: cutlass.Constexpr[bool],
                        mma_attention: cutlass.Constexpr[bool], s_keys: cute.Tensor,
                        s_values: cute.Tensor, kv_smem: cutlass.Constexpr[bool],
                        mma_wide: cutlass.Constexpr[bool] = False):
    """One work item up to its warps' partials: the ``heads`` query heads from ``vkvh x heads`` of KV head ``kvh``
    of sequence ``b`` roped into ``s_q`` (and this step's key and value appended where ``end`` is ``pos + 1``),
    keys [start, end) scored on the lane-group loop or, for ``mma_attention`` items that fit (``mma_wide``: heads of
    256 too), the tensor cores,
    and each warp's (accumulator, max, sum) per head left in ``s_part`` (:func:`_item_scratch`), then ``bar.sync``.
    Shared by :func:`_split_kv_items` and :func:`fused_attention_o`; with ``kv_smem`` (a fused step's group whose
    cached rows :func:`fused_o_load` put in shared memory) the keys are scored from ``s_keys`` / ``s_values``."""
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    lanes_per_pos = head_dim // VEC
    lane_slots = 1 << (lanes_per_pos - 1).bit_length()  # a lane group: lanes_per_pos padded to a power of two
    pos_per_warp = WARP // lane_slots
    grp = lane // lane_slots
    sub = lane - grp * lane_slots
    stride = warps * pos_per_warp
    writer = grp  # lane group 0 writes the warp's merged partial (not its spare lanes, if any)
    if cutlass.const_expr(lane_slots != lanes_per_pos):
        if sub >= lanes_per_pos:
            writer = Int32(1)
    s_q, s_inv, s_flag, s_part = _item_scratch(s_att, heads, head_dim, warps)
    m = cute.make_rmem_tensor(cute.make_layout(heads), Float32)
    l = cute.make_rmem_tensor(cute.make_layout(heads), Float32)
    acc = cute.make_rmem_tensor(cute.make_layout(heads * VEC), Float32)
    other = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
    owns_new = Int32(0)
    if end == pos + 1:
        owns_new = Int32(1)
    mma_item = mma_attention and mma_attention_fits(heads, head_dim, mma_wide)
    early = mma_item and mma_attention == MMA_EARLY_KV and head_dim <= 128 and not kv_smem
    kfirst = None
    vfirst = None
    loaded = 0
    if cutlass.const_expr(early):  # early_kv: the first step's K/V in flight while the query is roped
        kfirst = cute.make_rmem_tensor(cute.make_layout(VEC * 2 * (head_dim // 32)), k_cache.element_type)
        vfirst = cute.make_rmem_tensor(cute.make_layout(VEC * 4 * (head_dim // 64)), v_cache.element_type)
        loaded = Int32(0)
        first_kb = start + warp * MMA_ATT_KEYS
        if first_kb + MMA_ATT_KEYS <= pos:  # rows below pos only: _rope_group appends row pos
            _mma_load_kv(k_cache[b, kvh, None, None], v_cache[b, kvh, None, None], kfirst, vfirst, first_kb, end,
                         lane // 4, lane % 4, head_dim)
            loaded = Int32(1)
    if cutlass.const_expr(mma_item and mma_attention == MMA_EARLY_L1 and not kv_smem):
        _mma_first_step_l1(k_cache[b, kvh, None, None], v_cache[b, kvh, None, None], start + warp * MMA_ATT_KEYS,
                           end, pos, lane, head_dim)
    _rope_group(qkv, qk_norm, rope_cos, rope_sin, k_cache, v_cache, s_q, s_inv, b, kvh, vkvh * heads, pos,
                owns_new, tidx, n_heads, n_kv_heads, head_dim, threads, scale, has_qk_norm, eps, rotary_dim,
                whole_qk_norm, heads, s_keys, s_values, kv_smem)
    keys = k_cache[b, kvh, None, None]
    values = v_cache[b, kvh, None, None]
    if cutlass.const_expr(kv_smem):
        keys = s_keys
        values = s_values
    if cutlass.const_expr(mma_item):
        _mma_softmax_chunk(keys, values, s_q, s_part, start, end, warp, lane, heads, head_dim, warps,
                           mma_attention == MMA_TWO_BUFFERS, early, kfirst, vfirst, loaded)
    else:
        for h in cutlass.range_constexpr(heads):
            m[h] = Float32(ATT_NEG)
            l[h] = Float32(0.0)
        for e in cutlass.range_constexpr(heads * VEC):
            acc[e] = Float32(0.0)
        _online_softmax_chunk(keys, values, s_q, m, l, acc, start + warp * pos_per_warp, end, grp, sub, heads,
                              lanes_per_pos, stride, unroll, kv_pipeline)
        for h in cutlass.range_constexpr(heads):  # lane groups of a warp: butterfly merge
            offset = lane_slots
            while cutlass.const_expr(offset < WARP):
                m_o = cute.arch.shuffle_sync_bfly(m[h], offset)
                l_o = cute.arch.shuffle_sync_bfly(l[h], offset)
                for e in cutlass.range_constexpr(VEC):
                    other[e] = cute.arch.shuffle_sync_bfly(acc[h * VEC + e], offset)
                _merge_into(m, l, acc, h, m_o, l_o, other)
                offset *= 2
            if writer == 0:
                for e in cutlass.range_constexpr(VEC):
                    s_part[sub * VEC + e, h, warp] = acc[h * VEC + e]
                if sub == 0:
                    s_part[head_dim, h, warp] = m[h]
                    s_part[head_dim + 1, h, warp] = l[h]
    cute.arch.sync_threads()


@cute.jit
def _merge_warp_partials(s_part: cute.Tensor, h: Int32, d: Int32, head_dim: cutlass.Constexpr[int],
                         warps: cutlass.Constexpr[int]):
    """(max, sum, accumulator at dim ``d``) of head ``h`` over the warps' partials an item left in ``s_part``
    (:func:`_item_warp_partials`): exact, warps in order."""
    top = s_part[head_dim, h, 0]
    for w in cutlass.range_constexpr(1, warps):
        top = cute.arch.fmax(top, s_part[head_dim, h, w])
    total = Float32(0.0)
    out = Float32(0.0)
    for w in cutlass.range_constexpr(warps):
        weight = cute.math.exp(s_part[head_dim, h, w] - top)
        total = total + s_part[head_dim + 1, h, w] * weight
        out = out + s_part[d, h, w] * weight
    return top, total, out


@cute.jit
def _split_kv_items(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                    k_cache: cute.Tensor, v_cache: cute.Tensor, attn: cute.Tensor, part: cute.Tensor,
                    counts: cute.Tensor, pos: Int32, first_key: Int32, chunk: Int32, active: Int32,
                    s_att: cute.Tensor, cta: Int32, tidx: Int32, batch: cutlass.Constexpr[int],
                    n_heads: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                    head_dim: cutlass.Constexpr[int], ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                    scale: cutlass.Constexpr[float], has_qk_norm: cutlass.Constexpr[bool],
                    eps: cutlass.Constexpr[float], splits: cutlass.Constexpr[int], unroll: cutlass.Constexpr[int],
                    rotary_dim: cutlass.Constexpr[int], whole_qk_norm: cutlass.Constexpr[bool],
                    merge_preload: cutlass.Constexpr[bool], spread_merge: cutlass.Constexpr[bool],
                    heads: cutlass.Constexpr[int], slices: cutlass.Constexpr[int],
                    kv_pipeline: cutlass.Constexpr[bool], merge_above: cutlass.Constexpr[int],
                    mma_attention: cutlass.Constexpr[bool], mma_wide: cutlass.Constexpr[bool] = False,
                    group_counts: cute.Tensor = None, count_groups: cutlass.Constexpr[bool] = False):
    """This CTA's work items of :func:`split_kv_attention` at this step, ``slices`` head slices of ``heads`` query
    heads each per (split, batch, KV head) (1 slice: the whole group). Item ``i`` is split ``i // (groups x
    slices)``, then (batch, KV head, slice); the ``heads`` query heads of a slice are a "virtual KV group" of
    their own: partials, merge and arrival counter (``counts[(batch x kv_heads + kv head) x slices + slice]``).

    An active item ropes its heads' queries, scores every cached key row of its chunk once for all of them (GQA
    packing), keeps an online softmax (max, sum, accumulator) per head and lane group, and merges them across
    lane groups (shuffles) and warps (shared memory). With one active split it writes the normalised output;
    otherwise it stores its partial (acc, max, sum) in ``part[b, head, split, :]``, and the last item of its
    virtual group to arrive (an acq_rel counter in ``counts``, reset by that item) merges every split's partial
    into ``attn`` (or, with the spread merge, all its items merge a share each); where at most ``merge_above``
    splits are active the partials stay for the next stage's staging (:func:`merge_splits_to_smem`).

    s_att layout (fp32): [0, H*D) roped q | 8 slots: per-head inverse RMS (Qwen3) | flag | then
    (D + 2) x H x warps partial outputs (accumulator, max, sum), H = ``heads``: within the scratch the plan sizes
    for a whole group.
    """
    warps = threads // WARP
    groups = batch * n_kv_heads
    virtual_groups = groups * slices
    s_q, s_inv, s_flag, s_part = _item_scratch(s_att, heads, head_dim, warps)
    s_weight = cute.make_tensor(s_part.iterator, cute.make_layout((heads, splits)))  # reuses s_part when merging
    n = pos + 1
    for item in range(cta, groups * splits, ctas):
        split = item // virtual_groups
        vg = item - split * virtual_groups  # (batch, KV head, slice)
        if split < active:
            g = vg // slices
            b = g // n_kv_heads
            kvh = g - b * n_kv_heads
            vkvh = vg - b * n_kv_heads * slices  # kvh x slices + slice: the slice's heads start at vkvh x heads
            start = first_key + split * chunk
            end = cutlass.min(start + chunk, n)
            _item_warp_partials(qkv, qk_norm, rope_cos, rope_sin, k_cache, v_cache, s_att, b, kvh, vkvh, pos, start,
                                end, tidx, n_heads, n_kv_heads, head_dim, threads, scale, has_qk_norm, eps, unroll,
                                rotary_dim, whole_qk_norm, heads, kv_pipeline, mma_attention,
                                k_cache[b, kvh, None, None], v_cache[b, kvh, None, None], False, mma_wide)
            for i in range(tidx, heads * head_dim, threads):  # warps: merge, then output or partial
                h = i // head_dim
                d = i - h * head_dim
                top, total, out = _merge_warp_partials(s_part, h, d, head_dim, warps)
                head = vkvh * heads + h
                if active == 1:
                    attn[b, head * head_dim + d] = out / total
                else:
                    part[b, head, split, d] = out
                    if d == 0:
                        part[b, head, split, head_dim] = top
                        part[b, head, split, head_dim + 1] = total
            if active > merge_above:
                if cutlass.const_expr(spread_merge):
                    if active * 2 * (threads // SPREAD_LANES) >= heads * head_dim:  # at most two passes each
                        _merge_spread(attn, part, counts, s_part, b, vkvh, vg, split, active, tidx, heads, head_dim,
                                      threads)
                    else:
                        _merge_splits(attn, part, counts, s_flag, s_weight, b, vkvh, vg, active, tidx, heads,
                                      head_dim, threads, splits, merge_preload)
                else:
                    _merge_splits(attn, part, counts, s_flag, s_weight, b, vkvh, vg, active, tidx, heads, head_dim,
                                  threads, splits, merge_preload)
            cute.arch.sync_threads()
            if cutlass.const_expr(count_groups):  # bar.sync above: the CTA's writes come before the release
                if tidx == 0:
                    cute.arch.red((group_counts.iterator + g).llvm_ptr, Int64(1), op="add", dtype="u64",
                                  sem="release", scope="gpu")


@cute.jit
def _merge_splits(attn: cute.Tensor, part: cute.Tensor, counts: cute.Tensor, s_flag: cute.Tensor,
                  s_weight: cute.Tensor, b: Int32, kvh: Int32, g: Int32, active: Int32, tidx: Int32,
                  group: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                  splits: cutlass.Constexpr[int], preload: cutlass.Constexpr[bool]):
    """Arrive at group ``g``'s counter (release: this CTA's partials first; ``g``, ``kvh``, ``group`` name a
    virtual group of :func:`_split_kv_items`, whose heads start at ``kvh * group``); the last of ``active`` arrivals
    (acquire: everyone's partials visible) resets the counter and merges the partials into ``attn``: one warp
    per head turns the splits' (max, sum) into weights exp(m_s - max) / total in ``s_weight`` [group, splits],
    then each thread sums its outputs over the splits, ``MERGE_UNROLL`` splits x all its outputs loaded at once
    (the merge is one L2 round trip per ``MERGE_UNROLL`` splits, not one per split and output).

    With ``preload`` the same sums, in the same order (same bits), cost one L2 round trip after the arrival
    instead of three or more: each thread loads the partial outputs of its first ``PRELOAD_LOADS // outputs per
    thread`` splits before the weights are computed, and the weight warps load each split's max and sum once,
    together (kept in shared memory after ``s_weight``: ``2 * group * splits`` floats of the warps' scratch)."""
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
        lane = tidx % WARP
        warp = tidx // WARP
        outputs = group * head_dim
        per_thread = (outputs + threads - 1) // threads
        first_loads = 0  # splits whose partial outputs are loaded before the weights (preload)
        if cutlass.const_expr(preload):
            first_loads = max(1, PRELOAD_LOADS // per_thread)
            early = cute.make_rmem_tensor(cute.make_layout((per_thread, first_loads)), Float32)
            for j in cutlass.range_constexpr(per_thread):  # names of their own: h, d are staged loops' below
                early_i = cutlass.min(tidx + j * threads, outputs - 1)
                early_h = early_i // head_dim
                for u in cutlass.range_constexpr(first_loads):
                    early[j, u] = part[b, kvh * group + early_h, cutlass.min(u, active - 1),
                                       early_i - early_h * head_dim]
        s_sums = cute.make_tensor(s_weight.iterator + group * splits, cute.make_layout((group, splits)))  # preload
        for h in range(warp, group, threads // WARP):
            head = kvh * group + h
            top = Float32(ATT_NEG)
            for s in range(lane, active, WARP):
                if cutlass.const_expr(preload):  # max and sum in one round trip, kept for the next loop
                    m_s = part[b, head, s, head_dim]
                    s_weight[h, s] = m_s
                    s_sums[h, s] = part[b, head, s, head_dim + 1]
                    top = cute.arch.fmax(top, m_s)
                else:
                    top = cute.arch.fmax(top, part[b, head, s, head_dim])
            top = cute.arch.warp_reduction_max(top)
            total = Float32(0.0)
            for s in range(lane, active, WARP):  # each lane reads back only what it wrote: no barrier needed
                if cutlass.const_expr(preload):
                    weight = cute.math.exp(s_weight[h, s] - top)
                    s_weight[h, s] = weight
                    total = total + s_sums[h, s] * weight
                else:
                    weight = cute.math.exp(part[b, head, s, head_dim] - top)
                    s_weight[h, s] = weight
                    total = total + part[b, head, s, head_dim + 1] * weight
            inverse = Float32(1.0) / cute.arch.warp_reduction_sum(total)
            for s in range(lane, active, WARP):  # the lane that wrote each weight rescales it: no barrier needed
                s_weight[h, s] = s_weight[h, s] * inverse
        cute.arch.sync_threads()
        out = cute.make_rmem_tensor(cute.make_layout(per_thread), Float32)
        for j in cutlass.range_constexpr(per_thread):
            out[j] = Float32(0.0)
        if cutlass.const_expr(preload):
            for j in cutlass.range_constexpr(per_thread):
                early_h = cutlass.min(tidx + j * threads, outputs - 1) // head_dim
                for u in cutlass.range_constexpr(first_loads):
                    early_weight = s_weight[early_h, cutlass.min(u, active - 1)]
                    if u >= active:
                        early_weight = Float32(0.0)
                    out[j] = out[j] + early[j, u] * early_weight
        for first in range(first_loads, active, MERGE_UNROLL):
            for j in cutlass.range_constexpr(per_thread):
                i = cutlass.min(tidx + j * threads, outputs - 1)
                h = i // head_dim
                d = i - h * head_dim
                for u in cutlass.range_constexpr(MERGE_UNROLL):
                    s = cutlass.min(first + u, active - 1)
                    weight = s_weight[h, s]
                    if first + u >= active:
                        weight = Float32(0.0)
                    out[j] = out[j] + part[b, kvh * group + h, s, d] * weight
        for j in cutlass.range_constexpr(per_thread):
            i = tidx + j * threads
            if i < outputs:
                attn[b, kvh * outputs + i] = out[j]


@cute.jit
def _merge_spread(attn: cute.Tensor, part: cute.Tensor, counts: cute.Tensor, s_scratch: cute.Tensor, b: Int32,
                  kvh: Int32, g: Int32, split: Int32, active: Int32, tidx: Int32, group: cutlass.Constexpr[int],
                  head_dim: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """The spread merge (``generate(plan, spread_merge=True)``, the default for wide groups): every active item of
    group ``g`` arrives at the group's counter (release) and waits (acquire) until all ``active`` have, then
    merges its own slice of the group's ``group * head_dim`` outputs (item ``split`` takes the ``split``-th of
    ``active`` equal slices), so no CTA reads every split's partials: the last-arrival merge reads splits x outputs
    partials through one SM (gemma-2b at 4000 positions: 63 x 2048 floats, ~0.5 MB per layer).

    Per output ``SPREAD_LANES`` threads share out the splits, ``SPREAD_LOADS`` at once (one L2 round trip for up
    to 64 splits), keep an online softmax merge (max, sum, accumulator) each, and meet in shared memory
    (``s_scratch``: 3 x ``threads`` floats). The counter is not reset here (others may still be polling it):
    ``split_kv_counts_reset`` zeroes it after the grid barrier that follows attention."""
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.atomic_add((counts.iterator + g).llvm_ptr, Int32(1), sem="release", scope="gpu")
        seen = cute.arch.load((counts.iterator + g).llvm_ptr, Int32, sem="acquire", scope="gpu")
        while seen < active:
            seen = cute.arch.load((counts.iterator + g).llvm_ptr, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_threads()
    outputs = group * head_dim
    rows = threads // SPREAD_LANES  # outputs per pass
    lane_set = tidx // rows  # which share of the splits this thread merges
    r = tidx - lane_set * rows
    s_max = cute.make_tensor(s_scratch.iterator, cute.make_layout((SPREAD_LANES, rows)))
    s_sum = cute.make_tensor(s_scratch.iterator + threads, cute.make_layout((SPREAD_LANES, rows)))
    s_out = cute.make_tensor(s_scratch.iterator + 2 * threads, cute.make_layout((SPREAD_LANES, rows)))
    m_u = cute.make_rmem_tensor(cute.make_layout(SPREAD_LOADS), Float32)
    l_u = cute.make_rmem_tensor(cute.make_layout(SPREAD_LOADS), Float32)
    v_u = cute.make_rmem_tensor(cute.make_layout(SPREAD_LOADS), Float32)
    per_item = (outputs + active - 1) // active
    first = split * per_item
    last = cutlass.min(first + per_item, outputs)
    for base in range(first, last, rows):
        o = cutlass.min(base + r, outputs - 1)
        h = o // head_dim
        d = o - h * head_dim
        head = kvh * group + h
        top = Float32(ATT_NEG)
        total = Float32(0.0)
        out = Float32(0.0)
        for s0 in range(lane_set * SPREAD_LOADS, active, SPREAD_LANES * SPREAD_LOADS):
            for u in cutlass.range_constexpr(SPREAD_LOADS):
                s = cutlass.min(s0 + u, active - 1)  # a clamped repeat of a real split: it leaves the max as is
                m_u[u] = part[b, head, s, head_dim]
                l_u[u] = part[b, head, s, head_dim + 1]
                v_u[u] = part[b, head, s, d]
            new_top = top
            for u in cutlass.range_constexpr(SPREAD_LOADS):
                new_top = cute.arch.fmax(new_top, m_u[u])
            correction = cute.math.exp(top - new_top)
            total = total * correction
            out = out * correction
            for u in cutlass.range_constexpr(SPREAD_LOADS):
                weight = cute.math.exp(m_u[u] - new_top)
                if s0 + u >= active:
                    weight = Float32(0.0)
                total = total + l_u[u] * weight
                out = out + v_u[u] * weight
            top = new_top
        s_max[lane_set, r] = top
        s_sum[lane_set, r] = total
        s_out[lane_set, r] = out
        cute.arch.sync_threads()
        if lane_set == 0 and base + r < last:
            overall = s_max[0, r]
            for j in cutlass.range_constexpr(1, SPREAD_LANES):
                overall = cute.arch.fmax(overall, s_max[j, r])
            merged_sum = Float32(0.0)
            merged_out = Float32(0.0)
            for j in cutlass.range_constexpr(SPREAD_LANES):
                weight = cute.math.exp(s_max[j, r] - overall)  # a share without splits: ATT_NEG, weight 0
                merged_sum = merged_sum + s_sum[j, r] * weight
                merged_out = merged_out + s_out[j, r] * weight
            attn[b, kvh * outputs + o] = merged_out / merged_sum
        cute.arch.sync_threads()


@cute.jit
def split_kv_counts_reset(counts: cute.Tensor, cta: Int32, tidx: Int32, groups: cutlass.Constexpr[int],
                          threads: cutlass.Constexpr[int]):
    """Zero the split-KV groups' arrival counters (CTA 0), after the grid barrier that follows attention: a spread
    merge (:func:`_merge_spread`) leaves them at the group's arrivals, and the next layer's attention comes at
    least one grid barrier later. Where the last arrival merged, it already zeroed its counter."""
    if cta == 0:
        for i in range(tidx, groups, threads):
            counts[i] = Int32(0)


@cute.jit
def merge_splits_to_smem(attn: cute.Tensor, part: cute.Tensor, s_vec: cute.Tensor, pos: Int32, first_key: Int32,
                         tidx: Int32, batch: cutlass.Constexpr[int], n_heads: cutlass.Constexpr[int],
                         head_dim: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                         splits: cutlass.Constexpr[int], min_chunk: cutlass.Constexpr[int],
                         quantum: cutlass.Constexpr[int], head_slices: cutlass.Constexpr[int],
                         long_slices: cutlass.Constexpr[bool], fold: cutlass.Constexpr[int],
                         mma_slices: cutlass.Constexpr[int] = 0):
    """The O projection's staging with the split-KV merge folded in (``generate(plan, fold_merge=True)``, the
    default since session 24): where this step's attention (same dealing, :func:`split_schedule`) left
    2..``fold`` active splits unmerged (its ``merge_above``), every CTA merges the partials
    ``part[b, head, split, :]`` (accumulator, max, sum) of all heads into ``s_vec`` as it stages them; otherwise
    it copies ``attn`` (:func:`copy_to_smem`). No arrival counter, no last-arrival chain: the grid barrier after
    attention is the only wait. Each thread loads every split's values of its 4-output vectors at once (one L2
    round trip), clamped past ``active`` (weight 0). Same merge as :func:`_merge_splits` up to fp32 rounding (sum
    order). ``mma_slices``: the attention build's dealing (:func:`split_schedule`)."""
    visible = pos + 1 - first_key
    chunk, active, slices = split_schedule(visible, splits, min_chunk, quantum, head_slices, long_slices, mma_slices)
    width = n_heads * head_dim
    if active == 1 or active > fold:
        copy_to_smem(attn, s_vec, tidx, batch, width, threads)
    else:
        nvec = width // F32_VEC
        slots = (nvec + threads - 1) // threads
        ms = cute.make_rmem_tensor(cute.make_layout((fold, slots, batch)), Float32)
        ls = cute.make_rmem_tensor(cute.make_layout((fold, slots, batch)), Float32)
        ps = cute.make_rmem_tensor(cute.make_layout((F32_VEC, fold, slots, batch)), Float32)
        for b in cutlass.range_constexpr(batch):
            for j in cutlass.range_constexpr(slots):
                o = cutlass.min(tidx + j * threads, nvec - 1) * F32_VEC
                head = o // head_dim
                d = o - head * head_dim
                for s in cutlass.range_constexpr(fold):
                    split = cutlass.min(Int32(s), active - 1)
                    ms[s, j, b] = part[b, head, split, head_dim]
                    ls[s, j, b] = part[b, head, split, head_dim + 1]
                    for e in cutlass.range_constexpr(F32_VEC):
                        ps[e, s, j, b] = part[b, head, split, d + e]
        for b in cutlass.range_constexpr(batch):
            for j in cutlass.range_constexpr(slots):
                top = ms[0, j, b]
                for s in cutlass.range_constexpr(1, fold):
                    top = cute.arch.fmax(top, ms[s, j, b])  # a clamped repeat leaves the max as is
                total = Float32(0.0)
                out = cute.make_rmem_tensor(cute.make_layout(F32_VEC), Float32)
                for e in cutlass.range_constexpr(F32_VEC):
                    out[e] = Float32(0.0)
                for s in cutlass.range_constexpr(fold):
                    weight = cute.math.exp(ms[s, j, b] - top)
                    if s >= active:
                        weight = Float32(0.0)
                    total = total + ls[s, j, b] * weight
                    for e in cutlass.range_constexpr(F32_VEC):
                        out[e] = out[e] + ps[e, s, j, b] * weight
                inverse = Float32(1.0) / total
                for e in cutlass.range_constexpr(F32_VEC):
                    out[e] = out[e] * inverse
                idx = tidx + j * threads
                if cutlass.const_expr((j + 1) * threads <= nvec):
                    _stage_store(s_vec, b, idx, out.load())
                elif idx < nvec:
                    _stage_store(s_vec, b, idx, out.load())
        cute.arch.sync_threads()


# Attention and the O projection in one interval at short contexts (``generate(plan, fused_o=True)``, a candidate
# since session 34). A step whose visible positions fit the first split-KV chunk (``MIN_CHUNK``: one split) skips
# the O-projection stage and its grid barrier: CTA c takes KV group c % groups (whole groups on the fp32 lane-group
# loop, as the default's short-context head slices; with ``FUSED_MMA`` on the tensor cores:
# :func:`_item_warp_partials`, the same arithmetic as a one-split item) and row block c // groups of W_O. Every
# CTA of a group computes that group's attention (the same few cached rows from L2; in the default build most
# CTAs idle in that interval), then its rows of W_O[:, group's columns] @ attention into
# ``o_part[group, row]``, the W_O block copied into shared memory (the idle cp.async ring) while the grid met after
# the QKV projection. The next stage's staging sums x + o_part[0] + o_part[1] + ... in that order
# (:func:`rmsnorm_partials_to_smem`, which also stores that residual in ``o_mid``) and the down projection adds
# its output to ``o_mid``. Other steps run the stages as before (same bits as the default build); a fused step's
# logits differ from them by the fp32 order of the attention's and the O projection's sums (with ``FUSED_MMA`` also
# by the bf16 rounding of the query and the probabilities). ``fused_kv_smem`` also copies the group's cached K/V
# rows into that shared memory before the barrier (a cp.async group of their own, committed before the W_O
# block's, so the item can score them while the block still lands), and the item scores them from there.
@cute.jit
def fused_o_step(pos: Int32, first_key: Int32, min_chunk: cutlass.Constexpr[int]) -> Int32:
    """1 where every visible position of this step fits the first split-KV chunk (``pos + 1 - first_key <=
    min_chunk``: one split in every dealing :func:`split_schedule` makes), so a ``fused_o`` build runs attention
    and the O projection in one interval; 0 otherwise. Every CTA computes the same value."""
    fused = Int32(0)
    if pos + 1 - first_key <= min_chunk:
        fused = Int32(1)
    return fused


@cute.jit
def fused_o_load(w_o: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, s_ring: cute.Tensor, pos: Int32,
                 cta: Int32, tidx: Int32, n_heads: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                 head_dim: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int], blocks: cutlass.Constexpr[int],
                 block_rows: cutlass.Constexpr[int], kv_rows: cutlass.Constexpr[int],
                 kv_smem: cutlass.Constexpr[bool], threads: cutlass.Constexpr[int], skip: cutlass.Constexpr[int]):
    """Issued before the grid barrier that precedes a fused step's attention: cp.async this CTA's block of the
    layer's O projection (rows ``block x block_rows`` on, its KV group's columns) into the shared memory of the
    cp.async ring (idle until the gate/up GEMV's fill), as [block_rows, group x head_dim] bf16, and with
    ``kv_smem`` its group's cached K and V rows [0, pos) after it (:func:`_fused_kv_views`; this step's row is
    appended by the attention itself); with ``kv_smem`` the K/V rows then the W_O block as two committed cp.async
    groups, else the block as one: :func:`fused_attention_o` waits for the rows before scoring, for the block
    before its O rows. Threads ``skip..`` copy (``skip`` 32: warp 0, whose thread 0 polls the grid barrier, has
    nothing in flight; every thread still commits the groups)."""
    cols = (n_heads // n_kv_heads) * head_dim
    vecs = cols // VEC
    group = cta % n_kv_heads
    block = cta // n_kv_heads
    if block < blocks:
        s_wo = cute.make_tensor(s_ring.iterator, cute.make_layout((block_rows, cols), stride=(cols, 1)))
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), w_o.element_type,
                                   num_bits_per_copy=128)
        if cutlass.const_expr(kv_smem):
            s_keys, s_values = _fused_kv_views(s_ring, block_rows * cols, kv_rows, head_dim)
            kv_vecs = head_dim // VEC
            if tidx >= skip:
                for i in range(tidx - skip, pos * kv_vecs, threads - skip):
                    r = i // kv_vecs
                    v = i - r * kv_vecs
                    cute.copy(atom, cute.zipped_divide(k_cache[0, group, r, None], (VEC,))[(None, v)],
                              cute.zipped_divide(s_keys[r, None], (VEC,))[(None, v)])
                    cute.copy(atom, cute.zipped_divide(v_cache[0, group, r, None], (VEC,))[(None, v)],
                              cute.zipped_divide(s_values[r, None], (VEC,))[(None, v)])
            cute.arch.cp_async_commit_group()
        if tidx >= skip:
            for i in range(tidx - skip, block_rows * vecs, threads - skip):
                r = i // vecs
                v = i - r * vecs
                row = cutlass.min(block * block_rows + r, hidden - 1)
                cute.copy(atom, cute.zipped_divide(w_o[row, None], (VEC,))[(None, group * vecs + v)],
                          cute.zipped_divide(s_wo[r, None], (VEC,))[(None, v)])
    cute.arch.cp_async_commit_group()


def _fused_kv_views(s_ring: cute.Tensor, offset: int, kv_rows: int, head_dim: int):
    """(s_keys, s_values): a fused step's cached K and V rows of its group, [kv_rows, head_dim] each, in the ring's
    shared memory after the W_O block (``offset`` elements in). Plain Python, run while the calling body is traced."""
    s_keys = cute.make_tensor(s_ring.iterator + offset, cute.make_layout((kv_rows, head_dim), stride=(head_dim, 1)))
    s_values = cute.make_tensor(s_ring.iterator + offset + kv_rows * head_dim,
                                cute.make_layout((kv_rows, head_dim), stride=(head_dim, 1)))
    return s_keys, s_values


FUSED_O_ROWS = 4  # W_O rows a warp reduces at once in fused_attention_o (independent sums in flight)


@cute.jit
def fused_attention_o(qkv: cute.Tensor, qk_norm: cute.Tensor, rope_cos: cute.Tensor, rope_sin: cute.Tensor,
                      k_cache: cute.Tensor, v_cache: cute.Tensor, s_ring: cute.Tensor, o_part: cute.Tensor,
                      pos: Int32, first_key: Int32, s_att: cute.Tensor, cta: Int32, tidx: Int32,
                      n_heads: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                      head_dim: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                      scale: cutlass.Constexpr[float], has_qk_norm: cutlass.Constexpr[bool],
                      eps: cutlass.Constexpr[float], unroll: cutlass.Constexpr[int],
                      rotary_dim: cutlass.Constexpr[int], whole_qk_norm: cutlass.Constexpr[bool],
                      kv_pipeline: cutlass.Constexpr[bool], mma_attention: cutlass.Constexpr[bool],
                      hidden: cutlass.Constexpr[int], blocks: cutlass.Constexpr[int],
                      block_rows: cutlass.Constexpr[int], kv_rows: cutlass.Constexpr[int],
                      kv_smem: cutlass.Constexpr[bool]):
    """A fused step's attention and O projection (batch 1; module comment above :func:`fused_o_step`): this CTA's
    KV group over positions [first_key, pos] (this step's key and value appended, by every CTA of the group, the
    same bits), normalised into ``s_q``, then ``o_part[group, r] = sum_c W_O[r, c] * attention[c]`` over the
    group's columns for the rows of its block, from the block :func:`fused_o_load` put in shared memory. With
    ``kv_smem`` the group's cached rows are scored from shared memory too (no window: they start at 0)."""
    warps = threads // WARP
    heads = n_heads // n_kv_heads
    cols = heads * head_dim
    group = cta % n_kv_heads
    block = cta // n_kv_heads
    if block < blocks:
        s_keys, s_values = _fused_kv_views(s_ring, block_rows * cols, kv_rows, head_dim)
        if cutlass.const_expr(kv_smem):
            cute.arch.cp_async_wait_group(1)  # the K/V rows (the W_O block, committed after them, may still land)
            cute.arch.sync_threads()
        else:
            s_keys = k_cache[0, group, None, None]
            s_values = v_cache[0, group, None, None]
        _item_warp_partials(qkv, qk_norm, rope_cos, rope_sin, k_cache, v_cache, s_att, 0, group, group, pos,
                            first_key, pos + 1, tidx, n_heads, n_kv_heads, head_dim, threads, scale, has_qk_norm, eps,
                            unroll, rotary_dim, whole_qk_norm, heads, kv_pipeline, mma_attention, s_keys, s_values,
                            kv_smem)
        s_q, s_inv, s_flag, s_part = _item_scratch(s_att, heads, head_dim, warps)
        for i in range(tidx, cols, threads):  # warps' partials merged, normalised into s_q (read no more)
            h = i // head_dim
            d = i - h * head_dim
            top, total, out = _merge_warp_partials(s_part, h, d, head_dim, warps)
            s_q[i] = out / total
        _o_block_rows(s_q, s_ring, o_part, group, block, tidx, threads, cols, hidden, block_rows)
    else:
        cute.arch.cp_async_wait_group(0)


@cute.jit
def _o_block_rows(s_q: cute.Tensor, s_ring: cute.Tensor, o_part: cute.Tensor, group: Int32, block: Int32,
                  tidx: Int32, threads: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
                  hidden: cutlass.Constexpr[int], block_rows: cutlass.Constexpr[int]):
    """``o_part[group, r] = sum_c W_O[r, c] * s_q[c]`` for the rows of this CTA's W_O block (copied into shared
    memory by :func:`fused_o_load`: this waits for its cp.async group, then meets the CTA, so ``s_q``, the group's
    attention output in fp32, is complete too), one warp per ``FUSED_O_ROWS`` rows; ends with a CTA-wide sync (the
    next stage's ring fill may then overwrite both)."""
    cute.arch.cp_async_wait_group(0)
    cute.arch.sync_threads()
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    vecs = cols // VEC
    s_wo = cute.make_tensor(s_ring.iterator, cute.make_layout((block_rows, cols), stride=(cols, 1)))
    sums = cute.make_rmem_tensor(cute.make_layout(FUSED_O_ROWS), Float32)
    for r0 in range(warp * FUSED_O_ROWS, block_rows, warps * FUSED_O_ROWS):
        for k in cutlass.range_constexpr(FUSED_O_ROWS):
            sums[k] = Float32(0.0)
        for v0 in cutlass.range_constexpr(0, vecs, WARP):
            v = v0 + lane
            if v < vecs:
                av = cute.zipped_divide(s_q, (VEC,))[(None, cutlass.min(v, vecs - 1))].load()
                for k in cutlass.range_constexpr(FUSED_O_ROWS):
                    r = cutlass.min(r0 + k, block_rows - 1)
                    wv = cute.zipped_divide(s_wo[r, None], (VEC,))[(None, cutlass.min(v, vecs - 1))].load()
                    sums[k] = sums[k] + (wv.to(Float32) * av).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                                                     reduction_profile=0)
        for k in cutlass.range_constexpr(FUSED_O_ROWS):
            total = cute.arch.warp_reduction_sum(sums[k])
            row = block * block_rows + r0 + k
            if lane == 0 and r0 + k < block_rows and row < hidden:
                o_part[group, row] = total
    cute.arch.sync_threads()  # s_q and the W_O block are read: the next stage's ring fill may overwrite them


# Attention's O projection in attention's interval at every context (``generate(plan, fused_split=True)``, a
# candidate since session 44, on top of ``fused_o``): a step of several splits runs its split-KV items as the
# default does (each then adds 1 to its KV group's counter, ``group_counts``), and then every CTA takes the same
# (KV group, W_O row block) as a fused step: it waits until every item of its group arrived, merges that group's
# partials (or copies its merged output, where the items merged them) and multiplies its W_O block, copied into
# shared memory before the barrier as a fused step's, into ``o_part``. The O-projection stage, its grid barrier and
# the every-CTA merge of all heads in its staging are gone; the next staging sums the partials as after a fused
# step. A per-group wait replaces a grid barrier; the logits differ from the default's by the fp32 order of the
# merge and of the O projection's sums.
@cute.jit
def split_o_block(attn: cute.Tensor, part: cute.Tensor, group_counts: cute.Tensor, s_ring: cute.Tensor,
                  s_att: cute.Tensor, o_part: cute.Tensor, pos: Int32, first_key: Int32, cta: Int32, tidx: Int32,
                  n_heads: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                  head_dim: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                  splits: cutlass.Constexpr[int], min_chunk: cutlass.Constexpr[int], quantum: cutlass.Constexpr[int],
                  head_slices: cutlass.Constexpr[int], long_slices: cutlass.Constexpr[bool],
                  fold: cutlass.Constexpr[int], blocks: cutlass.Constexpr[int], block_rows: cutlass.Constexpr[int],
                  mma_slices: cutlass.Constexpr[int] = 0):
    """The O projection of a step of several splits in a ``fused_split`` build (module comment above; batch 1):
    this CTA's KV group (``cta % n_kv_heads``) and W_O row block (``cta // n_kv_heads``). Thread 0 polls
    ``group_counts[group]`` (acquire) until all ``active x slices`` items of the group (the dealing of
    :func:`split_schedule`) arrived; then the CTA merges the group's partials of the 2..``fold`` active splits
    (as :func:`merge_splits_to_smem`: each split's max, sum and accumulator, clamped past ``active``) or copies
    ``attn`` (one split, or more than ``fold``: the items merged them), into the attention scratch, and
    :func:`_o_block_rows` writes its rows of ``o_part[group]``. CTAs past the last block only wait for their
    cp.async groups."""
    heads = n_heads // n_kv_heads
    cols = heads * head_dim
    group = cta % n_kv_heads
    block = cta // n_kv_heads
    if block < blocks:
        chunk, active, slices = split_schedule(pos + 1 - first_key, splits, min_chunk, quantum, head_slices,
                                               long_slices, mma_slices)
        if tidx == 0:
            ptr = (group_counts.iterator + group).llvm_ptr
            target = Int64(active * slices)
            current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
            while current < target:
                current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
        cute.arch.sync_threads()
        s_q = cute.make_tensor(s_att.iterator, cute.make_layout(cols))
        if cutlass.const_expr(fold >= 2):
            if active == 1 or active > fold:
                for i in range(tidx, cols, threads):
                    s_q[i] = attn[0, group * cols + i]
            else:
                _merge_group_partials(part, s_q, group, active, tidx, heads, head_dim, threads, fold)
        else:  # the items merge every step of 2+ splits (no fold_merge)
            for i in range(tidx, cols, threads):
                s_q[i] = attn[0, group * cols + i]
        _o_block_rows(s_q, s_ring, o_part, group, block, tidx, threads, cols, hidden, block_rows)
    else:
        cute.arch.cp_async_wait_group(0)


@cute.jit
def _merge_group_partials(part: cute.Tensor, s_q: cute.Tensor, group: Int32, active: Int32, tidx: Int32,
                          heads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                          threads: cutlass.Constexpr[int], fold: cutlass.Constexpr[int]):
    """``s_q`` = one KV group's attention output merged from ``part[0, head, split, :]`` (accumulator, max, sum) of
    its ``active`` (2..``fold``) splits: :func:`merge_splits_to_smem`'s arithmetic, in the same order, for the
    group's heads; each thread loads every split of its 4-output vectors at once (clamped repeats weigh 0)."""
    nvec = heads * head_dim // F32_VEC
    for v in range(tidx, nvec, threads):
        o = v * F32_VEC
        h = o // head_dim
        d = o - h * head_dim
        head = group * heads + h
        ms = cute.make_rmem_tensor(cute.make_layout(fold), Float32)
        ls = cute.make_rmem_tensor(cute.make_layout(fold), Float32)
        ps = cute.make_rmem_tensor(cute.make_layout((F32_VEC, fold)), Float32)
        for s in cutlass.range_constexpr(fold):
            split = cutlass.min(Int32(s), active - 1)
            ms[s] = part[0, head, split, head_dim]
            ls[s] = part[0, head, split, head_dim + 1]
            for e in cutlass.range_constexpr(F32_VEC):
                ps[e, s] = part[0, head, split, d + e]
        top = ms[0]
        for s in cutlass.range_constexpr(1, fold):
            top = cute.arch.fmax(top, ms[s])
        total = Float32(0.0)
        out = cute.make_rmem_tensor(cute.make_layout(F32_VEC), Float32)
        for e in cutlass.range_constexpr(F32_VEC):
            out[e] = Float32(0.0)
        for s in cutlass.range_constexpr(fold):
            weight = cute.math.exp(ms[s] - top)
            if s >= active:
                weight = Float32(0.0)
            total = total + ls[s] * weight
            for e in cutlass.range_constexpr(F32_VEC):
                out[e] = out[e] + ps[e, s] * weight
        inverse = Float32(1.0) / total
        for e in cutlass.range_constexpr(F32_VEC):
            s_q[o + e] = out[e] * inverse
