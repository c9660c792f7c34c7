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
* ``bulk``: the lanes of warp 0 issue ``cp.async.bulk`` of 4 KB each onto one mbarrier.

Thread 0 reads ``%globaltimer`` and ``%clock64`` after a CTA barrier at the start, after every thread has issued
its copies (``issue``), after it arrived as the grid barrier arrives (``arrive``: ``atom.release.gpu.add`` on a
global counter, whose release may wait for the CTA's copies in flight) and after the copies landed (``landed``:
cp.async wait_group 0, or the mbarrier's phase). The table gives, per kind and size, the medians over CTAs and
launches (us and SM cycles from the CTA's start), and the median launch's span (first start to last landing over
the grid). What to read: ``issue`` or ``arrive`` near ``landed`` means the copies hold the CTA (they delay its
barrier arrival); near 0 means they land during the wait, as intended.

    source .cute/activate.sh && python3 scripts/gpu_copy_probe.py [--kb 16 48 68 128] [--out DIR]

``build(kind, elems, ctas, threads)`` returns the ``@cute.jit`` launch; ``tests/test_copy_probe.py`` compiles
every kind for sm_90a on the CPU.
"""


import argparse
import json
import statistics
from pathlib import Path

KINDS = ("cp16", "cp8", "cp4", "bulk")
BULK_BYTES = 4096  # bytes per cp.async.bulk (one per lane of warp 0 and round)
DEFAULT_CTAS = 132
DEFAULT_THREADS = 256
POINTS = ("start", "issue", "arrive", "landed")  # where thread 0 reads its clocks
STAMPS = 2 * len(POINTS) + 1  # %globaltimer at each point, then %clock64 at each, then the arrival counter
FLUSH_BYTES = 256 << 20  # written before every launch: over 5x the L2 of an H100 / H200 (50 MB)


def build(kind: str, elems: int, ctas: int = DEFAULT_CTAS, threads: int = DEFAULT_THREADS):
    """The ``@cute.jit`` launch(src, times, stream) of one probe: src bf16 [ctas, elems], times int64
    [ctas, STAMPS] (thread 0's ``%globaltimer`` at each of ``POINTS``, then its ``%clock64`` at the same points:
    the SM's cycles resolve what the nanosecond timer's update interval may not; the last column is the CTA's
    arrival counter)."""
    if kind not in KINDS:
        raise ValueError(f"unknown copy kind {kind!r}: pick one of {', '.join(KINDS)}")
    if elems * 2 % BULK_BYTES:
        raise ValueError(f"{elems} bf16 elements are not whole {BULK_BYTES}-byte bulk copies: pick a multiple of "
                         f"{BULK_BYTES // 2}")
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.cute.nvgpu.cpasync as cpasync
    from cutlass import Int32, Int64

    bits = {"cp16": 128, "cp8": 64, "cp4": 32, "bulk": BULK_BYTES * 8}[kind]
    per_copy = bits // 16  # bf16 elements per copy
    copies = elems // per_copy
    smem_bytes = elems * 2 + 128

    @cute.kernel
    def probe(src: cute.Tensor, times: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        s_buf = smem.allocate_tensor(src.element_type, cute.make_layout(elems), byte_alignment=128)
        s_bar = smem.allocate_tensor(Int64, cute.make_layout(1), byte_alignment=8)
        row = src[cta, None]
        if cutlass.const_expr(kind == "bulk"):
            if tidx == 0:
                cute.arch.mbarrier_init(s_bar.iterator, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx == 0:
            times[cta, 0] = cute.arch.globaltimer()
            times[cta, 4] = cute.arch.clock64()
        if cutlass.const_expr(kind == "bulk"):
            atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), src.element_type, num_bits_per_copy=bits)
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(s_bar.iterator, elems * 2)
            if tidx < 32:
                for i in range(tidx, copies, 32):
                    cute.copy(atom, cute.zipped_divide(row, (per_copy,))[(None, i)],
                              cute.zipped_divide(s_buf, (per_copy,))[(None, i)], mbar_ptr=s_bar.iterator)
        else:
            mode = cpasync.LoadCacheMode.GLOBAL if bits == 128 else cpasync.LoadCacheMode.ALWAYS
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), src.element_type, num_bits_per_copy=bits)
            for i in range(tidx, copies, threads):
                cute.copy(atom, cute.zipped_divide(row, (per_copy,))[(None, i)],
                          cute.zipped_divide(s_buf, (per_copy,))[(None, i)])
            cute.arch.cp_async_commit_group()
        cute.arch.sync_threads()
        if tidx == 0:
            times[cta, 1] = cute.arch.globaltimer()
            times[cta, 5] = cute.arch.clock64()
            # the grid barrier's arrival (bodies.sync): a release add, which orders the CTA's memory operations
            cute.arch.atomic_add((times.iterator + cta * STAMPS + 2 * len(POINTS)).llvm_ptr, Int64(1),
                                 sem="release", scope="gpu")
            times[cta, 2] = cute.arch.globaltimer()
            times[cta, 6] = cute.arch.clock64()
        if cutlass.const_expr(kind == "bulk"):
            cute.arch.mbarrier_wait(s_bar.iterator, Int32(0))
        else:
            cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if tidx == 0:
            times[cta, 3] = cute.arch.globaltimer()
            times[cta, 7] = cute.arch.clock64()

    @cute.jit
    def launch(src: cute.Tensor, times: cute.Tensor, stream: cuda.CUstream):
        probe(src, times).launch(grid=(ctas, 1, 1), block=(threads, 1, 1), smem=smem_bytes, stream=stream)

    return launch


def fake_arguments(elems: int, ctas: int = DEFAULT_CTAS) -> list:
    """Fake tensors for a compile without a GPU (``cute.compile(build(...), *fake_arguments(...), stream)``)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    return [make_fake_compact_tensor(cutlass.BFloat16, (ctas, elems), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int64, (ctas, STAMPS), stride_order=(1, 0), assumed_align=16)]


def _measure(kind: str, kb: int, ctas: int, threads: int, launches: int) -> dict:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    elems = kb * 1024 // 2
    src = torch.randn(ctas, elems, device="cuda").to(torch.bfloat16)
    times = torch.zeros(ctas, STAMPS, dtype=torch.int64, device="cuda")
    args = [from_dlpack(src, assumed_align=16), from_dlpack(times, assumed_align=16)]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled = cute.compile(build(kind, elems, ctas, threads), *args, stream)
    samples: dict[str, list[float]] = {f"{p}_{unit}": [] for p in POINTS[1:] for unit in ("us", "cycles")}
    spans = []
    # the megakernel's weights come from DRAM (the step streams far more than L2 holds): evict src before each launch
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    cycles = len(POINTS)  # the %clock64 columns follow the %globaltimer ones
    for n in range(launches + 3):
        flush.zero_()
        torch.cuda.synchronize()
        compiled(*args, stream)
        torch.cuda.synchronize()
        if n < 3:  # warm-up launches
            continue
        stamps = times.cpu()
        for i, point in enumerate(POINTS[1:], start=1):
            samples[f"{point}_us"] += ((stamps[:, i] - stamps[:, 0]) / 1e3).tolist()
            samples[f"{point}_cycles"] += (stamps[:, cycles + i] - stamps[:, cycles]).tolist()
        spans.append(float((stamps[:, 3].max() - stamps[:, 0].min()) / 1e3))
    return {"kind": kind, "kb_per_cta": kb, "ctas": ctas, "grid_mb": ctas * kb / 1024, "launches": launches,
            "span_us": statistics.median(spans), **{key: statistics.median(v) for key, v in samples.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kb", type=int, nargs="+", default=[16, 48, 68, 128],
                        help="kilobytes each CTA copies (multiples of 4)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
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
    print("| kind | KB per CTA | MB over the grid | issue us | arrive us | landed us | grid span us | issue / arrive / "
          "landed cycles |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for kb in args.kb:
        for kind in args.kinds:
            row = _measure(kind, kb, args.ctas, args.threads, args.launches)
            rows.append(row)
            print(f"| {kind} | {kb} | {row['grid_mb']:.1f} | {row['issue_us']:.2f} | {row['arrive_us']:.2f} | "
                  f"{row['landed_us']:.2f} | {row['span_us']:.2f} | {row['issue_cycles']:.0f} / "
                  f"{row['arrive_cycles']:.0f} / {row['landed_cycles']:.0f} |", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "copy-probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
