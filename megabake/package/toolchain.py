"""The toolchain a package was built with, and whether this machine's toolchain can load it.

Contract:

* ``toolchain_record() -> dict``: what made a package's device code, recorded in ``report.json``'s
  ``toolchain`` and in a precompiled kernel's metadata: ``megabake`` (version), ``cutlass_dsl`` (the
  nvidia-cutlass-dsl version), ``cutlass_dsl_cuda`` (the CUDA version CuTe DSL compiles with, e.g. ``"13.4"``),
  ``torch_cuda`` (``torch.version.cuda``), ``driver_min`` (the oldest NVIDIA driver that runs code built with
  that CUDA: the major-release minimum of CUDA minor-version compatibility, ``"580"`` for CUDA 13.x),
  ``host`` (``<machine>-<os>`` of a precompiled object's host code) and ``python``. Unknown -> None; works
  without CuTe DSL, torch or a GPU.
* ``precompiled_record() -> dict``: the part of it an exported kernel depends on (``megabake``,
  ``cutlass_dsl``, ``cutlass_dsl_cuda``, ``driver_min``, ``host``), kept in its metadata: the same on every
  machine of one ISA with one CuTe DSL, so a package's digests do not depend on the python or torch of the
  machine that baked it.
* ``check_compatible(record, *, precompiled)`` returns None when this machine can use a package built with
  ``record``, else raises :class:`ToolchainError` (exit code 3) naming what differs and the fix. Rules:

  - JIT from ``module.py`` (``precompiled=False``) needs the same CuTe DSL **major.minor**. module.py is CuTe DSL
    source: its API and the DSL's AST rewriting change between minor releases (functions renamed or removed,
    control-flow and constexpr rules tightened), which shows up as a trace error deep inside the first compile
    or, worse, as different code; patch releases keep the API and bring fixes, and ``megabake verify``
    re-checks numerics under whatever DSL runs.
  - A precompiled object (``precompiled=True``) needs the **exact** CuTe DSL version (its host code is linked
    against that release's runtime library and its metadata is decoded by that release), the same host
    machine and OS, and an installed driver >= ``driver_min`` (when this machine has a driver to read).
  - A record without a ``cutlass_dsl`` (packages baked before it was recorded, or without CuTe DSL) cannot be
    checked and passes; CuTe DSL missing here is an error either way (nothing can compile or load).
"""

from __future__ import annotations

import platform

from ..errors import EXIT_CANNOT_RUN, MegaBakeError

# CUDA major -> the oldest Linux driver of that major release family (CUDA minor version compatibility).
DRIVER_MINIMUM = {11: "450.80.02", 12: "525.60.13", 13: "580"}


class ToolchainError(MegaBakeError):
    """This machine's toolchain cannot load the package (CuTe DSL version, host, driver). Exit code 3."""

    exit_code = EXIT_CANNOT_RUN


def toolchain_record() -> dict:
    from .. import __version__

    dsl_cuda = _dsl_cuda_version()
    return {
        "megabake": __version__,
        "cutlass_dsl": _cutlass_dsl_version(),
        "cutlass_dsl_cuda": dsl_cuda,
        "torch_cuda": _torch_cuda_version(),
        "driver_min": driver_minimum(dsl_cuda),
        "host": host_platform(),
        "python": platform.python_version(),
    }


PRECOMPILED_KEYS = ("megabake", "cutlass_dsl", "cutlass_dsl_cuda", "driver_min", "host")


def precompiled_record() -> dict:
    record = toolchain_record()
    return {key: record[key] for key in PRECOMPILED_KEYS}


def host_platform() -> str:
    """``x86_64-linux``: the machine a precompiled object's host code runs on."""
    return f"{platform.machine().lower()}-{platform.system().lower()}"


def driver_minimum(cuda_version: str | None) -> str | None:
    """The oldest driver of ``cuda_version``'s major release family (``"13.4"`` -> ``"580"``), else None."""
    try:
        return DRIVER_MINIMUM.get(int(str(cuda_version).split(".")[0]))
    except ValueError:
        return None


def check_compatible(record: dict, *, precompiled: bool) -> None:
    """None if a package built with ``record`` can be used here (JIT or precompiled), else ToolchainError."""
    here = toolchain_record()
    wanted = (record or {}).get("cutlass_dsl")
    if here["cutlass_dsl"] is None:
        raise ToolchainError(f"CuTe DSL is not installed here, and the package was built with nvidia-cutlass-dsl "
                             f"{wanted or '(unrecorded)'}. fix: pip install nvidia-cutlass-dsl=={wanted or '4.8.1'}")
    if wanted is None:
        return
    if precompiled:
        _check_precompiled(record, here)
    elif _major_minor(wanted) != _major_minor(here["cutlass_dsl"]):
        raise ToolchainError(
            f"the package's module.py was generated for CuTe DSL {wanted} but nvidia-cutlass-dsl "
            f"{here['cutlass_dsl']} is installed; compiling it needs the same major.minor "
            f"({'.'.join(_major_minor(wanted))}.x). fix: pip install nvidia-cutlass-dsl=={wanted}, or re-bake the "
            "package with this toolchain (megabake bake)")


def _check_precompiled(record: dict, here: dict) -> None:
    if record["cutlass_dsl"] != here["cutlass_dsl"]:
        raise ToolchainError(
            f"the precompiled kernel was built with CuTe DSL {record['cutlass_dsl']} and loading it needs exactly "
            f"that version, but nvidia-cutlass-dsl {here['cutlass_dsl']} is installed. fix: pip install "
            f"nvidia-cutlass-dsl=={record['cutlass_dsl']}, or re-bake the package with this toolchain")
    if record.get("host") and record["host"] != here["host"]:
        raise ToolchainError(f"the precompiled kernel's host code is for {record['host']}, this machine is "
                             f"{here['host']}. fix: re-bake the package on a {here['host']} machine")
    installed, minimum = _installed_driver(), record.get("driver_min")
    if installed and minimum and _version_tuple(installed) < _version_tuple(minimum):
        raise ToolchainError(
            f"the precompiled kernel was built with CUDA {record.get('cutlass_dsl_cuda')}, which needs an NVIDIA "
            f"driver >= {minimum}, but driver {installed} is installed. fix: upgrade the driver to {minimum} or "
            "newer")


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(str(version).split(".")[:2])


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in str(version).split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _cutlass_dsl_version() -> str | None:
    from ..verification.env import cutlass_dsl_version

    return cutlass_dsl_version()


def _installed_driver() -> str | None:
    from ..verification.env import driver_version

    return driver_version()


def _dsl_cuda_version() -> str | None:
    """The CUDA version the installed CuTe DSL compiles with (``cutlass.CUDA_VERSION``), else None."""
    try:
        from cutlass import CUDA_VERSION
    except Exception:  # not installed, or broken here: unknown
        return None
    return f"{CUDA_VERSION.major}.{CUDA_VERSION.minor}"


def _torch_cuda_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda
