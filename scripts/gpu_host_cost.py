"""Where the host cost of a synchronized decode step goes (issue 12: synchronized call <= GPU time + 15 us).

For each preset (random weights) the default megakernel is built and bound, then, interleaved in rounds so a
drifting clock or a busy host hits every measure alike, medians of:

- ``gpu``: CUDA events around one replay of the step graph (pinned-row copy + kernel), synchronized;
- ``step``: a synchronized ``MegakernelDecoder.step()`` (what users call) and ``step host``: until it returns;
- ``replay``: the step graph replayed and synchronized (no Python checks, no staging);
- ``kernel graph``: a graph of the kernel alone (no input copy node), replayed and synchronized;
- ``launch``: the compiled kernel launched directly (no graph), synchronized;
- ``floor`` / ``floor + copy``: a graph of one one-element kernel, without and with a 16-byte pinned
  host-to-device copy node before it: launch + wake-up latency of any graph on this machine.

``step - gpu`` is the issue's number; ``step - replay`` the Python part; ``replay - kernel graph`` the copy node;
``kernel graph - gpu`` launch + wake-up of this kernel, to compare with ``floor``.

``--foreign`` adds the step after other GPU work, as a serving loop that runs other kernels between decode steps
would see it (session 30: in the benchmark the first synchronized call after the baselines ran took 67-134 us
longer than the next ones): ``step after copy`` / ``gpu after copy`` follow a 64 MB device-to-device copy (more
than the 50 MB L2: the kernel's code, tables and small buffers leave it), ``step after add`` / ``gpu after add`` a
one-element kernel (a different kernel, no shared memory, next to no L2 traffic). ``gpu after *`` minus ``gpu``
is what the GPU side pays; ``step after *`` minus ``step`` all of it.

``--cpu-load`` measures everything again after CPU work in the same process, as the benchmarks do before they
time (the bake's and gpu_tune's CPU reference executor, eager fp32 numerics): once right after it and once
after ``--settle`` seconds of sleep. Session 26 saw ``step()``'s host part at 88-132 us in 3 of 8 first variants of
``gpu_tune.py`` (the ones checked against the CPU reference) and 22-33 us everywhere else; this measure found no
such slowdown (SmolLM-135M: step - gpu 11.4 us fresh, 10.8 after the reference, 10.5 after 2 s), so the cause is
something else.

``--bench-like`` (session 31) walks from this tool's setting to the benchmark's, one change at a time, and
measures at each step what ``benchmarks/decode.py`` reports: ``block``, the median of 100 synchronized calls back
to back on the timing harness's inputs (``verification.timing``: advancing positions, varying token ids; its
``sync_call_block``), ``gpu``, the per-call GPU time of 20 calls queued behind a spin kernel (its ``gpu_event``),
and ``host``, the median time until ``step()`` returns. Steps: ``jit`` (this tool's decoder, the timing inputs),
``package`` (a fresh bake loaded with ``MegakernelDecoder.from_package``: the precompiled kernel, as the benchmark
loads it), ``+ baseline built`` (the same after an ``inductor-default-graph`` baseline is built and warmed in the
process; the baseline's own measures next to it), ``alternating`` (each sample of 20 synchronized calls right
after 20 baseline calls, as the benchmark's rounds), then all three again after ``torch.profiler`` has profiled
one call of each (``check_graph(..., count_launches=True)``: what the timing harness did before its timing
rounds until session 31; CUPTI stays attached after the profile ends, pytorch/pytorch#144455). Why: session
31's benchmark read the synchronized call 33-58 us over the queued GPU time
(Llama-3.2-1B b1 at 16: 0.789 back to back vs 0.741 ms), while this tool, the same day on Qwen3-0.6B, read
``step - gpu`` at 11 us, and gpu_tune.py (no profiler either) 13 us; the step where the gap appears is its
cause, and the baseline's rows say how much of its own synchronized time (~0.27 ms over its GPU time on
Llama-3.2-1B) the profile added.

    source .cute/activate.sh && python3 scripts/gpu_host_cost.py smollm-135m olmo-2-1b --out $OUT
    source .cute/activate.sh && python3 scripts/gpu_host_cost.py smollm-135m --cpu-load --out $OUT
    source .cute/activate.sh && python3 scripts/gpu_host_cost.py qwen3-0.6b --capacity 4096 --foreign --out $OUT
    source .cute/activate.sh && python3 scripts/gpu_host_cost.py smollm-135m --bench-like --out $OUT

Writes OUT/host-cost.json; prints a table (us) last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def build_decoder(name: str, capacity: int):
    from megabake.capture import capture_decode_step
    from megabake.codegen import generate
    from megabake.ir import lower
    from megabake.plan import build_plan
    from megabake.plan.rotary import recover_rotary
    from megabake.presets import get_preset
    from megabake.runtime import MegakernelDecoder, gpu_info

    model = get_preset(name).build_model()
    captured = capture_decode_step(model, capacity=capacity)
    ir = lower(captured)
    inv, scale = recover_rotary(captured, ir)
    plan = build_plan(ir, ctas=gpu_info().sm_count, inv_freq_buffer=inv, rotary_scaling=scale)
    return MegakernelDecoder(plan, generate(plan).source, model, device="cuda")


def synced(action, clock=time.perf_counter) -> float:
    """Microseconds from before ``action()`` until the GPU has finished it."""
    import torch

    start = clock()
    action()
    torch.cuda.synchronize()
    return (clock() - start) * 1e6


def event_us(action) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    action()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def capture(body):
    import torch

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    return graph


def after(foreign, sample):
    """A sample taken right after ``foreign()`` has run on the GPU (synchronized, untimed)."""
    import torch

    def run() -> float:
        foreign()
        torch.cuda.synchronize()
        return sample()

    return run


def foreign_measures(decoder, position: int) -> dict:
    """``--foreign``: the step and its graph's GPU time right after other GPU work (module doc)."""
    import torch

    token = [1]
    source = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    scalar = torch.zeros(1, device="cuda")

    def step() -> float:
        return synced(lambda: decoder.step(token, position))

    def gpu() -> float:
        return event_us(decoder._graphs[0].replay)

    def copy():
        target.copy_(source)

    def add():
        scalar.add_(1)

    return {"step after copy": after(copy, step), "gpu after copy": after(copy, gpu),
            "step after add": after(add, step), "gpu after add": after(add, gpu)}


