"""Bake and verify a list of presets in one run; write a markdown table and a PNG chart of ms/token.

Usage (on a Hopper GPU, from the repo root; on the H200: `source .cute/activate.sh` first):

    python3 benchmarks/decode.py --out DIR            # every model-sized preset (all but tiny-llama)
    python3 benchmarks/decode.py --presets smollm-135m llama-3.2-1b --out DIR
    python3 benchmarks/decode.py --from-results DIR/results.json --out DIR   # re-render table + chart
    python3 benchmarks/decode.py --out DIR --resume   # keep DIR's finished presets, run the rest
    python3 benchmarks/decode.py --presets smollm-135m --positions 16 1000 4000 --batches 1 4 8 --out DIR

With ``--positions`` / ``--batches`` the run is a context x batch matrix instead (``benchmarks/matrix.py``): per
preset and batch one bake whose bucket holds the largest position, numerics at the longest context, and for
each position the megakernel timed against graphed Inductor in the same process (DIR/matrix.md, matrix.png,
matrix.json, raw timings per cell under DIR/matrix/).

For every preset: bake (``megabake.baking.bake``, packages under DIR/packages), then ``verify_package``
(numerics over advancing decode calls, timings against the strongest CUDA-graphed Inductor baseline). A
preset that fails is logged with its traceback and the run goes on. Writes DIR/decode.log (everything),
DIR/results.json (one row per preset), DIR/<preset>-report.json (the full report with raw samples),
DIR/<preset>-package.tar.gz (the verified package, ``packages/...`` inside: untar it in the repo root),
DIR/decode.md (the table, rewritten after each preset) and DIR/decode.png (needs matplotlib; when
it is missing the chart is skipped with a note and can be rendered later with --from-results). The short
table is printed last. ``--stand-in`` times eager HF as the "megabake" candidate instead of baking: a check
of this harness on a GPU without a megakernel (its rows say so). ``--resume`` takes a preset's row from
DIR/<preset>-report.json when that report was made with the same settings (bucket, steps, prefill, samples,
tiling) by the same megabake sources (``toolchain.source_sha256``), so a run cut short by a time limit goes
on where it stopped instead of measuring everything again.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megabake.presets import PRESETS, is_preset  # noqa: E402  (after the sys.path line)

LOG = logging.getLogger("benchmarks.decode")
MEASURES = ("sync_call", "pipelined", "gpu_event")


@dataclass
class Row:
    """One preset's headline numbers (ms per token = ms per batch-1 decode call)."""

    preset: str
    model_id: str = ""
    status: str = "error"
    reasons: list[str] = field(default_factory=list)
    package: str | None = None
    megabake_ms: float | None = None
    megabake_ci: list[float] | None = None
    megabake_gpu_ms: float | None = None
    baselines_ms: dict[str, float] = field(default_factory=dict)
    baseline: str | None = None
    speedup: float | None = None
    speedup_ci: list[float] | None = None
    floor_ms: float | None = None
    seconds: float = 0.0
    stand_in: bool = False
    measured: str = ""  # where and with what: date, GPU, driver, versions, megabake git revision
    warnings: list[str] = field(default_factory=list)  # the timing harness's consistency warnings
    kernel: str = ""  # the GEMV tiling baked when not the default: "tiling 2x4+ring4" or "autotuned (...)"


def row_from_report(preset: str, report: dict, *, package: str | None = None, seconds: float = 0.0,
                    stand_in: bool = False) -> Row:
    """The table row of a verified (or failed) report."""
    timings = report.get("timings") or {}
    candidates = timings.get("candidates") or {}
    mk = next((c for c in candidates.values() if c.get("kind") == "megabake"), {})
    sync = mk.get("sync_call") or {}
    gpu = mk.get("gpu_event") or {}
    speedup = timings.get("speedup") or {}
    return Row(
        preset=preset, model_id=report.get("model", {}).get("id", ""), status=report.get("status", "?"),
        reasons=list(report.get("status_reasons", [])), package=package,
        megabake_ms=sync.get("median"), megabake_ci=sync.get("ci95"), megabake_gpu_ms=gpu.get("median"),
        baselines_ms={name: c["sync_call"]["median"] for name, c in candidates.items()
                      if c.get("kind") == "baseline" and c.get("sync_call")},
        baseline=timings.get("baseline"), speedup=speedup.get("median"), speedup_ci=speedup.get("ci95"),
        floor_ms=timings.get("floor_ms"), seconds=seconds, stand_in=stand_in, measured=measured_line(report),
        warnings=list(timings.get("warnings") or []), kernel=kernel_note(report),
    )


