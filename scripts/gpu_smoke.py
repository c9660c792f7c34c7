"""GPU smoke check of baked megakernels: correctness against the plan's reference executor, launch count,
and synchronized step latency, for a list of presets. Run on the H200 (one preset per subprocess with a
timeout, so a hang costs one preset, not the session):

    source .cute/activate.sh && python3 scripts/gpu_smoke.py tiny-llama smollm-135m llama-3.2-1b --out $OUT

Prints one table row per preset last; writes details to OUT/smoke-<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def check_preset(name: str, capacity: int, steps: int) -> dict:
    import torch

    from megabake.capture import capture_decode_step
    from megabake.codegen import generate
    from megabake.ir import lower
    from megabake.plan import build_plan
    from megabake.plan.rotary import recover_rotary
    from megabake.presets import get_preset
    from megabake.runtime import MegakernelDecoder, gpu_info

    t0 = time.perf_counter()
    info = gpu_info()
    model = get_preset(name).build_model()
    captured = capture_decode_step(model, capacity=capacity)
    ir = lower(captured)
    inv, scale = recover_rotary(captured, ir)
    plan = build_plan(ir, ctas=info.sm_count, inv_freq_buffer=inv, rotary_scaling=scale)
    source = generate(plan).source
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoder = MegakernelDecoder(plan, source, model, device="cuda", use_graph=False)
    compile_s = time.perf_counter() - t0
    # reference: the decoder's own packed bf16 weights and tables, fp32 math on the CPU
    reference = decoder.reference_executor()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, plan.dims.vocab, (steps,), generator=gen)
    errors = []
    for pos in range(steps):
        decoder.buffers["logits"].fill_(float("nan"))  # poison
        got = decoder.step(tokens[pos:pos + 1], pos).float().cpu().clone()
        want = reference.step(tokens[pos:pos + 1], pos)
        errors.append(float((got - want).norm() / want.norm()))
    kv_err = float((decoder.buffers["k_cache"].float().cpu() - reference.buffers["k_cache"].float()).abs().max())
    # repeat a step: a moving error is a race
    again = [float((decoder.step(tokens[steps - 1:steps], steps - 1).float().cpu() - want).norm() / want.norm())
             for _ in range(3)]
    # graph replay
    decoder._use_graph = True
    graph_ok = None
    pos = steps
    g_logits = decoder.step(tokens[:1], pos).float().cpu().clone()
    want = reference.step(tokens[:1], pos)
    graph_err = float((g_logits - want).norm() / want.norm())
    graph_ok = decoder._graph is not None
    # timing: synchronized complete call
    samples = []
    for i in range(30):
        decoder.step(tokens[:1], pos)
    torch.cuda.synchronize()
    for i in range(200):
        t = time.perf_counter()
        decoder.step(tokens[:1], pos)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(200):
        decoder.step(tokens[:1], pos)
    end.record()
    torch.cuda.synchronize()
    # launches per step, profiled after the timing: CUPTI stays attached after a profile (pytorch#144455), so
    # only the first preset of a run is timed without it; time one preset per process to compare sync_ms
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        decoder.step(tokens[:1], pos)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "megakernel" in e.name]
    all_cuda = sorted({e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"})
    return {
        "preset": name, "gpu": info.name, "ctas": plan.ctas, "barriers": plan.barriers_per_step,
        "build_s": build_s, "compile_s": compile_s, "max_rel_err_vs_ref": max(errors), "errors": errors,
        "repeat_errs": again, "kv_max_abs": kv_err, "graph": graph_ok, "graph_err": graph_err,
        "graph_error": getattr(decoder, "graph_error", None), "megakernel_launches": len(kernels),
        "cuda_events": all_cuda, "sync_ms_median": statistics.median(samples),
        "pipelined_ms": start.elapsed_time(end) / 200, "weight_bytes": plan.weight_bytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--out", default=".")
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        result = check_preset(args.one, args.capacity, args.steps)
        (out / f"smoke-{args.one}.json").write_text(json.dumps(result, indent=1))
        return
    rows = []
    for name in args.presets:
        cmd = [sys.executable, __file__, name, "--one", name, "--out", str(out), "--capacity", str(args.capacity),
               "--steps", str(args.steps)]
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
            (out / f"smoke-{name}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode:
                print(proc.stderr[-3000:])
                rows.append((name, "FAILED", proc.returncode))
                continue
        except subprocess.TimeoutExpired as exc:
            (out / f"smoke-{name}.log").write_text(str(exc.stdout or "") + str(exc.stderr or ""))
            rows.append((name, "TIMEOUT", args.timeout))
            continue
        r = json.loads((out / f"smoke-{name}.json").read_text())
        rows.append((name, f"err {r['max_rel_err_vs_ref']:.2e} rep {max(r['repeat_errs']):.1e} kv {r['kv_max_abs']:.1e} "
                           f"graph {r['graph']} gerr {r['graph_err']:.1e} launches {r['megakernel_launches']} "
                           f"sync {r['sync_ms_median']:.3f} ms pipe {r['pipelined_ms']:.3f} ms "
                           f"compile {r['compile_s']:.1f}s", r.get("graph_error")))
    print("\n== smoke ==")
    for row in rows:
        print(*row)


if __name__ == "__main__":
    main()
