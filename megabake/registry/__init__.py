"""Registry side of MegaBake: the registry index + static leaderboard, and the CI bake matrix.

Contract: ``build_registry(packages_root, out_dir, hub_repo=None)`` writes ``out_dir/index.json`` (made and
schema-checked by :mod:`megabake.package`) and ``out_dir/leaderboard.html`` (see :mod:`.leaderboard`);
``load_matrix`` / ``select`` turn ``registry/bake-matrix.json`` into bake jobs (see :mod:`.matrix`); the click
group ``registry`` (``megabake registry build|matrix``) lives in :mod:`.commands`. Imports are lazy.
"""

from __future__ import annotations

_LAZY = {
    "build_registry": "megabake.registry.leaderboard",
    "render_leaderboard": "megabake.registry.leaderboard",
    "leaderboard_rows": "megabake.registry.leaderboard",
    "load_matrix": "megabake.registry.matrix",
    "select": "megabake.registry.matrix",
    "registry": "megabake.registry.commands",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megabake.registry' has no attribute {name!r}")
