"""Publish verified packages to a Hugging Face Hub repo in one atomic commit, with tags, card and index.

Contract: ``publish(packages, repo_id, ...)`` reads and re-verifies every package, refuses packages that are
not verified / baked from random weights / failed / incomplete (``allow_unverified`` and
``allow_random_weights`` lift the first two), then, with the real ``huggingface_hub`` client:

1. ``create_repo(exist_ok=True)``; read the branch head (the parent commit), the tags, the report + manifest of
   every package folder in the repo at the parent, and ``registry/index.json`` at the parent. Only a real HTTP
   404 means "no index"; any other failure (5xx after retries, connection refused or dropped, truncated body)
   raises :class:`HubIOError` naming the file, the status or failure and the fix: nothing is committed;
2. rebuild the index from EVERY package present in the repo at the parent plus this publish's packages (never
   from this publish alone), so an index that was deleted, corrupted or is missing packages is repaired;
3. ``create_commit(..., parent_commit=parent)`` adding every file of every package that is not already there,
   the rebuilt ``registry/index.json`` and a regenerated ``README.md`` model card -- ONE commit, so readers see
   all of it or none of it, and a concurrent publisher gets :class:`PublishConflictError`;
4. ``create_tag`` per package: ``<org>--<model>.<model-rev>.<variant>``, never moved. Re-publishing identical
   packages with a correct index is a no-op; different contents under an existing tag raise
   :class:`ImmutableTagError`.

``plan_publish`` does steps 1-2 without writing; ``commit_publish`` does 3-4. ``dry_run=True`` returns the plan;
when the Hub cannot be read, a dry run still checks everything local (digests, schemas, publish gates, the files
and tags it would write) and its summary says what was NOT compared with the Hub.
"""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from megabake.hub.card import render_model_card
from megabake.hub.errors import (
    LIBRARY_ERRORS,
    HubError,
    HubIOError,
    ImmutableTagError,
    PublishConflictError,
    PublishFailedError,
    PublishRefusedError,
    describe,
    hub_io,
    is_absent,
)
from megabake.package import (
    DigestMismatchError,
    Package,
    empty_index,
    entry_from_report,
    iter_entries,
    merge_index,
    package_tag,
    read_package,
    registry_entry,
    repo_path,
    sha256_bytes,
    validate,
)
from megabake.package.store import MANIFEST, MODULE, PLAN, REPORT, dump_json

INDEX_PATH = "registry/index.json"
CARD_PATH = "README.md"
PACKAGES_PREFIX = "packages/"
REQUIRED_FILES = (MODULE, PLAN)
NOTHING_PUBLISHED = "Nothing was published (no commit, no tag)."
READ_WORKERS = 8
NOT_COMPARED = ("not compared with the Hub: the branch head (parent commit), existing tags and what they name, "
                "the packages already in the repo and registry/index.json. The real publish reads them: a package "
                "shown here as upload may turn out to be published already (skip) or only need its tag, and the "
                "index is rebuilt from every package in the repo, not only from these")


@dataclass
class PackageAction:
    """What publishing does with one package: "upload" its files, only "tag" it (already at the parent), "skip"."""

    package: Package
    path_in_repo: str
    tag: str
    action: str
    reason: str


@dataclass
class RemotePackage:
    """A package folder found in the repo at the parent commit; ``problem`` set: unreadable, left out of the index."""

    path: str
    manifest: bytes | None = None
    report: dict[str, Any] | None = None
    problem: str | None = None


@dataclass
class RemoteState:
    """The repo as read before a publish: parent commit, tags, package folders and the index at the parent."""

    parent: str | None
    tags: dict[str, str] = field(default_factory=dict)
    packages: dict[str, RemotePackage] = field(default_factory=dict)
    index: dict[str, Any] | None = None
    index_state: str = "absent"

    @property
    def exists(self) -> bool:
        return self.parent is not None


@dataclass
class PublishPlan:
    """Everything one publish would write; ``files`` maps repo paths to bytes (empty: nothing to commit).

    ``notes``: what happened to the registry index (rebuilt, repaired, entries left out); ``unchecked``: set when
    the Hub could not be read (dry run only): why, and the plan is then built from the local packages alone."""

    repo_id: str
    branch: str
    parent_commit: str | None
    repo_exists: bool
    actions: list[PackageAction]
    index: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)
    commit_message: str = ""
    commit_description: str = ""
    notes: list[str] = field(default_factory=list)
    unchecked: str | None = None

    @property
    def tags(self) -> list[str]:
        return [a.tag for a in self.actions if a.action in ("upload", "tag")]

    def summary(self) -> str:
        lines = self._header()
        for a in self.actions:
            lines.append(f"  {a.action:6} {a.path_in_repo}  tag {a.tag}  ({a.package.status}; {a.reason})")
        lines += [f"  index: {note}" for note in self.notes]
        if self.files:
            lines.append(f"one commit, {len(self.files)} files: {self.commit_message!r}")
            for path, data in sorted(self.files.items()):
                lines.append(f"  {len(data):>9} B  {sha256_bytes(data)[:16]}  {path}")
        else:
            lines.append("no commit needed")
        if self.tags:
            lines.append("tags: " + ", ".join(self.tags))
        return "\n".join(lines)

    def _header(self) -> list[str]:
        if self.unchecked is None:
            parent = self.parent_commit or "none: repo will be created"
            return [f"repo {self.repo_id} (branch {self.branch}, parent commit {parent})"]
        checked = len(self.actions)
        return [f"repo {self.repo_id} (branch {self.branch}, parent commit unknown: the Hub was not read)",
                f"checked locally: manifest digests, schemas and publish gates of {checked} package(s), and the "
                "files, index and card below",
                f"{NOT_COMPARED}.", f"why: {self.unchecked}"]


@dataclass
class PublishResult:
    plan: PublishPlan
    commit: str | None
    tags: list[str]
    dry_run: bool = False

    @property
    def repo_id(self) -> str:
        return self.plan.repo_id


# ------------------------------------------------------------------------------------------------- gates


def check_publishable(package: Package, allow_unverified: bool = False,
                      allow_random_weights: bool = False) -> list[str]:
    """Reasons ``package`` may not be published (empty list: it may)."""
    report, problems = package.report, []
    reasons = "; ".join(report["status_reasons"]) or "no reason recorded"
    if package.status in ("failed", "fallback"):
        problems.append(f"status is {package.status!r} ({reasons}); {package.status} packages are never published. "
                        "fix: fix the bake, then run megabake verify")
    elif package.status == "unverified" and not allow_unverified:
        problems.append(f"status is 'unverified' ({reasons}). fix: run `megabake verify` on a GPU of class "
                        f"{report['gpu_class']}, or pass --allow-unverified to publish it labelled unverified")
    if report["model"]["weights"] == "random" and not allow_random_weights:
        problems.append(f"baked from random weights (seed {report['model'].get('seed')}), not a pretrained model. "
                        "fix: bake a Hub model at a pinned revision, or pass --allow-random-weights")
    missing = [name for name in REQUIRED_FILES if name not in package.files]
    if missing:
        problems.append(f"missing {', '.join(missing)}. fix: re-bake the package")
    return problems


def _load_packages(packages: Iterable[str | Path | Package], allow_unverified: bool,
                   allow_random_weights: bool) -> list[Package]:
    loaded = [p if isinstance(p, Package) else read_package(p) for p in packages]
    if not loaded:
        raise PublishRefusedError("no packages given. fix: pass package folders (see `megabake ls`)")
    problems, seen = [], {}
    for package in loaded:
        problems += [f"{package.path}: {p}" for p in check_publishable(package, allow_unverified, allow_random_weights)]
        if package.repo_path in seen:
            problems.append(f"{package.path} and {seen[package.repo_path]} are the same package {package.repo_path}")
        seen[package.repo_path] = package.path
    if problems:
        raise PublishRefusedError("refusing to publish:\n  " + "\n  ".join(problems))
    return loaded


