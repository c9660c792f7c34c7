"""Merge verification evidence into a package report and decide its status.

Contract: ``assemble_report(report, *, numerics, timings, environment, toolchain, verified_at=None)`` is
pure: it returns a new report dict (the input is not modified) with ``numerics``, ``timings``,
``environment`` (plus ``verified_at``) and ``toolchain`` replaced, and ``status`` / ``status_reasons`` set
by ``decide_status``. ``validated(report)`` checks it against ``schemas/report.schema.json``.

Status rule: ``failed`` when numerics did not run or did not pass (each numerics failure becomes a reason
naming the step and the metric), when the megakernel was not timed, when fewer than ``MIN_SAMPLES``
samples were taken, when no baseline could be timed, or when the GPU class verified on differs from the
package's; otherwise ``verified``. The reasons of a verified report summarise the evidence (numerics level,
speedup with its interval, floor). ``summary_lines(report)`` renders the evidence as a few text lines.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .timing import MIN_SAMPLES

MAX_REASONS = 20


@dataclass(frozen=True)
class Verdict:
    status: str  # "verified" | "failed"
    reasons: list[str] = field(default_factory=list)


def utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _numerics_problems(numerics: dict | None) -> list[str]:
    if not numerics:
        return ["numerics: not run"]
    if numerics.get("pass"):
        return []
    failures = numerics.get("failures") or ["numerics did not pass (no failure recorded)"]
    shown = [f"numerics: {f}" for f in failures[:MAX_REASONS]]
    if len(failures) > MAX_REASONS:
        shown.append(f"numerics: ... and {len(failures) - MAX_REASONS} more failures (see numerics.failures)")
    return shown


def _timing_problems(timings: dict | None, min_samples: int) -> list[str]:
    if not timings:
        return ["timings: not run"]
    problems = []
    candidates = timings.get("candidates") or {}
    megabake = next((c for c in candidates.values() if c.get("kind") == "megabake"), None)
    if megabake is None or not megabake.get("sync_call"):
        error = (megabake or {}).get("error")
        problems.append(f"timings: the megakernel was not timed{f' ({error})' if error else ''}")
    for name, cand in candidates.items():
        measured = cand.get("sync_call")
        if measured and len(measured.get("samples", [])) < min_samples:
            problems.append(f"timings: {name} has {len(measured['samples'])} samples per measure, "
                            f"< {min_samples} required")
    if not timings.get("baseline"):
        errors = [f"{n}: {c.get('error')}" for n, c in candidates.items() if c.get("kind") == "baseline"]
        problems.append("timings: no baseline could be timed" + (f" ({'; '.join(errors)})" if errors else ""))
    return problems


def _environment_problems(report: dict, environment: dict | None) -> list[str]:
    if environment and environment.get("gpu_class") and environment["gpu_class"] != report.get("gpu_class"):
        return [f"environment: package is for {report.get('gpu_class')} but ran on {environment['gpu_class']} "
                f"({environment.get('gpu_name')})"]
    return []


def _top1_evidence(summary: dict) -> str:
    """Top-1 agreement as the pass rule reads it (over the decisive steps, where bf16 can resolve the
    top-1), then the raw figure over every step, which on random weights mostly counts near-ties."""
    every_step = _fmt(summary.get("top1_agreement"))
    if summary.get("top1_agreement_decisive") is None:
        return f"top-1 agreement {every_step}"
    return (f"top-1 agreement {_fmt(summary['top1_agreement_decisive'])} over the "
            f"{summary.get('decisive_steps')} decisive steps ({every_step} over all steps)")


def _evidence(numerics: dict | None, timings: dict | None) -> list[str]:
    lines = []
    if numerics:
        s = numerics.get("summary", {})
        lines.append(f"numerics: {numerics.get('steps')} steps after a {numerics.get('prefill')}-token prefill, "
                     f"max rel-L2 vs fp32 {_fmt(s.get('max_rel_l2_vs_fp32'))} (eager bf16 "
                     f"{_fmt(s.get('max_rel_l2_bf16_vs_fp32'))}), {_top1_evidence(s)}")
    if timings and timings.get("speedup") and timings.get("baseline"):
        sp, base = timings["speedup"], timings["baseline"]
        mk = next(c for c in timings["candidates"].values() if c.get("kind") == "megabake")
        lo, hi = sp.get("ci95", [None, None])
        lines.append(f"timings: {sp['median']:.2f}x vs {base} (95% CI {_fmt(lo)}-{_fmt(hi)}), megakernel "
                     f"{mk['sync_call']['median']:.4g} ms vs {timings['candidates'][base]['sync_call']['median']:.4g}"
                     f" ms per synchronized call, weight-streaming floor {_fmt(timings.get('floor_ms'))} ms")
        if hi is not None and hi < 1.0:
            lines.append(f"timings: the megakernel is slower than {base}")
    return lines


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def decide_status(report: dict, numerics: dict | None, timings: dict | None, environment: dict | None, *,
                  min_samples: int = MIN_SAMPLES) -> Verdict:
    problems = (_numerics_problems(numerics) + _timing_problems(timings, min_samples)
                + _environment_problems(report, environment))
    if problems:
        return Verdict("failed", problems)
    return Verdict("verified", _evidence(numerics, timings))


def assemble_report(report: dict, *, numerics: dict | None, timings: dict | None, environment: dict | None,
                    toolchain: dict | None = None, verified_at: str | None = None,
                    min_samples: int = MIN_SAMPLES) -> dict:
    """A new report with the evidence merged in and the status decided (module doc)."""
    new = copy.deepcopy(report)
    new["numerics"] = copy.deepcopy(numerics)
    new["timings"] = copy.deepcopy(timings)
    if environment is not None:
        new["environment"] = dict(environment, verified_at=verified_at or utc_now())
    if toolchain is not None:
        new["toolchain"] = dict(toolchain)
    verdict = decide_status(report, numerics, timings, environment, min_samples=min_samples)
    new["status"], new["status_reasons"] = verdict.status, list(verdict.reasons)
    return new


def validated(report: dict) -> dict:
    from megabake.package import validate

    return validate("report", report)


def summary_lines(report: dict) -> list[str]:
    """A few lines for a terminal: status, reasons, one row per timed candidate."""
    lines = [f"status: {report.get('status')}"] + [f"  - {r}" for r in report.get("status_reasons", [])]
    timings = report.get("timings") or {}
    rows = []
    for name, cand in (timings.get("candidates") or {}).items():
        cells = [name]
        for metric in ("sync_call", "pipelined", "gpu_event"):
            m = cand.get(metric)
            cells.append(f"{m['median']:.4g} [{m['ci95'][0]:.4g}, {m['ci95'][1]:.4g}]" if m else "-")
        cells.append({True: "yes", False: "NO"}.get(cand.get("graph_replays"), "?"))
        rows.append(cells)
    if rows:
        header = ["candidate", "sync ms [95% CI]", "pipelined ms", "gpu-event ms", "graph"]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        for row in [header] + rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        lines.append(f"floor {_fmt(timings.get('floor_ms'))} ms ({_fmt(timings.get('copy_bandwidth_GBps'))} GB/s "
                     f"copy), baseline {timings.get('baseline')}")
    lines += [f"  warning: {w}" for w in timings.get("warnings") or []]
    return lines
