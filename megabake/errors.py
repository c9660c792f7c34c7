"""Error types shared across the pipeline. Every message names the cause and the fix."""

from __future__ import annotations


class MegaBakeError(Exception):
    """Base class: a user-facing failure with an actionable message."""


class UnsupportedGraphError(MegaBakeError):
    """The captured graph holds a node the IR cannot express (strict mode)."""


class PlanError(MegaBakeError):
    """The IR does not fit a plan the code generator supports."""


class InputError(MegaBakeError, ValueError):
    """A runtime input is out of range for the baked bucket (position, token id, batch)."""


class DeviceError(MegaBakeError):
    """The GPU cannot run the package (not SM90, cooperative grid does not fit, ...)."""


class MissingDependencyError(MegaBakeError, ImportError):
    """An optional dependency (e.g. nvidia-cutlass-dsl) is needed but not installed."""


def require_cutlass():
    """Import CuTe DSL or raise with install instructions."""
    try:
        import cutlass
        import cutlass.cute  # noqa: F401  (the DSL itself, not only the package shell)
    except ImportError as exc:  # pragma: no cover - exercised by a test with a blocked import
        raise MissingDependencyError(
            "nvidia-cutlass-dsl is required to compile or run MegaBake kernels but is not installed "
            f"({exc}). Install it with: pip install 'megabake[cuda]' "
            "(or: pip install nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1)"
        ) from exc
    return cutlass


def network_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the Hub could not be reached": OSError, plus httpx's transport errors
    (huggingface_hub >= 1.0 talks httpx, whose errors are not OSErrors)."""
    try:
        import httpx
    except ImportError:  # older huggingface_hub (requests): its errors are OSErrors
        return (OSError,)
    return (OSError, httpx.HTTPError)
