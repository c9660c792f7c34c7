"""Error types shared across the pipeline, and the CLI's exit codes. Every message names the cause and the fix.

Exit codes of every ``megabake`` command (each error class carries its own as ``exit_code``):

* 0 ``EXIT_OK``: done (bake written, package verified, published, listed).
* 1 ``EXIT_FAILED``: a check failed or the work could not be completed: a bake whose status is "failed", a
  package that fails verification or whose files do not match manifest.json, a publish refused or in conflict,
  a Hub that cannot be reached, a model the compiler does not support (:class:`MegaBakeError` by default).
* 2 ``EXIT_USAGE``: usage or bad input, found before any work: an option out of range, an unknown preset, a
  path that does not exist or is not a package, an ``--out`` that cannot be written (click's own usage
  errors, and :class:`InputError`).
* 3 ``EXIT_CANNOT_RUN``: this machine cannot run it: no Hopper GPU, a GPU the plan does not fit, a missing
  optional dependency (:class:`DeviceError`, :class:`MissingDependencyError`).

Errors the CLI reports are printed as one line ``error: <message>`` on stderr (:func:`fail`); click's own
usage errors keep click's ``Usage: ... Error: ...`` form and exit 2.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANNOT_RUN = 3

USAGE_HELP = "usage or bad input (an option out of range, a missing path...), found before any work"
CANNOT_RUN_HELP = "cannot run here (no Hopper GPU, a GPU the plan does not fit, a missing dependency)"
UNAVAILABLE_HELP = "cannot run here: the command is unavailable (a missing dependency)"


def exit_codes_help(ok: str = "ok", failed: str = "a check failed, or the work could not be completed",
                    usage: str = USAGE_HELP, cannot_run: str = CANNOT_RUN_HELP) -> str:
    """The ``Exit codes:`` block of a command's ``--help`` epilog (click keeps its line breaks)."""
    import textwrap

    lines = [textwrap.fill(text, width=100, initial_indent=f"  {code}  ", subsequent_indent="     ")
             for code, text in enumerate((ok, failed, usage, cannot_run))]
    return "\b\nExit codes (errors print `error: <message>` on stderr):\n" + "\n".join(lines)


class MegaBakeError(Exception):
    """Base class: a user-facing failure with an actionable message (exit code 1 unless a subclass says)."""

    exit_code = EXIT_FAILED


class UnsupportedGraphError(MegaBakeError):
    """The captured graph holds a node the IR cannot express (strict mode)."""


class PlanError(MegaBakeError):
    """The IR does not fit a plan the code generator supports."""


class InputError(MegaBakeError, ValueError):
    """Bad input: an argument or runtime input is malformed or out of range (position, token id, batch, an
    option value, a path that is not a package). Exit code 2."""

    exit_code = EXIT_USAGE


class DeviceError(MegaBakeError):
    """The GPU cannot run the package (not SM90, cooperative grid does not fit, ...). Exit code 3."""

    exit_code = EXIT_CANNOT_RUN


class MissingDependencyError(MegaBakeError, ImportError):
    """An optional dependency (e.g. nvidia-cutlass-dsl) is needed but not installed. Exit code 3."""

    exit_code = EXIT_CANNOT_RUN


# ------------------------------------------------------------------------------------------- CLI reporting


def exit_code_of(exc: BaseException) -> int:
    """The exit code for ``exc``: its class's ``exit_code`` (1, 2 or 3), else 1."""
    code = getattr(exc, "exit_code", None)
    return code if code in (EXIT_FAILED, EXIT_USAGE, EXIT_CANNOT_RUN) else EXIT_FAILED


def fail(message, exit_code: int | None = None) -> NoReturn:
    """CLI only: print ``error: <message>`` on stderr and exit. ``message`` may be an exception, whose
    ``exit_code`` is used unless ``exit_code`` is given (default 1)."""
    import click

    if exit_code is None:
        exit_code = exit_code_of(message) if isinstance(message, BaseException) else EXIT_FAILED
    click.secho(f"error: {message}", fg="red", err=True)
    raise SystemExit(exit_code)