def _package_bytes(package: Package) -> dict[str, bytes]:
    """Every file of the package as bytes, each checked against manifest.json (the bytes that get uploaded)."""
    out = {}
    for entry in package.manifest["files"]:
        data = (package.path / entry["path"]).read_bytes()
        if sha256_bytes(data) != entry["sha256"]:
            raise DigestMismatchError(str(package.path), entry["path"], entry["sha256"], sha256_bytes(data))
        out[entry["path"]] = data
    out[MANIFEST] = (package.path / MANIFEST).read_bytes()
    return out


# -------------------------------------------------------------------------------------------------- read


def make_api(endpoint: str | None = None, token: str | bool | None = None) -> HfApi:
    return HfApi(endpoint=endpoint, token=token, library_name="megabake")


@dataclass
class _RemoteReader:
    """Reads small files of the repo at a revision into a scratch cache (never the user's HF cache)."""

    api: HfApi
    repo_id: str
    cache_dir: str

    def read(self, path: str, revision: str) -> bytes | None:
        """The file's bytes; None ONLY when the Hub answers 404 for it. Any other failure: HubIOError."""
        with hub_io(f"reading {self.repo_id}@{revision[:12]}:{path}", NOTHING_PUBLISHED, self.api.endpoint, path):
            try:
                local = self.api.hf_hub_download(self.repo_id, path, revision=revision, cache_dir=self.cache_dir)
            except EntryNotFoundError as exc:
                if is_absent(exc):
                    return None
                raise
            return Path(local).read_bytes()

    def read_many(self, paths: list[str], revision: str) -> list[bytes | None]:
        if not paths:
            return []
        with ThreadPoolExecutor(max_workers=min(READ_WORKERS, len(paths))) as pool:
            return list(pool.map(lambda path: self.read(path, revision), paths))


def read_remote(api: HfApi, repo_id: str, head: str | None, scratch: str) -> RemoteState:
    """The repo at ``head`` (None: no repo): tags, every package folder (report + manifest), the registry index."""
    state = RemoteState(head)
    if not state.exists:
        return state
    reader = _RemoteReader(api, repo_id, scratch)
    with hub_io(f"listing the refs and files of {repo_id}@{state.parent[:12]}", NOTHING_PUBLISHED, api.endpoint):
        state.tags = {t.name: t.target_commit for t in api.list_repo_refs(repo_id).tags}
        files = api.list_repo_files(repo_id, revision=state.parent)
    folders = sorted({p[: -len(MANIFEST) - 1] for p in files if p.startswith(PACKAGES_PREFIX)
                      and p.endswith("/" + MANIFEST)})
    paths = [f"{folder}/{name}" for folder in folders for name in (MANIFEST, REPORT)] + [INDEX_PATH]
    data = reader.read_many(paths, state.parent)
    for n, folder in enumerate(folders):
        state.packages[folder] = _remote_package(folder, data[2 * n], data[2 * n + 1])
    state.index, state.index_state = _parse_index(data[-1], f"{repo_id}@{state.parent[:12]}:{INDEX_PATH}")
    return state


def _remote_package(folder: str, manifest: bytes | None, report: bytes | None) -> RemotePackage:
    """Parse and cross-check one package folder of the repo (manifest digest of report.json, schemas, path)."""
    package = RemotePackage(folder, manifest)
    try:
        listed = {e["path"]: e["sha256"] for e in validate("manifest", json.loads(manifest or b"null"))["files"]}
        if report is None or listed.get(REPORT) != sha256_bytes(report):
            raise ValueError("report.json is missing or does not match manifest.json")
        package.report = validate("report", json.loads(report))
        model = package.report["model"]
        if repo_path(model["id"], model["revision"], package.report["variant"]) != folder:
            raise ValueError(f"report.json describes {model['id']}@{model['revision']} "
                             f"{package.report['variant']}, which belongs elsewhere")
    except (ValueError, TypeError, KeyError) as exc:
        package.report = None
        package.problem = str(exc).splitlines()[0]
    return package


def _parse_index(data: bytes | None, where: str) -> tuple[dict[str, Any] | None, str]:
    if data is None:
        return None, "absent"
    try:
        return validate("registry_index", json.loads(data), source=where), "present"
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"unusable ({str(exc).splitlines()[0]})"