def measures(decoder, position: int) -> dict:
    """name -> callable returning one sample (us)."""
    import torch

    token = [1]
    decoder.step(token, position)  # captures the step graphs
    torch.cuda.synchronize()
    kernel_graph = capture(decoder._launch)
    scalar = torch.zeros(1, device="cuda")
    pinned = torch.zeros(4, dtype=torch.int32).pin_memory()
    device_row = torch.zeros(4, dtype=torch.int32, device="cuda")
    floor = capture(lambda: scalar.add_(1))

    def copy_then_add():
        device_row.copy_(pinned, non_blocking=True)
        scalar.add_(1)

    floor_copy = capture(copy_then_add)

    def step_host() -> float:
        start = time.perf_counter()
        decoder.step(token, position)
        host = (time.perf_counter() - start) * 1e6
        torch.cuda.synchronize()
        return host

    return {"gpu": lambda: event_us(decoder._graphs[0].replay),
            "step": lambda: synced(lambda: decoder.step(token, position)),
            "step host": step_host,
            "replay": lambda: synced(decoder._graphs[0].replay),
            "kernel graph": lambda: synced(kernel_graph.replay),
            "launch": lambda: synced(decoder._launch),
            "floor": lambda: synced(floor.replay),
            "floor + copy": lambda: synced(floor_copy.replay)}


def sampled(named: dict, rounds: int, per_round: int) -> dict:
    """Medians and raw samples (us) of every measure, interleaved in ``rounds``."""
    samples = {key: [] for key in named}
    for _ in range(rounds):
        for key, sample in named.items():
            sample()  # one untimed call: the previous measure's state must not leak into this one
            samples[key].extend(sample() for _ in range(per_round))
    return {"median_us": {key: statistics.median(values) for key, values in samples.items()}, "samples_us": samples}


