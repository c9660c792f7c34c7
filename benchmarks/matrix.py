"""The context x batch matrix of ``benchmarks/decode.py --positions ... --batches ...``.

Contract: ``run_matrix(args) -> list[Cell]``. For each preset and batch: one bake on this GPU (bucket capacity
= the smallest power of two holding the largest position plus the timed steps, capped by the model's
``max_position_embeddings``; or ``--capacity`` where given), numerics at the longest context (``run_numerics``
after a prefill there: the megakernel must stay as close to fp32 as eager bf16), then for each position
``run_timings`` with the prompt prefilled up to that position: the megakernel against the graphed Inductor
baselines built in the same process, paired alternating samples, bootstrap CIs. Every cell's full timings (raw samples included) go to
``DIR/matrix/<preset>-b<batch>-p<position>.json``; ``DIR/matrix.md`` holds the table, ``DIR/matrix.png`` the
chart (latency vs context, one line per system, one panel per preset and batch). A cell that fails is
recorded with its error and the run goes on.

The baked package keeps the evidence: its ``report.json`` gets the numerics at the longest context and the
timings there (``assemble_report``, the same status rule as ``megabake verify``), and it comes back as
``DIR/<preset>-b<batch>-package.tar.gz`` (plus ``DIR/<preset>-b<batch>-report.json``), so ``tar -xzf`` in the
repository root adds a long-context bucket verified on this GPU to ``packages/``.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOG = logging.getLogger("benchmarks.matrix")
TIMED_STEPS = 20  # run_timings' inner calls advance the position this far past the prefill


@dataclass
class Cell:
    """One (preset, batch, position): ms per decode call (the whole batch), medians with 95% CIs."""

    preset: str
    batch: int
    position: int
    capacity: int = 0
    status: str = "error"  # measured | failed-numerics | error
    megabake_ms: float | None = None
    megabake_ci: list[float] | None = None
    megabake_gpu_ms: float | None = None
    megabake_block_ms: float | None = None  # median of back-to-back synchronized calls (the harness's block)
    baselines_ms: dict[str, float] = field(default_factory=dict)
    baseline: str | None = None
    speedup: float | None = None
    speedup_ci: list[float] | None = None
    numerics: dict = field(default_factory=dict)  # at the longest position of this (preset, batch)
    error: str | None = None
    seconds: float = 0.0


def bucket_capacity(positions: list[int], max_positions: int | None, requested: int | None = None) -> int:
    """Smallest power of two >= the largest position + the timed steps (at least 128), capped by the model;
    ``requested`` (``--capacity``) instead where given, refused past the model's positions."""
    if requested is not None:
        if max_positions and requested > max_positions:
            raise ValueError(f"--capacity {requested} is past the model's {max_positions} positions "
                             f"(max_position_embeddings): use --capacity {max_positions} or less")
        return requested
    need = max(positions) + TIMED_STEPS + 1
    capacity = 128
    while capacity < need:
        capacity *= 2
    return min(capacity, max_positions) if max_positions else capacity


def fitting_positions(positions: list[int], capacity: int) -> list[int]:
    """The positions that leave room for the timed steps in ``capacity`` (a too-large one becomes the last
    that fits, so a 2048-position model still gets a point near its limit)."""
    last = capacity - TIMED_STEPS - 1
    return sorted({min(p, last) for p in positions})


def run_matrix(args) -> list[Cell]:
    cells: list[Cell] = []
    for preset in args.presets:
        for batch in args.batches:
            cells += _preset_batch(preset, batch, args)
            write_matrix(cells, args.out)
    return cells


