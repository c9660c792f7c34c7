"""Read and write package folders atomically, with manifest digests and schema checks.

Contract:
* ``write_package(dest_dir, files, report)`` validates ``report`` (and ``source_map.json`` / ``plan.json`` when
  given) against the schemas and the cross-field rules of docs/FORMATS.md, then writes every file plus
  ``report.json`` and ``manifest.json`` into a temporary sibling folder, fsyncs, and renames it into place. An
  existing package is replaced only at that last step: a failure leaves the old package or nothing.
* ``read_package(path)`` checks manifest.json (schema, every listed file's size + sha256, no unlisted files),
  then report.json / source_map.json / plan.json, and returns a :class:`Package`.
* ``update_report(path, report)`` re-verifies the package and rewrites report.json + manifest.json atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from megabake.package.errors import DigestMismatchError, PackageError, SchemaValidationError
from megabake.package.layout import Variant, parse_variant, report_build_hash, repo_path, variant_name
from megabake.package.schema import validate

MANIFEST = "manifest.json"
REPORT = "report.json"
SOURCE_MAP = "source_map.json"
PLAN = "plan.json"
MODULE = "module.py"
IGNORED_DIRS = ("__pycache__",)  # written by Python when module.py is imported from the folder


@dataclass
class Package:
    """A verified package folder: its parsed documents (``source_map`` / ``plan`` are None when absent)."""

    path: Path
    report: dict[str, Any]
    source_map: dict[str, Any] | None
    manifest: dict[str, Any]
    plan: dict[str, Any] | None

    @property
    def model_id(self) -> str:
        return self.report["model"]["id"]

    @property
    def model_revision(self) -> str:
        return self.report["model"]["revision"]

    @property
    def variant(self) -> Variant:
        return parse_variant(self.report["variant"])

    @property
    def status(self) -> str:
        return self.report["status"]

    @property
    def repo_path(self) -> str:
        """Where this package lives inside a repository: ``packages/<org>--<model>/<rev>/<variant>``."""
        return repo_path(self.model_id, self.model_revision, self.report["variant"])

    @property
    def files(self) -> list[str]:
        """Every file of the package, manifest.json last."""
        return [entry["path"] for entry in self.manifest["files"]] + [MANIFEST]

    @property
    def manifest_sha256(self) -> str:
        return sha256_bytes((self.path / MANIFEST).read_bytes())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def dump_json(obj: Any) -> bytes:
    """The on-disk form of every JSON file MegaBake writes: 2-space indent, trailing newline."""
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


# --------------------------------------------------------------------------------------------------- write


def write_package(dest_dir: str | Path, files: dict[str, str | bytes], report: dict[str, Any]) -> Path:
    """Validate and atomically write a package folder; returns its path."""
    dest = Path(dest_dir)
    contents = _normalize_files(files)
    validate("report", report, source=REPORT)
    check_consistency(report, contents, source=str(dest))
    contents[REPORT] = dump_json(report)
    contents[MANIFEST] = dump_json(build_manifest(contents))
    _atomic_write_dir(dest, contents)
    return dest


def build_manifest(contents: dict[str, bytes]) -> dict[str, Any]:
    files = [{"path": name, "size": len(data), "sha256": sha256_bytes(data)}
             for name, data in sorted(contents.items()) if name != MANIFEST]
    return validate("manifest", {"schema_version": 1, "files": files}, source=MANIFEST)


def _normalize_files(files: dict[str, str | bytes]) -> dict[str, bytes]:
    contents: dict[str, bytes] = {}
    for name, data in files.items():
        _check_relative(name)
        if name in (MANIFEST, REPORT):
            raise PackageError(f"files must not contain {name!r}: write_package writes it (pass the report "
                               "as the report argument)")
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes):
            raise PackageError(f"file {name!r}: content must be str or bytes, got {type(data).__name__}")
        contents[name] = data
    return contents


def _check_relative(name: str) -> None:
    parts = PurePosixPath(name).parts
    if not name or name.startswith("/") or "\\" in name or any(p in (".", "..") for p in parts) \
            or any(p in IGNORED_DIRS for p in parts):
        raise PackageError(f"file name {name!r} must be a relative POSIX path inside the package "
                           "(no '..', no leading '/', no __pycache__)")


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_dir(dest: Path, contents: dict[str, bytes]) -> None:
    """Write into ``.<name>.tmp-<id>`` next to ``dest``, then swap it in; roll back on any failure."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    tmp = dest.parent / f".{dest.name}.tmp-{token}"
    old = dest.parent / f".{dest.name}.old-{token}"
    os.mkdir(tmp)
    try:
        for name, data in contents.items():
            _write_file(tmp / name, data)
        _fsync_dir(tmp)
        had_old = dest.exists()
        if had_old:
            os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except BaseException:
            if had_old:
                os.rename(old, dest)
            raise
        _fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- read


