"""How long the fused_mlp build's accumulator reductions take on this GPU, without a megakernel (a probe).

Each layer of a ``generate(plan, fused_mlp=True)`` build has ``chunks`` CTAs add one int64 partial per output row
into ``hidden + 1`` words (``red.relaxed.gpu.global.add.u64``). ``torch.index_add_`` on int64 CUDA tensors adds with
the same kind of global atomics, so timing it over the same pattern (128 partials x hidden rows, rows contiguous per
partial) bounds that cost per layer, next to fp32 atomics and a plain copy of the same bytes. CUDA-event medians.

    source .cute/activate.sh && python3 scripts/gpu_atomic_probe.py
"""

from __future__ import annotations

import torch
from gpu_long_context import _event_ms  # scripts/ is on sys.path when this runs as a script


def _median_us(fn, reps: int = 21, calls: int = 200) -> float:
    """Per call: ``calls`` calls queued between two events (one call alone reads the launch floor), median of
    ``reps`` such blocks (gpu_long_context's event timer)."""
    return _event_ms(fn, inner=calls, rounds=reps) * 1e3


def main() -> None:
    print(torch.cuda.get_device_name())
    print("| hidden | partials | int64 atomics us | fp32 atomics us | copy of the bytes us | empty launch us |")
    print("|---|---|---|---|---|---|")
    layers = 32  # one call adds 32 layers' partials (32 accumulator rows): the per-layer cost is the total / 32
    print(f"(per layer: one call adds {layers} layers' partials into {layers} rows; times are per call / {layers})")
    for hidden in (576, 896, 1024, 2048):
        partials = 128
        index = torch.arange(hidden * layers, device="cuda").view(layers, 1, hidden).expand(layers, partials, hidden)
        index = index.reshape(-1).contiguous()
        words = hidden * layers  # the accumulator rows of every layer of one call
        acc64 = torch.zeros(words + 1, dtype=torch.int64, device="cuda")
        src64 = torch.randint(-2**40, 2**40, (partials * words,), dtype=torch.int64, device="cuda")
        acc32 = torch.zeros(words + 1, dtype=torch.float32, device="cuda")
        src32 = torch.randn(partials * words, device="cuda")
        dst = torch.empty_like(src64)
        tiny = torch.zeros(1, device="cuda")
        int_us = _median_us(lambda: acc64.index_add_(0, index, src64))
        f32_us = _median_us(lambda: acc32.index_add_(0, index, src32))
        copy_us = _median_us(lambda: dst.copy_(src64))
        empty_us = _median_us(lambda: tiny.add_(1))
        print(f"| {hidden} | {partials} | {int_us / layers:.3f} | {f32_us / layers:.3f} | "
              f"{copy_us / layers:.3f} | {empty_us:.2f} (whole call) |")


if __name__ == "__main__":
    main()
