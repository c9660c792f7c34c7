"""Registry build: ``registry/index.json`` plus the static decode leaderboard ``registry/leaderboard.html``.

Contract:

* ``build_registry(packages_root, out_dir, hub_repo=None)`` reads every package under ``packages_root`` with
  :func:`megabake.package.read_package` (digests and schemas checked; a broken package raises
  :class:`megabake.package.PackageError`), writes the index made by :func:`megabake.package.build_index`
  (validated against ``schemas/registry-index.schema.json`` by :func:`megabake.package.write_index`) to
  ``out_dir/index.json`` and the leaderboard to ``out_dir/leaderboard.html``, and returns a :class:`BuildResult`.
  With ``hub_repo``, only packages that ``megabake publish`` accepts by default (verified, pretrained weights)
  keep the Hub repo and tag in the index and get a Hub link; the others are marked as not on the Hub.
* ``leaderboard_rows(packages, index, out_dir)`` -> one :class:`Row` per package; ``render_leaderboard(rows)`` ->
  the page as a string. The page is one self-contained HTML file: inline CSS, no script, no external resource
  (only plain hyperlinks). Per model: one row per package with MegaBake and graphed-Inductor ms/token (median
  and 95% CI, the measure named by the index's ``timing_measure``), speedup (median and CI), GPU class, bucket,
  status, and relative links to the package's report.json and source_map.json (plus the Hub folder when the
  index names a Hub repo).
* Numbers are shown only for a package whose report says ``status: verified`` and holds those timings. Every
  other row says ``not verified: <reason>`` (the report's ``status_reasons``, or what is missing) in place of
  the numbers; a page with no verified row says so at the top. Nothing is estimated or filled in. Models are
  ranked by their best verified speedup; models without verified numbers come last, alphabetically.
* Each package row carries ``data-*`` attributes (model, revision, variant, status, and the exact numbers
  shown) so tests and tools can read the rendered table back. Output depends only on the inputs (no clock).
* With ``models_table`` (a ``docs/MODELS.md`` written by ``megabake registry models``), the page ends with a
  "Models" section (``<section id="models">``): the same rows as that file (architecture family x status, read
  back from its rows block by :func:`megabake.registry.models.read_table`), one ``<tr class="family-row">`` each
  with ``data-*`` attributes (family, preset, status, numbers). Their report links are re-based onto ``out_dir``.
  The preset rows are recomputed from the packages being indexed; where they differ from the file's, the section
  says the file is stale and what changed (``BuildResult.models_stale``), and still shows the file's rows.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import quote

from megabake.package import Package, build_index, find_packages, read_package, write_index
from megabake.package.registry import iter_entries

INDEX_FILE = "index.json"
LEADERBOARD_FILE = "leaderboard.html"
HUB_URL = "https://huggingface.co"


@dataclass
class Row:
    """One package on the leaderboard. ``verified`` is True only when every number below is present."""

    model_id: str
    revision: str
    variant: str
    batch: int
    capacity: int
    gpu_class: str
    gpu_name: str | None
    status: str
    architecture: str
    weights: str
    seed: int | None
    created_at: str
    verified: bool
    reason: str | None  # why not verified (None when verified)
    measure: str | None = None
    baseline: str | None = None
    baseline_graphed: bool | None = None
    megabake_ms: float | None = None
    megabake_ci: tuple[float, float] | None = None
    baseline_ms: float | None = None
    baseline_ci: tuple[float, float] | None = None
    speedup: float | None = None
    speedup_ci: tuple[float, float] | None = None
    links: dict[str, str] = field(default_factory=dict)  # label -> href (report.json, source_map.json, Hub)


@dataclass
class BuildResult:
    index_path: Path
    leaderboard_path: Path
    index: dict[str, Any]
    rows: list[Row]
    models_table: Path | None = None
    model_rows: list = field(default_factory=list)  # megabake.registry.models.ModelRow, from models_table
    models_stale: list[str] = field(default_factory=list)  # preset rows of models_table that packages/ changed

    @property
    def verified(self) -> int:
        return sum(r.verified for r in self.rows)


# --------------------------------------------------------------------------------------------------- rows


def _ci(measurement: Any) -> tuple[float, float] | None:
    if isinstance(measurement, dict) and isinstance(measurement.get("ci95"), list) and len(measurement["ci95"]) == 2:
        lo, hi = measurement["ci95"]
        return (float(lo), float(hi))
    return None


def _href(target: Path, out_dir: Path) -> str:
    rel = os.path.relpath(target.resolve(), out_dir.resolve())
    return quote(Path(rel).as_posix())


def _not_verified_reason(report: dict[str, Any], missing: list[str]) -> str:
    status = report.get("status", "unverified")
    reasons = [r for r in report.get("status_reasons") or [] if r]
    if status != "verified":
        if reasons:
            return "; ".join(reasons)
        return f"status is {status!r} and the report gives no reason"
    return "report says 'verified' but has no " + ", ".join(missing)


def row_for(package: Package, entry: dict[str, Any], out_dir: Path) -> Row:
    """The leaderboard row of one package and its index entry (made by ``build_index``)."""
    report = package.report
    env = report.get("environment") or {}
    timings = report.get("timings") or {}
    candidates = timings.get("candidates") or {}
    measure = entry.get("timing_measure")
    ours = next((c for c in candidates.values() if c.get("kind") == "megabake"), None) or {}
    base = candidates.get(entry.get("baseline") or "") or {}

    missing = [name for name, value in (("MegaBake timing", entry.get("megabake_ms")),
                                        ("baseline timing", entry.get("baseline_ms")),
                                        ("speedup", entry.get("speedup"))) if value is None]
    verified = report.get("status") == "verified" and not missing

    links = {"report.json": _href(package.path / "report.json", out_dir)}
    if "source_map.json" in package.files:
        links["source_map.json"] = _href(package.path / "source_map.json", out_dir)
    if entry.get("hub_repo"):
        ref = quote(entry["tag"] or "main", safe="")
        links["Hub"] = f"{HUB_URL}/{entry['hub_repo']}/tree/{ref}/{quote(entry['path'])}"

    row = Row(
        model_id=package.model_id, revision=package.model_revision, variant=entry["variant"],
        batch=entry["batch"], capacity=entry["capacity"], gpu_class=entry["gpu_class"],
        gpu_name=env.get("gpu_name"), status=report["status"], architecture=report["model"]["architecture"],
        weights=report["model"]["weights"], seed=report["model"].get("seed"), created_at=report["created_at"],
        verified=verified, reason=None if verified else _not_verified_reason(report, missing), links=links,
    )
    if verified:
        row.measure = measure
        row.baseline = entry.get("baseline")
        row.baseline_graphed = base.get("graph_replays")
        row.megabake_ms = float(entry["megabake_ms"])
        row.baseline_ms = float(entry["baseline_ms"])
        row.speedup = float(entry["speedup"])
        row.megabake_ci = _ci(ours.get(measure))
        row.baseline_ci = _ci(base.get(measure))
        row.speedup_ci = _ci(timings.get("speedup"))
    return row


def leaderboard_rows(packages: Iterable[Package], index: dict[str, Any], out_dir: str | Path) -> list[Row]:
    """Rows for ``packages`` (matched to ``index`` entries by repo path), sorted by model, revision, bucket."""
    out_dir = Path(out_dir)
    by_path = {entry["path"]: entry for _, _, entry in iter_entries(index)}
    rows = []
    for package in packages:
        entry = by_path.get(package.repo_path)
        if entry is None:
            raise ValueError(f"package {package.path} ({package.repo_path}) is missing from the registry index")
        rows.append(row_for(package, entry, out_dir))
    rows.sort(key=lambda r: (r.model_id.lower(), r.revision, r.batch, r.capacity, r.gpu_class))
    return rows


# ------------------------------------------------------------------------------------------------- render

CSS = """
:root { --fg:#1b1f24; --muted:#5b6470; --line:#d6dbe1; --bg:#ffffff; --band:#f4f6f8; --ok:#1a7f37;
        --bad:#b42318; --warn:#9a6700; --accent:#0b5cad; }
* { box-sizing: border-box; }
body { margin: 0; padding: 28px 36px 48px; font: 14px/1.45 "DejaVu Sans", "Liberation Sans", Arial, sans-serif;
       color: var(--fg); background: var(--bg); }
header { border-bottom: 3px solid var(--accent); margin-bottom: 20px; padding-bottom: 10px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 28px 0 6px; }
.sub, .meta { color: var(--muted); }
.meta { font-size: 13px; margin: 0 0 8px; }
.banner { border: 1px solid var(--warn); background: #fff8e1; padding: 10px 14px; border-radius: 6px;
          margin: 12px 0; }
table { border-collapse: collapse; width: 100%; margin-top: 6px; table-layout: fixed; }
th, td { border-bottom: 1px solid var(--line); padding: 7px 10px; text-align: left; vertical-align: top; }
th { background: var(--band); font-size: 12px; text-transform: uppercase; letter-spacing: .03em; color: var(--muted); }
td.bucket, td.gpu code { white-space: nowrap; }
td { overflow-wrap: anywhere; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.num .ci { display: block; color: var(--muted); font-size: 12px; }
td.speedup { font-weight: bold; }
td.not-verified { color: var(--bad); font-style: italic; }
code { font: 12px "DejaVu Sans Mono", monospace; }
.status { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: bold;
          color: #fff; background: var(--muted); }
.status-verified { background: var(--ok); }
.status-failed { background: var(--bad); }
.status-fallback { background: var(--warn); }
.status-bakes-cpu { background: var(--accent); }
.status-refused, .status-error { background: var(--bad); }
.status-no-package { background: var(--muted); }
table.models td.details { font-size: 13px; }
table.models tr.cpu-try td.preset { color: var(--muted); font-style: italic; }
a { color: var(--accent); }
.links a { margin-right: 8px; white-space: nowrap; }
footer { margin-top: 32px; color: var(--muted); font-size: 12px; border-top: 1px solid var(--line); padding-top: 8px; }
"""

# Same column widths in every model's table, so the page reads as one leaderboard.
COLGROUP = ("<colgroup>" + "".join(f'<col style="width:{w}%">' for w in (11, 10, 11, 8, 13, 14, 13, 20))
            + "</colgroup>")

MEASURE_TEXT = {
    "sync_call": "synchronized decode call (launch to result on the host)",
    "pipelined": "back-to-back decode calls (pipelined, per token)",
    "gpu_event": "GPU time between CUDA events",
}


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _ms(value: float) -> str:
    """Milliseconds with at least three significant digits (0.0812 -> 0.0812, 2.05 -> 2.050)."""
    return f"{value:.4f}" if value < 0.1 else f"{value:.3f}"


def _ci_text(ci: tuple[float, float] | None, fmt) -> str:
    if ci is None:
        return '<span class="ci">CI not recorded</span>'
    return f'<span class="ci">95% CI {fmt(ci[0])}–{fmt(ci[1])}</span>'


def _attrs(row: Row) -> str:
    attrs = {"model": row.model_id, "revision": row.revision, "variant": row.variant, "status": row.status,
             "gpu-class": row.gpu_class, "batch": row.batch, "capacity": row.capacity,
             "verified": "true" if row.verified else "false"}
    if row.verified:
        attrs.update({"measure": row.measure, "megabake-ms": repr(row.megabake_ms),
                      "baseline-ms": repr(row.baseline_ms), "speedup": repr(row.speedup)})
    return " ".join(f'data-{k}="{_e(v)}"' for k, v in attrs.items() if v is not None)


def _row_html(row: Row) -> str:
    rev_short = row.revision if row.revision.startswith("random-seed") else row.revision[:12]
    gpu = f"<code>{_e(row.gpu_class)}</code>"
    if row.gpu_name:
        gpu += f'<br><span class="sub">{_e(row.gpu_name)}</span>'
    cells = [
        f'<td class="revision"><code title="{_e(row.revision)}">{_e(rev_short)}</code></td>',
        f'<td class="bucket">batch {row.batch} · KV {row.capacity}</td>',
        f'<td class="gpu">{gpu}</td>',
        f'<td class="status-cell"><span class="status status-{_e(row.status)}">{_e(row.status)}</span></td>',
    ]
    if row.verified:
        base_title = f"{row.baseline} ({'CUDA-graphed' if row.baseline_graphed else 'graph replay not recorded'})"
        cells += [
            f'<td class="num megabake-ms">{_ms(row.megabake_ms)} ms{_ci_text(row.megabake_ci, _ms)}</td>',
            f'<td class="num baseline-ms" title="{_e(base_title)}">{_ms(row.baseline_ms)} ms'
            f'{" (not CUDA-graphed)" if row.baseline_graphed is False else ""}{_ci_text(row.baseline_ci, _ms)}</td>',
            f'<td class="num speedup">{row.speedup:.2f}×{_ci_text(row.speedup_ci, lambda v: f"{v:.2f}×")}</td>',
        ]
    else:
        cells.append(f'<td class="not-verified" colspan="3">not verified: {_e(row.reason)}</td>')
    links = " ".join(f'<a href="{_e(href)}">{_e(label)}</a>' for label, href in row.links.items())
    if "source_map.json" not in row.links:
        links += ' <span class="sub">(no source_map.json)</span>'
    cells.append(f'<td class="links">{links}</td>')
    return f'<tr class="package" {_attrs(row)}>' + "".join(cells) + "</tr>"


def _model_section(model_id: str, rows: list[Row]) -> str:
    first = rows[0]
    weights = "random weights" + (f" (seed {first.seed})" if first.seed is not None else "") \
        if first.weights == "random" else "pretrained weights"
    verified = [r for r in rows if r.verified]
    if verified:
        best = max(verified, key=lambda r: r.speedup)
        verdict = (f"best verified speedup {best.speedup:.2f}× over {_e(best.baseline)} "
                   f"({_e(best.variant)})")
    else:
        verdict = "not verified: no package of this model has verified numbers"
    head = ("<tr><th>Revision</th><th>Bucket</th><th>GPU class</th><th>Status</th>"
            "<th>MegaBake ms/token</th><th>Graphed Inductor ms/token</th><th>Speedup</th><th>Evidence</th></tr>")
    body = "\n".join(_row_html(r) for r in rows)
    return (f'<section class="model" data-model="{_e(model_id)}">\n<h2>{_e(model_id)}</h2>\n'
            f'<p class="meta">{_e(first.architecture)} · {_e(weights)} · {verdict}</p>\n'
            f"<table>\n{COLGROUP}\n<thead>{head}</thead>\n<tbody>\n{body}\n</tbody>\n</table>\n</section>")


# Models section: architecture family x status, the rows of docs/MODELS.md (megabake.registry.models).
MODELS_COLGROUP = ("<colgroup>" + "".join(f'<col style="width:{w}%">' for w in (13, 14, 10, 12, 37, 14))
                   + "</colgroup>")


def _family_row_html(row, href: str | None) -> str:
    attrs = {"family": row.family, "family-key": row.family_key, "architecture": row.architecture,
             "preset": row.preset, "source": row.source, "status": row.status, "bucket": row.bucket or None}
    if row.status == "verified":
        attrs.update({"measure": row.measure, "megabake-ms": repr(row.megabake_ms),
                      "baseline-ms": repr(row.baseline_ms), "speedup": repr(row.speedup)})
    if row.error_class:
        attrs["error-class"] = row.error_class
    data = " ".join(f'data-{k}="{_e(v)}"' for k, v in attrs.items() if v is not None)
    preset = f"<code>{_e(row.preset)}</code>" if row.preset else "tiny config"
    evidence = f'<a href="{_e(href)}">report.json</a>' if href else _e(row.evidence)
    details_class = "details not-verified" if row.status in ("refused", "error", "failed") else "details"
    return (f'<tr class="family-row {_e(row.source)}" {data}>'
            f'<td class="family">{_e(row.family)}</td>'
            f'<td class="architecture"><code>{_e(row.architecture)}</code></td>'
            f'<td class="preset">{preset}</td>'
            f'<td class="status-cell"><span class="status status-{_e(row.status)}">{_e(row.label)}</span></td>'
            f'<td class="{details_class}">{_e(row.details)}</td>'
            f'<td class="evidence">{evidence}</td></tr>')


def _models_table_section(rows: list, source: str, links: dict, stale: list[str]) -> str:
    head = ("<tr><th>Family</th><th>HF class</th><th>Preset</th><th>Status</th><th>Details</th>"
            "<th>Evidence</th></tr>")
    body = "\n".join(_family_row_html(r, links.get(r.key)) for r in rows)
    parts = ['<section class="models" id="models">', "<h2>Models</h2>",
             f'<p class="meta">Architecture families and built-in presets × status, the rows of '
             f"<code>{_e(source)}</code> (generated by <code>megabake registry models</code>): presets from the "
             "newest report of their packages, families from a CPU try of a tiny config (capture → IR → plan → "
             "module.py). A refusal is the compiler's own error.</p>"]
    if stale:
        parts.append(f'<div class="banner" id="models-stale">{_e(source)} is stale: the packages indexed here '
                     f"differ from it ({_e('; '.join(stale))}). Regenerate it with "
                     "<code>megabake registry models</code>.</div>")
    if not rows:
        parts.append(f'<div class="banner" id="models-empty">{_e(source)} lists no rows.</div>')
    parts.append(f'<table class="models">\n{MODELS_COLGROUP}\n<thead>{head}</thead>\n<tbody>\n{body}\n'
                 "</tbody>\n</table>\n</section>")
    return "\n".join(parts)


def render_leaderboard(rows: list[Row], title: str = "MegaBake decode leaderboard",
                       source: str = "packages/", model_rows: list | None = None,
                       models_source: str = "docs/MODELS.md", model_links: dict | None = None,
                       models_stale: list[str] | None = None) -> str:
    """The whole page (see the module docstring); ``source`` names where the packages were read from.

    ``model_rows`` (``ModelRow``s, e.g. from ``docs/MODELS.md``) adds the Models section; ``model_links`` maps a
    row's ``key`` to its report href on this page; ``models_stale`` lists what makes the table stale."""
    models: dict[str, list[Row]] = {}
    for row in rows:
        models.setdefault(row.model_id, []).append(row)
    n_verified = sum(r.verified for r in rows)
    measures = sorted({r.measure for r in rows if r.verified and r.measure})
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{CSS}</style>",
        "</head>",
        "<body>",
        f"<header><h1>{_e(title)}</h1>"
        '<div class="sub">Batch-decode latency of MegaBake megakernel packages against CUDA-graphed '
        "Inductor, from each package's report.json.</div></header>",
        f'<p class="meta" id="summary">{len(rows)} package(s) of {len(models)} model(s) read from '
        f"<code>{_e(source)}</code>; {n_verified} verified.</p>",
    ]
    if not rows:
        parts.append(f'<div class="banner" id="no-packages">not verified: no packages found under '
                     f"<code>{_e(source)}</code>, so there are no numbers to show.</div>")
    elif n_verified == 0:
        parts.append('<div class="banner" id="no-verified">not verified: none of these packages has verified '
                     "timings yet (each row says why). Numbers appear once <code>megabake verify</code> has run "
                     "on a Hopper GPU.</div>")
    def rank(model_id: str):
        speedups = [r.speedup for r in models[model_id] if r.verified]
        return (0, -max(speedups), model_id.lower()) if speedups else (1, 0.0, model_id.lower())

    for model_id in sorted(models, key=rank):
        parts.append(_model_section(model_id, models[model_id]))
    if model_rows is not None:
        parts.append(_models_table_section(model_rows, models_source, model_links or {}, models_stale or []))
    measure_text = "; ".join(f"<code>{_e(m)}</code>: {_e(MEASURE_TEXT.get(m, m))}" for m in measures)
    newest = max((r.created_at for r in rows), default=None)
    parts.append(
        "<footer>ms/token: median of the timed samples in report.json"
        + (f" ({measure_text})" if measure_text else "")
        + "; 95% CI as recorded by <code>megabake verify</code>. Speedup = graphed Inductor / MegaBake, with its "
        "own CI. Rows without verified numbers say why instead of showing numbers."
        + (f" Newest report: {_e(newest)}." if newest else "")
        + " This page is static: no scripts, nothing loaded from the network.</footer>"
    )
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


# -------------------------------------------------------------------------------------------------- build


def publishable(entry: dict[str, Any]) -> bool:
    """What ``megabake publish`` accepts by default: verified packages of pretrained weights."""
    return entry["status"] == "verified" and entry["weights"] == "pretrained"


def _drop_unpublishable_hub_refs(index: dict[str, Any]) -> None:
    """``build_index(hub_repo=...)`` gives every package a Hub repo and tag; keep them only where
    ``megabake publish`` would have published the package, so the index never points at a missing Hub folder."""
    for _, _, entry in iter_entries(index):
        if not publishable(entry):
            entry["hub_repo"] = None
            entry["tag"] = None


def build_registry(packages_root: str | Path = "packages", out_dir: str | Path = "registry",
                   hub_repo: str | None = None, models_table: str | Path | None = None) -> BuildResult:
    """Write ``out_dir/index.json`` (schema-checked) and ``out_dir/leaderboard.html`` from ``packages_root``;
    with ``models_table`` (a generated ``docs/MODELS.md``) the page gets its Models section."""
    packages_root, out_dir = Path(packages_root), Path(out_dir)
    if not packages_root.is_dir():
        raise FileNotFoundError(f"packages folder {packages_root} does not exist; pass --packages DIR "
                                "(the folder `megabake bake --out` wrote to)")
    index = build_index(packages_root, hub_repo=hub_repo)
    if hub_repo:
        _drop_unpublishable_hub_refs(index)
    packages = [read_package(path) for path in find_packages(packages_root)]
    # read the models table before writing anything, so a bad table leaves out_dir untouched
    models = _models_for_page(Path(models_table), packages_root, packages, out_dir) if models_table else None
    out_dir.mkdir(parents=True, exist_ok=True)
    index_path = write_index(out_dir / INDEX_FILE, index)
    rows = leaderboard_rows(packages, index, out_dir)
    page = render_leaderboard(rows, source=packages_root.as_posix().rstrip("/") + "/",
                              **(models or {}))
    html_path = out_dir / LEADERBOARD_FILE
    tmp = html_path.with_name(f".{html_path.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(html_path)
    return BuildResult(index_path=index_path, leaderboard_path=html_path, index=index, rows=rows,
                       models_table=Path(models_table) if models_table else None,
                       model_rows=(models or {}).get("model_rows", []),
                       models_stale=(models or {}).get("models_stale", []))


def _models_for_page(table: Path, packages_root: Path, packages: list[Package], out_dir: Path) -> dict[str, Any]:
    """The Models section's inputs: the table's rows, their report links re-based onto ``out_dir``, and what
    the packages being indexed change in the table's preset rows."""
    from urllib.parse import unquote

    from megabake.registry.models import FAMILIES, preset_rows, read_table, stale_rows

    stored = read_table(table)
    links = {row.key: _href(table.parent / unquote(row.report), out_dir) for row in stored if row.report}
    fresh = preset_rows(packages_root, table.parent, FAMILIES, packages=packages)
    stale = stale_rows([r for r in stored if r.source != "cpu-try"], fresh, ignore=("family", "family_key"))
    return {"model_rows": stored, "models_source": table.as_posix(), "model_links": links, "models_stale": stale}