def _preset_batch(preset: str, batch: int, args) -> list[Cell]:
    from megabake.presets import get_preset

    max_positions = get_preset(preset).config.get("max_position_embeddings")
    try:
        capacity = bucket_capacity(args.positions, max_positions, args.capacity)
    except ValueError as exc:  # this preset cannot take the requested bucket; the others still run
        LOG.error("[%s b%d] %s", preset, batch, exc)
        return [Cell(preset, batch, p, args.capacity, error=f"ValueError: {exc}") for p in args.positions]
    positions = fitting_positions(args.positions, capacity)
    started = time.perf_counter()
    try:
        package_path, decoder = _bake_decoder(preset, batch, capacity, args)
        LOG.info("[%s b%d] numerics at position %d (%d steps) ...", preset, batch, positions[-1], args.numerics_steps)
        numerics_started = time.perf_counter()
        numerics_result = _numerics_at(decoder, positions[-1], args.numerics_steps)
        numerics = _numerics_summary(numerics_result)
        LOG.info("[%s b%d] numerics: %s in %.1f s", preset, batch, "pass" if numerics["pass"] else "FAIL",
                 time.perf_counter() - numerics_started)
    except Exception as exc:  # a bucket that does not bake (e.g. shared memory) fails its cells, not the run
        LOG.error("[%s b%d] bake failed: %s\n%s", preset, batch, exc, traceback.format_exc())
        return [Cell(preset, batch, p, capacity, error=f"{type(exc).__name__}: {exc}") for p in positions]
    cells = []
    timings = None
    for position in positions:
        cell = Cell(preset, batch, position, capacity, numerics=numerics)
        try:
            LOG.info("[%s b%d p%d] time MegaBake and %s ...", preset, batch, position,
                     ", ".join(args.baselines or ["the default baselines"]))
            timings = _timed(decoder, position, args)
            _fill(cell, timings)
            cell.status = "measured" if numerics.get("pass") else "failed-numerics"
            (args.out / "matrix").mkdir(parents=True, exist_ok=True)
            (args.out / "matrix" / f"{preset}-b{batch}-p{position}.json").write_text(json.dumps(timings, indent=1))
        except Exception as exc:
            LOG.error("[%s b%d p%d] failed: %s\n%s", preset, batch, position, exc, traceback.format_exc())
            cell.error = f"{type(exc).__name__}: {exc}"
        cell.seconds = time.perf_counter() - started
        LOG.info("[%s b%d p%d] %s: megabake %s ms, %s %s ms, speedup %s", preset, batch, position, cell.status,
                 cell.megabake_ms, cell.baseline, cell.baselines_ms.get(cell.baseline or ""), cell.speedup)
        cells.append(cell)
    if cells and cells[-1].error is None and timings is not None:  # the longest context was timed
        _record_evidence(package_path, numerics_result, timings, args.out, f"{preset}-b{batch}")
    del decoder
    _free()
    return cells


def _bake_decoder(preset: str, batch: int, capacity: int, args):
    """(package folder, MegakernelDecoder on cuda) of a fresh bake under ``args.out/packages``, with the run's
    ``--tiling`` / ``--attention-preload``, or ``--autotune``: each bucket's GEMV tilings timed on that bucket (the
    bake then also runs its own numerics and latency check on the GPU, as ``megabake bake --autotune`` does)."""
    from megabake.baking import bake
    from megabake.runtime import MegakernelDecoder

    autotune = bool(getattr(args, "autotune", False))
    baked = bake(preset, batch=batch, capacity=capacity, out=args.out / "packages", reference_steps=1,
                 run_on_gpu=autotune, autotune=autotune, tiling=getattr(args, "tiling", None),
                 attention_preload=getattr(args, "attention_preload", False),
                 progress=lambda msg: LOG.info("[bake %s b%d c%d] %s", preset, batch, capacity, msg))
    return baked.path, MegakernelDecoder.from_package(baked.path, model=baked.model, device="cuda")


def _numerics_at(decoder, position: int, steps: int) -> dict:
    """run_numerics' whole result after a prefill up to ``position`` (less where the steps would not fit)."""
    from megabake.verification import run_numerics

    prefill = max(1, min(position, decoder.capacity - steps))
    return run_numerics(decoder, prefill=prefill, steps=steps)


def _numerics_summary(result: dict) -> dict:
    summary = result.get("summary") or {}
    return {"pass": bool(result.get("pass")), "prefill": result.get("prefill"), "steps": result.get("steps"),
            "max_rel_l2_vs_fp32": summary.get("max_rel_l2_vs_fp32"),
            "max_rel_l2_bf16_vs_fp32": summary.get("max_rel_l2_bf16_vs_fp32"),
            "failures": result.get("failures", [])[:3]}


def _record_evidence(package_path: Path, numerics: dict, timings: dict, out: Path, name: str,
                     env: dict | None = None) -> dict:
    """Write the numerics and the longest context's timings into the package's report.json (status decided as
    `megabake verify` decides it), keep a flat copy of the report and the package as one archive in ``out``."""
    from benchmarks.decode import archive_package
    from megabake.package import read_package, update_report
    from megabake.verification.env import environment, toolchain
    from megabake.verification.report import assemble_report, validated

    package = read_package(package_path)
    report = validated(assemble_report(package.report, numerics=numerics, timings=timings,
                                       environment=env or environment(), toolchain=toolchain()))
    update_report(package_path, report)
    (out / f"{name}-report.json").write_text(json.dumps(report, indent=1) + "\n")
    archive_package(package_path, out / "packages", out / f"{name}-package.tar.gz")
    LOG.info("[%s] report %s: %s", name, report["status"], "; ".join(report["status_reasons"][:3]))
    return report


