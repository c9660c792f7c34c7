"""How often do two *eager bf16* implementations of the same model pick the same top-1 token? (CPU only.)

The numerics pass rule asks for top-1 agreement with eager bf16. On random-weight presets the logits are
flat (near-ties over the whole vocabulary), so this measures how often rounding flips a near-tie. This
script puts a number on that floor, with no megakernel involved: the same preset and weights, teacher-forced
on random tokens, through

* ``eager-bf16``: the HF model in bf16 on the CPU (PyTorch's bf16 kernels);
* ``eager-bf16-alt``: the same, but every linear layer accumulates in fp32 and rounds its output to bf16 (what
  cuBLAS does on a GPU: another, equally valid, eager bf16);
* ``fp32``: the fp32 model on the bf16-rounded weights (the verifier's reference; the megakernel computes in
  fp32 on these weights too, so it sits next to this row).

and prints top-1 agreement for each pair, over all positions after a 16-token prefix, plus the share of
"decisive" positions (fp32 top-1/top-2 gap larger than twice eager bf16's max-abs logit error) and the
agreement there.

    python3 scripts/top1_noise_floor.py llama-3.2-1b --sequences 4 --length 80
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def fp32_accumulating_linears():
    original = F.linear

    def linear(x, weight, bias=None):
        if x.dtype != torch.bfloat16:
            return original(x, weight, bias)
        out = original(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(torch.bfloat16)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


@torch.no_grad()
def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).logits.float()


def agreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    same = a.argmax(-1) == b.argmax(-1)
    if mask is not None:
        same = same[mask]
    return float(same.float().mean()) if same.numel() else float("nan")


def main() -> None:
    from megabake.presets import get_preset

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (faster)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=80)
    parser.add_argument("--prefix", type=int, default=16)
    args = parser.parse_args()

    spec = get_preset(args.preset)
    if args.layers:
        import dataclasses

        spec = dataclasses.replace(spec, config=dict(spec.config, num_hidden_layers=args.layers))
    model = spec.build_model().to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, model.config.vocab_size, (args.sequences, args.length), generator=generator)
    with torch.no_grad():
        bf16 = logits_of(model, tokens)[:, args.prefix:]
        with fp32_accumulating_linears():
            alt = logits_of(model, tokens)[:, args.prefix:]
        model.float()
        fp32 = logits_of(model, tokens)[:, args.prefix:]
    top2 = fp32.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    bf16_err = (bf16 - fp32).abs().amax(-1)
    decisive = gap > 2 * bf16_err
    result = {
        "preset": args.preset, "layers": model.config.num_hidden_layers, "positions": int(fp32[..., 0].numel()),
        "top1 eager-bf16 vs eager-bf16-alt": agreement(bf16, alt),
        "top1 eager-bf16 vs fp32": agreement(bf16, fp32),
        "top1 eager-bf16-alt vs fp32": agreement(alt, fp32),
        "decisive share": float(decisive.float().mean()),
        "top1 eager-bf16 vs eager-bf16-alt, decisive positions": agreement(bf16, alt, decisive),
        "rel-L2 eager-bf16 vs fp32 (median)": float(((bf16 - fp32).norm(dim=-1) / fp32.norm(dim=-1)).median()),
        "fp32 top1-top2 gap (median)": float(gap.median()),
        "fp32 logit std (median)": float(fp32.std(-1).median()),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
