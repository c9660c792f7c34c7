"""Publish verified packages to a Hugging Face Hub repo in one atomic commit, with tags, card and index.

Contract: ``publish(packages, repo_id, ...)`` reads and re-verifies every package, refuses packages that are
not verified / baked from random weights / failed / incomplete (``allow_unverified`` and
``allow_random_weights`` lift the first two), then, with the real ``huggingface_hub`` client:

1. ``create_repo(exist_ok=True)``; read the branch head (the parent commit), the tags, and
   ``registry/index.json`` at the parent;
2. ``create_commit(..., parent_commit=parent)`` adding every file of every package that is not already there,
   the merged ``registry/index.json`` and a regenerated ``README.md`` model card -- ONE commit, so readers see
   all of it or none of it, and a concurrent publisher gets :class:`PublishConflictError`;
3. ``create_tag`` per package: ``<org>--<model>.<model-rev>.<variant>``, never moved. Re-publishing identical
   packages is a no-op; different contents under an existing tag raise :class:`ImmutableTagError`.

``plan_publish`` does steps 1 without writing (``dry_run=True`` returns its plan); ``commit_publish`` does 2-3.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import httpx
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from megabake.hub.card import render_model_card
from megabake.hub.errors import (
    HubError,
    ImmutableTagError,
    PublishConflictError,
    PublishFailedError,
    PublishRefusedError,
)
from megabake.package import (
    DigestMismatchError,
    Package,
    empty_index,
    merge_index,
    package_tag,
    read_package,
    registry_entry,
    sha256_bytes,
    validate,
)
from megabake.package.store import MANIFEST, MODULE, PLAN, dump_json

INDEX_PATH = "registry/index.json"
CARD_PATH = "README.md"
REQUIRED_FILES = (MODULE, PLAN)


@dataclass
class PackageAction:
    """What publishing does with one package: "upload" its files, only "tag" it (already at the parent), "skip"."""

    package: Package
    path_in_repo: str
    tag: str
    action: str
    reason: str


@dataclass
class PublishPlan:
    """Everything one publish would write; ``files`` maps repo paths to bytes (empty: nothing to commit)."""

    repo_id: str
    branch: str
    parent_commit: str | None
    repo_exists: bool
    actions: list[PackageAction]
    index: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)
    commit_message: str = ""
    commit_description: str = ""

    @property
    def tags(self) -> list[str]:
        return [a.tag for a in self.actions if a.action in ("upload", "tag")]

    def summary(self) -> str:
        parent = self.parent_commit or "none: repo will be created"
        lines = [f"repo {self.repo_id} (branch {self.branch}, parent commit {parent})"]
        for a in self.actions:
            lines.append(f"  {a.action:6} {a.path_in_repo}  tag {a.tag}  ({a.package.status}; {a.reason})")
        if self.files:
            lines.append(f"one commit, {len(self.files)} files: {self.commit_message!r}")
            for path, data in sorted(self.files.items()):
                lines.append(f"  {len(data):>9} B  {sha256_bytes(data)[:16]}  {path}")
        else:
            lines.append("no commit needed")
        if self.tags:
            lines.append("tags: " + ", ".join(self.tags))
        return "\n".join(lines)


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


# -------------------------------------------------------------------------------------------------- plan


def make_api(endpoint: str | None = None, token: str | bool | None = None) -> HfApi:
    return HfApi(endpoint=endpoint, token=token, library_name="megabake")


def plan_publish(api: HfApi, packages: Iterable[str | Path | Package], repo_id: str, *, branch: str = "main",
                 parent_commit: str | None = None, allow_unverified: bool = False,
                 allow_random_weights: bool = False) -> PublishPlan:
    """Read the repo state at ``parent_commit`` (default: the branch head) and decide what to write."""
    loaded = _load_packages(packages, allow_unverified, allow_random_weights)
    head = _branch_head(api, repo_id, branch)
    if parent_commit is not None and parent_commit != head:
        raise PublishConflictError(
            f"{repo_id}@{branch} moved: --parent-commit {parent_commit} was asked for, but the branch head is "
            f"{head}. Nothing was written and nothing was overwritten. fix: review the new head "
            "(--dry-run) and publish again with its commit")
    parent = head
    exists = head is not None
    tags = {t.name: t.target_commit for t in api.list_repo_refs(repo_id).tags} if exists else {}
    with tempfile.TemporaryDirectory(prefix="megabake-publish-") as scratch:
        reader = _RemoteReader(api, repo_id, scratch)
        remote_index = reader.index(parent) if exists else empty_index()
        actions = [_decide(reader, package, tags, parent if exists else None) for package in loaded]
    entries = [(a.package.model_id, a.package.model_revision, registry_entry(a.package, repo_id, a.tag))
               for a in actions if a.action != "skip"]
    index = merge_index(remote_index, entries)
    plan = PublishPlan(repo_id, branch, parent, exists, actions, index)
    if any(a.action == "upload" for a in actions) or index["models"] != remote_index["models"]:
        plan.files = _commit_files(repo_id, actions, index)
        uploaded = [a for a in actions if a.action == "upload"]
        plan.commit_message = f"megabake publish: {len(uploaded)} package(s)"
        plan.commit_description = "\n".join(f"- {a.path_in_repo} ({a.package.status}) tag {a.tag}" for a in actions)
    return plan


def _commit_files(repo_id: str, actions: list[PackageAction], index: dict[str, Any]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for action in actions:
        if action.action == "upload":
            for name, data in _package_bytes(action.package).items():
                files[f"{action.path_in_repo}/{name}"] = data
    files[INDEX_PATH] = dump_json(index)
    files[CARD_PATH] = render_model_card(repo_id, index).encode()
    return files


def _decide(reader: "_RemoteReader", package: Package, tags: dict[str, str], parent: str | None) -> PackageAction:
    tag = package_tag(package.model_id, package.model_revision, package.report["variant"])
    path = package.repo_path
    local = (package.path / MANIFEST).read_bytes()
    if tag in tags:
        if reader.read(f"{path}/{MANIFEST}", tags[tag]) == local:
            return PackageAction(package, path, tag, "skip", f"already published at tag {tag}")
        raise ImmutableTagError(
            f"tag {tag} already exists in {reader.repo_id} (commit {tags[tag][:12]}) and names a different "
            f"{path}/manifest.json than {package.path}; package tags are immutable. fix: publish to another repo, "
            "or, to withdraw the old package deliberately, delete the tag first (HfApi.delete_tag)")
    if parent is not None and reader.read(f"{path}/{MANIFEST}", parent) == local:
        return PackageAction(package, path, tag, "tag", "files already on the branch, tag missing")
    return PackageAction(package, path, tag, "upload", "new" if parent else "new repo")


@dataclass
class _RemoteReader:
    """Reads small files of the repo at a revision into a scratch cache (never the user's HF cache)."""

    api: HfApi
    repo_id: str
    cache_dir: str

    def read(self, path: str, revision: str) -> bytes | None:
        try:
            return Path(self.api.hf_hub_download(self.repo_id, path, revision=revision,
                                                 cache_dir=self.cache_dir)).read_bytes()
        except EntryNotFoundError:
            return None

    def index(self, revision: str) -> dict[str, Any]:
        data = self.read(INDEX_PATH, revision)
        if data is None:
            return empty_index()
        try:
            return validate("registry_index", json.loads(data), source=f"{self.repo_id}@{revision[:12]}:{INDEX_PATH}")
        except ValueError as exc:
            raise HubError(f"{self.repo_id}@{revision}: {INDEX_PATH} is unusable ({exc}). fix: repair or delete "
                           "it in the Hub repo; it is rebuilt from the packages on the next publish") from None


def _branch_head(api: HfApi, repo_id: str, branch: str) -> str | None:
    try:
        return api.repo_info(repo_id, revision=branch).sha
    except RepositoryNotFoundError:
        return None
    except RevisionNotFoundError:
        raise HubError(f"branch {branch!r} does not exist in {repo_id}. fix: create it "
                       f"(HfApi.create_branch) or publish to an existing branch") from None


# ------------------------------------------------------------------------------------------------ commit


def commit_publish(api: HfApi, plan: PublishPlan) -> PublishResult:
    """Write ``plan``: one commit on top of ``plan.parent_commit`` (if anything changed), then its tags."""
    commit = plan.parent_commit
    if plan.files:
        operations = [CommitOperationAdd(path, data) for path, data in sorted(plan.files.items())]
        try:
            info = api.create_commit(plan.repo_id, operations, commit_message=plan.commit_message,
                                     commit_description=plan.commit_description, revision=plan.branch,
                                     parent_commit=plan.parent_commit)
        except HfHubHTTPError as exc:
            if exc.response is not None and exc.response.status_code in (409, 412):
                raise _conflict(api, plan, exc) from exc
            raise _failed(api, plan, exc) from exc
        except (httpx.HTTPError, OSError) as exc:
            raise _failed(api, plan, exc) from exc
        commit = info.oid
    created = []
    for tag in plan.tags:
        try:
            api.create_tag(plan.repo_id, tag=tag, revision=commit, tag_message=f"megabake package {tag}")
        except HfHubHTTPError as exc:
            raise HubError(f"commit {commit} landed in {plan.repo_id}, but tag {tag} could not be created ({exc}). "
                           "fix: rerun the same publish command: it skips what is published and creates "
                           "the missing tags") from exc
        created.append(tag)
    return PublishResult(plan, commit if plan.files or created else None, created)


def _current_head(api: HfApi, plan: PublishPlan) -> str:
    try:
        return _branch_head(api, plan.repo_id, plan.branch) or "unknown"
    except Exception as exc:  # best effort: only used to make the error message precise
        return f"unknown ({type(exc).__name__})"


def _conflict(api: HfApi, plan: PublishPlan, exc: Exception) -> PublishConflictError:
    return PublishConflictError(
        f"{plan.repo_id}@{plan.branch} moved: this publish was planned on parent commit {plan.parent_commit}, "
        f"but the branch head is now {_current_head(api, plan)} (another publisher committed first). Nothing was "
        "written and nothing was overwritten. fix: rerun the publish; it re-reads the registry index and merges "
        f"(server said: {exc})")


def _failed(api: HfApi, plan: PublishPlan, exc: Exception) -> PublishFailedError:
    head = _current_head(api, plan)
    landed = ("the branch head is unchanged, so nothing of this publish is visible" if head == plan.parent_commit
              else f"the branch head is now {head}; check it with HfApi.list_repo_commits")
    return PublishFailedError(
        f"the commit to {plan.repo_id}@{plan.branch} did not complete ({type(exc).__name__}: {exc}); the Hub "
        f"applies a commit all-or-nothing and {landed}. No tag was created. fix: rerun the same publish command; "
        "it is idempotent (packages already published are skipped)")


# ------------------------------------------------------------------------------------------------- entry


def publish(packages: Iterable[str | Path | Package], repo_id: str, *, branch: str = "main",
            parent_commit: str | None = None, allow_unverified: bool = False, allow_random_weights: bool = False,
            dry_run: bool = False, private: bool | None = None, endpoint: str | None = None,
            token: str | bool | None = None) -> PublishResult:
    """Publish ``packages`` to ``repo_id`` (see the module docstring). ``dry_run`` writes nothing."""
    api = make_api(endpoint, token)
    loaded = _load_packages(packages, allow_unverified, allow_random_weights)  # refuse before touching the Hub
    if not dry_run:
        api.create_repo(repo_id, exist_ok=True, private=private)
    plan = plan_publish(api, loaded, repo_id, branch=branch, parent_commit=parent_commit,
                        allow_unverified=allow_unverified, allow_random_weights=allow_random_weights)
    if dry_run:
        return PublishResult(plan, None, [], dry_run=True)
    return commit_publish(api, plan)