def _timed(decoder, position: int, args) -> dict:
    from megabake.verification.timing import run_timings

    return run_timings(decoder, samples=args.samples, baselines=args.baselines, prefill=max(1, position),
                       inner=TIMED_STEPS)


def _fill(cell: Cell, timings: dict) -> None:
    candidates = timings.get("candidates") or {}
    mk = next((c for c in candidates.values() if c.get("kind") == "megabake"), {})
    cell.megabake_ms = (mk.get("sync_call") or {}).get("median")
    cell.megabake_ci = (mk.get("sync_call") or {}).get("ci95")
    cell.megabake_gpu_ms = (mk.get("gpu_event") or {}).get("median")
    cell.megabake_block_ms = (mk.get("sync_call_block") or {}).get("median")
    cell.baselines_ms = {name: c["sync_call"]["median"] for name, c in candidates.items()
                         if c.get("kind") == "baseline" and c.get("sync_call")}
    cell.baseline = timings.get("baseline")
    speedup = timings.get("speedup") or {}
    cell.speedup, cell.speedup_ci = speedup.get("median"), speedup.get("ci95")


def _free() -> None:
    import gc

    import torch

    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def matrix_table(cells: list[Cell]) -> str:
    names = sorted({name for cell in cells for name in cell.baselines_ms})
    header = (["preset", "batch", "position", "status", "MegaBake ms [95% CI]", "MegaBake GPU ms"]
              + [f"{n} ms" for n in names] + ["speedup [95% CI]", "numerics at the longest context"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in cells:
        ci = f" [{c.megabake_ci[0]:.3f}, {c.megabake_ci[1]:.3f}]" if c.megabake_ci else ""
        speed = "-" if c.speedup is None else f"{c.speedup:.2f}x" + (
            f" [{c.speedup_ci[0]:.2f}, {c.speedup_ci[1]:.2f}]" if c.speedup_ci else "")
        n = c.numerics
        numerics = (f"{'pass' if n.get('pass') else 'FAIL'}: rel-L2 {n.get('max_rel_l2_vs_fp32', 0):.4f} vs eager "
                    f"{n.get('max_rel_l2_bf16_vs_fp32', 0):.4f} (prefill {n.get('prefill')})" if n else "-")
        cells_ = ([c.preset, str(c.batch), str(c.position), c.status if not c.error else f"error: {c.error[:80]}",
                   _ms(c.megabake_ms) + ci, _ms(c.megabake_gpu_ms)] + [_ms(c.baselines_ms.get(x)) for x in names]
                  + [speed, numerics])
        lines.append("| " + " | ".join(cells_) + " |")
    lines.append("")
    lines.append("ms = median of synchronized complete decode calls (host + GPU) for the whole batch; GPU ms = "
                 "CUDA-event time of the megakernel; speedup = paired ratio to the fastest baseline.")
    return "\n".join(lines) + "\n"


def write_matrix(cells: list[Cell], out: Path) -> str:
    (out / "matrix.json").write_text(json.dumps([asdict(c) for c in cells], indent=1) + "\n")
    table = matrix_table(cells)
    (out / "matrix.md").write_text(table)
    skipped = matrix_chart(cells, out / "matrix.png")
    return table + (f"\n({skipped})\n" if skipped else "")


def matrix_chart(cells: list[Cell], path: Path) -> str | None:
    """Latency vs context: one panel per (preset, batch), one line per system; returns why skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: chart skipped"
    panels = list(dict.fromkeys((c.preset, c.batch) for c in cells if c.megabake_ms is not None))
    if not panels:
        return "no measured cell: chart skipped"
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.6), squeeze=False)
    for ax, (preset, batch) in zip(axes[0], panels):
        mine = [c for c in cells if (c.preset, c.batch) == (preset, batch) and c.megabake_ms is not None]
        systems = ["MegaBake"] + sorted({n for c in mine for n in c.baselines_ms})
        for name in systems:
            points = [(c.position, c.megabake_ms if name == "MegaBake" else c.baselines_ms.get(name)) for c in mine]
            points = [(x, y) for x, y in points if y is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
        ax.set_title(f"{preset}, batch {batch}", fontsize=9)
        ax.set_xlabel("context position")
        ax.set_ylabel("ms per decode call")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
