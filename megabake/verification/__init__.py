"""Verify: numerics across advancing decode calls, timing against CUDA-graphed Inductor, report assembly.

Public API (imports are lazy: ``import megabake.verification`` does not import torch):

* ``verify_package(path, *, steps=64, prefill=16, samples=40, baselines=None, device=None) -> dict``:
  the updated report (written to ``path/report.json``); needs a Hopper GPU.
* ``run_numerics(decoder, *, prefill=16, steps=64, seed=0, slack=1.25) -> dict``: report ``numerics``.
* ``run_timings(decoder, *, samples=40, baselines=None) -> dict``: report ``timings``; needs CUDA.
* ``environment() -> dict`` (report ``environment``; needs CUDA), ``toolchain() -> dict``.
* ``assemble_report(report, *, numerics, timings, environment, toolchain) -> dict``: pure merge + status.

Modules: ``stats`` (median, bootstrap), ``numerics``, ``reference`` (eager HF + StaticCache),
``baselines``, ``timing``, ``report``, ``env``, ``api``, ``commands`` (the click command ``verify``).
"""

from __future__ import annotations

_LAZY = {
    "verify_package": ("megabake.verification.api", "verify_package"),
    "verify_decoder": ("megabake.verification.api", "verify_decoder"),
    "run_numerics": ("megabake.verification.numerics", "run_numerics"),
    "run_timings": ("megabake.verification.timing", "run_timings"),
    "environment": ("megabake.verification.env", "environment"),
    "toolchain": ("megabake.verification.env", "toolchain"),
    "assemble_report": ("megabake.verification.report", "assemble_report"),
    "DEFAULT_BASELINES": ("megabake.verification.baselines", "DEFAULT_BASELINES"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'megabake.verification' has no attribute {name!r}")
