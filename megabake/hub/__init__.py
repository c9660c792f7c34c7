"""Hub layer: publish packages to the Hugging Face Hub and load them back.

Contract: ``publish(packages, repo_id, ...)`` -> :class:`PublishResult` (one atomic commit with every package
file, ``registry/index.json`` and the ``README.md`` model card; one immutable tag per package);
``load_from_hub(repo_id, revision, ...)`` -> runnable decoder; ``fetch_package(...)`` -> verified
:class:`FetchedPackage` without importing any code. All Hub I/O goes through ``huggingface_hub``; every failure
of it (server errors, unreachable Hub, truncated or interrupted transfers) surfaces as :class:`HubIOError`, a
``MegaBakeError`` naming the file, the status or failure and the fix -- never as a raw library exception.
Lock files (:mod:`megabake.hub.lock`): ``megabake lock`` pins, per repo, a commit, a package folder and its
manifest digest; ``load_from_hub(..., lockfile=PATH)`` loads exactly that.
"""

from megabake.hub.errors import (
    HubError,
    HubIOError,
    ImmutableTagError,
    LockChangedError,
    LockFileError,
    NoMatchingPackageError,
    PublishConflictError,
    PublishFailedError,
    PublishRefusedError,
    UntrustedCodeError,
)
from megabake.hub.load import (
    FetchedPackage,
    check_trust,
    fetch_package,
    load_from_hub,
    read_hub_index,
    resolve_commit,
)
from megabake.hub.lock import LOCK_FILE, lock_entry, locked_entry, make_lock, read_lock, write_lock
from megabake.hub.publish import (
    CARD_PATH,
    INDEX_PATH,
    PublishPlan,
    PublishResult,
    check_publishable,
    commit_publish,
    make_api,
    plan_publish,
    publish,
)
from megabake.hub.select import Request, select_entry

__all__ = [
    "CARD_PATH",
    "INDEX_PATH",
    "LOCK_FILE",
    "FetchedPackage",
    "HubError",
    "HubIOError",
    "ImmutableTagError",
    "LockChangedError",
    "LockFileError",
    "NoMatchingPackageError",
    "PublishConflictError",
    "PublishFailedError",
    "PublishPlan",
    "PublishRefusedError",
    "PublishResult",
    "Request",
    "UntrustedCodeError",
    "check_publishable",
    "check_trust",
    "commit_publish",
    "fetch_package",
    "load_from_hub",
    "lock_entry",
    "locked_entry",
    "make_lock",
    "make_api",
    "plan_publish",
    "publish",
    "read_hub_index",
    "read_lock",
    "resolve_commit",
    "select_entry",
    "write_lock",
]
