"""Shared pytest setup: the gpu marker skips without a Hopper GPU; Hub server fixtures are plugins; a full garbage
collection after each test module keeps the suite's memory flat; ``--shard I/N`` runs one part of the tests
(tests/sharding.py)."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.hub_server"]


def _hopper_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run part I of N (from 0) of the selected tests; tests sharing a module-scoped fixture "
                          "stay in one part (tests/sharding.py; scripts/gpu_session.sh PARTS=tests-parallel)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--shard"):
        from tests.sharding import Shard, select

        try:
            shard = Shard.parse(config.getoption("--shard"))
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        kept, dropped = select(items, shard)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if _hopper_available():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (SM90) GPU: run `pytest -m gpu` on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_after_each_module():
    """Free each test module's models before the next module builds its own. Exported programs, modules with
    hooks and compiled steps sit in reference cycles; being few Python objects holding gigabytes of tensors,
    they rarely trigger a full collection on their own, and the CPU suite grew past a 23 GB machine (OOM-killed
    at 24 GB RSS, session 8)."""
    yield
    import gc

    gc.collect()
    _return_freed_heap_to_the_os()


def _return_freed_heap_to_the_os() -> None:
    """glibc may keep freed small-allocation heap pages mapped (a full CPU run's used memory sat at 18-20 GB of 23
    between modules in session 9; how much of that is such pages is not measured); ``malloc_trim(0)`` hands them
    back to the OS. A no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
