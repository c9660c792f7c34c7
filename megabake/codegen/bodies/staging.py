"""Embedding gather and vector staging: the fp32 rows a GEMV stage multiplies, staged in shared memory.

Part of megabake/codegen/bodies (see its __init__ for the contract); code generation copies these
routines into module.py in the order of ``megabake.codegen.bodies.BODY_FILES``."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32, Int64

from .common import WARP


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
    """The idx-th 4-element vector view of a contiguous row (16 bytes of fp32, 8 of bf16)."""
    return cute.zipped_divide(t, (F32_VEC,))[(None, idx)]


def _stage_store(s_vec: cute.Tensor, b: int, idx: Int32, values):
    """Store 4 fp32 values as the idx-th 4-element vector of sequence b's staged row (converted to the row's
    dtype: bf16 in buckets whose fp32 rows do not fit in shared memory). Plain Python, run while the calling
    body is traced."""
    if s_vec.element_type == Float32:
        _f32_vec(s_vec[b, None], idx).store(values)
    else:
        _f32_vec(s_vec[b, None], idx).store(values.to(s_vec.element_type))


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
                _stage_store(s_vec, b, idx, values[b][j] * inv * scales[j])
            elif idx < nvec:
                _stage_store(s_vec, b, idx, values[b][j] * inv * scales[j])
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
                _stage_store(s_vec, b, idx, values[j])
            elif idx < nvec:
                _stage_store(s_vec, b, idx, values[j])
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
                _stage_store(s_vec, b, idx, act)
            elif idx < nvec:
                _stage_store(s_vec, b, idx, act)
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
                _stage_store(s_vec, b, idx, act)
            elif idx < nvec:
                _stage_store(s_vec, b, idx, act)
    cute.arch.sync_threads()


@cute.jit
def zero_rows(t: cute.Tensor, cta: Int32, tidx: Int32, batch: cutlass.Constexpr[int], width: cutlass.Constexpr[int],
              ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """t[b, :width] = 0 over all CTAs' threads, in t's element type (a post-norm layout's pending MLP output before
    layer 0; a fused_mlp build's int64 accumulator rows)."""
    for i in range(cta * threads + tidx, batch * width, ctas * threads):
        b = i // width
        t[b, i - b * width] = t.element_type(0)


@cute.jit
def residual_norm_to_smem(x: cute.Tensor, delta: cute.Tensor, post_weight: cute.Tensor, pre_weight: cute.Tensor,
                          out: cute.Tensor, s_vec: cute.Tensor, s_red: cute.Tensor, cta: Int32, tidx: Int32,
                          batch: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                          threads: cutlass.Constexpr[int], eps: cutlass.Constexpr[float],
                          write_back: cutlass.Constexpr[bool], normalize: cutlass.Constexpr[bool]):
    """Post-norm layouts (Gemma 2): r = x[b] + rmsnorm(delta[b]) * post_weight, the residual add of a normalised
    projection output, then s_vec[b] = rmsnorm(r) * pre_weight (without ``normalize``, OLMo-2: s_vec[b] = r;
    ``pre_weight`` is unused). Every CTA recomputes both; with ``write_back`` CTA 0 stores r in out[b] (the other
    residual buffer: nobody reads ``out`` in this stage)."""
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    nvec = hidden // F32_VEC
    slots = (nvec + threads - 1) // threads
    deltas = []
    for b in cutlass.range_constexpr(batch):
        row = []
        for j in cutlass.range_constexpr(slots):
            row.append(_f32_vec(delta[b, None], cutlass.min(tidx + j * threads, nvec - 1)).load())
        deltas.append(row)
    for b in cutlass.range_constexpr(batch):  # sum of squares of delta
        partial = Float32(0.0)
        for j in cutlass.range_constexpr(slots):
            square = (deltas[b][j] * deltas[b][j]).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            if cutlass.const_expr((j + 1) * threads <= nvec):
                partial = partial + square
            elif tidx + j * threads < nvec:
                partial = partial + square
        partial = cute.arch.warp_reduction_sum(partial)
        if lane == 0:
            s_red[b * warps + warp] = partial
    cute.arch.sync_threads()
    residuals = []
    for b in cutlass.range_constexpr(batch):
        total = Float32(0.0)
        for w in cutlass.range_constexpr(warps):
            total = total + s_red[b * warps + w]
        inv = cute.math.rsqrt(total * (1.0 / hidden) + eps)
        row = []
        for j in cutlass.range_constexpr(slots):
            idx = cutlass.min(tidx + j * threads, nvec - 1)
            row.append(_f32_vec(x[b, None], idx).load() + deltas[b][j] * inv * _f32_vec(post_weight, idx).load())
        residuals.append(row)
    if cutlass.const_expr(normalize):
        cute.arch.sync_threads()  # every thread has read s_red before it is reused
        for b in cutlass.range_constexpr(batch):  # sum of squares of the new residual
            partial = Float32(0.0)
            for j in cutlass.range_constexpr(slots):
                square = (residuals[b][j] * residuals[b][j]).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                                                    reduction_profile=0)
                if cutlass.const_expr((j + 1) * threads <= nvec):
                    partial = partial + square
                elif tidx + j * threads < nvec:
                    partial = partial + square
            partial = cute.arch.warp_reduction_sum(partial)
            if lane == 0:
                s_red[b * warps + warp] = partial
        cute.arch.sync_threads()
    for b in cutlass.range_constexpr(batch):  # stage rmsnorm(r) * pre_weight (OLMo-2: r itself); CTA 0 stores r
        inv = Float32(1.0)
        if cutlass.const_expr(normalize):
            total = Float32(0.0)
            for w in cutlass.range_constexpr(warps):
                total = total + s_red[b * warps + w]
            inv = cute.math.rsqrt(total * (1.0 / hidden) + eps)
        for j in cutlass.range_constexpr(slots):
            idx = tidx + j * threads
            staged = residuals[b][j]
            if cutlass.const_expr(normalize):
                staged = residuals[b][j] * inv * _f32_vec(pre_weight, cutlass.min(idx, nvec - 1)).load()
            if cutlass.const_expr((j + 1) * threads <= nvec):
                _stage_store(s_vec, b, idx, staged)
                if cutlass.const_expr(write_back):
                    if cta == 0:
                        _f32_vec(out[b, None], idx).store(residuals[b][j])
            elif idx < nvec:
                _stage_store(s_vec, b, idx, staged)
                if cutlass.const_expr(write_back):
                    if cta == 0:
                        _f32_vec(out[b, None], idx).store(residuals[b][j])
    cute.arch.sync_threads()


