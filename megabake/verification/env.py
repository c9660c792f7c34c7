"""Where verification ran: the GPU (``environment()``) and the software (``toolchain()``).

Contract: ``environment()`` returns the report's ``environment`` object ``{gpu_name, gpu_class, sm_count,
compute_capability, driver, cuda_runtime, hostname}`` of the current CUDA device and raises
:class:`DeviceError` without one; ``toolchain()`` returns the report's ``toolchain`` object (megabake version
and git revision, python, torch, transformers, huggingface_hub, cutlass_dsl, cuda_driver; unknown -> None)
and works anywhere. ``hopper_problem()`` says why this machine cannot run a megakernel (None if it can);
``require_hopper()`` raises that as a DeviceError. ``gpu_class_name(9, 0, 132) == "sm90a-132sm"``.
"""

from __future__ import annotations

import hashlib
import platform
import re
import socket
import subprocess
from importlib import metadata
from pathlib import Path

from ..errors import DeviceError

_DRIVER_FILE = Path("/proc/driver/nvidia/version")


def gpu_class_name(major: int, minor: int, sm_count: int) -> str:
    """Compute capability + arch-specific suffix (SM90 and later) + SM count, e.g. ``sm90a-132sm``."""
    from megabake.package import gpu_class_of

    return gpu_class_of((major, minor), sm_count)


def hopper_problem(device=None) -> str | None:
    """None if ``device`` (default: the current CUDA device) is an SM90 GPU, else why not."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return f"device {device!r} is not a CUDA GPU: the megakernel runs on Hopper (SM90) GPUs only"
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible to torch on this machine "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
                "run `megabake verify` on a Hopper (H100/H200) machine")
    props = torch.cuda.get_device_properties(device)
    if (props.major, props.minor) != (9, 0):
        return (f"{props.name} has compute capability {props.major}.{props.minor}; the megakernel targets "
                "sm_90a (Hopper: H100/H200) and cannot run here")
    return None


def require_hopper(device=None) -> None:
    problem = hopper_problem(device)
    if problem:
        raise DeviceError(f"megabake verify needs a Hopper GPU: {problem}. The report was left unchanged.")


def parse_driver_text(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version text (proprietary or open kernel module), else None."""
    match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9]+(?:\.[0-9]+)+)", text)
    return match.group(1) if match else None


def driver_version() -> str | None:
    """NVIDIA kernel driver version (e.g. ``580.159.04``) from /proc or nvidia-smi, else None."""
    try:
        found = parse_driver_text(_DRIVER_FILE.read_text())
        if found:
            return found
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        return line.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device=None) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("no CUDA GPU visible: the environment record describes the GPU verification ran on")
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    return {
        "gpu_name": props.name,
        "gpu_class": gpu_class_name(props.major, props.minor, props.multi_processor_count),
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "driver": driver_version(),
        "cuda_runtime": torch.version.cuda,
        "hostname": socket.gethostname(),
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cutlass_dsl_version() -> str | None:
    """nvidia-cutlass-dsl's version from its metadata, or from the module when installed without it."""
    found = _version("nvidia-cutlass-dsl")
    if found:
        return found
    try:
        import cutlass

        return getattr(cutlass, "__version__", None)
    except Exception:  # not installed, or broken without a driver: either way unknown
        return None


def git_revision(root: Path | None = None) -> str | None:
    """The commit of the megabake source tree, ``+dirty`` if it has uncommitted changes; None outside git."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=20)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=20)
        dirty = status.returncode == 0 and bool(status.stdout.strip())
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def source_digest(root: Path | None = None) -> str:
    """sha256 over the megabake package's Python sources and schemas (relative path and bytes of each, in
    path order): names the compiler that made a report even where git metadata is missing or stale (a copied
    tree, an installed wheel). ``__pycache__`` and other generated files are left out."""
    root = root or Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for pattern in ("**/*.py", "schemas/*.json") for p in root.glob(pattern)
                       if "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def toolchain() -> dict:
    import torch
    import transformers

    import megabake

    return {
        "megabake": megabake.__version__,
        "git_revision": git_revision(),
        "source_sha256": source_digest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "huggingface_hub": _version("huggingface_hub"),
        "cutlass_dsl": cutlass_dsl_version(),
        "cuda_driver": driver_version(),
    }
