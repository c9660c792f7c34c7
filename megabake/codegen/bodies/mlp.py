"""The MLP in one barrier interval (``generate(plan, fused_mlp=True)``, a candidate since session 43): each CTA
computes the gated activations of its own block of the intermediate width, then that block's share of the down
projection for every output row, and adds it into a per-layer accumulator with integer atomics.

Part of megabake/codegen/bodies (see its __init__ for the contract); code generation copies these
routines into module.py in the order of ``megabake.codegen.bodies.BODY_FILES``.

Why integers: the CTAs' partial sums of one output row arrive in any order. fp32 atomics would make the sum
depend on that order (a different result on every run); the partials are instead rounded to fixed point
(``MLP_FIXED_ONE`` units per 1.0, round toward zero) and summed as 64-bit integers, which is exact and
order-free, so every run gives the same bits. A partial that is not finite or not under ``MLP_FIXED_LIMIT`` in
magnitude is not added; it counts in the row's flag word (column ``hidden``) instead, and the staging that reads
the accumulator turns a flagged row into NaN (where fp32 would have given inf or NaN, or, past the limit, a
finite output row of 8.4e6 or more per CTA, which no trained model's MLP produces). The limit keeps the sum of up
to ``MLP_MAX_PARTIALS`` partials inside int64: 2^8 x 2^23 x 2^32 = 2^63, so the sum can never wrap.

Buffers: ``mlp_acc`` int64 [layers + 1, hidden + 4] (``codegen.fused_mlp``): row l is what layer l's
input adds to ``o_mid`` (row 0 stays zero: layer 0's input is the embedding, stored in ``o_mid``), row l + 1 is
what layer l's MLP adds. Every launch zeroes it before its first grid barrier (``zero_rows``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32, Int64

from .staging import F32_VEC, _f32_vec, _store_and_stage_rmsnorm

MLP_FIXED_ONE = 4294967296.0  # 2^32 integer units per 1.0 in the accumulator
MLP_FIXED_LIMIT = 8388608.0  # 2^23: partials at or over this magnitude are flagged (the sum never wraps)
MLP_MAX_PARTIALS = 256  # partials one accumulator row may sum (codegen.fused_mlp refuses more CTAs)


@cute.jit
def mlp_down_load(w_down: cute.Tensor, s_down: cute.Tensor, cta: Int32, tidx: Int32,
                  chunks: cutlass.Constexpr[int], per_cta: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                  bits: cutlass.Constexpr[int], threads: cutlass.Constexpr[int], skip: cutlass.Constexpr[int]):
    """cp.async this CTA's columns of the layer's down projection, W_down[:, cta * per_cta + (0..per_cta)], into
    ``s_down`` [hidden, per_cta] bf16, ``bits`` per copy (the widest that divides a row's slice); one committed
    group, empty on CTAs past ``chunks``. Weights do not depend on the stages before: issued before the grid
    barrier that precedes the MLP, the copies land during the wait. Threads ``skip..`` copy (``skip`` 32: warp 0,
    whose thread 0 polls the grid barrier, has nothing in flight); every thread commits the group."""
    if cta < chunks and tidx >= skip:
        elems = bits // 16
        vecs = per_cta // elems
        mode = cpasync.LoadCacheMode.GLOBAL if bits == 128 else cpasync.LoadCacheMode.ALWAYS
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), w_down.element_type, num_bits_per_copy=bits)
        for i in range(tidx - skip, hidden * vecs, threads - skip):
            r = i // vecs
            v = i - r * vecs
            cute.copy(atom, cute.zipped_divide(w_down[r, None], (elems,))[(None, cta * vecs + v)],
                      cute.zipped_divide(s_down[r, None], (elems,))[(None, v)])
    cute.arch.cp_async_commit_group()


@cute.jit
def mlp_down_bulk(w_cta: cute.Tensor, s_down: cute.Tensor, s_bar: cute.Tensor, cta: Int32, tidx: Int32,
                  chunks: cutlass.Constexpr[int], per_cta: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                  copy_bytes: cutlass.Constexpr[int]):
    """:func:`mlp_down_load` from this CTA's packed columns ``w_cta`` (hidden x per_cta bf16, contiguous: the
    runtime's ``w_down_cta``) by ``cp.async.bulk`` copies of ``copy_bytes``, issued by warp 0 (thread 0 has just
    arrived at the grid barrier; bulk copies go through the copy engine, not its load path, so its polls do not
    queue behind them: ``scripts/gpu_copy_probe.py``) and completed on the mbarrier ``s_bar`` (one arrival, by
    thread 0, expecting every byte): :func:`mlp_down_partial` waits on it. Nothing on CTAs past ``chunks``."""
    if cta < chunks and tidx < 32:
        elems = copy_bytes // 2
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(s_bar.iterator, hidden * per_cta * 2)
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), w_cta.element_type, num_bits_per_copy=copy_bytes * 8)
        flat = cute.make_tensor(s_down.iterator, cute.make_layout(hidden * per_cta))
        for i in range(tidx, hidden * per_cta // elems, 32):
            cute.copy(atom, cute.zipped_divide(w_cta, (elems,))[(None, i)],
                      cute.zipped_divide(flat, (elems,))[(None, i)], mbar_ptr=s_bar.iterator)


@cute.jit
def mlp_down_partial(s_down: cute.Tensor, s_act: cute.Tensor, acc: cute.Tensor, cta: Int32, tidx: Int32,
                     chunks: cutlass.Constexpr[int], per_cta: cutlass.Constexpr[int],
                     hidden: cutlass.Constexpr[int], threads: cutlass.Constexpr[int], s_bar: cute.Tensor,
                     phase: Int32, bulk: cutlass.Constexpr[bool]):
    """This CTA's share of the down projection, added into one accumulator row ``acc`` [hidden + 4]: for each
    output row h (thread-strided) p = sum_j s_down[h, j] * s_act[0, j] in fp32, j ascending, then
    ``red.add.u64`` of p in fixed point (:data:`MLP_FIXED_ONE`); a p that is NaN, infinite or at least
    :data:`MLP_FIXED_LIMIT` in magnitude adds 1 to the flag word ``acc[hidden]`` instead (so the int64 sum of at
    most :data:`MLP_MAX_PARTIALS` partials cannot wrap). Needs the CTA's
    activations in ``s_act`` and its ``s_down`` copies landed (wait_group(0) and a CTA barrier before); with
    ``bulk`` (:func:`mlp_down_bulk`) every thread first waits for the mbarrier ``s_bar``'s phase ``phase`` (the
    layer's parity: one phase per layer) to complete."""
    if cta < chunks:
        if cutlass.const_expr(bulk):
            cute.arch.mbarrier_wait(s_bar.iterator, phase)
        for h in range(tidx, hidden, threads):
            p = Float32(0.0)
            for j in cutlass.range_constexpr(per_cta):
                p = p + s_down[h, j].to(Float32) * s_act[0, j]
            fixed = Int64(0)
            bad = Int32(1)
            if p < Float32(MLP_FIXED_LIMIT):
                if p > Float32(-MLP_FIXED_LIMIT):  # NaN fails both tests
                    fixed = Int64(p * Float32(MLP_FIXED_ONE))
                    bad = Int32(0)
            if bad == 0:
                cute.arch.red((acc.iterator + h).llvm_ptr, fixed, op="add", dtype="u64", sem="relaxed", scope="gpu")
            else:
                cute.arch.red((acc.iterator + hidden).llvm_ptr, Int64(1), op="add", dtype="u64", sem="relaxed",
                              scope="gpu")