def _branch_head(api: HfApi, repo_id: str, branch: str) -> str | None:
    with hub_io(f"reading the head of {repo_id}@{branch}", NOTHING_PUBLISHED, api.endpoint):
        try:
            return api.repo_info(repo_id, revision=branch).sha
        except RepositoryNotFoundError:
            return None
        except RevisionNotFoundError:
            raise HubError(f"branch {branch!r} does not exist in {repo_id}. fix: create it "
                           f"(HfApi.create_branch) or publish to an existing branch") from None


# -------------------------------------------------------------------------------------------------- plan


def plan_publish(api: HfApi, packages: Iterable[str | Path | Package], repo_id: str, *, branch: str = "main",
                 parent_commit: str | None = None, allow_unverified: bool = False,
                 allow_random_weights: bool = False) -> PublishPlan:
    """Read the repo at the branch head and decide what to write (the head must be ``parent_commit`` if given)."""
    loaded = _load_packages(packages, allow_unverified, allow_random_weights)
    head = _branch_head(api, repo_id, branch)
    _check_parent(repo_id, branch, parent_commit, head)
    with tempfile.TemporaryDirectory(prefix="megabake-publish-") as scratch:
        remote = read_remote(api, repo_id, head, scratch)
        reader = _RemoteReader(api, repo_id, scratch)
        actions = [_decide(reader, remote, package) for package in loaded]
    index, notes = rebuild_index(repo_id, remote, actions)
    plan = PublishPlan(repo_id, branch, remote.parent, remote.exists, actions, index, notes=notes)
    if any(a.action == "upload" for a in actions) or _index_changed(remote, index):
        _fill_commit(plan)
    return plan


def _check_parent(repo_id: str, branch: str, parent_commit: str | None, head: str | None) -> None:
    if parent_commit is not None and parent_commit != head:
        raise PublishConflictError(
            f"{repo_id}@{branch} moved: --parent-commit {parent_commit} was asked for, but the branch head is "
            f"{head}. Nothing was written and nothing was overwritten. fix: review the new head "
            "(--dry-run) and publish again with its commit")


def plan_offline(packages: Iterable[str | Path | Package], repo_id: str, reason: str, *, branch: str = "main",
                 allow_unverified: bool = False, allow_random_weights: bool = False) -> PublishPlan:
    """The plan from the local packages alone (the Hub could not be read): every package an upload."""
    loaded = _load_packages(packages, allow_unverified, allow_random_weights)
    actions = [PackageAction(p, p.repo_path, package_tag(p.model_id, p.model_revision, p.report["variant"]),
                             "upload", "not compared with the Hub") for p in loaded]
    index, _ = rebuild_index(repo_id, RemoteState(None), actions)
    plan = PublishPlan(repo_id, branch, None, False, actions, index, unchecked=reason,
                       notes=["built from these packages only (the repo's packages were not read)"])
    _fill_commit(plan)
    return plan


def _fill_commit(plan: PublishPlan) -> None:
    plan.files = _commit_files(plan.repo_id, plan.actions, plan.index)
    uploaded = [a for a in plan.actions if a.action == "upload"]
    plan.commit_message = f"megabake publish: {len(uploaded)} package(s)"
    plan.commit_description = "\n".join([*(f"- {a.path_in_repo} ({a.package.status}) tag {a.tag}"
                                           for a in plan.actions), *(f"- index: {n}" for n in plan.notes)])


def rebuild_index(repo_id: str, remote: RemoteState, actions: list[PackageAction]) -> tuple[dict[str, Any], list[str]]:
    """The registry index of the repo after this publish: every readable package folder at the parent, plus this
    publish's packages (which replace same-path folders); and notes on what changed versus the index found."""
    tags = set(remote.tags) | {a.tag for a in actions if a.action in ("upload", "tag")}
    entries = _remote_entries(repo_id, remote, tags)
    entries += [(a.package.model_id, a.package.model_revision, registry_entry(a.package, repo_id, a.tag))
                for a in actions if a.action != "skip"]
    index = merge_index(empty_index(), entries)
    return index, _index_notes(remote, index)


