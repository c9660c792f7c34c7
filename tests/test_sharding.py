"""``pytest --shard I/N`` (tests/sharding.py): disjoint parts that cover the selection, tests sharing a
module-scoped fixture kept together, parts balanced by cost; bad values refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.sharding import Shard, assign

REPO = Path(__file__).resolve().parents[1]
GPU_FILES = ["tests/test_gpu_decode.py", "tests/test_hub_gpu.py", "tests/test_precompiled_gpu.py",
             "tests/test_verify_gpu.py"]


def test_groups_stay_together_and_parts_balance_by_cost():
    keys = ["a", "a", "b", "c", "d", "e"]
    costs = [50.0, 40.0, 60.0, 10.0, 10.0, 10.0]
    parts = assign(keys, costs, 2)
    assert parts[0] == parts[1]  # one group
    loads = [sum(c for c, p in zip(costs, parts) if p == part) for part in (0, 1)]
    assert sorted(loads) == [90.0, 90.0]  # a (90) alone; b + c + d + e (90)
    assert assign(keys, costs, 1) == [0] * 6


@pytest.mark.parametrize("text", ["1", "2/2", "-1/3", "a/b", "1/0"])
def test_bad_shard_values_are_refused(text):
    with pytest.raises(ValueError, match="--shard"):
        Shard.parse(text)


def _collected(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "-m", "gpu", *args, *GPU_FILES], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_shards_of_the_gpu_suite_partition_it_and_keep_each_numerics_preset_whole():
    everything = _collected()
    shards = [_collected("--shard", f"{i}/4") for i in range(4)]
    assert sorted(sum(shards, [])) == sorted(everything)  # disjoint, and nothing lost
    assert all(shards)
    for preset in ("gemma-2-2b", "smollm-135m"):  # the module-scoped `baked` fixture's tests share one part
        holding = [i for i, shard in enumerate(shards) if any(f"[{preset}]" in t and "baked" not in t
                                                              and ("advancing_steps" in t or "one_kernel_launch" in t)
                                                              for t in shard)]
        assert len(holding) == 1, (preset, holding)


def test_a_bad_shard_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "--shard", "4/4", "tests/test_sharding.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 4 and "--shard '4/4'" in proc.stderr


def test_the_cost_table_names_each_fragment_once():
    """A fragment written twice in the SECONDS literal silently keeps the later value (session 46 nearly lost its
    measured durations that way): every key appears once."""
    import ast
    from pathlib import Path

    source = (Path(__file__).parent / "sharding.py").read_text()
    table = next(node.value for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SECONDS" for t in node.targets))
    keys = [key.value for key in table.keys]
    assert keys and len(keys) == len(set(keys)), sorted({k for k in keys if keys.count(k) > 1})