@cute.jit
def rmsnorm_from_acc_to_smem(o_mid: cute.Tensor, acc: cute.Tensor, x: cute.Tensor, weight: cute.Tensor,
                             s_vec: cute.Tensor, s_red: cute.Tensor, cta: Int32, tidx: Int32,
                             hidden: cutlass.Constexpr[int], ctas: cutlass.Constexpr[int],
                             threads: cutlass.Constexpr[int], eps: cutlass.Constexpr[float]):
    """The staging of the first GEMV after a ``fused_mlp`` layer (the next layer's QKV projection, or the final
    norm; batch 1): the residual r = o_mid + acc / :data:`MLP_FIXED_ONE` (NaN where the row's flag word is set);
    the CTA that owns each 4-float vector (vector index mod ``ctas``) stores r in ``x``, and every CTA stages
    rmsnorm(r) * weight as :func:`rmsnorm_to_smem` does (and, as it, meets the CTA before the GEMV reads the row)."""
    nvec = hidden // F32_VEC
    slots = (nvec + threads - 1) // threads
    values = cute.make_rmem_tensor(cute.make_layout(F32_VEC * slots), Float32)
    for j in cutlass.range_constexpr(slots):
        idx = cutlass.min(tidx + j * threads, nvec - 1)
        added = cute.zipped_divide(acc, (F32_VEC,))[(None, idx)].load().to(Float32)
        _f32_vec(values, j).store(_f32_vec(o_mid[0, None], idx).load() + added * Float32(1.0 / MLP_FIXED_ONE))
    if acc[hidden] != Int64(0):
        for j in cutlass.range_constexpr(slots):
            _f32_vec(values, j).store(_f32_vec(values, j).load() * Float32(float("nan")))
    _store_and_stage_rmsnorm(values, x, weight, s_vec, s_red, cta, tidx, hidden, ctas, threads, eps)
