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

    source .cute/activate.sh && python3 scripts/gpu_host_cost.py smollm-135m olmo-2-1b --out $OUT
    source .cute/activate.sh && python3 scripts/gpu_host_cost.py smollm-135m --cpu-load --out $OUT
    source .cute/activate.sh && python3 scripts/gpu_host_cost.py qwen3-0.6b --capacity 4096 --foreign --out $OUT

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

    from megabake.plan.reference import reference_executor_from_buffers

    started = time.perf_counter()
    reference = reference_executor_from_buffers(decoder.plan, decoder.buffers)
    for p in range(steps):
        reference.step(torch.tensor([1 + p]), p)
    return time.perf_counter() - started


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
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
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
