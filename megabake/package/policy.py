"""Write policy for new packages: a baked package never silently replaces another.

Contract (docs/FORMATS.md, "Writing a package over another"):

* ``package_destination(root, model_id, model_revision, mode, batch, capacity, gpu_class, tag_hash)`` ->
  ``(folder, variant)``: where a new bake goes (``tag_hash``: the build's hash, ``layout.build_hash`` of the plan's
  sha256 and the module's codegen record). The variant carries the plan tag
  (``decode-b1-c128-sm90a-132sm-p1a2b3c4d``: its first 8 hex digits), so two plans of one bucket (other tilings,
  another compiler version) or two builds of one plan (with and without a loader warp) never share a folder;
  except when the bucket's untagged folder (a package baked before plan tags existed) holds this exact build (same
  ``report_build_hash``): then that folder.
* ``save_package(dest, files, report, force=False) -> SaveResult`` compares the new package with the one at
  ``dest`` and then writes (atomically, through :func:`~megabake.package.store.write_package`) or not:

  ==================================================  ============  ==========================================
  what is at ``dest``                                 ``action``    written
  ==================================================  ============  ==========================================
  nothing (or an empty folder)                        written       the new package
  identical files, report at least as strong          unchanged     nothing: same inputs, identical bytes
  identical files, weaker report                      upgraded      the new package (its stronger report)
  different files, or not a valid package             refused       nothing: :class:`OverwriteRefusedError`
  any of the above, with ``force=True``               replaced      the new package (unless none was there)
  ==================================================  ============  ==========================================

  "Files" are all files but ``report.json`` and ``manifest.json`` (for a bake: ``module.py``, ``plan.json``,
  ``source_map.json``), compared byte for byte: reports always differ (``created_at``), so for them only the
  strength of ``status`` counts: verified > unverified > failed = fallback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megabake.errors import MegaBakeError
from megabake.package.errors import OverwriteRefusedError
from megabake.package.layout import package_dir, report_build_hash, variant_name
from megabake.package.schema import validate
from megabake.package.store import MANIFEST, REPORT, _normalize_files, check_consistency, read_package, write_package

STRENGTH = {"verified": 2, "unverified": 1, "failed": 0, "fallback": 0}
FORCE_FIX = "pass --force (Python: force=True) to replace it"


@dataclass(frozen=True)
class SaveResult:
    """What :func:`save_package` did. ``action``: written | unchanged | upgraded | replaced; ``message``: one
    line for the user ("" for a plain first write); ``previous_status``: the status of the package that was at
    the folder (None when there was none)."""

    path: Path
    action: str
    message: str = ""
    previous_status: str | None = None

    @property
    def wrote(self) -> bool:
        return self.action != "unchanged"


def package_destination(root: str | Path, model_id: str, model_revision: str, mode: str, batch: int, capacity: int,
                        gpu_class: str, tag_hash: str) -> tuple[Path, str]:
    """(folder, variant) for a new package: the plan-tagged name, or the untagged folder holding this build
    (``tag_hash``: :func:`~megabake.package.layout.build_hash` of the plan and the module's codegen record)."""
    untagged = variant_name(mode, batch, capacity, gpu_class)
    legacy = package_dir(root, model_id, model_revision, untagged)
    if _build_hash(legacy) == tag_hash:
        return legacy, untagged
    tagged = variant_name(mode, batch, capacity, gpu_class, tag_hash)
    return package_dir(root, model_id, model_revision, tagged), tagged


def _build_hash(folder: Path) -> str | None:
    try:
        return report_build_hash(json.loads((folder / REPORT).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_package(dest: str | Path, files: dict[str, str | bytes], report: dict[str, Any], *,
                 force: bool = False) -> SaveResult:
    """Write the package unless that would replace a different or better-evidenced one (see module docstring)."""
    dest = Path(dest)
    contents = _normalize_files(files)
    validate("report", report, source=REPORT)
    check_consistency(report, contents, source=str(dest))  # an invalid package is refused before any comparison
    existing = _existing(dest)
    if existing is None:
        write_package(dest, files, report)
        return SaveResult(dest, "written")
    old_files, old_status, problem = existing
    new = report["status"]
    differs = [problem] if problem else _differences(contents, old_files)
    if force:
        write_package(dest, files, report)
        held = (f"a different package ({'; '.join(differs)}; its report {old_status or 'unreadable'})" if differs
                else f"the same package files with a {old_status} report")
        return SaveResult(dest, "replaced", f"replaced (--force): {dest} held {held}; it now holds this bake's "
                                            f"package ({new})", old_status)
    if differs:
        raise _refusal(dest, differs, old_status, new, problem)
    if STRENGTH[new] > STRENGTH[old_status]:
        write_package(dest, files, report)
        return SaveResult(dest, "upgraded", f"replaced the report at {dest}: the package files are identical and "
                                            f"this bake's {new} report is stronger than its {old_status} one",
                          old_status)
    names = ", ".join(sorted(old_files))
    return SaveResult(dest, "unchanged", f"unchanged: identical package already at {dest} ({names} byte-identical; "
                                         f"its {old_status} report is kept, this bake's {new} report was not "
                                         "written; --force writes it)", old_status)


def _existing(dest: Path) -> tuple[dict[str, bytes], str | None, str | None] | None:
    """(files but report + manifest, report status, problem) of what is at ``dest``; None when nothing is."""
    if not dest.exists() and not dest.is_symlink():
        return None
    if dest.is_dir() and not any(dest.iterdir()):
        return None
    try:
        package = read_package(dest)
    except (MegaBakeError, OSError, ValueError) as exc:  # tampered, partial or foreign: replaced only with force
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return {}, None, f"it is not a valid package: {reason}"
    files = {name: (dest / name).read_bytes() for name in package.files if name not in (REPORT, MANIFEST)}
    return files, package.status, None


def _differences(new: dict[str, bytes], old: dict[str, bytes]) -> list[str]:
    out = []
    for name in sorted(set(new) | set(old)):
        if name not in old:
            out.append(f"{name} is new")
        elif name not in new:
            out.append(f"{name} would be dropped")
        elif new[name] != old[name]:
            out.append(f"{name} differs")
    return out


def _refusal(dest: Path, differs: list[str], old: str | None, new: str, problem: str | None) -> OverwriteRefusedError:
    if problem:
        message = (f"refusing to write the package at {dest}: the folder exists and {problem}. Nothing was written. "
                   f"fix: {FORCE_FIX}, or remove that folder")
    else:
        message = (f"refusing to replace the package at {dest}: {', '.join(differs)} (the package there is {old}, "
                   f"this bake is {new}). A package folder holds one kernel and its evidence; nothing was written. "
                   f"fix: {FORCE_FIX}, or bake into another --out folder")
    return OverwriteRefusedError(message, str(dest), differs)
