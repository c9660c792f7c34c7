"""Errors of the Hub layer (publish, load), and the translation of huggingface_hub / httpx failures into them.

Contract: every error raised by :mod:`megabake.hub` is a :class:`HubError` (a ``MegaBakeError``) whose message names
the cause and the fix. :func:`hub_io` is a context manager that turns any library failure raised inside it (HTTP
error, connection refused, timeout, truncated or interrupted transfer, offline mode, ...) into
:class:`HubIOError` naming what was being done, the HTTP status or the failure, what was (not) written or imported,
and the fix. :func:`is_absent` tells the one failure that means "this file does not exist at this commit" (a real
HTTP 404 ``EntryNotFound`` answer) from everything else, which never means absent.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator
from urllib.parse import unquote, urlsplit

import httpx
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)

from megabake.errors import InputError, MegaBakeError

RETRYABLE_STATUS = (408, 429, 500, 502, 503, 504)
LIBRARY_ERRORS = (HfHubHTTPError, EntryNotFoundError, RevisionResolutionError, httpx.HTTPError, OSError, ValueError)


class HubError(MegaBakeError):
    """A publish or load against the Hugging Face Hub could not be done."""


class HubIOError(HubError):
    """A Hub request failed (server error, unreachable, truncated or interrupted transfer, not found, refused).

    ``path``: the repo file (or API call) concerned; ``status``: the HTTP status when the Hub answered, else None;
    ``failure``: what went wrong, in words."""

    def __init__(self, message: str, path: str | None = None, status: int | None = None, failure: str = ""):
        super().__init__(message)
        self.path, self.status, self.failure = path, status, failure


class PublishRefusedError(HubError):
    """A package may not be published as is (unverified, random weights, failed, incomplete, duplicate)."""


class PublishConflictError(HubError):
    """The branch moved since the publish was planned (stale parent commit); nothing was written."""


class PublishFailedError(HubError):
    """The commit did not complete (connection dropped, server error); the Hub shows none of it."""


class ImmutableTagError(HubError):
    """A package tag already exists and names different package contents; tags are never moved."""


class NoMatchingPackageError(HubError, LookupError):
    """No published package fits the request; the message lists what exists and what was asked for."""


class UntrustedCodeError(HubError, PermissionError):
    """module.py would be imported without trust_remote_code=True or a caller-pinned commit."""


class LockFileError(HubError, InputError):
    """A lock file cannot be used: unreadable or malformed, no entry for the repo, or the call asks for something
    other than what it pins. Exit code 2 (bad input)."""


class LockChangedError(HubError):
    """``megabake lock`` would replace a lock file that pins other packages, without ``--force``; nothing written."""


# --------------------------------------------------------------------------------------- classification


def is_absent(exc: BaseException) -> bool:
    """True only for a real HTTP 404 "entry not found" answer: the file does not exist at that revision."""
    response = getattr(exc, "response", None)
    return isinstance(exc, RemoteEntryNotFoundError) and response is not None and response.status_code == 404


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during (cause / context), without cycles."""
    seen, out, pending = set(), [], [exc]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        out.append(current)
        pending += [current.__cause__, current.__context__]
    return out


def http_status(exc: BaseException) -> int | None:
    """The HTTP status the Hub answered with, anywhere in the exception chain (None: no answer)."""
    for item in _chain(exc):
        response = getattr(item, "response", None)
        if isinstance(item, (HfHubHTTPError, httpx.HTTPStatusError)) and response is not None:
            return response.status_code
    return None


def failed_path(exc: BaseException) -> str | None:
    """The repo file a failed download was for (from the request URL in the chain), if one is recorded."""
    for item in _chain(exc):
        url = _url_of(item)
        if url and "/resolve/" in url:
            return unquote(urlsplit(url).path.split("/resolve/", 1)[1].split("/", 1)[-1])
    return None