def read_package(path: str | Path) -> Package:
    """Verify a package folder (manifest digests, schemas, cross-field rules) and return it."""
    root = Path(path)
    if not (root / MANIFEST).is_file():
        raise PackageError(f"{root} is not a package folder: {MANIFEST} is missing. fix: pass the variant "
                           "folder packages/<org>--<model>/<rev>/<variant>/ written by `megabake bake` "
                           "(`megabake ls` lists them)")
    manifest = validate("manifest", _load_json(root, MANIFEST), source=str(root / MANIFEST))
    _check_digests(root, manifest)
    listed = {entry["path"] for entry in manifest["files"]}
    if REPORT not in listed:
        raise PackageError(f"package {root}: manifest.json does not list report.json. fix: re-bake the package")
    report = validate("report", _load_json(root, REPORT), source=str(root / REPORT))
    source_map = _load_json(root, SOURCE_MAP) if SOURCE_MAP in listed else None
    if source_map is not None:
        validate("source_map", source_map, source=str(root / SOURCE_MAP))
    contents = {name: (root / name).read_bytes() for name in (PLAN, SOURCE_MAP, MODULE) if name in listed}
    check_consistency(report, contents, source=str(root))
    plan = _load_json(root, PLAN) if PLAN in listed else None
    return Package(path=root, report=report, source_map=source_map, manifest=manifest, plan=plan)


def update_report(path: str | Path, report: dict[str, Any]) -> Package:
    """Replace report.json of a verified package (same model, revision and variant) atomically."""
    package = read_package(path)
    for pointer, old, new in (("/model/id", package.model_id, report.get("model", {}).get("id")),
                              ("/model/revision", package.model_revision, report.get("model", {}).get("revision")),
                              ("/variant", package.report["variant"], report.get("variant"))):
        if old != new:
            raise SchemaValidationError("report", pointer, repr(old), f"{new!r} changes the package identity",
                                        source=f"update_report({package.path})")
    files = {name: (package.path / name).read_bytes() for name in package.files if name not in (REPORT, MANIFEST)}
    write_package(package.path, files, report)
    return read_package(package.path)


def _load_json(root: Path, name: str) -> Any:
    try:
        return json.loads((root / name).read_text())
    except FileNotFoundError:
        raise PackageError(f"package {root}: {name} is missing. fix: re-bake or re-download the package") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PackageError(f"package {root}: {name} is not valid JSON ({exc}). fix: re-bake or re-download "
                           "the package") from None


def _check_digests(root: Path, manifest: dict[str, Any]) -> None:
    seen: set[str] = set()
    for entry in manifest["files"]:
        name = entry["path"]
        if name in seen:
            raise PackageError(f"package {root}: manifest.json lists {name!r} twice. fix: re-bake the package")
        seen.add(name)
        file = root / name
        if not file.is_file():
            raise PackageError(f"package {root}: {name!r} is listed in manifest.json but missing. "
                               "fix: re-bake or re-download the package")
        size = file.stat().st_size
        digest = sha256_file(file)
        if size != entry["size"] or digest != entry["sha256"]:
            raise DigestMismatchError(str(root), name, f"{entry['size']} bytes, sha256 {entry['sha256']}",
                                      f"{size} bytes, sha256 {digest}")
    for file in sorted(root.rglob("*")):
        rel = file.relative_to(root).as_posix()
        if file.is_dir() or rel == MANIFEST or any(p in IGNORED_DIRS for p in file.relative_to(root).parts):
            continue
        if rel not in seen:
            raise PackageError(f"package {root}: file {rel!r} is not listed in manifest.json (added after the "
                               "package was written). fix: remove it, or re-bake the package")


