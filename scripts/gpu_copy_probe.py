"""What a CTA's copy of weights into shared memory costs it before a grid barrier, by copy kind (a probe).

Why (session 46): a fused_mlp build copies each CTA's columns of W_down into shared memory just before the grid
barrier that precedes the MLP, so that they land during the wait. Session 44's H100 timelines say they do not:
with fused_mlp the attention+O interval (which issues the copies) grows by ~0.38 us per MB copied over the grid on
both Qwen presets (Qwen2.5-0.5B +3.4 us a layer for 68 KB a CTA, Qwen3-0.6B +2.4 us for 48 KB), about the time the
bytes take to arrive. If issuing cp.async stalls the warps until most of the bytes are in flight, a CTA cannot
reach the barrier early; a bulk copy (``cp.async.bulk``, issued by a few lanes and completed on an mbarrier by the
copy engine) would not hold the warps. This probe measures that, outside the megakernel.

Every CTA of the grid (132 by default: the megakernel's) copies its own ``KB`` kilobytes of a bf16 buffer into
shared memory, all at once, as the pre-barrier copies do (from DRAM: a 256 MB write evicts the L2 before every
launch), by one of:

* ``cp16`` / ``cp8`` / ``cp4``: each thread issues ``cp.async`` of 16 / 8 / 4 bytes (``bodies.mlp_down_load``'s
  copies: Qwen3-0.6B's W_down columns copy 16 bytes at a time, SmolLM-135M's 8, Qwen2.5-0.5B's 4);
* ``bulk``: the lanes of warp 0 issue ``cp.async.bulk`` of 4 KB each onto one mbarrier;
* ``cp16row`` / ``bulkrow``: a CTA's 48 bytes of each row of a row-major matrix whose rows hold every CTA's slice
  side by side (Qwen3-0.6B's W_down columns as ``bodies.mlp_down_load`` copies them), by cp.async of 16 bytes or
  one ``cp.async.bulk`` per row;
* ``none``: no copy (the baseline of the chase).

Thread 0 reads ``%globaltimer`` and ``%clock64`` after a CTA barrier at the start, after every thread has issued
its copies (``issue``), after it arrived at a grid barrier as the megakernel does (``arrive``: a fire-and-forget
``red.release.gpu.add`` on a counter every CTA shares, as ``bodies.grid_arrive``, whose release may wait for the
CTA's copies in flight; session 47's first runs used ``atom``, which returns the count), after its acquire polls saw
every CTA's arrival (``released``) and after the copies landed (``landed``: cp.async wait_group 0, or the
mbarrier's phase). ``MODES`` says where the arrival sits: after the copies are issued (``after``, session 46's
probe), before them (``split``, as the megakernel's split barrier since session 27), and the same two with warp 0
issuing no copy (``spare``, ``spare-after``), so that the thread that arrives and polls has none in flight, and
``relaxed`` (as ``split`` with relaxed polls and one ``fence.acq_rel.gpu`` after them). ``chase`` has no grid
barrier: while warps 1.. copy, thread 0 walks 16 dependent loads of an L2-resident chain (``arrive`` is the walk's
end), which says whether copies in flight slow a latency-bound interval (attention) they would overlap. The
table gives, per kind, mode and size, the medians over CTAs and launches (us from the CTA's start; SM cycles for
``released`` and ``landed``), and the median launch's span (first start to last landing over the grid). What to
read: ``released`` near ``landed`` means the copies hold the grid barrier (a CTA leaves it only when its own copies
are in); near the barrier's own latency (~1 us) means they land during the wait, as intended.

    source .cute/activate.sh && python3 scripts/gpu_copy_probe.py [--kb 16 48 68 128] [--kinds ...] [--modes ...] \\
        [--out DIR]

``build(kind, elems, ctas, threads, mode)`` returns the ``@cute.jit`` launch; ``tests/test_copy_probe.py`` compiles
each kind and each mode for sm_90a on the CPU.
"""


import argparse
import json
import statistics
from pathlib import Path

