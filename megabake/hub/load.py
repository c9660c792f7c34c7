"""Load a published package from the Hub: resolve, select, download, verify, trust, construct.

Contract: ``fetch_package(repo_id, revision, ...)`` resolves ``revision`` (branch, tag or commit) to ONE commit
with ``HfApi.resolve_revision`` and does everything else at that commit: reads ``registry/index.json`` (or, when
the Hub answers a real HTTP 404 for it -- or the HF cache recorded that 404 for this commit -- the packages'
report + manifest files), picks the package for the GPU class and the smallest bucket that fits
(:mod:`megabake.hub.select`), downloads only its ``manifest.json`` and the files it lists, one by one with
``hf_hub_download`` (the standard HF cache, so ``HF_HUB_OFFLINE=1`` works from it), and verifies digests, schemas
and that the package is the one the index names. ``load_from_hub`` then refuses to import ``module.py`` unless
``trust_remote_code=True`` or the caller pinned the 40-hex commit as ``revision``, and returns
``megabake.runtime.MegakernelDecoder.from_package(path, device=device, model_path=model_path)``: a package baked
from a local model folder or .gguf file rebuilds its model from there, or from its copy at ``model_path`` (its
weights' sha256 must match the report); ``model_path`` for a package of a preset or a Hub model raises
``InputError`` before anything is imported.

With ``lockfile=PATH`` (a lock written by ``megabake lock``, :mod:`megabake.hub.lock`) nothing is resolved or
selected: the repo's entry names the commit, the package folder and the sha256 of its ``manifest.json``; exactly
that package is downloaded at exactly that commit and verified against the entry (a different manifest raises
``DigestMismatchError``). A lock pins a commit, so, like a 40-hex ``revision``, it counts as trusted. A lock
without an entry for the repo, a malformed lock, or a ``revision`` / ``bucket`` / ``gpu_class`` / model that
the locked package does not match raises ``LockFileError`` (exit code 2). ``fetch_to_lock`` is ``fetch_package``
for ``megabake lock`` (its failures say that no lock file was written).

Faults: any failure of the Hub other than that 404 (5xx after huggingface_hub's retries, connection refused or
dropped, truncated body, server gone mid-download, offline without a cached copy) raises
:class:`~megabake.hub.errors.HubIOError` naming the file, the HTTP status or failure and the fix, before anything
is imported. No huggingface_hub / httpx exception escapes. Partial downloads never enter the HF cache.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.file_download import _CACHED_NO_EXIST

from megabake.errors import InputError
from megabake.hub.errors import HubError, LockFileError, NoMatchingPackageError, UntrustedCodeError, hub_io, is_absent
from megabake.hub.lock import locked_entry, read_lock
from megabake.hub.publish import INDEX_PATH
from megabake.hub.select import Request, fits, select_entry
from megabake.package import (
    DigestMismatchError,
    Package,
    empty_index,
    entry_from_report,
    merge_index,
    parse_variant,
    read_package,
    sha256_bytes,
    validate,
)
from megabake.package.store import MANIFEST, REPORT

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
NOTHING_IMPORTED = "Nothing was imported (module.py was not loaded); the HF cache holds no partial file."
_CACHE_FIX = ("delete the cached copy (`hf cache rm model/{repo_id}`) and load again with force_download=True; "
              "if the error persists, the copy on the Hub is corrupt: republish the package")
_LOCK_FIX = ("delete the cached copy (`hf cache rm model/{repo_id}`) and load again with force_download=True; if the "
             "error persists, the package at the locked commit is not the one {lockfile} pins: review it, then "
             "re-lock deliberately (`megabake lock {repo_id}@<rev> --out {lockfile} --force`)")


@dataclass
class FetchedPackage:
    """A verified package folder in the HF cache and where it came from."""

    repo_id: str
    revision: str
    commit: str
    path: Path
    package: Package
    entry: dict[str, Any]
    model_id: str
    model_revision: str
    lockfile: Path | None = None

    @property
    def pinned(self) -> bool:
        """True when the caller pinned this exact commit: a 40-hex revision, or a lock file."""
        return self.revision == self.commit or self.lockfile is not None


@dataclass
class _Hub:
    """One repo at one resolved commit, with the download settings every call shares."""

    repo_id: str
    commit: str
    cache_dir: str | Path | None
    endpoint: str | None
    token: str | bool | None
    local_files_only: bool
    force_download: bool

    consequence: str = NOTHING_IMPORTED
    label: str = "index"  # what names the package: the registry index, or a lock file
    fix: str | None = None  # the fix of a digest mismatch (default: re-download, else republish)

    def kwargs(self) -> dict[str, Any]:
        return dict(revision=self.commit, cache_dir=self.cache_dir, endpoint=self.endpoint, token=self.token,
                    local_files_only=self.local_files_only, force_download=self.force_download,
                    library_name="megabake")

    @property
    def host(self) -> str:
        return self.endpoint or constants.ENDPOINT

    def where(self, path: str) -> str:
        return f"{self.repo_id}@{self.commit[:12]}:{path}"

    def snapshot(self, patterns: list[str], what: str) -> Path:
        with hub_io(f"downloading {self.where(what)}", self.consequence, self.host):
            return Path(snapshot_download(self.repo_id, allow_patterns=patterns, **self.kwargs()))

    def download(self, path: str) -> Path:
        """One file at the commit, into the HF cache (a failed or partial download never lands there)."""
        with hub_io(f"downloading {self.where(path)}", self.consequence, self.host, path):
            return Path(hf_hub_download(self.repo_id, path, **self.kwargs()))

    def package_folder(self, entry: dict[str, Any], where: str) -> Path:
        """The entry's manifest.json (checked against the index's digest first), then every file it lists, each
        into the HF cache; returns the package folder in the cache snapshot. Nothing is verified beyond that here."""
        path, manifest = self._manifest(entry, where)
        for item in manifest["files"]:
            self.download(f"{entry['path']}/{item['path']}")
        return path.parent

    def _manifest(self, entry: dict[str, Any], where: str) -> tuple[Path, dict[str, Any]]:
        path = self.download(f"{entry['path']}/{MANIFEST}")
        digest, fix = sha256_bytes(path.read_bytes()), self.fix or _CACHE_FIX.format(repo_id=self.repo_id)
        if digest != entry["manifest_sha256"]:
            raise DigestMismatchError(str(path.parent), MANIFEST, f"the package named by {where}",
                                      f"manifest_sha256: {self.label} says {entry['manifest_sha256']!r}, package has "
                                      f"{digest!r}", fix=fix)
        try:
            return path, validate("manifest", json.loads(path.read_text()), source=self.where(entry["path"]))
        except ValueError as exc:
            raise HubError(f"{self.where(entry['path'])}/{MANIFEST} is not a valid manifest ({exc}). "
                           f"{self.consequence} fix: {fix}") from None

    def index(self) -> tuple[dict[str, Any], str]:
        """The registry index at the commit, or one built from the packages' reports when there is none."""
        path = self._index_file()
        if path is None:
            return self._index_from_reports(), f"the package folders of {self.repo_id}@{self.commit[:12]}"
        where = self.where(INDEX_PATH)
        try:
            return validate("registry_index", json.loads(Path(path).read_text()), source=where), where
        except ValueError as exc:
            raise HubError(f"{where} is not a valid registry index ({exc}). {self.consequence} fix: republish "
                           "(any publish to the repo rebuilds the index from its packages)") from None

    def _index_file(self) -> str | None:
        """Local path of the index; None ONLY when it is absent at this commit (a real 404, live or cached)."""
        with hub_io(f"reading {self.where(INDEX_PATH)}", self.consequence, self.host, INDEX_PATH):
            try:
                return hf_hub_download(self.repo_id, INDEX_PATH, **self.kwargs())
            except EntryNotFoundError as exc:
                if is_absent(exc) or self._cached_absent():
                    return None
                raise

    def _cached_absent(self) -> bool:
        """The HF cache recorded a 404 for the index at this (immutable) commit: it is absent, even offline."""
        found = try_to_load_from_cache(self.repo_id, INDEX_PATH, cache_dir=self.cache_dir, revision=self.commit)
        return found is _CACHED_NO_EXIST

    def _index_from_reports(self) -> dict[str, Any]:
        folder = self.snapshot([f"packages/*/{REPORT}", f"packages/*/{MANIFEST}"], f"packages/*/{REPORT}")
        entries = []
        for manifest in sorted(folder.glob(f"packages/*/*/*/{MANIFEST}")):
            report = self._report(manifest.parent / REPORT)
            entry = entry_from_report(report, sha256_bytes(manifest.read_bytes()), self.repo_id)
            entries.append((report["model"]["id"], report["model"]["revision"], entry))
        return merge_index(empty_index(), entries)

    def _report(self, path: Path) -> dict[str, Any]:
        try:
            return validate("report", json.loads(path.read_text()), source=str(path))
        except ValueError as exc:
            raise HubError(f"{path} (the repo has no {INDEX_PATH}) is not a valid report ({exc}). "
                           f"{self.consequence} fix: republish the package") from None


