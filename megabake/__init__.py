"""MegaBake: bake Hugging Face decoders into one persistent CuTe DSL megakernel per decode step.

Public API only (imports are lazy so ``import megabake`` stays cheap and works without CuTe DSL):
``bake``, ``verify``, ``publish``, ``load_from_hub``, ``MegakernelDecoder``, ``make_backend``.
No submodule shares a public function's name (the pipelines live in ``megabake.baking`` and
``megabake.verification``), so importing any submodule never replaces ``megabake.bake`` or ``megabake.verify``.
Pipeline: capture -> ir -> plan -> codegen -> runtime, then verify, package, hub.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "bake": ("megabake.baking", "bake"),
    "verify": ("megabake.verification", "verify_package"),
    "publish": ("megabake.hub", "publish"),
    "load_from_hub": ("megabake.hub", "load_from_hub"),
    "MegakernelDecoder": ("megabake.runtime", "MegakernelDecoder"),
    "make_backend": ("megabake.integrations", "make_backend"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'megabake' has no attribute {name!r}")