KINDS = ("cp16", "cp8", "cp4", "bulk", "cp16row", "bulkrow", "none")
# the row kinds copy a CTA's columns of a row-major matrix as bodies.mlp_down_load does Qwen3-0.6B's W_down: ROW_ELEMS
# bf16 of every row, the CTAs' slices side by side (cp16row: cp.async of 16 bytes; bulkrow: one cp.async.bulk per row)
ROW_ELEMS = 24  # bf16 elements of a CTA's slice of a row (Qwen3-0.6B: 24 W_down columns a CTA, 48 bytes)
ROW_KINDS = ("cp16row", "bulkrow")
BULK_KINDS = ("bulk", "bulkrow")
# where thread 0 arrives at the grid barrier and who copies (session 47):
#   after:       every warp copies; thread 0 arrives after the copies are issued (the probe of session 46)
#   split:       every warp copies; thread 0 arrives before they are issued (the megakernel's split barrier:
#                bodies.grid_arrive, then the fills, then bodies.grid_wait)
#   spare:       as split, but warp 0 issues no copy (warps 1.. copy), so the thread that polls has none in flight
#   spare-after: warp 0 issues no copy and thread 0 arrives after the other warps issued theirs
#   relaxed:     as split, but thread 0 polls with relaxed loads and then one fence.acq_rel.gpu
#                (bodies.grid_barrier_red's relaxed_polls)
#   chase:       no grid barrier; warp 0 issues no copy and thread 0 walks CHASE dependent loads of an L2-resident
#                chain while the other warps' copies are in flight (as attention's loads would, were the next
#                interval's weights copied during it); ``arrive`` is the walk's end
MODES = ("after", "split", "spare", "spare-after", "relaxed", "chase")
BULK_BYTES = 4096  # bytes per cp.async.bulk (one per lane of the issuing warp and round)
DEFAULT_CTAS = 132
DEFAULT_THREADS = 256
CHASE = 16  # dependent loads of the chase
CHAIN = 1 << 20  # int32 entries of the chain (4 MB, read into L2 before every launch)
# where thread 0 reads its clocks: the CTA's start, all copies issued, its arrival returned to the program (the
# release add issued), the grid barrier released (its acquire polls saw every CTA's arrival), the copies landed
POINTS = ("start", "issue", "arrive", "released", "landed")
STAMPS = 2 * len(POINTS) + 1  # %globaltimer at each point, then %clock64 at each, then the chase's last index
FLUSH_BYTES = 256 << 20  # written before every launch: over 5x the L2 of an H100 / H200 (50 MB)


