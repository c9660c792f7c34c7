"""How fast a persistent kernel can run a model's decode schedule if one loader warp per SM streams the weights
through a shared-memory ring across grid barriers (a probe of issue 12's "larger design", session 50).

Why: the megakernel fills each GEMV's cp.async ring only once the CTA reaches the barrier before that GEMV, so DRAM
idles while attention runs and while CTAs wait (docs/PERF.md, sessions 47-49: a short-context interval costs ~2.5-3
us against ~1 us of bytes). Weights do not depend on the barrier: a loader warp could keep copying the next tiles
(``cp.async.bulk`` onto per-slot mbarriers) for as long as the ring has free slots, whatever barrier the other warps
wait at. This probe measures what that buys before the megakernel is rebuilt around it.

The probe runs a model's schedule of barrier intervals (per layer: QKV | attention + O | gate/up + down, as the
fused batch-1 default does at short contexts; then the LM head), each with the bytes a CTA streams in it (the
weights' bytes over the grid, rounded up to whole ``SLOT_BYTES`` tiles per CTA). Every CTA has 8 consumer warps and
one loader warp (warp 8). The loader's lane 0 copies the CTA's tiles in order into a ring of ``slots`` slots: it
waits for a slot's "empty" mbarrier (its 8 consumer warps have read it), arms the slot's "full" mbarrier with the
tile's bytes and issues ``SLOT_BYTES // COPY_BYTES`` bulk copies onto it. The consumer warps, per interval: stage a
vector of ``STAGE_FLOATS`` fp32 from global memory into shared memory (the RMSNorm input of the real stage; an L2
hit), spin ``spin_ns`` on ``%globaltimer`` in the attention intervals (attention's latency-bound work, no DRAM),
then for each tile wait on its full mbarrier, reduce it against the staged vector as a GEMV does (each warp one
2 KB row of the tile: 16-byte loads, fp32 FMAs, a warp butterfly), release it, and meet at a grid barrier (a named
barrier of the consumer warps, thread 0's ``red.release`` arrival and acquire polls as ``bodies.grid_arrive`` /
``grid_wait``, then the named barrier again). Modes:

* ``stream``: the loader runs ahead across barriers, bounded only by the ring.
* ``interval``: the loader may start an interval's tiles only once the CTA has arrived at the barrier before it
  (an mbarrier "gate" thread 0 arrives on right after its grid arrival), as the megakernel's ring prefill today.
* ``copy``: no staging, spin, arithmetic or grid barrier: the consumers only wait for each tile and release it (the
  rate at which the grid streams the CTAs' tiles: the floor any schedule of these bytes can reach).
* ``sync``: no tiles at all: the staging, the spin and the grid barriers only (the schedule's latency chain with
  DRAM idle).
* ``relaxed``: ``stream`` with a relaxed arrival (no release: not a correct barrier for data, a measurement of what
  the release waits for while copies are in flight).
* ``sync-loaded``: ``sync`` while the loader streams every tile anyway, reusing a slot once its own copy landed (the
  latency chain with DRAM saturated).
* ``l2ahead``: ``interval`` (nothing copied into shared memory in flight when thread 0 arrives), while the loader
  warp's lanes also prefetch the tile ``ahead`` tiles past the one they copy into the L2 (``prefetch.global.L2``,
  ungated: DRAM streams during the waits, the copies after the barrier read the L2).
* ``bulk-l2``: ``stream`` (not gated: this is how session 50 measured it) while lane 0 also prefetches the tile
  ``ahead`` tiles on into the L2 with one ``cp.async.bulk.prefetch.L2`` (inline PTX: the DSL has no op for it).

``--inflight D`` bounds the loader (any mode): it waits for tile t - D to land before it asks for tile t.

What it found (session 50, H100; benchmarks/results/2026-12-06-h100-session50): thread 0's ``red.release.gpu`` waits
for the SM's own copies in flight (0.4 us with none, 1.3-2.8 us streaming ahead, 0.02 us relaxed), so unbounded
run-ahead gives most of its overlap back; with two tiles in flight the Qwen3-0.6B / Qwen2.5-0.5B schedules run
11-14% under ``interval`` (today's kernel), Llama-3.2-1B 6%, SmolLM-135M not at all (its step is its barriers).

Thread 0 of CTA 0 reads ``%globaltimer`` after every grid barrier and, in each interval, once the vector is staged,
once the tiles are reduced and once it has arrived at the grid barrier (``PHASES``), so the table also gives the
mean interval by kind and where it goes. GPU ms per step are CUDA-event medians of ``--launches`` launches (each
streams ~1 GB, far past the L2).

    source .cute/activate.sh && python3 scripts/gpu_stream_probe.py qwen3-0.6b [--spin-ns 0 2000 3000] \\
        [--slots 8 12] [--modes stream interval copy] [--out DIR]

``build(...)`` returns the ``@cute.jit`` launch; ``tests/test_stream_probe.py`` compiles it for sm_90a on the CPU.
"""

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

