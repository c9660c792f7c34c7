"""Shared pytest setup: the gpu marker skips without a Hopper GPU; Hub server fixtures are plugins."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.hub_server"]


def _hopper_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if _hopper_available():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (SM90) GPU: run `pytest -m gpu` on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
