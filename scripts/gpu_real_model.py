"""Issue 13 on the H200: a real model from its GGUF file to text, through every interface users call.

Usage (on the H200, after ``source .cute/activate.sh``; the GGUF travels in parts, see ../shared/GPU.md):

    python3 scripts/gpu_real_model.py GGUF --out DIR [--capacity 512] [--new-tokens 48]

Steps, each logged and written to ``DIR/real_model.json``:
1. ``megabake.baking.bake(GGUF)`` on this GPU (the bake's own numerics check runs on the megakernel);
2. greedy chat answers to the fixture's chat prompts (plus one more): the megakernel's tokens vs HF fp32's and HF
   bf16's, common-prefix lengths, teacher-forced top-1 agreement with fp32 along fp32's answer;
3. ``megabake run PKG --prompt ... --chat`` in a fresh process: its stdout and stderr;
4. the transformers drop-in (``serve_decode_steps``) and the ``torch.compile`` backend (``make_backend``): their
   greedy ids must equal ``decoder.generate``'s.
Prints the tables last.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXTRA_PROMPTS = ("Give me a short tip for writing clean Python code.",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {}
    from megabake.baking import bake
    from megabake.runtime import MegakernelDecoder
    from scripts.gpu_long_context import _chats
    from tests.real_weights import CHAT_PROMPTS, _fp32_model_and_tokenizer, chat_ids

    model, tokenizer = _fp32_model_and_tokenizer(str(args.gguf))
    started = time.perf_counter()
    baked = bake(str(args.gguf), capacity=args.capacity, out=args.out / "packages", gpu_steps=32, gpu_prefill=16,
                 progress=lambda msg: print(f"[bake] {msg}", flush=True))
    result["bake"] = {"path": str(baked.path), "status": baked.report["status"],
                      "reasons": baked.report["status_reasons"][:3], "seconds": time.perf_counter() - started}
    print(json.dumps(result["bake"]), flush=True)
    decoder = MegakernelDecoder.from_package(baked.path, model=copy.deepcopy(model), device="cuda")
    prompts = tuple(CHAT_PROMPTS) + EXTRA_PROMPTS
    result["chats"] = _chats(decoder, model, tokenizer, prompts, chat_ids, new_tokens=args.new_tokens)
    result["run"] = _run_command(baked.path, args.gguf, prompts[0])
    result["interfaces"] = _interfaces(decoder, model, tokenizer, chat_ids(tokenizer, prompts[1]))
    (args.out / "real_model.json").write_text(json.dumps(result, indent=1))
    _print(result)


def _run_command(package: Path, gguf: Path, prompt: str) -> dict:
    command = [sys.executable, "-m", "megabake.cli", "run", str(package), "--prompt", prompt, "--chat",
               "--max-new-tokens", "48", "--model-path", str(gguf)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    stderr = [line for line in proc.stderr.splitlines() if line.startswith("[megabake]") or "error" in line]
    return {"command": "megabake run PKG --prompt " + repr(prompt) + " --chat --max-new-tokens 48",
            "exit": proc.returncode, "stdout": proc.stdout, "stderr": stderr}


@torch.no_grad()
def _interfaces(decoder, model, tokenizer, ids) -> dict:
    """The drop-in and the torch.compile backend against the megakernel's own generate (greedy, 32 tokens)."""
    from transformers import StaticCache

    from megabake.integrations import make_backend, serve_decode_steps
    from megabake.rope import cast_model

    own = decoder.generate(ids, max_new_tokens=32)[0].tolist()
    out = {"own_text": tokenizer.decode(own[ids.shape[1]:])}
    hf = cast_model(copy.deepcopy(model), device="cuda", dtype=torch.bfloat16).eval()
    try:
        with serve_decode_steps(hf, decoder) as served:
            dropin = hf.generate(ids.cuda(), max_new_tokens=32, do_sample=False, disable_compile=True)[0].tolist()
        out["dropin_equal"] = dropin[:len(own)] == own
        out["dropin_stats"] = str(served.stats)
    except Exception as exc:
        out["dropin_error"] = f"{type(exc).__name__}: {exc}"
    try:  # prefill graphs run eagerly here (other="eager") to save device time; the default is Inductor
        backend = make_backend(other="eager")
        compiled = cast_model(copy.deepcopy(model), device="cuda", dtype=torch.bfloat16).eval()
        backend.prepare(compiled, batch=1, cache_length=decoder.capacity)
        compiled.compile(backend=backend, fullgraph=True)
        cache = StaticCache(config=compiled.config, max_cache_len=decoder.capacity)
        got = compiled.generate(ids.cuda(), max_new_tokens=32, do_sample=False, disable_compile=True,
                                past_key_values=cache)[0].tolist()
        out["backend_equal"] = got[:len(own)] == own
        out["backend_summary"] = backend.summary()
    except Exception as exc:
        out["backend_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _print(result: dict) -> None:
    print("| prompt | common prefix MB/fp32 | bf16/fp32 | fp32 tokens | teacher-forced top-1 MB / bf16 | megakernel text |")
    print("|---|---|---|---|---|---|")
    for c in result["chats"]:
        print(f"| {c['prompt']} | {c['common_megakernel']} | {c['common_bf16']} | {c['fp32_tokens']} | "
              f"{c['top1_megakernel']:.2f} / {c['top1_bf16']:.2f} | {c['megakernel_text']!r} |")
    run = result["run"]
    print(f"\n$ {run['command']}   (exit {run['exit']})\n{run['stdout']}\n" + "\n".join(run["stderr"]))
    print("\ninterfaces:", json.dumps(result["interfaces"], indent=1))


if __name__ == "__main__":
    main()