def resolve_commit(api: HfApi, repo_id: str, revision: str, cache_dir=None, local_files_only: bool = False,
                   consequence: str = NOTHING_IMPORTED) -> str:
    """Branch / tag / commit -> 40-hex commit (from the HF cache's refs when offline or the Hub is down)."""
    with hub_io(f"resolving {repo_id}@{revision}", consequence, api.endpoint):
        resolved = api.resolve_revision(repo_id, revision=revision, cache_dir=cache_dir,
                                        local_files_only=local_files_only)
    return resolved.resolved


def fetch_package(repo_id: str, revision: str | None = None, *, model_id: str | None = None,
                  model_revision: str | None = None, bucket: Any = None, gpu_class: str | None = None,
                  allow_unverified: bool = False, cache_dir: str | Path | None = None, endpoint: str | None = None,
                  token: str | bool | None = None, local_files_only: bool = False,
                  force_download: bool = False, lockfile: str | Path | None = None) -> FetchedPackage:
    """Resolve, select, download and verify one package (no code is imported). See the module docstring.

    ``revision``: a branch, tag or commit (default "main"). ``gpu_class=None`` accepts any GPU class (what the
    CPU reference executor can run). ``lockfile``: load exactly the package the lock pins for ``repo_id``.
    """
    request = Request.from_args(bucket, gpu_class, model_id, model_revision)
    if lockfile is not None:
        return _fetch_locked(repo_id, lockfile, revision, request, allow_unverified, cache_dir, endpoint, token,
                             local_files_only, force_download)
    revision = revision or "main"
    request = request.with_tag_defaults(revision)
    return _fetch(repo_id, revision, request, allow_unverified, cache_dir, endpoint, token, local_files_only,
                  force_download)


