"""The loader warp (``generate(plan, loader_warp=True)``, a candidate since session 51): a ninth warp per CTA streams
the CTA's weights into shared memory in the order the other eight warps consume them, across grid barriers.

A loader build runs ``THREADS + 32`` threads. Warps ``0 .. WARPS - 1`` (the consumers) run the step as every build
does, meeting at named barrier 1 over ``THREADS`` threads (code generation rewrites the module's CTA barriers); warp
``WARPS`` runs :func:`loader_rows`, :func:`loader_o_block` and :func:`loader_down` in consumption order and never
waits at a grid barrier: weights depend on nothing the step computes.

Rows of a streamed GEMV stage (:func:`gemv_slots`) go through a ring of ``slots`` slots of :data:`SLOT_BYTES`:
each CTA owns a contiguous run of ``per_cta`` rows of the weight view, streamed in units of ``unit_rows`` whole rows,
one unit per slot. Unit ``seq`` (a running count over the whole step, the same in every CTA) sits in slot ``seq %
slots``; its "full" mbarrier completes when its bytes landed (phase ``seq // slots``), its "empty" mbarrier when all
``WARPS`` consumer warps are done with it (every warp waits for every unit, so no warp can run a ring lap ahead).
The loader keeps at most ``inflight`` units requested and not landed: the grid barrier's release waits for the SM's
copies in flight (``scripts/gpu_stream_probe.py``, session 50). Each row's sum is the one ``gemv_rows`` forms (lane
``l`` adds vectors ``l, l + 32, ...`` in order, then the warp's butterfly), so the logits are the default's bits.

The O projection's block (``fused_o``) and the W_down columns (``fused_mlp`` with ``bulk_down``) have buffers of
their own, each with one full and one empty mbarrier, one phase per layer.

Part of megabake/codegen/bodies (see its __init__ for the contract); code generation copies these
routines into module.py in the order of ``megabake.codegen.bodies.BODY_FILES``."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.cpasync as cpasync
from cutlass import Float32, Int32

from .common import VEC, WARP
from .gemv import _gemv_chunk, _gemv_write

SLOT_BYTES = 16384  # one ring slot: a unit of whole weight rows (scripts/gpu_stream_probe.py streamed 16 KB tiles)


def _slot_rows(ring: cute.Tensor, slots: int, unit_rows: int, cols: int) -> cute.Tensor:
    """The ring as [slot, row of the unit, column] for rows of ``cols`` elements (plain Python, run at trace time)."""
    return cute.make_tensor(ring.iterator, cute.make_layout((slots, unit_rows, cols),
                                                            stride=(SLOT_BYTES // 2, cols, 1)))


def first_group(warp, unit, per_unit: int, warps: int):
    """The first group of rows of unit ``unit`` (``per_unit`` groups) that warp ``warp`` reduces: groups are dealt
    round robin over the CTA's whole run, group ``unit * per_unit + g`` to warp ``(unit * per_unit + g) % warps``
    (plain Python, on DSL integers while a body is traced, or on ints)."""
    return (warp - unit * per_unit % warps + warps) % warps


@cute.jit
def _unit_rows_present(row0: Int32, u: Int32, rows: cutlass.Constexpr[int], per_cta: cutlass.Constexpr[int],
                       unit_rows: cutlass.Constexpr[int]) -> Int32:
    """How many rows unit ``u`` of the CTA's run (rows ``row0 ..`` of a ``rows``-row view) holds: 0 past its end."""
    owned = cutlass.max(cutlass.min(rows - row0, per_cta), 0)
    return cutlass.max(cutlass.min(owned - u * unit_rows, unit_rows), 0)