def _url_of(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if response is not None:
        return str(response.url)
    try:
        return str(exc.request.url) if isinstance(exc, httpx.RequestError) else None
    except RuntimeError:  # httpx: request not set
        return None


def describe(exc: BaseException, endpoint: str | None = None) -> tuple[int | None, str, str]:
    """(HTTP status or None, what failed in words, the fix) for a huggingface_hub / httpx failure."""
    status = http_status(exc)
    where = endpoint or "the Hub"
    chain = _chain(exc)
    kinds = {type(item) for item in chain}
    if status is not None:
        return status, *_describe_status(status, chain, where)
    if any(isinstance(item, OfflineModeIsEnabled) for item in chain) or "local_files_only" in str(exc):
        return (None, "offline mode is on (HF_HUB_OFFLINE=1 or local_files_only=True) and what is needed is not in "
                "the Hugging Face cache", "go online (unset HF_HUB_OFFLINE, drop local_files_only) and retry; one "
                "online load caches a package for offline use")
    for item in chain:
        text = _describe_transport(item, where)
        if text:
            return None, text, "check the network and the endpoint, then retry the same command"
    if any(issubclass(k, HFValidationError) for k in kinds):
        return None, f"invalid argument ({exc})", "check the repo id and revision"
    return None, f"{type(exc).__name__}: {_first_line(exc)}", "retry the same command"


def _describe_status(status: int, chain: list[BaseException], where: str) -> tuple[str, str]:
    if any(isinstance(item, RepositoryNotFoundError) for item in chain):
        return (f"the repository was not found on {where} (HTTP {status}; it does not exist, or it is private and "
                "the token cannot see it)", "check the repo id, and log in (`hf auth login`) or pass a token")
    if any(isinstance(item, RevisionNotFoundError) for item in chain):
        return f"the revision was not found (HTTP {status})", "check the branch, tag or commit"
    if status in (401, 403):
        return (f"{where} refused the request (HTTP {status}: not authorised)",
                "log in (`hf auth login`) or pass a token with access to the repo, then retry")
    if status in RETRYABLE_STATUS:
        return (f"{where} answered HTTP {status} (server error / overloaded) and kept answering it through "
                "huggingface_hub's retries", "retry later; the same command is safe to rerun")
    if status == 404:
        return f"{where} answered HTTP 404 (not found)", "check the repo id, revision and file"
    return f"{where} answered HTTP {status}", "retry; if it persists, check the endpoint and the request"


def _describe_transport(exc: BaseException, where: str) -> str | None:
    text = _first_line(exc)
    if isinstance(exc, httpx.ConnectError):
        return f"could not reach the Hub at {where} (connection failed: {text})"
    if isinstance(exc, httpx.TimeoutException):
        return f"{where} did not answer in time ({type(exc).__name__}: {text})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"the connection to {where} closed before a complete answer arrived ({text})"
    if isinstance(exc, httpx.TransportError):
        return f"the connection to {where} broke mid-transfer ({type(exc).__name__}: {text})"
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return f"the download was truncated ({text}); the partial file was discarded"
    if isinstance(exc, ValueError) and "JSON" in type(exc).__name__ + text:
        return f"{where} sent an unreadable (truncated?) answer ({type(exc).__name__}: {text})"
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(exc).__name__


def hub_failure(exc: BaseException, action: str, consequence: str, endpoint: str | None = None,
                path: str | None = None) -> HubIOError:
    """A :class:`HubIOError` for ``exc``: "``action`` failed: <failure>. ``consequence`` fix: <fix>"."""
    status, failure, fix = describe(exc, endpoint)
    path = path or failed_path(exc)
    target = f" failed on {path}" if path and path not in action else " failed"
    return HubIOError(f"{action}{target}: {failure}. {consequence} fix: {fix}", path, status, failure)


@contextmanager
def hub_io(action: str, consequence: str, endpoint: str | None = None, path: str | None = None) -> Iterator[None]:
    """Run Hub I/O; any library failure inside becomes a :class:`HubIOError` (MegaBake errors pass through)."""
    try:
        yield
    except MegaBakeError:
        raise
    except LIBRARY_ERRORS as exc:
        raise hub_failure(exc, action, consequence, endpoint, path) from exc