def source_shape(kind: str, elems: int, ctas: int) -> tuple[int, int]:
    """The bf16 source's shape: [ctas, elems] (a CTA's row), or for the row kinds [rows, ctas * ROW_ELEMS] (a CTA
    copies its ROW_ELEMS columns of each of ``elems // ROW_ELEMS`` rows)."""
    return (elems // ROW_ELEMS, ctas * ROW_ELEMS) if kind in ROW_KINDS else (ctas, elems)


def build(kind: str, elems: int, ctas: int = DEFAULT_CTAS, threads: int = DEFAULT_THREADS, mode: str = "after"):
    """The ``@cute.jit`` launch(src, times, counter, chain, stream) of one probe: src bf16 (:func:`source_shape`),
    times int64 [ctas, STAMPS] (thread 0's ``%globaltimer`` at each of ``POINTS``, then its ``%clock64`` at the
    same points: the SM's cycles resolve what the nanosecond timer's update interval may not), counter int64 [1]
    (the grid barrier's: it only grows, so launches need no reset; zero before the first), chain int32 [CHAIN]
    (entry i: the next index of the chase)."""
    if kind not in KINDS:
        raise ValueError(f"unknown copy kind {kind!r}: pick one of {', '.join(KINDS)}")
    if mode not in MODES:
        raise ValueError(f"unknown arrival mode {mode!r}: pick one of {', '.join(MODES)}")
    if kind == "bulk" and elems * 2 % BULK_BYTES:
        raise ValueError(f"{elems} bf16 elements are not whole {BULK_BYTES}-byte bulk copies: pick a multiple of "
                         f"{BULK_BYTES // 2}")
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.cute.nvgpu.cpasync as cpasync
    from cutlass import Int32, Int64

    rows = elems // ROW_ELEMS
    bits = {"cp16": 128, "cp8": 64, "cp4": 32, "bulk": BULK_BYTES * 8, "cp16row": 128, "bulkrow": ROW_ELEMS * 16,
            "none": 128}[kind]
    per_copy = bits // 16  # bf16 elements per copy
    copies = rows * ROW_ELEMS // per_copy if kind in ROW_KINDS else elems // per_copy
    row_copies = ROW_ELEMS // per_copy  # copies per row (row kinds)
    landed_bytes = rows * ROW_ELEMS * 2 if kind in ROW_KINDS else elems * 2
    smem_bytes = elems * 2 + 128
    spare = mode.startswith("spare") or mode == "chase"
    first_copier = 32 if spare else 0  # warp 0 copies nothing in the spare and chase modes
    copiers = threads - first_copier
    arrive_first = mode in ("split", "spare", "relaxed")
    barrier = mode != "chase"
    poll = "relaxed" if mode == "relaxed" else "acquire"
    cycles = len(POINTS)  # the %clock64 columns follow the %globaltimer ones

    @cute.kernel
    def probe(src: cute.Tensor, times: cute.Tensor, counter: cute.Tensor, chain: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        s_buf = smem.allocate_tensor(src.element_type, cute.make_layout(elems), byte_alignment=128)
        s_bar = smem.allocate_tensor(Int64, cute.make_layout(1), byte_alignment=8)
        target = cute.make_rmem_tensor(cute.make_layout(1), Int64)
        ptr = counter.iterator.llvm_ptr
        if cutlass.const_expr(kind in BULK_KINDS):
            if tidx == 0:
                cute.arch.mbarrier_init(s_bar.iterator, 1)
            cute.arch.mbarrier_init_fence()
        if tidx == 0:
            # the counter value this launch's barrier waits for, known before the clocks start, as the megakernel
            # keeps it in a register (bodies.grid_arrive's next_target): the previous launch's CTAs all arrived, so
            # the counter reads launches x ctas plus the arrivals of this launch so far
            target[0] = (cute.arch.load(ptr, Int64, sem="relaxed", scope="gpu") // ctas + 1) * ctas
        cute.arch.sync_threads()
        if tidx == 0:
            times[cta, 0] = cute.arch.globaltimer()
            times[cta, cycles] = cute.arch.clock64()
            if cutlass.const_expr(arrive_first):
                # the grid barrier's arrival as bodies.grid_arrive: a fire-and-forget release add
                cute.arch.red(ptr, Int64(1), op="add", dtype="u64", sem="release", scope="gpu")
                times[cta, 2] = cute.arch.globaltimer()
                times[cta, cycles + 2] = cute.arch.clock64()
            if cutlass.const_expr(mode == "chase"):
                index = Int32(0)
                for _ in cutlass.range_constexpr(CHASE):
                    index = cute.arch.load((chain.iterator + index).llvm_ptr, Int32, sem="relaxed", scope="gpu")
                times[cta, 2] = cute.arch.globaltimer()
                times[cta, cycles + 2] = cute.arch.clock64()
                times[cta, 2 * cycles] = Int64(index)
        if cutlass.const_expr(kind in BULK_KINDS):
            atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), src.element_type, num_bits_per_copy=bits)
            if tidx == first_copier:
                cute.arch.mbarrier_arrive_and_expect_tx(s_bar.iterator, landed_bytes)
            if tidx >= first_copier and tidx < first_copier + 32:
                for i in range(tidx - first_copier, copies, 32):
                    if cutlass.const_expr(kind == "bulkrow"):
                        part = cute.zipped_divide(src[i, None], (per_copy,))[(None, cta)]
                    else:
                        part = cute.zipped_divide(src[cta, None], (per_copy,))[(None, i)]
                    cute.copy(atom, part, cute.zipped_divide(s_buf, (per_copy,))[(None, i)], mbar_ptr=s_bar.iterator)
        elif cutlass.const_expr(kind != "none"):
            cache = cpasync.LoadCacheMode.GLOBAL if bits == 128 else cpasync.LoadCacheMode.ALWAYS
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cache), src.element_type, num_bits_per_copy=bits)
            if tidx >= first_copier:
                for i in range(tidx - first_copier, copies, copiers):
                    if cutlass.const_expr(kind == "cp16row"):
                        r = i // row_copies
                        column = cta * row_copies + i - r * row_copies  # in copies of per_copy elements
                        part = cute.zipped_divide(src[r, None], (per_copy,))[(None, column)]
                    else:
                        part = cute.zipped_divide(src[cta, None], (per_copy,))[(None, i)]
                    cute.copy(atom, part, cute.zipped_divide(s_buf, (per_copy,))[(None, i)])
            cute.arch.cp_async_commit_group()
        cute.arch.sync_threads()
        if tidx == 0:
            times[cta, 1] = cute.arch.globaltimer()
            times[cta, cycles + 1] = cute.arch.clock64()
            if cutlass.const_expr(barrier and not arrive_first):
                cute.arch.red(ptr, Int64(1), op="add", dtype="u64", sem="release", scope="gpu")
                times[cta, 2] = cute.arch.globaltimer()
                times[cta, cycles + 2] = cute.arch.clock64()
            if cutlass.const_expr(barrier):
                # the grid barrier's wait (bodies.grid_wait): acquire polls until every CTA arrived
                current = cute.arch.load(ptr, Int64, sem=poll, scope="gpu")
                while current < target[0]:
                    current = cute.arch.load(ptr, Int64, sem=poll, scope="gpu")
                if cutlass.const_expr(mode == "relaxed"):
                    cute.arch.fence_acq_rel_gpu()
            times[cta, 3] = cute.arch.globaltimer()
            times[cta, cycles + 3] = cute.arch.clock64()
        if cutlass.const_expr(kind in BULK_KINDS):
            cute.arch.mbarrier_wait(s_bar.iterator, Int32(0))
        elif cutlass.const_expr(kind != "none"):
            cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if tidx == 0:
            times[cta, 4] = cute.arch.globaltimer()
            times[cta, cycles + 4] = cute.arch.clock64()

    @cute.jit
    def launch(src: cute.Tensor, times: cute.Tensor, counter: cute.Tensor, chain: cute.Tensor,
               stream: cuda.CUstream):
        probe(src, times, counter, chain).launch(grid=(ctas, 1, 1), block=(threads, 1, 1), smem=smem_bytes,
                                                 stream=stream)

    return launch


