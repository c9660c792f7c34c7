"""Errors of the Hub layer (publish, load). Every message names the cause and the fix."""

from __future__ import annotations

from megabake.errors import MegaBakeError


class HubError(MegaBakeError):
    """A publish or load against the Hugging Face Hub could not be done."""


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