@cute.jit
def rmsnorm_partials_to_smem(x: cute.Tensor, o_mid: cute.Tensor, o_part: cute.Tensor, weight: cute.Tensor,
                             s_vec: cute.Tensor, s_red: cute.Tensor, cta: Int32, tidx: Int32, fused: Int32,
                             parts: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                             ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                             eps: cutlass.Constexpr[float]):
    """The staging after a ``fused_o`` build's attention (batch 1): the residual r = x + o_part[0] + ... +
    o_part[parts - 1] (in that order) where ``fused`` is 1, else x; every CTA stages rmsnorm(r) * weight as
    :func:`rmsnorm_to_smem` does, and the CTA that owns each 4-float vector (vector index mod ``ctas``) stores r
    in ``o_mid``, which the down projection then adds its output to (x itself is still read by other CTAs)."""
    nvec = hidden // F32_VEC
    slots = (nvec + threads - 1) // threads
    values = cute.make_rmem_tensor(cute.make_layout(F32_VEC * slots), Float32)
    for j in cutlass.range_constexpr(slots):
        _f32_vec(values, j).store(_f32_vec(x[0, None], cutlass.min(tidx + j * threads, nvec - 1)).load())
    if fused == 1:
        for p in cutlass.range_constexpr(parts):
            for j in cutlass.range_constexpr(slots):
                _f32_vec(values, j).store(_f32_vec(values, j).load() +
                                          _f32_vec(o_part[p, None], cutlass.min(tidx + j * threads, nvec - 1)).load())
    _store_and_stage_rmsnorm(values, o_mid, weight, s_vec, s_red, cta, tidx, hidden, ctas, threads, eps)


@cute.jit
def _store_and_stage_rmsnorm(values: cute.Tensor, store: cute.Tensor, weight: cute.Tensor, s_vec: cute.Tensor,
                             s_red: cute.Tensor, cta: Int32, tidx: Int32, hidden: cutlass.Constexpr[int],
                             ctas: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                             eps: cutlass.Constexpr[float]):
    """The common end of a batch-1 staging that built this thread's residual vectors in ``values`` (register
    slots of 4 floats, thread-strided): the CTA that owns each vector (vector index mod ``ctas``) stores it in
    ``store`` [1, hidden], and every CTA stages rmsnorm(residual) * weight in ``s_vec`` as :func:`rmsnorm_to_smem`
    does, then meets (the GEMV after it reads the whole row)."""
    warps = threads // WARP
    lane = tidx % WARP
    warp = tidx // WARP
    nvec = hidden // F32_VEC
    slots = (nvec + threads - 1) // threads
    scales = []
    for j in cutlass.range_constexpr(slots):
        scales.append(_f32_vec(weight, cutlass.min(tidx + j * threads, nvec - 1)).load())
    partial = Float32(0.0)
    for j in cutlass.range_constexpr(slots):
        row = _f32_vec(values, j).load()
        square = (row * row).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        idx = tidx + j * threads
        if idx < nvec:
            partial = partial + square
            if idx % ctas == cta:
                _f32_vec(store[0, None], idx).store(row)
    partial = cute.arch.warp_reduction_sum(partial)
    if lane == 0:
        s_red[warp] = partial
    cute.arch.sync_threads()
    total = Float32(0.0)
    for w in cutlass.range_constexpr(warps):
        total = total + s_red[w]
    inv = cute.math.rsqrt(total * (1.0 / hidden) + eps)
    for j in cutlass.range_constexpr(slots):
        idx = tidx + j * threads
        if idx < nvec:
            _stage_store(s_vec, 0, idx, _f32_vec(values, j).load() * inv * scales[j])
    cute.arch.sync_threads()