def fake_arguments(elems: int, ctas: int = DEFAULT_CTAS, kind: str = "cp16") -> list:
    """Fake tensors for a compile without a GPU (``cute.compile(build(...), *fake_arguments(...), stream)``)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    return [make_fake_compact_tensor(cutlass.BFloat16, source_shape(kind, elems, ctas), stride_order=(1, 0),
                                     assumed_align=16),
            make_fake_compact_tensor(cutlass.Int64, (ctas, STAMPS), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int64, (1,), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (CHAIN,), assumed_align=16)]


def _measure(kind: str, kb: int, ctas: int, threads: int, launches: int, mode: str) -> dict:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    elems = kb * 1024 // 2
    src = torch.randn(*source_shape(kind, elems, ctas), device="cuda").to(torch.bfloat16)
    times = torch.zeros(ctas, STAMPS, dtype=torch.int64, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    chain = torch.randperm(CHAIN, device="cuda").to(torch.int32)  # a random walk over 4 MB, one line a step
    args = [from_dlpack(src, assumed_align=16), from_dlpack(times, assumed_align=16),
            from_dlpack(counter, assumed_align=16), from_dlpack(chain, assumed_align=16)]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled = cute.compile(build(kind, elems, ctas, threads, mode), *args, stream)
    samples: dict[str, list[float]] = {f"{p}_{unit}": [] for p in POINTS[1:] for unit in ("us", "cycles")}
    spans = []
    # the megakernel's weights come from DRAM (the step streams far more than L2 holds): evict src before each launch
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    cycles = len(POINTS)  # the %clock64 columns follow the %globaltimer ones
    for n in range(launches + 3):
        flush.zero_()
        chain.sum()  # the chase's chain into L2 (attention's K/V rows are prefetched there before its interval)
        torch.cuda.synchronize()
        compiled(*args, stream)
        torch.cuda.synchronize()
        if n < 3:  # warm-up launches
            continue
        stamps = times.cpu()
        for i, point in enumerate(POINTS[1:], start=1):
            samples[f"{point}_us"] += ((stamps[:, i] - stamps[:, 0]) / 1e3).tolist()
            samples[f"{point}_cycles"] += (stamps[:, cycles + i] - stamps[:, cycles]).tolist()
        spans.append(float((stamps[:, 4].max() - stamps[:, 0].min()) / 1e3))
    if mode != "chase" and int(counter.item()) != ctas * (launches + 3):
        raise RuntimeError(f"the grid barrier's counter reads {int(counter.item())} after {launches + 3} launches of "
                           f"{ctas} CTAs: a CTA did not arrive")
    return {"kind": kind, "mode": mode, "kb_per_cta": kb, "ctas": ctas, "grid_mb": ctas * kb / 1024,
            "launches": launches, "span_us": statistics.median(spans),
            **{key: statistics.median(v) for key, v in samples.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kb", type=int, nargs="+", default=[16, 48, 68, 128],
                        help="kilobytes each CTA copies (multiples of 4)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="where thread 0 arrives and whether warp 0 copies (MODES in the source)")
    parser.add_argument("--ctas", type=int, default=DEFAULT_CTAS)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="folder for copy-probe.json")
    args = parser.parse_args()
    bad = [kb for kb in args.kb if kb <= 0 or kb % (BULK_BYTES // 1024)]
    if bad:
        parser.error(f"--kb {bad}: each size must be a positive multiple of {BULK_BYTES // 1024} (whole bulk copies)")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_copy_probe.py times copies on a GPU: none is visible (run it through the device tool)")
    print(f"{torch.cuda.get_device_name()}: {args.ctas} CTAs x {args.threads} threads, {args.launches} launches")
    print("| kind | mode | KB per CTA | MB over the grid | issue us | arrive us | released us | landed us "
          "| grid span us | released / landed cycles |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for kb in args.kb:
        for mode in args.modes:
            for kind in args.kinds:
                row = _measure(kind, kb, args.ctas, args.threads, args.launches, mode)
                rows.append(row)
                print(f"| {kind} | {mode} | {kb} | {row['grid_mb']:.1f} | {row['issue_us']:.2f} | "
                      f"{row['arrive_us']:.2f} | {row['released_us']:.2f} | {row['landed_us']:.2f} | "
                      f"{row['span_us']:.2f} | {row['released_cycles']:.0f} / {row['landed_cycles']:.0f} |",
                      flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "copy-probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