def _remote_entries(repo_id: str, remote: RemoteState, tags: set[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """Index entries of the readable package folders at the parent (tag null when the tag does not exist)."""
    entries = []
    for package in remote.packages.values():
        if package.report is None:
            continue
        report, model = package.report, package.report["model"]
        tag = package_tag(model["id"], model["revision"], report["variant"])
        entry = entry_from_report(report, sha256_bytes(package.manifest), repo_id, tag if tag in tags else None)
        entries.append((model["id"], model["revision"], entry))
    return entries


def _index_notes(remote: RemoteState, index: dict[str, Any]) -> list[str]:
    if not remote.exists:
        return []
    notes = [f"left out {p.path}: unreadable package folder ({p.problem}). fix: republish that package"
             for p in remote.packages.values() if p.problem]
    if remote.index is None:
        return [f"{INDEX_PATH} at the parent is {remote.index_state}: rebuilt from the {len(remote.packages)} "
                "package folder(s) in the repo and this publish", *notes]
    before = {e["path"] for _, _, e in iter_entries(remote.index)}
    after = {e["path"] for _, _, e in iter_entries(index)}
    in_repo = set(remote.packages)
    repaired = sorted((after - before) & in_repo)
    if repaired:
        notes.append(f"repaired: {len(repaired)} package(s) in the repo were missing from {INDEX_PATH}: "
                     + ", ".join(repaired))
    dropped = sorted(before - after)
    if dropped:
        notes.append("dropped (no readable package folder in the repo): " + ", ".join(dropped))
    return notes


def _index_changed(remote: RemoteState, index: dict[str, Any]) -> bool:
    if remote.index is not None:
        return index["models"] != remote.index["models"]
    return bool(index["models"]) or remote.index_state != "absent"


def _commit_files(repo_id: str, actions: list[PackageAction], index: dict[str, Any]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for action in actions:
        if action.action == "upload":
            for name, data in _package_bytes(action.package).items():
                files[f"{action.path_in_repo}/{name}"] = data
    files[INDEX_PATH] = dump_json(index)
    files[CARD_PATH] = render_model_card(repo_id, index).encode()
    return files


def _decide(reader: _RemoteReader, remote: RemoteState, package: Package) -> PackageAction:
    tag = package_tag(package.model_id, package.model_revision, package.report["variant"])
    path = package.repo_path
    local = (package.path / MANIFEST).read_bytes()
    at_parent = remote.packages.get(path)
    if tag in remote.tags:
        commit = remote.tags[tag]
        if _manifest_at(reader, remote, path, commit) == local:
            return PackageAction(package, path, tag, "skip", f"already published at tag {tag}")
        raise ImmutableTagError(
            f"tag {tag} already exists in {reader.repo_id} (commit {commit[:12]}) and names a different "
            f"{path}/manifest.json than {package.path}; package tags are immutable. fix: publish to another repo, "
            "or, to withdraw the old package deliberately, delete the tag first (HfApi.delete_tag)")
    if at_parent is not None and at_parent.manifest == local:
        return PackageAction(package, path, tag, "tag", "files already on the branch, tag missing")
    return PackageAction(package, path, tag, "upload", "new" if remote.exists else "new repo")


def _manifest_at(reader: _RemoteReader, remote: RemoteState, path: str, commit: str) -> bytes | None:
    """``path``/manifest.json at ``commit`` (already read when ``commit`` is the parent)."""
    if commit == remote.parent:
        return remote.packages[path].manifest if path in remote.packages else None
    return reader.read(f"{path}/{MANIFEST}", commit)


# ------------------------------------------------------------------------------------------------ commit


def commit_publish(api: HfApi, plan: PublishPlan) -> PublishResult:
    """Write ``plan``: one commit on top of ``plan.parent_commit`` (if anything changed), then its tags."""
    if plan.unchecked is not None:
        raise HubError(f"this plan was made without reading {plan.repo_id} ({plan.unchecked}) and cannot be "
                       "committed. fix: rerun publish once the Hub can be reached")
    commit = plan.parent_commit
    if plan.files:
        commit = _create_commit(api, plan)
    created = []
    for tag in plan.tags:
        try:
            api.create_tag(plan.repo_id, tag=tag, revision=commit, tag_message=f"megabake package {tag}")
        except LIBRARY_ERRORS as exc:
            _, failure, _ = describe(exc, api.endpoint)
            raise HubError(f"commit {commit} landed in {plan.repo_id}, but tag {tag} could not be created "
                           f"({failure}). fix: rerun the same publish command: it skips what is published and "
                           "creates the missing tags") from exc
        created.append(tag)
    return PublishResult(plan, commit if plan.files or created else None, created)


def _create_commit(api: HfApi, plan: PublishPlan) -> str:
    operations = [CommitOperationAdd(path, data) for path, data in sorted(plan.files.items())]
    try:
        info = api.create_commit(plan.repo_id, operations, commit_message=plan.commit_message,
                                 commit_description=plan.commit_description, revision=plan.branch,
                                 parent_commit=plan.parent_commit)
    except HfHubHTTPError as exc:
        if exc.response is not None and exc.response.status_code in (409, 412):
            raise _conflict(api, plan, exc) from exc
        raise _failed(api, plan, exc) from exc
    except LIBRARY_ERRORS as exc:
        raise _failed(api, plan, exc) from exc
    return info.oid


def _current_head(api: HfApi, plan: PublishPlan) -> str:
    try:
        return _branch_head(api, plan.repo_id, plan.branch) or "unknown"
    except Exception as exc:  # best effort: only used to make the error message precise
        return f"unknown ({type(exc).__name__})"


def _conflict(api: HfApi, plan: PublishPlan, exc: Exception) -> PublishConflictError:
    return PublishConflictError(
        f"{plan.repo_id}@{plan.branch} moved: this publish was planned on parent commit {plan.parent_commit}, "
        f"but the branch head is now {_current_head(api, plan)} (another publisher committed first). Nothing was "
        "written and nothing was overwritten. fix: rerun the publish; it re-reads the repo and rebuilds the "
        f"registry index from every package in it (server said: {exc})")


def _failed(api: HfApi, plan: PublishPlan, exc: Exception) -> PublishFailedError:
    head = _current_head(api, plan)
    landed = ("the branch head is unchanged, so nothing of this publish is visible" if head == plan.parent_commit
              else f"the branch head is now {head}; check it with HfApi.list_repo_commits")
    _, failure, _ = describe(exc, api.endpoint)
    return PublishFailedError(
        f"the commit to {plan.repo_id}@{plan.branch} did not complete ({failure}); the Hub applies a commit "
        f"all-or-nothing and {landed}. No tag was created. fix: rerun the same publish command; it is idempotent "
        "(packages already published are skipped)")


# ------------------------------------------------------------------------------------------------- entry


def publish(packages: Iterable[str | Path | Package], repo_id: str, *, branch: str = "main",
            parent_commit: str | None = None, allow_unverified: bool = False, allow_random_weights: bool = False,
            dry_run: bool = False, private: bool | None = None, endpoint: str | None = None,
            token: str | bool | None = None) -> PublishResult:
    """Publish ``packages`` to ``repo_id`` (see the module docstring). ``dry_run`` writes nothing."""
    api = make_api(endpoint, token)
    loaded = _load_packages(packages, allow_unverified, allow_random_weights)  # refuse before touching the Hub
    gates = dict(branch=branch, allow_unverified=allow_unverified, allow_random_weights=allow_random_weights)
    if dry_run:
        return PublishResult(_dry_plan(api, loaded, repo_id, parent_commit, gates), None, [], dry_run=True)
    with hub_io(f"creating or opening the repo {repo_id}", NOTHING_PUBLISHED, api.endpoint):
        api.create_repo(repo_id, exist_ok=True, private=private)
    plan = plan_publish(api, loaded, repo_id, parent_commit=parent_commit, **gates)
    return commit_publish(api, plan)


def _dry_plan(api: HfApi, loaded: list[Package], repo_id: str, parent_commit: str | None,
              gates: dict[str, Any]) -> PublishPlan:
    """The plan against the Hub, or, when the Hub cannot be read, the local-only plan saying what was not compared."""
    try:
        return plan_publish(api, loaded, repo_id, parent_commit=parent_commit, **gates)
    except HubIOError as exc:
        return plan_offline(loaded, repo_id, str(exc), **gates)