MODES = ("stream", "interval", "copy", "sync", "relaxed", "sync-loaded", "l2ahead", "bulk-l2")
SLOT_BYTES = 16384  # one tile: 8 rows of 2 KB, one per consumer warp
COPY_BYTES = 4096  # bytes per cp.async.bulk
ROW_ELEMS = SLOT_BYTES // 2 // 8  # bf16 of a consumer warp's row of a tile (1024)
STAGE_FLOATS = ROW_ELEMS  # fp32 staged per interval (the GEMV input a row is reduced against)
CONSUMER_WARPS = 8
CONSUMERS = 32 * CONSUMER_WARPS
THREADS = CONSUMERS + 32  # + the loader warp
DEFAULT_CTAS = 132
MAX_SLOTS = 13  # 13 x 16 KB + the staged vector and mbarriers fit the H100 / H200's 227 KB per CTA
PHASES = ("staged", "tiles", "arrived", "released")  # CTA 0's clocks in each interval (us from the last release)
NAMED_BARRIER = 1  # the consumer warps' CTA barrier (barrier 0, __syncthreads, would wait for the loader warp)


@dataclass(frozen=True)
class Interval:
    """One barrier interval of the schedule: what it is, the tiles each CTA streams in it, the attention spin."""
    kind: str
    tiles: int
    spin_ns: int = 0


def model_schedule(preset: str, ctas: int = DEFAULT_CTAS, spin_ns: int = 2000) -> list[Interval]:
    """The batch-1 fused default's intervals of ``preset`` at a short context: per layer QKV, attention + O (with
    ``spin_ns``), gate/up + down; then the LM head. Each streams its weights' bf16 bytes over ``ctas`` CTAs, rounded
    up to whole tiles."""
    from megabake.presets import get_preset

    config = get_preset(preset).make_config()
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads

    def tiles(rows: int, cols: int) -> int:
        return math.ceil(rows * cols * 2 / ctas / SLOT_BYTES)

    layer = [Interval("qkv", tiles((heads + 2 * kv_heads) * head_dim, hidden)),
             Interval("attention+o", tiles(hidden, heads * head_dim), spin_ns),
             Interval("mlp", tiles(2 * inter, hidden) + tiles(hidden, inter))]
    return layer * config.num_hidden_layers + [Interval("lm_head", tiles(config.vocab_size, hidden))]


