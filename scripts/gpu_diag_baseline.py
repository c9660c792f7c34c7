"""Diagnose megakernel + Inductor baseline interplay on one preset and time both side by side (H200).

    source .cute/activate.sh && python3 scripts/gpu_diag_baseline.py llama-3.2-1b [baseline ...]

Baselines are built and timed one after the other in the order given (default: inductor-graph first).
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from tests.compiler_fixtures import compile_preset  # noqa: E402

from megabake.runtime import MegakernelDecoder, gpu_info  # noqa: E402
from megabake.verification.baselines import build_baseline  # noqa: E402


def timed(call, n=200):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


name = sys.argv[1]
compiled = compile_preset(name, capacity=128, ctas=gpu_info().sm_count)
decoder = MegakernelDecoder(compiled.plan, compiled.generated.source, compiled.model, device="cuda")
prompt = torch.randint(1, compiled.plan.dims.vocab, (1, 16), generator=torch.Generator().manual_seed(0))
decoder.prefill(prompt)
tok = torch.tensor([7])
for pos in range(16, 36):
    decoder.step(tok, pos)
torch.cuda.synchronize()
print("megakernel steps ok", flush=True)
mk = timed(lambda: decoder.step(tok, 30))
print(f"megakernel sync median {mk:.3f} ms", flush=True)
for baseline in sys.argv[2:] or ("inductor-graph", "inductor-reduce-overhead"):
    try:
        step = build_baseline(baseline, decoder.model, prompt.cuda(), 128)
        ids, pos = torch.tensor([7], device="cuda"), torch.tensor([30], device="cuda")
        step.call(ids, pos)
        torch.cuda.synchronize()
        print(baseline, "ok", flush=True)
        bl = timed(lambda: step.call(ids, pos))
        decoder.step(tok, 30)
        torch.cuda.synchronize()
        mk2 = timed(lambda: decoder.step(tok, 30))
        print(f"{baseline} sync median {bl:.3f} ms | megakernel again {mk2:.3f} ms | speedup {bl / mk2:.2f}x", flush=True)
    except Exception as exc:
        print(baseline, "FAILED", type(exc).__name__, str(exc)[:300], flush=True)
        break