@cute.jit
def loader_rows(weight: cute.Tensor, ring: cute.Tensor, full: cute.Tensor, empty: cute.Tensor, seq0: Int32,
                row0: Int32, lane: Int32, rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
                per_cta: cutlass.Constexpr[int], unit_rows: cutlass.Constexpr[int], units: cutlass.Constexpr[int],
                slots: cutlass.Constexpr[int], inflight: cutlass.Constexpr[int]):
    """The loader's side of one streamed GEMV stage: units ``seq0 .. seq0 + units - 1``, each of up to ``unit_rows``
    rows ``row0 + u * unit_rows ..`` of ``weight``, one ``cp.async.bulk`` per row, completing on the slot's full
    mbarrier (lane 0 arms it with the unit's bytes; an empty unit completes at once). A slot is refilled once every
    consumer warp released it; at most ``inflight`` units (0: no bound) are requested and not landed, which must
    stay below ``slots`` (a wait a lap back would be for a phase not armed yet: ``codegen.loader``'s ring_slots)."""
    view = _slot_rows(ring, slots, unit_rows, cols)
    atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), weight.element_type, num_bits_per_copy=cols * 16)
    for u in range(units):
        seq = seq0 + u
        slot = seq % slots
        if seq >= slots:
            cute.arch.mbarrier_wait(empty.iterator + slot, (seq // slots - 1) % 2)
        if cutlass.const_expr(inflight > 0):
            if seq >= inflight:
                landed = seq - inflight
                cute.arch.mbarrier_wait(full.iterator + landed % slots, (landed // slots) % 2)
        present = _unit_rows_present(row0, u, rows, per_cta, unit_rows)
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(full.iterator + slot, present * cols * 2)
        cute.arch.sync_warp()
        for r in range(lane, present, WARP):
            cute.copy(atom, cute.zipped_divide(weight[row0 + u * unit_rows + r, None], (cols,))[(None, 0)],
                      cute.zipped_divide(view[slot, r, None], (cols,))[(None, 0)], mbar_ptr=full.iterator + slot)


@cute.jit
def gemv_slots(ring: cute.Tensor, full: cute.Tensor, empty: cute.Tensor, seq0: Int32, s_vec: cute.Tensor,
               out: cute.Tensor, bias: cute.Tensor, row0: Int32, warp: Int32, lane: Int32,
               rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int], batch: cutlass.Constexpr[int],
               group: cutlass.Constexpr[int], per_cta: cutlass.Constexpr[int], unit_rows: cutlass.Constexpr[int],
               units: cutlass.Constexpr[int], slots: cutlass.Constexpr[int], warps: cutlass.Constexpr[int],
               accumulate: cutlass.Constexpr[bool], has_bias: cutlass.Constexpr[bool], act: cutlass.Constexpr[int]):
    """The consumers' side of :func:`loader_rows`: ``out[b, r] (+)= sum_k weight[r, k] * s_vec[b, k]`` for the
    CTA's rows ``row0 ..``. A unit's rows go to the warps in groups of ``group`` (2: the gate/up stage's (gate, up)
    pairs for the gated write, ``act``), dealt round robin over the whole run; every warp waits for every unit and
    releases it, so a slot is refilled only after all ``warps`` read it. Sums and writes are
    :func:`gemv_rows_streamed`'s (:func:`_gemv_write`), so results are bit-identical to it."""
    view = _slot_rows(ring, slots, unit_rows, cols)
    kvecs = cols // VEC
    per_unit = unit_rows // group
    acc = cute.make_rmem_tensor(cute.make_layout(group * batch), Float32)
    for u in range(units):
        seq = seq0 + u
        slot = seq % slots
        cute.arch.mbarrier_wait(full.iterator + slot, (seq // slots) % 2)
        present = _unit_rows_present(row0, u, rows, per_cta, unit_rows)
        first = first_group(warp, u, per_unit, warps)
        for g in range(first, per_unit, warps):
            if g * group < present:
                for i in cutlass.range_constexpr(group * batch):
                    acc[i] = Float32(0.0)
                for j in cutlass.range_constexpr((kvecs + WARP - 1) // WARP):
                    kv = j * WARP + lane
                    if cutlass.const_expr((j + 1) * WARP <= kvecs):
                        _gemv_chunk(view[slot, None, None], s_vec, acc, g, kv, unit_rows, batch, group)
                    elif kv < kvecs:
                        _gemv_chunk(view[slot, None, None], s_vec, acc, g, kv, unit_rows, batch, group)
                _gemv_write(acc, out, bias, (row0 + u * unit_rows) // group + g, lane, rows, batch, group,
                            accumulate, has_bias, act)
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(empty.iterator + slot)


@cute.jit
def loader_o_block(w_o: cute.Tensor, s_wo: cute.Tensor, full: cute.Tensor, empty: cute.Tensor, layer: Int32,
                   cta: Int32, lane: Int32,
                   n_heads: cutlass.Constexpr[int], n_kv_heads: cutlass.Constexpr[int],
                   head_dim: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int], blocks: cutlass.Constexpr[int],
                   block_rows: cutlass.Constexpr[int]):
    """The loader's copy of this CTA's block of the layer's O projection (the rows and columns
    ``bodies.fused_o_load`` copies, in its layout) into ``s_wo``, one ``cp.async.bulk`` per row onto ``full``, once the
    layer before released the buffer (``empty``: :func:`release_block`). Nothing on CTAs past the last block."""
    cols = (n_heads // n_kv_heads) * head_dim
    group = cta % n_kv_heads
    block = cta // n_kv_heads
    if block < blocks:
        if layer > 0:
            cute.arch.mbarrier_wait(empty.iterator, (layer - 1) % 2)
        present = cutlass.min(block_rows, hidden - block * block_rows)
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(full.iterator, present * cols * 2)
        cute.arch.sync_warp()
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), w_o.element_type, num_bits_per_copy=cols * 16)
        view = cute.make_tensor(s_wo.iterator, cute.make_layout((block_rows, cols), stride=(cols, 1)))
        for r in range(lane, present, WARP):
            cute.copy(atom, cute.zipped_divide(w_o[block * block_rows + r, None], (cols,))[(None, group)],
                      cute.zipped_divide(view[r, None], (cols,))[(None, 0)], mbar_ptr=full.iterator)


@cute.jit
def loader_down(w_cta: cute.Tensor, s_down: cute.Tensor, s_bar: cute.Tensor, s_empty: cute.Tensor, layer: Int32,
                cta: Int32, lane: Int32, chunks: cutlass.Constexpr[int], per_cta: cutlass.Constexpr[int],
                hidden: cutlass.Constexpr[int], copy_bytes: cutlass.Constexpr[int]):
    """``bodies.mlp_down_bulk`` issued by the loader: this CTA's packed W_down columns into ``s_down`` on the mbarrier
    ``s_bar`` (``bodies.mlp_down_partial`` waits for the layer's phase), once the layer before released ``s_down``
    (``s_empty``: every consumer warp after its down partials, :func:`release_block`)."""
    if cta < chunks:
        if layer > 0:
            cute.arch.mbarrier_wait(s_empty.iterator, (layer - 1) % 2)
        elems = copy_bytes // 2
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(s_bar.iterator, hidden * per_cta * 2)
        cute.arch.sync_warp()
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), w_cta.element_type, num_bits_per_copy=copy_bytes * 8)
        flat = cute.make_tensor(s_down.iterator, cute.make_layout(hidden * per_cta))
        for i in range(lane, hidden * per_cta // elems, WARP):
            cute.copy(atom, cute.zipped_divide(w_cta, (elems,))[(None, i)],
                      cute.zipped_divide(flat, (elems,))[(None, i)], mbar_ptr=s_bar.iterator)


@cute.jit
def wait_block(bar: cute.Tensor, phase: Int32, active: Int32):
    """Every consumer thread waits for phase ``phase`` of the buffer's full mbarrier ``bar`` (where ``active``)."""
    if active != 0:
        cute.arch.mbarrier_wait(bar.iterator, phase)


@cute.jit
def release_block(bar: cute.Tensor, tidx: Int32, active: Int32, per_warp: cutlass.Constexpr[bool]):
    """Consumers are done with a loader buffer (where ``active``): ``per_warp``, each warp's lane 0 arrives on the
    empty mbarrier ``bar`` (initialised for every consumer warp) once its lanes are done; else thread 0 arrives
    alone (the caller's last CTA barrier already ordered every thread's reads)."""
    if active != 0:
        if cutlass.const_expr(per_warp):
            cute.arch.sync_warp()
            if tidx % WARP == 0:
                cute.arch.mbarrier_arrive(bar.iterator)
        elif tidx == 0:
            cute.arch.mbarrier_arrive(bar.iterator)


@cute.jit
def gate_arrive(gates: cute.Tensor, gate: cutlass.Constexpr[int], tidx: Int32):
    """Thread 0 tells the loader warp that its CTA arrived at a grid barrier (``generate(plan, loader_gates=...)``):
    one phase of the CTA mbarrier ``gates[gate]`` (initialised for one arrival) per layer. Called after the grid
    arrival, so the copies the loader then issues are not in flight when that arrival's release fence runs."""
    if tidx == 0:
        cute.arch.mbarrier_arrive(gates.iterator + gate)
