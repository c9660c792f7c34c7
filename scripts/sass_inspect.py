"""Registers, spills and the load/FFMA order of a generated megakernel, on a CPU (no GPU needed).

    python3 scripts/sass_inspect.py llama-3.2-1b --tiling 2 4 --flags pipeline preload spread --out /tmp/sass
    python3 scripts/sass_inspect.py olmo-2-1b --default-tiling --capacity 4096 --build kv-pipeline --loops-with MUFU

Builds a 2-layer stack of the preset's real shapes with one GEMV tiling on every stage (the LM head never
preloads), compiles module.py for sm_90a with CuTe DSL (PTX kept), assembles it with the local `ptxas`
(a PTX `.version` newer than that ptxas is lowered to the one it names) and, when `nvdisasm` is found (PATH or
$NVDISASM; `pip download nvidia-cuda-nvdisasm` has one), writes the SASS and prints the sequence of global
loads, FFMAs, branches and barriers, run-length encoded: a pipelined GEMV loop shows its 8 `LDG` ahead of its
FFMAs. ``--default-tiling`` takes the bake's own plan instead, ``--build`` one of ``scripts/gpu_tune.py``'s code
generation candidates (``kv-pipeline``, ``pass-chunks``, ...), and ``--loops-with OP`` prints only the loops
(a label to the backward branch that returns to it) whose body holds OP: ``--loops-with MUFU`` shows the split-KV
attention loop, where the K/V loads should lead the scoring FFMAs. These are the local toolchain's choices; the
DSL's own toolchain on the GPU may schedule differently.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_ptx(preset_name: str, per_tile: int, unroll: int, flags: list[str], stages: int, out: Path, *,
              capacity: int = 128, batch: int = 1, default_tiling: bool = False,
              build: dict | None = None) -> Path:
    from megabake.codegen import generate
    from megabake.compiler import compile_step
    from megabake.plan import GEMV_STAGES, GemvTuning
    from megabake.presets import get_preset
    from megabake.runtime.compile import compile_check, load_module

    preset = get_preset(preset_name)
    model = dataclasses.replace(preset, config=dict(preset.config, num_hidden_layers=2)).build_model()
    tuning = None
    if not default_tiling:
        chosen = {flag: True for flag in flags}
        tuning = {stage: GemvTuning(per_tile, unroll, stages=stages,
                                    **{k: v for k, v in chosen.items()
                                       if not (stage == "norm_lm_head" and k == "preload")})
                  for stage in GEMV_STAGES}
    plan = compile_step(model, capacity=capacity, batch=batch, ctas=132, threads=256, tuning=tuning).plan
    result = compile_check(plan, load_module(generate(plan, **(build or {})).source), dump_dir=str(out))
    if not result.ok:
        raise SystemExit(f"CuTe DSL compile failed: {result.error}")
    return max(out.glob("*.ptx"), key=lambda p: p.stat().st_mtime)


def assemble(ptx: Path, out: Path) -> tuple[Path, str]:
    """ptxas the PTX; when this ptxas is older than the PTX's ``.version``, lower it to the one ptxas names."""
    ptxas = shutil.which("ptxas")
    if not ptxas:
        raise SystemExit("ptxas not found on PATH: install the CUDA toolkit's ptxas (12.x or 13.x)")
    local, cubin = out / "kernel.ptx", out / "kernel.cubin"
    text = ptx.read_text()
    for _ in range(2):
        local.write_text(text)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", str(local), "-o", str(cubin)],
                             capture_output=True, text=True)
        if not run.returncode:
            return cubin, run.stderr
        supported = re.search(r"current version is '(\d+\.\d+)'", run.stderr)
        if not supported:
            break
        text = re.sub(r"^\.version \d+\.\d+", f".version {supported.group(1)}", text, count=1, flags=re.M)
    raise SystemExit(f"ptxas failed:\n{run.stderr[-2000:]}")


def schedule(sass: str) -> str:
    """Run-length encoded sequence of LDG / FFMA / HMMA / LDS / SHFL / MUFU / BRA / BAR / WARPSYNC instructions."""
    seq = []
    for line in sass.splitlines():
        match = re.search(r"\*/\s+(@!?P\d\s+)?([A-Z][A-Z0-9.]*)", line)
        if not match:
            continue
        op = match.group(2).split(".")[0]
        if op in ("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "FFMA", "HMMA", "LDS", "SHFL", "MUFU", "BRA", "BAR", "WARPSYNC",
                  "NOP", "STL", "LDL"):
            if seq and seq[-1][0] == op:
                seq[-1][1] += 1
            else:
                seq.append([op, 1])
    return " ".join(f"{n}{op}" for op, n in seq)


def loops_with(sass: str, op: str) -> list[str]:
    """The schedule (:func:`schedule`) of every innermost loop of ``sass`` whose body holds ``op``: a loop runs
    from a label to the backward branch that returns to it; one holding another loop (the layer loop) is left out."""
    lines = sass.splitlines()
    labels, spans = {}, []
    for i, line in enumerate(lines):
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = i
            continue
        branch = re.search(r"\bBRA\b.*?\.(L_x_\d+)", line)
        if branch and branch.group(1) in labels:
            spans.append((labels[branch.group(1)], i))
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [schedule("\n".join(lines[a:b + 1])) for a, b in innermost
            if any(re.search(rf"\b{re.escape(op)}\b", text) for text in lines[a:b + 1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset")
    parser.add_argument("--tiling", nargs=2, type=int, default=[2, 4], metavar=("PER_TILE", "UNROLL"))
    parser.add_argument("--flags", nargs="*", default=[], choices=["spread", "preload", "pipeline"])
    parser.add_argument("--stages", type=int, default=0, help="cp.async ring depth of every GEMV stage (0: none)")
    parser.add_argument("--capacity", type=int, default=128, help="KV capacity of the bucket (default 128)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step of the bucket (default 1)")
    parser.add_argument("--default-tiling", action="store_true",
                        help="the bake's default GEMV tiling instead of --tiling / --flags / --stages")
    parser.add_argument("--build", default="default",
                        help="a code generation candidate of scripts/gpu_tune.py (BUILDS: kv-pipeline, ...; default: "
                             "generate's own defaults. Before session 57 it was atom, the one-call grid barrier, "
                             "which also turns off the loader warp)")
    parser.add_argument("--loops-with", metavar="OP",
                        help="print only the loops holding this SASS op (MUFU: the split-KV attention loop)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/megabake-sass"))
    args = parser.parse_args()
    from gpu_tune import BUILDS

    if args.build not in BUILDS:
        parser.error(f"unknown --build {args.build!r}: choose one of {', '.join(BUILDS)}")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    args.out.mkdir(parents=True, exist_ok=True)
    ptx = build_ptx(args.preset, *args.tiling, args.flags, args.stages, args.out, capacity=args.capacity,
                    batch=args.batch, default_tiling=args.default_tiling, build=BUILDS[args.build])
    cubin, info = assemble(ptx, args.out)
    print("\n".join(line.strip() for line in info.splitlines() if "registers" in line or "spill" in line))
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm:
        print("nvdisasm not found (PATH or $NVDISASM): registers only")
        return
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    (args.out / "kernel.sass").write_text(sass)
    if args.loops_with:
        print(f"SASS: {args.out / 'kernel.sass'}; loops holding {args.loops_with}:")
        print("\n".join(loops_with(sass, args.loops_with)) or "none")
        return
    print(f"SASS: {args.out / 'kernel.sass'}\n{schedule(sass)}")


if __name__ == "__main__":
    main()
