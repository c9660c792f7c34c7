"""scripts/gpu_session.sh's ``tests-parallel`` part, the whole GPU suite in one device call, runs every GPU test file.

What this test shows: each ``tests/test_*_gpu.py`` (and ``tests/test_gpu_decode.py``) is named in that part's
pytest runs, either in the ``TESTS3`` list it reuses or in its own shard command, except the real-weights tests,
which need the GGUF carried to the device (README "Running the GPU tests"). Until session 52 the spare-warp and
loader-warp tests were missing from it, so "the whole suite passed" did not cover them.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_session.sh"
NEEDS_REAL_WEIGHTS = {"tests/test_real_weights_gpu.py"}


def _parallel_part_files(script: str) -> set[str]:
    """The test files the tests-parallel part runs: its shard command's own files plus TESTS3's."""
    part = script.split('if [[ " $PARTS " == *" tests-parallel "* ]]; then', 1)[1].split("\nfi\n", 1)[0]
    tests3 = script.split("TESTS3=(", 1)[1].split(")", 1)[0]
    assert '"${TESTS3[@]:2}"' in part, "tests-parallel no longer reuses TESTS3's files"
    return set(re.findall(r"tests/test_\w+\.py", part + tests3))


def test_tests_parallel_runs_every_gpu_test_file():
    paths = [*(REPO / "tests").glob("test_*_gpu.py"), REPO / "tests" / "test_gpu_decode.py"]
    gpu_files = {f"tests/{path.name}" for path in paths}
    assert "tests/test_loader_warp_gpu.py" in gpu_files
    missing = gpu_files - NEEDS_REAL_WEIGHTS - _parallel_part_files(SCRIPT.read_text())
    assert not missing, f"scripts/gpu_session.sh tests-parallel does not run {sorted(missing)}: add them to its shards"
