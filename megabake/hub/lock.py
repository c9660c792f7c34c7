"""Lock files: pin published packages to a commit and a manifest digest, and load exactly those.

Contract (the format: ``schemas/lock.schema.json``; prose: docs/PUBLISHING.md, "Lock files"):

* ``lock_entry(fetched)`` -> one entry (repo, revision asked, resolved 40-hex commit, package path, variant, model,
  GPU class, status, sha256 of the package's ``manifest.json``, tag) of a verified :class:`FetchedPackage`;
* ``make_lock(entries)`` -> the lock document (entries sorted by repo; one per repo);
* ``read_lock(path)`` -> a validated lock, or :class:`LockFileError` (exit 2) naming the file, what is wrong and
  the fix; ``locked_entry(lock, repo_id, path)`` -> the repo's entry, or :class:`LockFileError`;
* ``write_lock(path, lock, force=False)`` -> "written" | "unchanged" | "updated": atomic (temporary file +
  rename). A lock file that already pins the same packages is left untouched (identical bytes); one that pins
  other packages is replaced only with ``force`` (:class:`LockChangedError`, exit 1, otherwise).

The bytes are deterministic (no timestamp): locking the same state twice gives the same file.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from megabake import __version__
from megabake.hub.errors import LockChangedError, LockFileError
from megabake.package import SchemaValidationError, validate
from megabake.package.store import dump_json

LOCK_FILE = "megabake.lock"
ENTRY_KEYS = ("repo", "revision", "commit", "path", "variant", "model_id", "model_revision", "gpu_class", "status",
              "manifest_sha256", "tag")
RELOCK = "regenerate it with `megabake lock REPO[@REV] ... --out {path} --force`"


def lock_entry(fetched) -> dict[str, Any]:
    """The lock entry of a fetched (downloaded and verified) package."""
    entry = fetched.entry
    return {"repo": fetched.repo_id, "revision": fetched.revision, "commit": fetched.commit, "path": entry["path"],
            "variant": entry["variant"], "model_id": fetched.model_id, "model_revision": fetched.model_revision,
            "gpu_class": entry["gpu_class"], "status": entry["status"], "manifest_sha256": entry["manifest_sha256"],
            "tag": entry.get("tag")}


def make_lock(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A schema-valid lock document; one entry per repo, sorted by repo."""
    repos = [e["repo"] for e in entries]
    duplicates = sorted({r for r in repos if repos.count(r) > 1})
    if duplicates:
        raise LockFileError(f"a lock holds one package per repo, and {', '.join(duplicates)} came more than once. "
                            "fix: name each repo once")
    lock = {"schema_version": 1, "generated_by": f"megabake {__version__}",
            "packages": sorted(entries, key=lambda e: e["repo"])}
    return validate("lock", lock, source="lock")


def read_lock(path: str | Path) -> dict[str, Any]:
    """The lock at ``path``, validated (schema, one entry per repo), or :class:`LockFileError`."""
    path = Path(path)
    fix = RELOCK.format(path=path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LockFileError(f"lock file {path} does not exist. fix: pass the lock file `megabake lock` wrote "
                            f"(default ./{LOCK_FILE}), or create one with `megabake lock REPO[@REV] --out {path}`") \
            from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LockFileError(f"lock file {path} is not readable JSON ({exc}). fix: {fix}") from None
    try:
        validate("lock", data, source=str(path))
    except SchemaValidationError as exc:
        raise LockFileError(f"lock file {path} is malformed: at JSON pointer {exc.pointer or '/'!r}: "
                            f"{exc.problems[0][1]}; expected {exc.expected} (schemas/lock.schema.json). fix: {fix}") \
            from None
    repos = [entry["repo"] for entry in data["packages"]]
    twice = sorted({repo for repo in repos if repos.count(repo) > 1})
    if twice:
        raise LockFileError(f"lock file {path} is malformed: {', '.join(twice)} has more than one entry. fix: {fix}")
    return data


def locked_entry(lock: dict[str, Any], repo_id: str, path: str | Path) -> dict[str, Any]:
    """The entry of ``repo_id`` in ``lock``, or :class:`LockFileError` listing the repos it pins."""
    for entry in lock["packages"]:
        if entry["repo"] == repo_id:
            return entry
    pinned = ", ".join(entry["repo"] for entry in lock["packages"])
    keep = " ".join(f"{entry['repo']}@{entry['commit']}" for entry in lock["packages"])
    raise LockFileError(f"lock file {path} has no entry for {repo_id} (it pins: {pinned}). fix: load a pinned repo, "
                        f"or lock this one too: `megabake lock {keep} {repo_id} --out {path} --force`")


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What replacing lock ``old`` by ``new`` changes, one line per repo ([] when they pin the same packages)."""
    before = {e["repo"]: e for e in old["packages"]}
    after = {e["repo"]: e for e in new["packages"]}
    lines = []
    for repo in sorted(before.keys() | after.keys()):
        if repo not in after:
            lines.append(f"{repo}: dropped")
        elif repo not in before:
            lines.append(f"{repo}: added ({after[repo]['commit'][:12]} {after[repo]['variant']})")
        else:
            old, new = before[repo], after[repo]
            diff = [f"{k} {old[k]} -> {new[k]}" for k in ENTRY_KEYS if old[k] != new[k]]
            if diff:
                lines.append(f"{repo}: " + ", ".join(diff))
    return lines


def write_lock(path: str | Path, lock: dict[str, Any], *, force: bool = False) -> str:
    """Write ``lock`` atomically; "written", "unchanged" (same packages already pinned) or "updated" (force)."""
    path = Path(path)
    validate("lock", lock, source=str(path))
    if path.exists():
        try:
            diff = changes(read_lock(path), lock)
        except LockFileError:
            if not force:
                raise
            diff = ["the old file was not a valid lock"]
        if not diff:
            return "unchanged"
        if force:
            _atomic_write(path, dump_json(lock))
            return "updated"
        raise LockChangedError(f"refusing to replace lock file {path}: it pins other packages ({'; '.join(diff)}). "
                               f"Nothing was written. fix: pass --force to update the lock, or --out another file")
    _atomic_write(path, dump_json(lock))
    return "written"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