def reference_load(decoder, steps: int = 3) -> float:
    """The CPU work gpu_tune.py and the bake do before timing: the plan's reference executor on the decoder's
    own weights, ``steps`` decode steps. Returns its seconds."""
    import torch

    started = time.perf_counter()
    reference = decoder.reference_executor()
    for p in range(steps):
        reference.step(torch.tensor([1 + p]), p)
    return time.perf_counter() - started


BENCH_INNER = 20  # the benchmark's calls per sample (benchmarks/matrix.TIMED_STEPS)
BLOCK_CALLS = 100  # the benchmark's back-to-back block (TimingSettings.block_calls)


def harness_measures(call, sync_rounds: int = 5) -> dict:
    """``block`` / ``gpu`` / ``host`` (module doc) of ``call(i)`` on the timing harness's schedule, in us, measured
    by the harness's own ``measure_blocks`` and ``measure_gpu_events``."""
    import torch

    from megabake.verification.timing import (Candidate, Samples, TimingSettings, measure_blocks,
                                              measure_gpu_events)

    for k in range(BENCH_INNER):
        call(k)  # one untimed pass: the previous measure's state must not leak into this one
    samples = {"timed": Samples()}
    settings = TimingSettings(inner=BENCH_INNER, block_calls=BLOCK_CALLS)
    measure_blocks([Candidate("timed", "megabake", call)], settings, torch.cuda.synchronize, samples)
    block = [ms * 1e3 for ms in samples["timed"].sync_call_block]
    host = [ms * 1e3 for ms in samples["timed"].host_call_block]
    indices = list(range(BENCH_INNER))
    gpu = [measure_gpu_events(call, indices, hold_ms=2.0 * BENCH_INNER) * 1e3 for _ in range(sync_rounds)]
    return {"block": statistics.median(block), "gpu": statistics.median(gpu), "host": statistics.median(host),
            "first": block[0], "samples_us": {"block": block, "gpu": gpu, "host": host}}


def alternating_measures(call, other, rounds: int = 20) -> dict:
    """``block`` as the benchmark's alternating rounds see it: per round, ``other`` runs its 20 calls, then 20
    synchronized calls of ``call`` (the mean per call is one sample); ``first``: the median first call."""
    import torch

    means, firsts = [], []
    for _ in range(rounds):
        for k in range(BENCH_INNER):
            other(k)
        torch.cuda.synchronize()
        times = []
        for k in range(BENCH_INNER):
            start = time.perf_counter()
            call(k)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e6)
        means.append(sum(times) / len(times))
        firsts.append(times[0])
    return {"block": statistics.median(means), "first": statistics.median(firsts),
            "samples_us": {"block": means, "first": firsts}}


def bench_like_rows(name: str, capacity: int, position: int, out: Path) -> list[dict]:
    """``--bench-like`` (module doc): one row per step from this tool's setting to the benchmark's."""
    import torch

    from megabake.baking import bake
    from megabake.runtime import MegakernelDecoder
    from megabake.verification.timing import (TimingInputs, TimingSettings, baseline_candidate, check_graph,
                                              megakernel_candidate)

    rows = []

    def record(step: str, measured: dict) -> dict:
        print(f"[{name}] {step}: block {measured['block']:.1f} us, gpu {measured['gpu']:.1f}, "
              f"host {measured.get('host', float('nan')):.1f}, first {measured['first']:.1f}", flush=True)
        rows.append({"preset": name, "capacity": capacity, "position": position, "phase": step, **measured})
        return measured

    settings = TimingSettings(inner=BENCH_INNER, prefill=max(1, position))
    jit = build_decoder(name, capacity)
    inputs = TimingInputs.make(jit, settings)
    record("jit", harness_measures(megakernel_candidate(jit, inputs).call))
    del jit
    torch.cuda.empty_cache()
    baked = bake(name, capacity=capacity, out=out / "packages", reference_steps=1, run_on_gpu=False, force=True)
    decoder = MegakernelDecoder.from_package(baked.path, model=baked.model, device="cuda")
    call = megakernel_candidate(decoder, inputs).call
    record(f"package ({decoder.compile_path})", harness_measures(call))
    baseline = baseline_candidate("inductor-default-graph", decoder.model, inputs, capacity)  # as run_timings
    if baseline.error:
        rows.append({"preset": name, "phase": "+ baseline built", "error": baseline.error})
        return rows
    with torch.no_grad():
        for k in range(30):
            baseline.call(k % BENCH_INNER)
        for state in ("", " profiled"):
            if state:  # the timing harness's graph check before session 31: torch.profiler with CUPTI
                for each in (call, baseline.call):
                    check_graph(each, count_launches=True)
            ours = record(f"megakernel{state or ', baseline built'}", harness_measures(call))
            record(f"baseline{state}", harness_measures(baseline.call))
            record(f"megakernel alternating{state}", {**alternating_measures(call, baseline.call), "gpu": ours["gpu"]})
    return rows