def fetch_to_lock(repo_id: str, revision: str | None, *, bucket: Any = None, gpu_class: str | None = None,
                  model_id: str | None = None, model_revision: str | None = None, allow_unverified: bool = False,
                  endpoint: str | None = None, token: str | bool | None = None) -> FetchedPackage:
    """``fetch_package`` for ``megabake lock``: the same selection and checks; a failure says nothing was written."""
    revision = revision or "main"
    request = Request.from_args(bucket, gpu_class, model_id, model_revision).with_tag_defaults(revision)
    return _fetch(repo_id, revision, request, allow_unverified, None, endpoint, token, False, False,
                  consequence="Nothing was written (no lock file).")


def _fetch(repo_id, revision, request, allow_unverified, cache_dir, endpoint, token, local_files_only,
           force_download, consequence: str = NOTHING_IMPORTED) -> FetchedPackage:
    api = HfApi(endpoint=endpoint, token=token, library_name="megabake")
    commit = resolve_commit(api, repo_id, revision, cache_dir, local_files_only, consequence)
    hub = _Hub(repo_id, commit, cache_dir, endpoint, token, local_files_only, force_download, consequence)
    index, where = hub.index()
    found_model, found_revision, entry = select_entry(index, request, allow_unverified, where)
    folder = hub.package_folder(entry, where)
    package = _verify(folder, entry, where, _CACHE_FIX.format(repo_id=repo_id))
    return FetchedPackage(repo_id, revision, commit, package.path, package, entry, found_model, found_revision)