def build(intervals: int, total_tiles: int, slots: int = 12, mode: str = "stream", ctas: int = DEFAULT_CTAS,
          ahead: int = 12, inflight: int = 0):
    """The ``@cute.jit`` launch(src, sched, stage, out, times, counter, stream): src bf16 [ctas, total_tiles *
    SLOT_BYTES / 2] (CTA c's tiles in order), sched int32 [intervals, 3] (first tile, tiles, spin ns), stage fp32
    [STAGE_FLOATS], out fp32 [ctas, CONSUMER_WARPS] (the reductions: they keep the arithmetic), times int64
    [intervals + 1, 4] (CTA 0's clocks: row 0 the start, row i + 1 interval i's ``PHASES``), counter int64 [1]
    (the grid barrier's:
    it only grows, so launches need no reset)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: pick one of {', '.join(MODES)}")
    if not 2 <= slots <= MAX_SLOTS:
        raise ValueError(f"{slots} ring slots: pick 2 to {MAX_SLOTS} (16 KB each; a CTA has 227 KB)")
    if not 0 <= inflight < slots:
        raise ValueError(f"{inflight} tiles in flight: pick 0 (as many as the ring takes) to {slots - 1}")
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.cute.nvgpu.cpasync as cpasync
    from cutlass import Float32, Int64

    copies = SLOT_BYTES // COPY_BYTES
    copy_elems = COPY_BYTES // 2
    vec = 8  # bf16 per 16-byte load
    loads = ROW_ELEMS // vec // 32  # 16-byte loads per lane and row
    barriers = mode != "copy"
    work = mode != "copy"
    streams = mode != "sync"
    consumes = mode not in ("sync", "sync-loaded")
    self_recycling = mode == "sync-loaded"  # the loader waits for its own copies, not for consumers
    arrival = "relaxed" if mode == "relaxed" else "release"
    gated = mode in ("interval", "l2ahead")
    l2_ahead = mode in ("l2ahead", "bulk-l2")
    l2_bulk = mode == "bulk-l2"
    per_launch = ctas * intervals  # grid arrivals a launch adds to the counter
    smem_bytes = slots * SLOT_BYTES + STAGE_FLOATS * 4 + (2 * slots + 2) * 8 + 256

    @cute.kernel
    def probe(src: cute.Tensor, sched: cute.Tensor, stage: cute.Tensor, out: cute.Tensor, times: cute.Tensor,
              counter: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        smem = cutlass.memory.SmemAllocator()
        s_ring = smem.allocate_tensor(
            src.element_type, cute.make_layout((slots, CONSUMER_WARPS, ROW_ELEMS),
                                               stride=(CONSUMER_WARPS * ROW_ELEMS, ROW_ELEMS, 1)),
            byte_alignment=128)
        s_vec = smem.allocate_tensor(Float32, cute.make_layout(STAGE_FLOATS), byte_alignment=16)
        s_full = smem.allocate_tensor(Int64, cute.make_layout(slots), byte_alignment=8)
        s_empty = smem.allocate_tensor(Int64, cute.make_layout(slots), byte_alignment=8)
        s_gate = smem.allocate_tensor(Int64, cute.make_layout(1), byte_alignment=8)
        s_base = smem.allocate_tensor(Int64, cute.make_layout(1), byte_alignment=8)
        ptr = counter.iterator.llvm_ptr
        if tidx == 0:
            for s in cutlass.range_constexpr(slots):
                cute.arch.mbarrier_init(s_full.iterator + s, 1)
                cute.arch.mbarrier_init(s_empty.iterator + s, CONSUMER_WARPS)
            cute.arch.mbarrier_init(s_gate.iterator, 1)
            # this launch's first barrier target: every CTA of the previous launches arrived at each of their
            # barriers, and of this launch at most ctas - 1 arrivals (the CTAs that read this) can precede it
            s_base[0] = cute.arch.load(ptr, Int64, sem="relaxed", scope="gpu") // per_launch * per_launch
            if cta == 0:
                times[0, 3] = cute.arch.globaltimer()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        n_intervals = intervals
        if warp == CONSUMER_WARPS and streams:
            # the loader: lane 0 streams the CTA's tiles into the ring, interval after interval (l2ahead: every
            # lane also prefetches the tile ``ahead`` tiles on into the L2, past the gate; bulk-l2: lane 0, ungated)
            atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), src.element_type, num_bits_per_copy=COPY_BYTES * 8)
            flat = cute.make_tensor(s_ring.iterator, cute.make_layout(slots * SLOT_BYTES // 2))
            if cutlass.const_expr(l2_ahead):
                for p in cutlass.range_constexpr(min(ahead, total_tiles)):
                    if cutlass.const_expr(l2_bulk):
                        if lane == 0:
                            _bulk_prefetch_tile(src, cta, p)
                    else:
                        _prefetch_tile(src, cta, p, lane)
            for i in range(n_intervals):
                if cutlass.const_expr(gated):
                    cute.arch.mbarrier_wait(s_gate.iterator, i % 2)
                first = sched[i, 0]
                for t in range(first, first + sched[i, 1]):
                    s = t % slots
                    if t >= slots:
                        if cutlass.const_expr(self_recycling):
                            cute.arch.mbarrier_wait(s_full.iterator + s, (t // slots - 1) % 2)
                        else:
                            cute.arch.mbarrier_wait(s_empty.iterator + s, (t // slots - 1) % 2)
                    if cutlass.const_expr(inflight > 0):  # at most ``inflight`` tiles requested and not landed
                        if t >= inflight:
                            landed = t - inflight
                            cute.arch.mbarrier_wait(s_full.iterator + landed % slots, (landed // slots) % 2)
                    if lane == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(s_full.iterator + s, SLOT_BYTES)
                        for c in cutlass.range_constexpr(copies):
                            cute.copy(atom, cute.zipped_divide(src[cta, None], (copy_elems,))[(None, t * copies + c)],
                                      cute.zipped_divide(flat, (copy_elems,))[(None, s * copies + c)],
                                      mbar_ptr=s_full.iterator + s)
                    if cutlass.const_expr(l2_ahead):
                        if t + ahead < total_tiles:
                            if cutlass.const_expr(l2_bulk):
                                if lane == 0:
                                    _bulk_prefetch_tile(src, cta, t + ahead)
                            else:
                                _prefetch_tile(src, cta, t + ahead, lane)
        elif warp < CONSUMER_WARPS:
            total = Float32(0.0)
            target = s_base[0]
            if cutlass.const_expr(gated):
                if tidx == 0:
                    cute.arch.mbarrier_arrive(s_gate.iterator)  # the first interval needs no barrier
            for i in range(n_intervals):
                first = sched[i, 0]
                if cutlass.const_expr(work):
                    # the stage's input vector, staged as the RMSNorm staging does (an L2 hit)
                    for k in cutlass.range_constexpr(STAGE_FLOATS // CONSUMERS):
                        s_vec[k * CONSUMERS + tidx] = stage[k * CONSUMERS + tidx]
                    cute.arch.barrier(barrier_id=NAMED_BARRIER, number_of_threads=CONSUMERS)
                    if tidx == 0:
                        if cta == 0:
                            times[i + 1, 0] = cute.arch.globaltimer()
                    spin = Int64(sched[i, 2])
                    if spin > Int64(0):
                        start = cute.arch.globaltimer()
                        while cute.arch.globaltimer() - start < spin:
                            pass
                for t in range(first, first + sched[i, 1] * int(consumes)):
                    s = t % slots
                    cute.arch.mbarrier_wait(s_full.iterator + s, (t // slots) % 2)
                    if cutlass.const_expr(work):
                        part = Float32(0.0)
                        for j in cutlass.range_constexpr(loads):
                            k = (j * 32 + lane) * vec
                            w = cute.zipped_divide(s_ring[s, warp, None], (vec,))[(None, k // vec)].load()
                            x = cute.zipped_divide(s_vec, (vec,))[(None, k // vec)].load()
                            part = part + (w.to(Float32) * x).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                                                     reduction_profile=0)
                        for offset in cutlass.range_constexpr(5):
                            part = part + cute.arch.shuffle_sync_bfly(part, 1 << (4 - offset))
                        total = total + part
                    cute.arch.sync_warp()
                    if lane == 0:
                        cute.arch.mbarrier_arrive(s_empty.iterator + s)
                if cutlass.const_expr(barriers):
                    target = target + Int64(ctas)
                    cute.arch.barrier(barrier_id=NAMED_BARRIER, number_of_threads=CONSUMERS)
                    if tidx == 0:
                        if cta == 0:
                            times[i + 1, 1] = cute.arch.globaltimer()
                        cute.arch.red(ptr, Int64(1), op="add", dtype="u64", sem=arrival, scope="gpu")
                        if cta == 0:
                            times[i + 1, 2] = cute.arch.globaltimer()
                        if cutlass.const_expr(gated):
                            if i + 1 < n_intervals:
                                cute.arch.mbarrier_arrive(s_gate.iterator)
                        current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
                        while current < target:
                            current = cute.arch.load(ptr, Int64, sem="acquire", scope="gpu")
                        if cta == 0:
                            times[i + 1, 3] = cute.arch.globaltimer()
                    cute.arch.barrier(barrier_id=NAMED_BARRIER, number_of_threads=CONSUMERS)
            if cutlass.const_expr(not barriers):
                if tidx == 0:
                    cute.arch.red(ptr, Int64(n_intervals), op="add", dtype="u64", sem="release", scope="gpu")
                    if cta == 0:
                        times[n_intervals, 3] = cute.arch.globaltimer()
            if lane == 0:
                out[cta, warp] = total

    @cute.jit
    def launch(src: cute.Tensor, sched: cute.Tensor, stage: cute.Tensor, out: cute.Tensor, times: cute.Tensor,
               counter: cute.Tensor, stream: cuda.CUstream):
        probe(src, sched, stage, out, times, counter).launch(grid=(ctas, 1, 1), block=(THREADS, 1, 1),
                                                             smem=smem_bytes, stream=stream, cooperative=True)

    return launch


def _bulk_prefetch_tile(src, cta, tile):
    """One ``cp.async.bulk.prefetch.L2.global`` of tile ``tile`` of CTA ``cta``'s stream (inline PTX)."""
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm

    start = (src[cta, None].iterator + tile * (SLOT_BYTES // 2)).llvm_ptr
    llvm.inline_asm(None, [start, Int32(SLOT_BYTES).ir_value()], "cp.async.bulk.prefetch.L2.global [$0], $1;",
                    "l,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _prefetch_tile(src, cta, tile, lane):
    """The loader warp's lanes prefetch tile ``tile`` of CTA ``cta``'s stream into the L2: one
    ``prefetch.global.L2`` per 128-byte line."""
    import cutlass.cute as cute

    lines = SLOT_BYTES // 128
    for k in range(lines // 32):  # unrolled as the kernel is traced
        element = tile * (SLOT_BYTES // 2) + (k * 32 + lane) * 64
        cute.arch.prefetch((src[cta, None].iterator + element).llvm_ptr, cache_level="L2")


def fake_arguments(intervals: int, total_tiles: int, ctas: int = DEFAULT_CTAS) -> list:
    """Fake tensors for a compile without a GPU (``cute.compile(build(...), *fake_arguments(...), stream)``)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    return [make_fake_compact_tensor(cutlass.BFloat16, (ctas, total_tiles * SLOT_BYTES // 2), stride_order=(1, 0),
                                     assumed_align=128),
            make_fake_compact_tensor(cutlass.Int32, (intervals, 3), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(cutlass.Float32, (STAGE_FLOATS,), assumed_align=16),
            make_fake_compact_tensor(cutlass.Float32, (ctas, CONSUMER_WARPS), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int64, (intervals + 1, len(PHASES)), stride_order=(1, 0),
                                     assumed_align=16),
            make_fake_compact_tensor(cutlass.Int64, (1,), assumed_align=16)]


def schedule_table(schedule: list[Interval]) -> list[list[int]]:
    """sched rows (first tile, tiles, spin ns) of ``schedule``."""
    rows, first = [], 0
    for interval in schedule:
        rows.append([first, interval.tiles, interval.spin_ns])
        first += interval.tiles
    return rows


def _measure(schedule: list[Interval], slots: int, mode: str, ctas: int, launches: int, ahead: int,
             inflight: int = 0) -> dict:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    rows = schedule_table(schedule)
    total_tiles = rows[-1][0] + rows[-1][1]
    src = torch.empty(ctas, total_tiles * SLOT_BYTES // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    sched = torch.tensor(rows, dtype=torch.int32, device="cuda")
    stage = torch.randn(STAGE_FLOATS, device="cuda")
    out = torch.full((ctas, CONSUMER_WARPS), float("nan"), device="cuda")
    times = torch.zeros(len(rows) + 1, len(PHASES), dtype=torch.int64, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    tensors = [src, sched, stage, out, times, counter]
    args = [from_dlpack(t, assumed_align=16) for t in tensors]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled = cute.compile(build(len(rows), total_tiles, slots, mode, ctas, ahead, inflight), *args, stream)
    samples, intervals = [], {}
    for n in range(launches + 3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        compiled(*args, stream)
        end.record()
        torch.cuda.synchronize()
        if n < 3:  # warm-up launches
            continue
        samples.append(begin.elapsed_time(end))
        stamps = times.cpu()
        if mode != "copy":  # each phase's clock, then the interval's length, in us from the last release
            since = (stamps[1:] - stamps[:-1, 3:4]).tolist()
            for interval, clocks in zip(schedule, since):
                intervals.setdefault(interval.kind, []).append([c / 1e3 for c in clocks])
    if int(counter.item()) != ctas * len(rows) * (launches + 3):
        raise RuntimeError(f"the grid barrier's counter reads {int(counter.item())}: a CTA missed an arrival")
    if mode != "copy" and not torch.isfinite(out).all():
        raise RuntimeError("a consumer warp wrote no finite reduction: the tiles were not all read")
    gb = ctas * total_tiles * SLOT_BYTES / 1e9 if mode != "sync" else 0.0  # sync-loaded: the loader's bytes
    ms = statistics.median(samples)
    return {"mode": mode, "slots": slots, "inflight": inflight, "ahead": ahead if mode in ("l2ahead", "bulk-l2") else 0,
            "spin_ns": max(i.spin_ns for i in schedule), "ctas": ctas,
            "gb_per_step": gb, "gpu_ms": ms, "tb_per_s": gb / ms, "launches": launches,
            "interval_us": {kind: statistics.mean(c[-1] for c in v) for kind, v in intervals.items()},
            "phase_us": {kind: {p: statistics.mean(c[n] for c in v) for n, p in enumerate(PHASES)}
                         for kind, v in intervals.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="+", help="built-in presets whose schedule to run (megabake.presets)")
    parser.add_argument("--spin-ns", type=int, nargs="+", default=[2000],
                        help="attention's latency in each attention + O interval (ns)")
    parser.add_argument("--slots", type=int, nargs="+", default=[12], help=f"ring slots of 16 KB (2-{MAX_SLOTS})")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--ahead", type=int, default=12,
                        help="l2ahead: tiles the L2 prefetch runs ahead of the copies (12: 25 MB over 132 CTAs)")
    parser.add_argument("--inflight", type=int, default=0,
                        help="tiles the loader keeps requested and not landed (0: as many as the ring's free slots)")
    parser.add_argument("--ctas", type=int, default=DEFAULT_CTAS)
    parser.add_argument("--launches", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="folder for stream-probe.json")
    args = parser.parse_args()
    bad = [s for s in args.slots if not 2 <= s <= MAX_SLOTS]
    if bad:
        parser.error(f"--slots {bad}: each must be 2 to {MAX_SLOTS} (16 KB slots; a CTA has 227 KB)")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_stream_probe.py times a kernel on a GPU: none is visible (run it through the device "
                         "tool)")
    print(f"{torch.cuda.get_device_name()}: {args.ctas} CTAs x {THREADS} threads, {args.launches} launches")
    print("| preset | mode | slots (in flight, L2 ahead) | spin ns | GB / step | GPU ms | TB/s "
          "| mean interval us (qkv / attention+o / mlp) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for preset in args.presets:
        for spin in args.spin_ns:
            schedule = model_schedule(preset, args.ctas, spin)
            for slots in args.slots:
                for mode in args.modes:
                    if mode == "copy" and (spin != args.spin_ns[0]):
                        continue  # the copy mode has no spin: once per preset and ring
                    row = {"preset": preset, **_measure(schedule, slots, mode, args.ctas, args.launches, args.ahead,
                                                               args.inflight)}
                    rows.append(row)
                    parts = " / ".join(f"{row['interval_us'].get(k, 0.0):.2f}" for k in ("qkv", "attention+o", "mlp"))
                    ring = f"{slots} ({row['inflight'] or '-'}, {row['ahead'] or '-'})"
                    print(f"| {preset} | {mode} | {ring} | {spin} | {row['gb_per_step']:.3f} | {row['gpu_ms']:.3f} | "
                          f"{row['tb_per_s']:.2f} | {parts} |", flush=True)
    print("\nCTA 0's phases, mean us from the interval's start (the last release): staged / tiles reduced / arrived "
          "/ released")
    print("| preset | mode | slots | spin ns | qkv | attention+o | mlp |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if row["phase_us"]:
            cells = " | ".join(" / ".join(f"{row['phase_us'][k][p]:.2f}" for p in PHASES)
                               for k in ("qkv", "attention+o", "mlp"))
            print(f"| {row['preset']} | {row['mode']} | {row['slots']} | {row['spin_ns']} | {cells} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stream-probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
