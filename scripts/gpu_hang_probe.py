"""Hunt a megakernel hang on the GPU: the tensor-core GEMV test's steps, built with the barrier watchdog.

A persistent kernel whose CTA never reaches a grid barrier hangs the process, and from outside a hang looks like a
slow test. This script replays the kernel steps of ``test_mma_gemv_kernel_matches_reference_executor_at_long_context``
(random 1024-slot cache, positions 0, 1, 2, 127, 128, 129, 700, 1023; no CPU reference) for each of its cases, in
the test's order, for ``--rounds`` rounds, with kernels from ``generate(plan, watchdog=True)``: a CTA that waits at
a grid barrier for ~3 s gives up, and per CTA the module records its arrivals and the first barrier it gave up at
(``MegakernelDecoder.barrier_watch``). A step that does not finish within ``--step-timeout`` seconds even so (a CTA
stuck outside a barrier) is reported from a copy of the barrier counter taken on a side stream while the kernel
still runs, then the process exits. (Written in session 13 for what turned out to be a test selection: ``-k mma``
also matches every Gemma test; kept for the barrier work of issue 12, where a missed arrival deadlocks.)

    source .cute/activate.sh && python3 scripts/gpu_hang_probe.py --rounds 3 --out $OUT

Prints one line per step that gave up or stalled (which barrier, which CTAs were behind, the stage of that
barrier), and a summary; writes OUT/hang-probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

CASES = (("tiny-llama", 2, None), ("llama-3.2-1b", 8, 2), ("qwen2.5-0.5b", 5, 2))
POSITIONS = (0, 1, 2, 127, 128, 129, 700, 1023)


def barrier_stages(plan) -> list[str]:
    """Name of the stage that ends at each grid barrier, in the order a step reaches them (1-based ordinals)."""
    names = [s.name for s in plan.stages if s.scope == "prologue" and s.barrier_after]
    for layer in range(plan.dims.layers):
        names += [f"layer{layer}.{s.name}" for s in plan.stages if s.scope == "layer" and s.barrier_after]
    return names + [s.name for s in plan.stages if s.scope == "epilogue" and s.barrier_after]


def build_case(preset: str, batch: int, layers, watchdog: bool):
    from megabake.codegen import generate
    from megabake.plan import GEMV_STAGES, GemvTuning
    from megabake.runtime import MegakernelDecoder, gpu_info
    from tests.compiler_fixtures import compile_preset

    tuning = {stage: GemvTuning.parse("8x8+mma") for stage in GEMV_STAGES}
    compiled = compile_preset(preset, layers=layers, vocab=4096 if layers else None, batch=batch, capacity=1024,
                              ctas=gpu_info().sm_count, tuning=tuning)
    source = generate(compiled.plan, watchdog=watchdog).source
    return compiled.plan, MegakernelDecoder(compiled.plan, source, compiled.model, device="cuda")


def side_copy(tensor):
    """A copy of ``tensor`` taken on another stream (the kernel on the main stream may still be running)."""
    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        host = tensor.to("cpu", non_blocking=True)
    side.synchronize()
    return host


def run_steps(plan, decoder, step_timeout: float) -> list[dict]:
    """The test's steps; a record for each step that gave up at a barrier or did not finish."""
    import torch

    generator = torch.Generator().manual_seed(23)
    for name in ("k_cache", "v_cache"):
        buffer = decoder.buffers[name]
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
    tokens = torch.randint(1, plan.dims.vocab, (plan.batch, len(POSITIONS)), generator=generator)
    stages, problems = barrier_stages(plan), []
    for t, pos in enumerate(POSITIONS):
        before = decoder.barrier_watch()
        decoder.step(tokens[:, t], pos)
        done = torch.cuda.Event()
        done.record()
        started = time.perf_counter()
        while not done.query() and time.perf_counter() - started < step_timeout:
            time.sleep(0.01)
        if not done.query():
            counter = int(side_copy(decoder.buffers["barrier"][:1 + 2 * plan.ctas])[0])
            problems.append({"position": pos, "stalled": True, "barrier_counter": counter})
            return problems
        watch = decoder.barrier_watch()
        arrivals = [a - b for (a, _), (b, _) in zip(watch, before)]
        gave_up = sorted({g for _, g in watch if g} - {g for _, g in before if g})
        if gave_up or len(set(arrivals)) > 1:
            first = gave_up[0] if gave_up else 0
            ordinal = (first - 1) % len(stages) if first else None
            problems.append({"position": pos, "gave_up_at": gave_up, "stage": stages[ordinal] if first else None,
                             "arrivals_per_cta": sorted(set(arrivals)),
                             "ctas_behind": [c for c, a in enumerate(arrivals) if a < max(arrivals)][:32]})
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-timeout", type=float, default=20.0, help="seconds before a step counts as stalled")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = []
    for round_index in range(args.rounds):
        for preset, batch, layers in CASES:
            started = time.perf_counter()
            plan, decoder = build_case(preset, batch, layers, watchdog=True)
            problems = run_steps(plan, decoder, args.step_timeout)
            row = {"round": round_index, "preset": preset, "batch": batch, "problems": problems,
                   "seconds": round(time.perf_counter() - started, 1)}
            report.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "hang-probe.json").write_text(json.dumps(report, indent=1))
            if any(p.get("stalled") for p in problems):
                print("stalled: a CTA never reached a barrier; exiting without waiting for the kernel", flush=True)
                os._exit(3)
            del decoder
    hangs = [r for r in report if r["problems"]]
    print(f"== hang probe: {len(report)} case runs, {len(hangs)} with a barrier given up or uneven arrivals ==")


if __name__ == "__main__":
    main()