def reports_errors(func):
    """Decorate a click command's callback (innermost, right above ``def``): a :class:`MegaBakeError` becomes
    ``error: <message>`` and its exit code, an ``OSError`` (a file or the network failed) ``error: ...`` and 1;
    never a traceback. Works whether the command runs under ``megabake`` or on its own (tests)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except MegaBakeError as exc:
            fail(exc)
        except BrokenPipeError:  # click handles a closed stdout itself
            raise
        except OSError as exc:
            fail(os_error_message(exc), EXIT_FAILED)

    return wrapper


def os_error_message(exc: OSError) -> str:
    """``OSError`` as one readable line: what failed on which file."""
    if exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc) or type(exc).__name__


# ------------------------------------------------------------------------- input checks shared by commands

# Hub repo ids: ORG/NAME, each part letters, digits, '-', '_', '.', no '--' or '..', not starting or ending
# with '-' or '.', at most 96 characters (the Hub's own rules).
_HUB_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
HUB_REPO_ID_RE = re.compile(rf"^{_HUB_NAME}/{_HUB_NAME}$")
COMMIT_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def check_repo_id(repo_id: str, option: str = "--repo") -> str:
    """A Hub repo id of the form ORG/NAME, or :class:`InputError` naming ``option``."""
    if not HUB_REPO_ID_RE.match(repo_id or "") or "--" in repo_id or ".." in repo_id:
        raise InputError(f"{option} {repo_id!r} is not a Hub repo id of the form ORG/NAME (letters, digits, "
                         "'-', '_', '.'; no '--' or '..'; at most 96 characters per part), e.g. "
                         "my-org/SmolLM-135M-megabake")
    return repo_id


def check_commit_sha(sha: str, option: str) -> str:
    """A full 40-hex (lowercase) commit sha, or :class:`InputError` naming ``option``."""
    if not COMMIT_SHA_RE.match(sha or ""):
        raise InputError(f"{option} {sha!r} is not a full commit sha (40 lowercase hex digits); copy it from "
                         "`megabake publish --dry-run` or the repo's commit history")
    return sha


def check_endpoint(url: str, option: str = "--endpoint") -> str:
    """An http(s) URL with a host, or :class:`InputError`."""
    if not re.match(r"^https?://[^/\s]+", url or ""):
        raise InputError(f"{option} {url!r} is not an http(s) URL such as https://huggingface.co")
    return url


def check_out_dir(path, option: str = "--out") -> list[Path]:
    """Before any work: make sure ``path`` is a directory this process can write, creating it (and missing
    parents) and writing then deleting a probe file in it. Returns the directories it created, deepest first,
    so a caller whose work then fails can :func:`remove_created` them. Raises :class:`InputError`."""
    import tempfile

    path = Path(path).expanduser()
    fix = f"fix: pass a folder you can write to with {option}"
    try:
        if path.exists() and not path.is_dir():
            raise InputError(f"{option} {path} exists and is not a directory. {fix}")
        created: list[Path] = []
        probe = path.absolute()
        while not probe.exists():
            created.append(probe)
            probe = probe.parent
        if not probe.is_dir():
            raise InputError(f"{option} {path} cannot be created: {probe} is not a directory. {fix}")
    except OSError as exc:
        raise InputError(f"{option} {path} cannot be checked ({os_error_message(exc)}). {fix}") from None
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=".megabake-write-check-", dir=path)
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        remove_created(created)
        raise InputError(f"{option} {path} is not a writable directory ({exc.strerror or exc}). {fix}") from None
    return created


def remove_created(directories: list[Path]) -> None:
    """Remove the (still empty) directories :func:`check_out_dir` created; anything else is left alone."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


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
