"""Registry index: model id -> model revision -> packages, with headline numbers.

Contract: ``registry_entry(package, hub_repo=None, tag=None)`` summarizes one :class:`Package` (where it lives,
what it fits, its status, and ``megabake_ms`` / ``baseline_ms`` / ``speedup`` from ``report.timings`` or null);
``build_index(packages_root, hub_repo=None)`` indexes every package under a packages root; ``merge_index``
adds or replaces entries (keyed by ``path``); ``read_index`` / ``write_index`` validate against
``schemas/registry-index.schema.json``. All returned dicts are schema-valid.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, Iterator

from megabake.package.layout import package_tag, parse_variant, repo_path
from megabake.package.schema import validate
from megabake.package.store import MANIFEST, Package, dump_json, read_package

MEASURES = ("sync_call", "pipelined", "gpu_event")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def empty_index() -> dict[str, Any]:
    return {"schema_version": 1, "generated_at": utc_now(), "models": {}}


def headline(report: dict[str, Any]) -> dict[str, Any]:
    """megabake_ms / baseline_ms / speedup (+ baseline name and measure) from report.timings, nulls if absent.

    The measure is ``timings.speedup.measure`` when given, else the first of sync_call, pipelined, gpu_event
    that the megabake candidate has; speedup is ``timings.speedup.median`` when given, else baseline / megabake.
    """
    out = {"megabake_ms": None, "baseline_ms": None, "speedup": None, "baseline": None, "timing_measure": None}
    timings = report.get("timings")
    if not timings:
        return out
    candidates = timings["candidates"]
    ours = next((c for c in candidates.values() if c["kind"] == "megabake"), None)
    base_name = timings.get("baseline")
    base = candidates.get(base_name) if base_name else None
    speedup = timings.get("speedup") or {}
    measure = speedup.get("measure") or next((m for m in MEASURES if ours and ours.get(m)), None)
    out["baseline"] = base_name
    out["timing_measure"] = measure
    if measure and ours and ours.get(measure):
        out["megabake_ms"] = ours[measure]["median"]
    if measure and base and base.get(measure):
        out["baseline_ms"] = base[measure]["median"]
    if speedup.get("median") is not None:
        out["speedup"] = speedup["median"]
    elif out["megabake_ms"] and out["baseline_ms"] is not None:
        out["speedup"] = out["baseline_ms"] / out["megabake_ms"]
    return out


def registry_entry(package: Package, hub_repo: str | None = None, tag: str | None = None) -> dict[str, Any]:
    """One index entry for ``package``; ``tag`` defaults to the package's Hub tag when ``hub_repo`` is given."""
    return entry_from_report(package.report, package.manifest_sha256, hub_repo, tag)


def entry_from_report(report: dict[str, Any], manifest_sha256: str, hub_repo: str | None = None,
                      tag: str | None = None) -> dict[str, Any]:
    """Index entry from a (schema-valid) report and the sha256 of its package's manifest.json."""
    model = report["model"]
    variant = parse_variant(report["variant"])
    if hub_repo and tag is None:
        tag = package_tag(model["id"], model["revision"], variant.name)
    return {
        "hub_repo": hub_repo,
        "path": repo_path(model["id"], model["revision"], variant.name),
        "variant": variant.name,
        "mode": variant.mode,
        "batch": variant.batch,
        "capacity": variant.capacity,
        "gpu_class": variant.gpu_class,
        "status": report["status"],
        "weights": model["weights"],
        "architecture": model["architecture"],
        "plan_hash": report["plan"]["hash"],
        "manifest_sha256": manifest_sha256,
        "tag": tag,
        "created_at": report["created_at"],
        **headline(report),
    }


def merge_index(index: dict[str, Any], entries: list[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """A new index: ``index`` plus ``(model_id, model_revision, entry)`` items, replacing same-path entries."""
    merged = json.loads(json.dumps(index))
    for model_id, revision, entry in entries:
        bucket = merged["models"].setdefault(model_id, {}).setdefault(revision, [])
        bucket[:] = [e for e in bucket if e["path"] != entry["path"]] + [entry]
        bucket.sort(key=lambda e: e["path"])
    merged["generated_at"] = utc_now()
    return validate("registry_index", merged, source="registry index")


def find_packages(packages_root: str | Path) -> list[Path]:
    """Every package folder (a folder holding manifest.json) under ``packages_root``, sorted."""
    root = Path(packages_root)
    if (root / MANIFEST).is_file():
        return [root]
    found = (p.parent for p in root.rglob(MANIFEST))
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(root).parts))


def build_index(packages_root: str | Path, hub_repo: str | None = None) -> dict[str, Any]:
    """Index every (verified-on-read) package under ``packages_root``."""
    entries = []
    for path in find_packages(packages_root):
        package = read_package(path)
        entries.append((package.model_id, package.model_revision, registry_entry(package, hub_repo)))
    return merge_index(empty_index(), entries)


def iter_entries(index: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for model_id, revisions in sorted(index["models"].items()):
        for revision, entries in sorted(revisions.items()):
            for entry in entries:
                yield model_id, revision, entry


def read_index(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        from megabake.package.errors import PackageError

        raise PackageError(f"registry index {path} is not valid JSON ({exc}). fix: rebuild it with "
                           "megabake.package.build_index") from None
    return validate("registry_index", data, source=str(path))


def write_index(path: str | Path, index: dict[str, Any]) -> Path:
    validate("registry_index", index, source=str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(dump_json(index))
    tmp.replace(path)
    return path
