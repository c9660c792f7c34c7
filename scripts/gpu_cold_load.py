"""Cold start of a baked package on a Hopper GPU: fresh process -> first token, JIT vs precompiled kernel.

Usage (repo root, on the H200):

    source .cute/activate.sh && python3 scripts/gpu_cold_load.py --out /tmp/cold [--preset tiny-llama]
        [--capacity 128] [--reps 5] [--timeout 600] [--no-graph]

It bakes the preset once (CPU work: capture, plan, codegen, compile check; the GPU is not used), then makes two
copies of the package: ``pkg-jit`` without a precompiled kernel (the runtime JIT-compiles module.py) and
``pkg-precompiled`` with one (the bake's, or exported here when the bake does not ship it yet; manifests are
rebuilt). Each measurement spawns a fresh ``python3`` that imports MegaBake, rebuilds the model from the report,
binds it (``MegakernelDecoder.from_package``) and runs one decode step; modes alternate (baseline, jit,
precompiled, baseline, ...) so drift hits all alike. ``baseline`` only imports torch + CuTe DSL and initialises
CUDA: the floor every mode pays. Reported per run: spawn -> first token (wall, seconds), the child's phases
(imports, from_package, of which the kernel compile or load, first step) and the compile path it took; the
first-step logits' sha256 must be the same for both paths (bit-identical kernels).

Writes ``<out>/cold_load.json`` (every run + summary) and prints a table. Every child has a timeout; a child
that fails or times out is recorded with its error and the script goes on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("baseline", "jit", "precompiled")


# ------------------------------------------------------------------------------------------------ child
def _timed_compile(decoder_class, phases: dict) -> None:
    """Time ``decoder_class._compile`` (precompiled load or JIT) into ``phases["compile_or_load"]``."""
    original = decoder_class._compile

    def _compile(self):
        started = time.time()
        try:
            original(self)
        finally:
            phases["compile_or_load"] = time.time() - started

    decoder_class._compile = _compile


def child(package: str | None, spawned_at: float, use_graph: bool) -> dict:
    started = time.time()
    import importlib

    import torch

    importlib.import_module("cutlass.cute")  # the DSL: every mode pays this import
    from megabake.runtime import MegakernelDecoder

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    imported = time.time()
    result = {"imports_and_cuda_init": imported - started, "interpreter_start": started - spawned_at}
    if package is None:
        return dict(result, first_token=imported - spawned_at)
    phases: dict = {}
    _timed_compile(MegakernelDecoder, phases)
    decoder = MegakernelDecoder.from_package(package, device="cuda", use_graph=use_graph)
    torch.cuda.synchronize()
    bound = time.time()
    logits = decoder.step([1], 0)
    token = int(logits[0].argmax())
    torch.cuda.synchronize()
    done = time.time()
    return dict(result, from_package=bound - imported, compile_or_load=phases.get("compile_or_load"),
                first_step=done - bound, first_token=done - spawned_at, token=token,
                logits_sha256=hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest(),
                compile_path=getattr(decoder, "compile_path", "jit"),
                compile_fallback=getattr(decoder, "compile_fallback", None))


# ----------------------------------------------------------------------------------------------- parent
def _rewrite_manifest(directory: Path) -> None:
    from megabake.package.store import MANIFEST, build_manifest, dump_json

    contents = {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
                if p.is_file() and p.name != MANIFEST and "__pycache__" not in p.parts}
    (directory / MANIFEST).write_bytes(dump_json(build_manifest(contents)))


def prepare(preset: str, capacity: int, out: Path) -> dict[str, Path]:
    """Bake once (no GPU run), then the two package copies: without and with the precompiled kernel."""
    from megabake.baking import bake
    from megabake.plan import Plan
    from megabake.runtime.compile import METADATA_FILE, OBJECT_FILE, export_kernel, load_module

    shutil.rmtree(out / "bake", ignore_errors=True)  # a fresh bake: never refused as a replacement
    baked = bake(preset, capacity=capacity, out=out / "bake", run_on_gpu=False,
                 progress=lambda msg: print(f"  bake: {msg}", flush=True))
    packages = {"jit": out / "pkg-jit", "precompiled": out / "pkg-precompiled"}
    for path in packages.values():
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(baked.path, path, ignore=shutil.ignore_patterns("__pycache__"))
    for name in (OBJECT_FILE, METADATA_FILE):
        (packages["jit"] / name).unlink(missing_ok=True)
    pre = packages["precompiled"]
    if not (pre / METADATA_FILE).exists():
        print("  the bake shipped no precompiled kernel: exporting it here", flush=True)
        plan = Plan.from_json((pre / "plan.json").read_text())
        export_kernel(plan, load_module((pre / "module.py").read_text()), pre)
    for path in packages.values():
        _rewrite_manifest(path)
    return packages


def measure(mode: str, package: Path | None, timeout: float, use_graph: bool) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(package) if package else "-",
               "--spawned-at", repr(time.time())] + ([] if use_graph else ["--no-graph"])
    row = {"mode": mode}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return dict(row, error=f"timed out after {timeout:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return dict(row, error=f"exit {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    row.update(json.loads(lines[-1]))
    if mode != "baseline" and row.get("compile_path") != mode:
        row["error"] = f"expected the {mode} path, the runtime took {row.get('compile_path')}: " \
                       f"{row.get('compile_fallback')}"
    return row


def summarize(rows: list[dict]) -> dict:
    summary = {}
    for mode in MODES:
        ok = [r for r in rows if r["mode"] == mode and "error" not in r]
        summary[mode] = {"runs": len(ok), "errors": sum(r["mode"] == mode and "error" in r for r in rows)}
        for key in ("first_token", "imports_and_cuda_init", "from_package", "compile_or_load", "first_step"):
            values = [r[key] for r in ok if r.get(key) is not None]
            if values:
                summary[mode][key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    jit, pre = (summary[m].get("first_token", {}).get("median") for m in ("jit", "precompiled"))
    digests = {r["logits_sha256"] for r in rows if r.get("logits_sha256") and "error" not in r}
    summary["speedup_first_token"] = jit / pre if jit and pre else None
    summary["logits_identical_across_paths"] = len(digests) == 1 if digests else None
    return summary


def print_table(summary: dict) -> None:
    keys = ("first_token", "imports_and_cuda_init", "from_package", "compile_or_load", "first_step")
    print(f"\n{'mode':<12} {'runs':>4} " + " ".join(f"{k:>22}" for k in keys))
    for mode in MODES:
        cells = []
        for key in keys:
            stat = summary[mode].get(key)
            cells.append(f"{stat['median']:9.3f} [{stat['min']:.2f},{stat['max']:.2f}]" if stat else "-")
        print(f"{mode:<12} {summary[mode]['runs']:>4} " + " ".join(f"{c:>22}" for c in cells))
    speedup = summary["speedup_first_token"]
    print(f"\nmedian seconds [min, max]; spawn -> first token speedup (jit / precompiled): "
          f"{f'{speedup:.2f}x' if speedup else 'n/a'}; logits identical across paths: "
          f"{summary['logits_identical_across_paths']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the packages and cold_load.json")
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    parser.add_argument("--no-graph", action="store_true", help="direct launches, no CUDA graph capture")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(None if args.child == "-" else args.child, args.spawned_at, not args.no_graph)))
        return 0
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    packages = prepare(args.preset, args.capacity, out)
    rows = []
    for rep in range(args.reps):
        for mode in MODES:
            row = measure(mode, packages.get(mode), args.timeout, not args.no_graph)
            rows.append(dict(row, rep=rep))
            error = (row.get("error") or "").strip().splitlines()
            shown = f"error: {error[-1]}" if error else f"{row['first_token']:.3f} s to the first token"
            print(f"  rep {rep} {mode:<12} {shown}", flush=True)
    summary = summarize(rows)
    report = {"preset": args.preset, "capacity": args.capacity, "use_graph": not args.no_graph,
              "python": sys.version.split()[0], "packages": {k: str(v) for k, v in packages.items()},
              "runs": rows, "summary": summary}
    (out / "cold_load.json").write_text(json.dumps(report, indent=1) + "\n")
    print_table(summary)
    print(f"\nwrote {out / 'cold_load.json'}")
    failed = any("error" in r for r in rows) or summary["logits_identical_across_paths"] is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