def measure_preset(name: str, capacity: int, position: int, rounds: int, per_round: int, cpu_load: bool = False,
                   settle: float = 2.0, foreign: bool = False) -> list[dict]:
    decoder = build_decoder(name, capacity)
    named = measures(decoder, position)
    if foreign:
        named.update(foreign_measures(decoder, position))
    rows = [{"preset": name, "capacity": capacity, "position": position, "phase": "fresh",
             **sampled(named, rounds, per_round)}]
    if cpu_load:
        load_s = reference_load(decoder)
        rows.append({"preset": name, "capacity": capacity, "position": position, "phase": "after CPU reference",
                     "load_s": load_s, **sampled(named, rounds, per_round)})
        time.sleep(settle)
        rows.append({"preset": name, "capacity": capacity, "position": position,
                     "phase": f"+{settle:g} s sleep", **sampled(named, rounds, per_round)})
    return rows


def print_bench_like(rows: list[dict], out: Path) -> None:
    (out / "host-gap.json").write_text(json.dumps(rows, indent=1))
    print("| preset | step | block us | gpu us | block - gpu | host us | first call us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['preset']} | {r['phase']} | failed: {r['error'][:80]} | | | | |")
            continue
        host = f"{r['host']:.1f}" if "host" in r else ""
        print(f"| {r['preset']} | {r['phase']} | {r['block']:.1f} | {r['gpu']:.1f} | {r['block'] - r['gpu']:.1f} "
              f"| {host} | {r['first']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--position", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=30)
    parser.add_argument("--cpu-load", action="store_true",
                        help="measure again after the CPU reference executor's work, and after --settle s of sleep")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds of sleep before the last --cpu-load measure (default 2)")
    parser.add_argument("--foreign", action="store_true",
                        help="also measure the step right after a 64 MB copy and after a one-element kernel")
    parser.add_argument("--bench-like", action="store_true",
                        help="instead: the benchmark's block/GPU/host measures, from this tool's decoder to the "
                             "benchmark's package decoder next to a graphed baseline, one change at a time")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.bench_like:
        print_bench_like([row for name in args.presets
                          for row in bench_like_rows(name, args.capacity, args.position, args.out)], args.out)
        return
    results = [row for name in args.presets
               for row in measure_preset(name, args.capacity, args.position, args.rounds, args.per_round,
                                         args.cpu_load, args.settle, args.foreign)]
    (args.out / "host-cost.json").write_text(json.dumps(results, indent=1))
    keys = list(results[0]["median_us"])
    print("| preset | phase | " + " | ".join(keys) + " | step - gpu | step - replay | replay - kernel graph |")
    print("|---" * (len(keys) + 5) + "|")
    for r in results:
        m = r["median_us"]
        print(f"| {r['preset']} | {r['phase']} | " + " | ".join(f"{m[k]:.1f}" for k in keys)
              + f" | {m['step'] - m['gpu']:.1f} | {m['step'] - m['replay']:.1f} | {m['replay'] - m['kernel graph']:.1f} |")


if __name__ == "__main__":
    main()