def _fetch_locked(repo_id, lockfile, revision, request, allow_unverified, cache_dir, endpoint, token,
                  local_files_only, force_download) -> FetchedPackage:
    """The package ``lockfile`` pins for ``repo_id``, at its commit, checked against the lock's digest."""
    lockfile = Path(lockfile)
    entry = locked_entry(read_lock(lockfile), repo_id, lockfile)
    _check_locked_request(entry, revision, request, allow_unverified, lockfile)
    fix = _LOCK_FIX.format(repo_id=repo_id, lockfile=lockfile)
    hub = _Hub(repo_id, entry["commit"], cache_dir, endpoint, token, local_files_only, force_download,
               label=f"lock file {lockfile}", fix=fix)
    where = f"{lockfile} (entry {repo_id})"
    folder = hub.package_folder(entry, where)
    package = _verify(folder, entry, where, fix, label="the lock")
    return FetchedPackage(repo_id, entry["revision"], entry["commit"], package.path, package, entry,
                          entry["model_id"], entry["model_revision"], lockfile=lockfile)


def _check_locked_request(entry: dict[str, Any], revision: str | None, request: Request, allow_unverified: bool,
                          lockfile: Path) -> None:
    """What the caller asked for must be what the lock pins (the lock decides; it never widens or narrows)."""
    pinned = f"{entry['repo']}@{entry['revision']} = commit {entry['commit']}, {entry['path']}"
    variant = parse_variant(entry["variant"])
    as_index_entry = {"variant": entry["variant"], "mode": variant.mode, "batch": variant.batch,
                      "capacity": variant.capacity, "gpu_class": variant.gpu_class}
    conflicts = []
    if revision not in (None, entry["revision"], entry["commit"]):
        conflicts.append(f"revision {revision!r}")
    if (request.model_id not in (None, entry["model_id"])
            or request.model_revision not in (None, entry["model_revision"])):
        conflicts.append(f"model {request.model_id or 'any'}@{request.model_revision or 'any'}")
    if not fits(as_index_entry, request):
        conflicts.append(f"a bucket / GPU class that variant does not fit (batch {request.batch}, KV capacity >= "
                         f"{request.capacity or 1}, GPU class {request.gpu_class or 'any'})")
    if conflicts:
        raise LockFileError(f"{lockfile} pins {pinned}, but the call asks for {' and '.join(conflicts)}. fix: drop "
                            f"those arguments (the lock chooses), or re-lock with them (`megabake lock ... --out "
                            f"{lockfile} --force`)")
    if entry["status"] != "verified" and not allow_unverified:
        raise LockFileError(f"{lockfile} pins {pinned}, which is {entry['status']}. fix: pass allow_unverified=True "
                            "to load it, or lock a verified package")


def _verify(path: Path, entry: dict[str, Any], where: str, fix: str, label: str = "index") -> Package:
    try:
        package = read_package(path)
    except DigestMismatchError as exc:
        raise DigestMismatchError(exc.package, exc.path, exc.expected, exc.actual, fix=fix) from None
    mismatches = [(key, entry[key], value) for key, value in (
        ("variant", package.report["variant"]), ("path", package.repo_path),
        ("manifest_sha256", package.manifest_sha256), ("status", package.status))
        if entry[key] != value]
    if mismatches:
        listing = "; ".join(f"{key}: {label} says {want!r}, package has {got!r}" for key, want, got in mismatches)
        raise DigestMismatchError(str(path), MANIFEST, f"the package named by {where}", listing, fix=fix)
    return package


def check_trust(fetched: FetchedPackage, trust_remote_code: bool) -> None:
    """Refuse to run module.py unless trusted explicitly or pinned to a commit by the caller."""
    if trust_remote_code or fetched.pinned:
        return
    raise UntrustedCodeError(
        f"refusing to import {fetched.path / 'module.py'}: it is generated code from {fetched.repo_id} "
        f"(revision {fetched.revision!r} = commit {fetched.commit}) and would run in this process, and "
        f"{fetched.revision!r} is a movable reference, not a commit you pinned. fix: review that module.py, then "
        f"pass trust_remote_code=True, or pin revision={fetched.commit!r}")