# -------------------------------------------------------------------------------------------- consistency


def check_consistency(report: dict[str, Any], contents: dict[str, bytes], source: str) -> None:
    """Cross-field rules a JSON Schema cannot express (docs/FORMATS.md, "Consistency rules")."""
    bucket = report["bucket"]
    untagged = variant_name(bucket["mode"], bucket["batch"], bucket["capacity"], report["gpu_class"])
    tagged = variant_name(bucket["mode"], bucket["batch"], bucket["capacity"], report["gpu_class"],
                          report_build_hash(report))
    _require(report["variant"] in (tagged, untagged), "report", "/variant", f"{tagged!r} (or {untagged!r})",
             f"{report['variant']!r} does not match /bucket, /gpu_class, /plan/hash and /kernel/codegen", source)
    model = report["model"]
    if model["weights"] == "random":
        expected_rev = f"random-seed{model['seed']}"
        _require(model["revision"] == expected_rev, "report", "/model/revision", repr(expected_rev),
                 f"{model['revision']!r} does not name the seed of random weights", source)
    if report["status"] == "verified":
        numerics = report.get("numerics") or {}
        _require(numerics.get("pass") is True, "report", "/numerics/pass", "true for status 'verified'",
                 f"status is 'verified' but numerics.pass is {numerics.get('pass')!r}", source)
    timings = report.get("timings")
    if timings and timings.get("baseline") is not None:
        _require(timings["baseline"] in timings["candidates"], "report", "/timings/baseline",
                 f"one of {sorted(timings['candidates'])}", f"{timings['baseline']!r} is not a candidate", source)
    if PLAN in contents:
        _check_plan(report, contents[PLAN], source)
    if SOURCE_MAP in contents:
        _check_source_map(report, contents, source)


def _check_plan(report: dict[str, Any], plan_bytes: bytes, source: str) -> None:
    try:
        json.loads(plan_bytes)
    except ValueError as exc:
        raise PackageError(f"{source}: plan.json is not valid JSON ({exc}). fix: write the plan's canonical "
                           "JSON") from None
    digest = sha256_bytes(plan_bytes)
    _require(digest == report["plan"]["hash"], "report", "/plan/hash", f"{digest!r} (sha256 of plan.json)",
             f"{report['plan']['hash']!r} is not the sha256 of plan.json", source)


def _check_source_map(report: dict[str, Any], contents: dict[str, bytes], source: str) -> None:
    try:
        source_map = json.loads(contents[SOURCE_MAP])
    except ValueError as exc:
        raise PackageError(f"{source}: source_map.json is not valid JSON ({exc})") from None
    validate("source_map", source_map, source=SOURCE_MAP)
    _require(source_map["plan_hash"] == report["plan"]["hash"], "source_map", "/plan_hash",
             f"{report['plan']['hash']!r} (report.plan.hash)", f"{source_map['plan_hash']!r} differs", source)
    module = source_map["module"]
    _require(module in contents, "source_map", "/module", "a file of the package",
             f"{module!r} is not in the package", source)
    n_lines = contents[module].decode(errors="replace").count("\n") + 1
    for index, entry in enumerate(source_map["entries"]):
        first, last = entry["lines"]
        _require(first <= last <= n_lines, "source_map", f"/entries/{index}/lines",
                 f"[first, last] with first <= last <= {n_lines} (lines of {module})", f"{[first, last]}", source)


def _require(ok: bool, kind: str, pointer: str, expected: str, message: str, source: str) -> None:
    if not ok:
        raise SchemaValidationError(kind, pointer, expected, message, source=source)
