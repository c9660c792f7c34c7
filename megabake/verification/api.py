"""Verify a baked package: numerics + timings on a Hopper GPU, evidence written into report.json.

Contract: ``verify_package(path, *, steps=64, prefill=16, samples=40, baselines=None, device=None)``
checks the package folder (digests, schemas), refuses to run without a Hopper GPU (``DeviceError``, report
left unchanged), loads ``MegakernelDecoder.from_package``, runs ``verify_decoder`` and writes the new
report with ``megabake.package.update_report`` (schema-validated); returns the new report dict.
``verify_decoder(decoder, report, ...)`` does the work on any object with the decoder interface and
returns the new report without writing it; ``timings=False`` skips timing (CPU tests), which fails the
status with "timings: not run". A crash while timing is recorded (status failed, reason names it) so the
numerics evidence is still written.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .env import environment, require_hopper, toolchain
from .numerics import run_numerics
from .report import assemble_report, validated


def _timings_or_reason(decoder, *, samples, baselines, prefill) -> dict:
    """run_timings, or on a crash a timings object whose megakernel entry carries the error (status failed)."""
    from .timing import run_timings

    try:
        return run_timings(decoder, samples=samples, baselines=baselines, prefill=prefill)
    except Exception as exc:  # the numerics evidence is still worth writing; the status says what broke
        logging.getLogger(__name__).exception("timing crashed")
        error = f"timing crashed: {type(exc).__name__}: {str(exc)[:400]}"
        return {"unit": "ms", "candidates": {"megabake": {"kind": "megabake", "error": error}}, "baseline": None}


def verify_decoder(decoder, report: dict, *, steps=64, prefill: int = 16, samples: int = 40, baselines=None,
                   timings: bool = True, env: dict | None = None) -> dict:
    """Numerics, then timings, merged into a copy of ``report`` (see module doc)."""
    numerics = run_numerics(decoder, prefill=prefill, steps=steps)
    _free_device_memory()
    timing = (_timings_or_reason(decoder, samples=samples, baselines=baselines, prefill=prefill)
              if timings else None)
    if env is None and timings:
        env = environment(decoder.device)
    return validated(assemble_report(report, numerics=numerics, timings=timing, environment=env,
                                     toolchain=toolchain()))


def _free_device_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def verify_package(path, *, steps=64, prefill: int = 16, samples: int = 40, baselines=None,
                   device=None, model=None, model_path=None) -> dict:
    """Verify the package folder ``path`` on this machine's Hopper GPU and update its report.json.

    ``model``: the model the package was baked from, when the caller still holds it (saves rebuilding it;
    the package's config hash is still checked against it). ``model_path``: where a local model folder or
    .gguf file the package was baked from lies now (digest-checked)."""
    from megabake.package import read_package, update_report

    path = Path(path)
    package = read_package(path)
    require_hopper(device)
    from megabake.runtime import MegakernelDecoder

    decoder = MegakernelDecoder.from_package(path, device=device or "cuda", model=model, model_path=model_path)
    report = verify_decoder(decoder, package.report, steps=steps, prefill=prefill, samples=samples,
                            baselines=baselines)
    update_report(path, report)
    return report
