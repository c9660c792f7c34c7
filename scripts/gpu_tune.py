"""GEMV tiling sweep and per-stage timeline of the megakernel on the H200 (a performance investigation tool).

For each preset: capture and lower once, then for each tuning variant (rows per warp tile x loads in flight
per lane) build the plan, generate, compile and bind the kernel, check its logits against the first
(default) variant at the same state, and time graph replays with CUDA events (median of --reps). Then a
``timeline=True`` build of the default and of the fastest variant reports where one step's time goes, per
stage kind (summed over layers), with the bytes each stage streams and the bandwidth that implies.

    source .cute/activate.sh && python3 scripts/gpu_tune.py smollm-135m llama-3.2-1b --out $OUT

Writes OUT/tune-<preset>.json; prints a short table per preset last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

VARIANTS = {  # name -> per-stage (per_tile, unroll) overrides ("*": every GEMV stage); "default" first
    "default": {},
    "t2u8": {"*": (2, 8)},
    "t1u8": {"*": (1, 8)},
    "t1u16": {"*": (1, 16)},
    "t1u16-lm2u4": {"*": (1, 16), "norm_lm_head": (2, 4)},
    "t1u8-lm2u8": {"*": (1, 8), "norm_lm_head": (2, 8)},
}


def tuning_for(spec: dict):
    from megabake.plan import GEMV_STAGES, GemvTuning

    every = {name: GemvTuning(*spec["*"]) for name in GEMV_STAGES} if "*" in spec else {}
    return {**every, **{name: GemvTuning(*value) for name, value in spec.items() if name != "*"}}


def stage_bytes(plan) -> dict[str, float]:
    d = plan.dims
    per_layer = {"norm_qkv": d.qkv_rows * d.hidden, "o_residual": d.hidden * d.q_rows,
                 "norm_gate_up": 2 * d.intermediate * d.hidden, "down_residual": d.hidden * d.intermediate}
    out = {k: 2.0 * v * d.layers for k, v in per_layer.items()}
    out["norm_lm_head"] = 2.0 * d.vocab * d.hidden
    return out


STEPS = 3  # decode steps from an empty cache before timing (positions 0..STEPS-1)


def vs_reference(decoder, plan, tokens) -> float:
    """rel-L2 of the decoder's last logits against the plan's CPU reference executor on its own bf16 weights."""
    from megabake.plan.reference import ReferenceExecutor

    weights = {spec.buffer: decoder.buffers[spec.buffer].cpu() for spec in plan.packed}
    reference = ReferenceExecutor(plan, weights, decoder.buffers["rope_cos"].cpu(), decoder.buffers["rope_sin"].cpu())
    for p in range(len(tokens)):
        want = reference.step(tokens[p:p + 1], p)
    got = decoder.buffers["logits"].float().cpu()
    return float((got - want).norm() / want.norm())


def time_replays(decoder, token, pos: int, reps: int) -> float:
    import torch

    decoder.step(token, pos)  # captures the graph
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decoder._graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sync_call(decoder, token, pos: int, reps: int) -> float:
    import torch

    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        decoder.step(token, pos)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def timeline(plan, model, tokens) -> dict[str, float]:
    from megabake.codegen import generate
    from megabake.runtime import MegakernelDecoder

    source = generate(plan, timeline=True).source
    decoder = MegakernelDecoder(plan, source, model, device="cuda", use_graph=False)
    for p in range(len(tokens)):
        decoder.step(tokens[p:p + 1], p)
    for _ in range(3):
        decoder.step(tokens[-1:], len(tokens) - 1)
    by_kind: dict[str, float] = {}
    for label, us in decoder.stage_timeline():
        kind = label.split(".")[-1]
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    del decoder
    return by_kind


def sweep(name: str, variants: list[str], reps: int, capacity: int) -> dict:
    import torch

    from megabake.capture import capture_decode_step
    from megabake.codegen import generate
    from megabake.ir import lower
    from megabake.plan import build_plan
    from megabake.plan.rotary import recover_rotary
    from megabake.presets import get_preset
    from megabake.runtime import MegakernelDecoder, gpu_info

    info = gpu_info()
    model = get_preset(name).build_model()
    captured = capture_decode_step(model, capacity=capacity)
    ir = lower(captured)
    inv, scale = recover_rotary(captured, ir)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, model.config.vocab_size, (STEPS,), generator=gen)
    pos = STEPS - 1
    token = tokens[pos:pos + 1]
    rows, default_logits, plans = [], None, {}
    for variant in variants:
        t0 = time.perf_counter()
        try:
            plan = build_plan(ir, ctas=info.sm_count, inv_freq_buffer=inv, rotary_scaling=scale,
                              tuning=tuning_for(VARIANTS[variant]))
            decoder = MegakernelDecoder(plan, generate(plan).source, model, device="cuda")
            for p in range(STEPS):
                decoder.buffers["logits"].fill_(float("nan"))  # poison
                logits = decoder.step(tokens[p:p + 1], p).float().cpu().clone()
            row = {"variant": variant, "finite": bool(torch.isfinite(logits).all())}
            if default_logits is None:
                default_logits = logits
                row["rel_l2_vs_cpu_reference"] = vs_reference(decoder, plan, tokens)
            row["rel_l2_vs_default"] = float((logits - default_logits).norm() / default_logits.norm())
            row.update(gpu_ms=time_replays(decoder, token, pos, reps), sync_ms=sync_call(decoder, token, pos, reps),
                       build_s=round(time.perf_counter() - t0, 1))
            plans[variant] = plan
            del decoder
        except Exception as exc:  # one variant failing must not end the sweep
            row = {"variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    ok = [r for r in rows if "gpu_ms" in r and r["finite"] and r["rel_l2_vs_default"] < 1e-3]
    best = min(ok, key=lambda r: r["gpu_ms"])["variant"] if ok else None
    timelines = {}
    for variant in dict.fromkeys(["default", best]):
        if variant in plans:
            try:
                timelines[variant] = timeline(plans[variant], model, tokens)
            except Exception as exc:
                timelines[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"preset": name, "gpu": info.name, "rows": rows, "best": best, "timelines": timelines,
            "stage_bytes": stage_bytes(plans["default"]) if "default" in plans else {}}


def print_table(result: dict) -> None:
    print(f"== {result['preset']} ({result['gpu']}) ==")
    print("| variant | GPU ms (graph replay) | sync ms | rel-L2 vs default | vs CPU reference |")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:80]} | | |")
        else:
            ref = r.get("rel_l2_vs_cpu_reference")
            print(f"| {r['variant']} | {r['gpu_ms']:.3f} | {r['sync_ms']:.3f} | {r['rel_l2_vs_default']:.1e} | "
                  f"{'' if ref is None else f'{ref:.1e}'} |")
    for variant, kinds in result["timelines"].items():
        if "error" in kinds:
            print(f"timeline {variant}: {kinds['error']}")
            continue
        total = sum(kinds.values())
        parts = []
        for kind, us in kinds.items():
            moved = result["stage_bytes"].get(kind)
            rate = f" {moved / us / 1e6:.2f} TB/s" if moved else ""  # bytes per us / 1e6 = TB/s
            parts.append(f"{kind} {us:.0f}us{rate}")
        print(f"timeline {variant} (CTA 0, total {total:.0f} us): " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.presets:
        result = sweep(name, args.variants, args.reps, args.capacity)
        (args.out / f"tune-{name}.json").write_text(json.dumps(result, indent=1))
        results.append(result)
    for result in results:
        print_table(result)


if __name__ == "__main__":
    main()