def kernel_note(report: dict) -> str:
    """How the kernel's GEMV tiling was chosen, when not the default (the table says so under it)."""
    from megabake.package.commands import tiling_note

    kernel = report.get("kernel") or {}
    note = tiling_note(kernel)
    named = not kernel.get("autotune") and (kernel.get("tiling") or {}).get("spec")
    return f"tiling {note}" if named else note


def measured_line(report: dict) -> str:
    """'2026-11-30, NVIDIA H200 (132 SMs, driver ...), torch ..., ...' from a verified report's records."""
    env, tools = report.get("environment") or {}, report.get("toolchain") or {}
    if not env:
        return ""
    date = str(env.get("verified_at") or report.get("created_at") or "")[:10]
    parts = [f"{env.get('gpu_name')} ({env.get('sm_count')} SMs, driver {env.get('driver')})"]
    parts += [f"{name} {tools[key]}" for key, name in (("torch", "torch"), ("transformers", "transformers"),
                                                        ("cutlass_dsl", "CuTe DSL"), ("megabake", "megabake"))
              if tools.get(key)]
    if tools.get("git_revision"):
        commit, _, dirty = str(tools["git_revision"]).partition("+")
        parts.append(f"git {commit[:12]}" + (f"+{dirty}" if dirty else ""))
    return ", ".join(p for p in [date] + parts if p)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown_table(rows: list[Row]) -> str:
    """ms/token (synchronized complete call, median) per preset; speedup vs the fastest baseline."""
    names = sorted({name for row in rows for name in row.baselines_ms})
    header = (["preset", "status", "MegaBake ms [95% CI]", "MegaBake GPU ms"] + [f"{n} ms" for n in names]
              + ["floor ms", "speedup [95% CI]"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        ci = row.megabake_ci
        mk = _ms(row.megabake_ms) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        speed = "-" if row.speedup is None else (
            f"{row.speedup:.2f}x" + (f" [{row.speedup_ci[0]:.2f}, {row.speedup_ci[1]:.2f}]" if row.speedup_ci else "")
            + (f" vs {row.baseline}" if row.baseline else ""))
        label = row.preset + (" (stand-in: eager HF, not a megakernel)" if row.stand_in else "")
        cells = ([label, row.status, mk, _ms(row.megabake_gpu_ms)] + [_ms(row.baselines_ms.get(n)) for n in names]
                 + [_ms(row.floor_ms), speed])
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("ms/token = median of synchronized complete decode calls (host + GPU), batch 1; GPU ms = "
                 "CUDA-event time of the kernel alone; floor = weight bytes / device copy bandwidth.")
    for measured in dict.fromkeys(row.measured for row in rows if row.measured):
        lines.append(f"Measured: {measured}.")
    for row in rows:
        lines += [f"Kernel ({row.preset}): {row.kernel}."] if row.kernel else []
        lines += [f"Warning ({row.preset}): {warning}" for warning in row.warnings]
    return "\n".join(lines) + "\n"


def write_chart(rows: list[Row], path: Path) -> str | None:
    """Grouped bars of ms/token (log scale) per preset; returns None, or why the chart was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: chart skipped (re-render with --from-results on a machine with it)"
    rows = [r for r in rows if r.megabake_ms is not None]
    if not rows:
        return "no timed preset: chart skipped"
    series = ["MegaBake"] + sorted({n for r in rows for n in r.baselines_ms}) + ["floor"]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(4.2 + 2.0 * len(rows), 4.5))
    for k, name in enumerate(series):
        values = [r.megabake_ms if name == "MegaBake" else r.floor_ms if name == "floor" else r.baselines_ms.get(name)
                  for r in rows]
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        bars = ax.bar(xs, [v or 0.0 for v in values], width, label=name)
        for bar, value in zip(bars, values):
            if value:
                ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                            fontsize=7)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r.preset + (f"\n{r.speedup:.2f}x [{r.speedup_ci[0]:.2f}, {r.speedup_ci[1]:.2f}]"
                                    if r.speedup and r.speedup_ci else "") for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms / token (batch 1, synchronized call)")
    ax.set_title("MegaBake decode vs CUDA-graphed Inductor" + (" (stand-in)" if any(r.stand_in for r in rows) else ""))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------------ running


def bake_preset(preset: str, out: Path, capacity: int, autotune: bool = False, tiling: str | None = None,
                attention_preload: bool = False):
    """Bake on this GPU; one CPU reference step (verify's 64 GPU steps are the real numerics evidence)."""
    from megabake.baking import bake

    return bake(preset, capacity=capacity, out=out / "packages", reference_steps=1, autotune=autotune,
                tiling=tiling, attention_preload=attention_preload,
                progress=lambda msg: LOG.info("[bake %s] %s", preset, msg))


def verify_preset(preset: str, args) -> Row:
    from megabake.verification import verify_package

    started = time.perf_counter()
    baked = bake_preset(preset, args.out, args.capacity, args.autotune, args.tiling, args.attention_preload)
    path = baked.path
    LOG.info("[%s] baked %s; verifying", preset, path)
    report = verify_package(path, steps=args.steps, prefill=args.prefill, samples=args.samples,
                            baselines=args.baselines, model=baked.model)
    del baked
    # next to the table: the whole report with raw samples (package folders are deep; keep a flat copy)
    (args.out / f"{preset}-report.json").write_text(json.dumps(report, indent=1) + "\n")
    archive_package(path, args.out / "packages", args.out / f"{preset}-package.tar.gz")
    return row_from_report(preset, report, package=str(path), seconds=time.perf_counter() - started)


def archive_package(path: Path, root: Path, archive: Path) -> Path:
    """The verified package as one flat file, ``packages/<org>--<model>/<revision>/<variant>/...`` inside: a
    machine that brings back only shallow files (the team's H200) still returns it, and ``tar -xzf`` in the
    repository root puts it where `megabake registry build` finds it."""
    import tarfile

    path, root = Path(path), Path(root)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(path, arcname=str(Path("packages") / path.relative_to(root)))
    return archive


def stand_in_preset(preset: str, args) -> Row:
    """Eager HF on the GPU in place of the megakernel: exercises numerics + timings + assembly."""
    import torch

    from megabake.presets import get_preset
    from megabake.verification.api import verify_decoder
    from megabake.verification.doubles import EagerDecoder

    started = time.perf_counter()
    spec = get_preset(preset)
    model = spec.build_model(dtype=torch.bfloat16).to("cuda")
    decoder = EagerDecoder(model, capacity=args.capacity, exact=False)
    report = verify_decoder(decoder, _stand_in_report(spec, args.capacity), steps=args.steps, prefill=args.prefill,
                            samples=args.samples, baselines=args.baselines)
    return row_from_report(preset, report, seconds=time.perf_counter() - started, stand_in=True)


def _stand_in_report(spec, capacity: int) -> dict:
    from megabake.verification.env import environment

    env = environment()
    return {"schema_version": 1, "status": "unverified", "status_reasons": [], "created_at": "2026-01-01T00:00:00Z",
            "model": {"id": spec.model_id, "revision": "random-seed0", "config_hash": spec.config_hash(),
                      "weights": "random", "seed": 0, "preset": spec.name, "architecture": spec.architecture,
                      "dtype": "bfloat16"},
            "bucket": {"mode": "decode", "batch": 1, "capacity": capacity}, "gpu_class": env["gpu_class"],
            "variant": f"decode-b1-c{capacity}-{env['gpu_class']}", "plan": {"hash": "0" * 64},
            "toolchain": {"megabake": "stand-in", "python": "-", "torch": "-", "transformers": "-"},
            "kernel": None}


def resumable_report(preset: str, args) -> dict | None:
    """DIR/<preset>-report.json when it holds finished timings made with this run's settings, else None
    (and the reason logged): ``--resume`` must never mix rows measured under different settings."""
    path = args.out / f"{preset}-report.json"
    if not path.exists():
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        LOG.warning("[%s] cannot resume from %s (%s); measuring again", preset, path, exc)
        return None
    wanted = _run_settings(preset, args)
    found = _report_settings(report)
    if found != wanted:
        differing = sorted(k for k in wanted if found.get(k) != wanted[k])
        LOG.warning("[%s] %s was made with other settings (%s); measuring again", preset, path,
                    ", ".join(f"{k}={found.get(k)!r} not {wanted[k]!r}" for k in differing))
        return None
    return report


def _run_settings(preset: str, args) -> dict:
    from megabake.baking import normalized_tiling
    from megabake.verification.env import source_digest

    return {"preset": preset, "compiler": source_digest(), "capacity": args.capacity, "steps": args.steps,
            "prefill": args.prefill, "samples": args.samples, "timed": True, "autotune": bool(args.autotune),
            "tiling": normalized_tiling(args.tiling) if args.tiling else None,
            "attention_preload": bool(args.attention_preload)}


def _report_settings(report: dict) -> dict:
    numerics, timings = report.get("numerics") or {}, report.get("timings") or {}
    kernel = report.get("kernel") or {}
    tiling = kernel.get("tiling") or {}
    return {"preset": (report.get("model") or {}).get("preset"),
            "compiler": (report.get("toolchain") or {}).get("source_sha256"),
            "capacity": (report.get("bucket") or {}).get("capacity"),
            "steps": numerics.get("steps"), "prefill": numerics.get("prefill"),
            "samples": (timings.get("method") or {}).get("samples"), "timed": bool(timings.get("candidates")),
            "autotune": bool(kernel.get("autotune")), "tiling": tiling.get("spec"),
            "attention_preload": bool(tiling.get("attention_preload"))}


def run(args) -> list[Row]:
    rows = []
    for preset in args.presets:
        LOG.info("=== %s ===", preset)
        started = time.perf_counter()
        report = resumable_report(preset, args) if args.resume and not args.stand_in else None
        if report is not None:
            LOG.info("[%s] resumed from %s", preset, args.out / f"{preset}-report.json")
            rows.append(row_from_report(preset, report))
            continue
        try:
            row = stand_in_preset(preset, args) if args.stand_in else verify_preset(preset, args)
        except Exception as exc:  # keep going: one broken preset must not cost the others' GPU time
            LOG.error("[%s] failed: %s\n%s", preset, exc, traceback.format_exc())
            row = Row(preset, status="error", reasons=[f"{type(exc).__name__}: {exc}"],
                      seconds=time.perf_counter() - started, stand_in=args.stand_in)
        LOG.info("[%s] %s in %.0f s: %s", preset, row.status, row.seconds, "; ".join(row.reasons[:3]))
        rows.append(row)
        write_outputs(rows, args.out)  # a run cut short still leaves the finished presets' table
        _free_gpu()
    return rows


def _free_gpu() -> None:
    import gc

    gc.collect()
    try:
        import torch

        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def write_outputs(rows: list[Row], out: Path) -> str:
    (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    table = markdown_table(rows)
    (out / "decode.md").write_text(table)
    skipped = write_chart(rows, out / "decode.png")
    if skipped:
        LOG.warning(skipped)
        table += f"\n({skipped})\n"
    return table


# Every preset that bakes a real model shape without an experimental opt-in (the tiny ones are seconds-long
# offline checks, not models; Gemma 3's per-layer rotary tables wait for their H200 run).
# every model-sized preset that bakes without an opt-in, in the presets' order (a new family's preset joins the
# benchmark by being added to megabake.presets, nothing else)
DEFAULT_PRESETS = tuple(name for name, preset in PRESETS.items()
                        if not name.startswith("tiny-") and not preset.experimental)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS),
                        help=f"built-in presets to bake and verify (default: {' '.join(DEFAULT_PRESETS)})")
    parser.add_argument("--out", type=Path, required=True, help="folder for logs, packages, table and chart")
    parser.add_argument("--capacity", type=int, default=None,
                        help="KV capacity of the baked bucket (default 128; with --positions: the smallest power of "
                        "two, at least 128, that holds the largest position and the timed steps)")
    parser.add_argument("--steps", default=64, help="numerics decode steps (an int or 'max')")
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--baselines", nargs="+", default=None,
                        help="baselines to time (default: inductor-reduce-overhead inductor-graph; also "
                        "inductor-default-graph: Inductor's default mode, no autotuning, in a hand-captured graph; "
                        "eager); speedups are against the fastest")
    parser.add_argument("--from-results", type=Path, default=None, help="re-render from a results.json")
    parser.add_argument("--resume", action="store_true", help="take a preset's row from OUT/<preset>-report.json "
                        "when it was made with the same settings; run only the others")
    parser.add_argument("--stand-in", action="store_true", help="time eager HF instead of a baked megakernel")
    parser.add_argument("--autotune", action="store_true", help="bake with `--autotune` (per-stage GEMV tiling "
                        "measured on this GPU)")
    parser.add_argument("--tiling", default=None, help="bake with `--tiling SPEC` (e.g. 2x4+spread+preload+ring4, "
                        "balanced:2x4+ring4)")
    parser.add_argument("--attention-preload", action="store_true", help="bake with `--attention-preload`")
    parser.add_argument("--positions", nargs="+", type=int, default=None,
                        help="context axis: time each preset at these KV positions (e.g. 16 1000 4000)")
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="batch axis (e.g. 1 4 8)")
    parser.add_argument("--numerics-steps", type=int, default=64,
                        help="matrix mode: decode steps of the numerics check at the longest context")
    args = parser.parse_args(argv)
    if args.positions or args.batches:
        args.positions = args.positions or [16]
        args.batches = args.batches or [1]
        if min(args.positions) < 1 or min(args.batches) < 1:
            parser.error("--positions and --batches take positive integers")
        if args.capacity is not None:
            from benchmarks.matrix import TIMED_STEPS

            need = max(args.positions) + TIMED_STEPS + 1
            if args.capacity < need:
                parser.error(f"--capacity {args.capacity} cannot hold position {max(args.positions)} and the "
                             f"{TIMED_STEPS} timed steps after it: use --capacity {need} or more, or drop --capacity "
                             "to bake the smallest bucket that fits")
    elif args.capacity is None:
        args.capacity = 128
    if args.capacity is not None and args.capacity < 1:
        parser.error("--capacity takes a positive integer")
    if args.autotune and (args.tiling or args.attention_preload):
        parser.error("--autotune chooses the GEMV tiling and attention preload itself; drop --tiling / "
                     "--attention-preload, or drop --autotune")
    if args.tiling:
        from megabake.baking import normalized_tiling
        from megabake.errors import PlanError

        try:
            normalized_tiling(args.tiling)
        except PlanError as exc:  # a typo must not cost a GPU run
            parser.error(str(exc))
    from megabake.verification.commands import KNOWN_BASELINES

    unknown_baselines = [name for name in args.baselines or () if name not in KNOWN_BASELINES]
    if unknown_baselines:  # a typo must not cost a GPU run either
        parser.error(f"unknown baseline(s) {', '.join(unknown_baselines)}; known: {', '.join(KNOWN_BASELINES)}")
    unknown = [name for name in args.presets if not is_preset(name)]
    if unknown:
        parser.error(f"unknown preset(s) {', '.join(unknown)}; built-in presets: {', '.join(PRESETS)}")
    if args.steps != "max":
        args.steps = int(args.steps)
    return args


def setup_logging(out: Path) -> list[logging.Handler]:
    """Log everything to OUT/decode.log and warnings to stderr; returns the handlers to remove after."""
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "decode.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    root.addHandler(console)
    return [handler, console]


def main(argv=None) -> int:
    args = parse_args(argv)
    handlers = setup_logging(args.out)
    try:
        if args.positions:
            from benchmarks.matrix import run_matrix, write_matrix

            cells = run_matrix(args)
            print(write_matrix(cells, args.out))
            return 0 if cells and all(c.status == "measured" for c in cells) else 1
        if args.from_results:
            rows = [Row(**r) for r in json.loads(args.from_results.read_text())]
        else:
            rows = run(args)
        table = write_outputs(rows, args.out)
    finally:
        for handler in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()
    print(table)
    return 0 if rows and all(r.status == "verified" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