def load_from_hub(repo_id: str, revision: str | None = None, *, model_revision: str | None = None,
                  bucket: Any = None, device: Any = None, trust_remote_code: bool = False,
                  model_id: str | None = None, gpu_class: str | None = None, allow_unverified: bool = False,
                  cache_dir: str | Path | None = None, endpoint: str | None = None, token: str | bool | None = None,
                  local_files_only: bool = False, force_download: bool = False, lockfile: str | Path | None = None,
                  model_path: str | Path | None = None):
    """Return the runnable decoder of the best published package for this device (see the module docstring).

    ``revision``: a branch, tag or commit (default "main"). ``bucket``: None (batch 1, smallest capacity), a KV
    capacity, ``(batch, capacity)``, ``"b1-c512"`` or a variant name. ``device``: None (CUDA if available, else
    CPU), ``"cpu"`` (CPU reference executor: any GPU class fits) or a CUDA device (its GPU class must match).
    ``gpu_class`` overrides the detected class. ``lockfile``: load exactly the package a ``megabake lock`` file
    pins for ``repo_id`` (its commit and manifest digest). ``model_path``: where the local model folder or .gguf
    file the package was baked from lies on this machine (packages baked from local weights only).
    """
    device = _device(device)
    detected = None if gpu_class else _device_gpu_class(device)
    if lockfile is not None:
        fetched = fetch_package(repo_id, revision, model_id=model_id, model_revision=model_revision, bucket=bucket,
                                gpu_class=gpu_class, allow_unverified=allow_unverified, cache_dir=cache_dir,
                                endpoint=endpoint, token=token, local_files_only=local_files_only,
                                force_download=force_download, lockfile=lockfile)
        _check_device_class(fetched.entry["variant"], detected, device, f"lock file {lockfile}")
    else:
        revision = revision or "main"
        request = Request.from_args(bucket, gpu_class, model_id, model_revision).with_tag_defaults(revision)
        if request.variant:
            _check_device_class(request.variant, detected, device, f"revision {revision!r}")
        elif detected:
            request = dataclasses.replace(request, gpu_class=detected)
        fetched = _fetch(repo_id, revision, request, allow_unverified, cache_dir, endpoint, token, local_files_only,
                         force_download)
    check_model_path(fetched, model_path)
    check_trust(fetched, trust_remote_code)
    try:
        from megabake.runtime import MegakernelDecoder
    except ImportError as exc:
        raise HubError(f"megabake.runtime.MegakernelDecoder is unavailable ({exc}); the package was fetched and "
                       f"verified at {fetched.path}. fix: install megabake completely (pip install -e .)") from exc
    return MegakernelDecoder.from_package(fetched.path, device=device, model_path=model_path)


def check_model_path(fetched: FetchedPackage, model_path: str | Path | None) -> None:
    """``model_path`` names local weights: only a package baked from a local folder or .gguf file reads them."""
    model = fetched.package.report["model"]
    if model_path is not None and not model.get("local"):
        raise InputError(f"model_path applies to packages baked from a local model folder or .gguf file, and "
                         f"{fetched.repo_id}'s package {fetched.entry['variant']} was baked from "
                         f"{model['id']}@{model['revision']}: drop model_path")


def _check_device_class(variant: str, detected: str | None, device: str, source: str) -> None:
    """A variant pinned by a tag, a variant name or a lock must be of the CUDA device's GPU class."""
    gpu_class = parse_variant(variant).gpu_class
    if detected and gpu_class != detected:
        raise NoMatchingPackageError(f"{source} names variant {variant} (GPU class {gpu_class}), but {device} is GPU "
                                     f"class {detected}. fix: load another tag, variant or lock for {detected}, or "
                                     "pass device='cpu' to run the CPU reference executor")


def _device(device: Any) -> str:
    if device is not None:
        return str(device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_gpu_class(device: str) -> str | None:
    """GPU class of a CUDA device (as the runtime names it), None for the CPU: the reference executor runs any."""
    if not device.startswith("cuda"):
        return None
    import torch

    from megabake.runtime import gpu_info

    info = gpu_info(torch.device(device))
    return info.gpu_class if info is not None else None


def read_hub_index(repo_id: str, revision: str = "main", *, cache_dir: str | Path | None = None,
                   endpoint: str | None = None, token: str | bool | None = None,
                   local_files_only: bool = False) -> tuple[dict[str, Any], str]:
    """(registry index, commit) of ``repo_id`` at ``revision`` (built from the package reports if it has none)."""
    api = HfApi(endpoint=endpoint, token=token, library_name="megabake")
    consequence = "Nothing was read."
    commit = resolve_commit(api, repo_id, revision, cache_dir, local_files_only, consequence)
    index, _ = _Hub(repo_id, commit, cache_dir, endpoint, token, local_files_only, False, consequence).index()
    return index, commit
