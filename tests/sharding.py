"""``pytest --shard I/N``: run one of N disjoint parts of the selected tests, so that N pytest processes share a
machine (scripts/gpu_session.sh ``PARTS=tests-parallel`` runs the GPU suite as N processes on one H200: their
time is mostly CPU work, random init and CuTe DSL compiles, which then overlaps).

Tests that share a module- or session-scoped fixture (with the same parameter, for a parametrized one) stay in
one part, so no part builds such a fixture that another part also builds for the same tests. Parts are filled
costliest group first, each group into the part with the least cost so far; ties keep the collection order. A
test's cost is its seconds in ``SECONDS`` (the GPU suite's slowest tests on the H200, sessions 15-17, setup +
call), else ``DEFAULT_SECONDS``. Conftest's autouse fixtures (names starting with ``_``) do not group."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SECONDS = 8.0
SECONDS = {  # node-id fragment -> seconds (first match wins); from `pytest --durations` of the H200 logs
    # session 46, 8 shards at once on an H100 (setup + call; these outgrew the older entries below, and the shard
    # holding gemma-2b's numerics, its head-slices case and fused_split's Llama-3.2-1B case ran past 480 s; the
    # numerics, tilings, cold-load and gemma-2b many-splits entries below carry session 46's durations too)
    "kv_prefetch_gives_bit_identical_logits_at_split_boundaries_and_capacity[smollm-135m": 45.0,
    "mma_wide_matches_the_lane_group_loop_to_bf16_rounding[gemma-2b": 58.0,
    "mma_attention_matches_the_lane_group_loop_to_bf16_rounding[llama-3.2-1b": 42.0,
    "fused_split_gives_the_fused_o_logits_to_fp32_order_and_the_same_bits_twice[qwen2.5": 44.0,
    "advancing_steps[gemma-2-2b]": 137.0, "advancing_steps[gemma-3-270m]": 102.0, "advancing_steps[gemma-2b]": 75.0,
    "advancing_steps[smollm-135m]": 42.0, "advancing_steps[llama-3.2-1b]": 80.0,
    # session 31: the tilings test also builds the rebalanced bake tiling (75 s alone on SmolLM-135M)
    "tilings_give_bit_identical_logits[smollm-135m]": 80.0, "tilings_give_bit_identical_logits[llama-3.2-1b]": 92.0,
    "bit_identical_logits[llama-3.2-1b]": 51.0, "bit_identical_logits[smollm-135m]": 49.0,
    "bit_identical_logits[tiny-llama]": 27.0, "test_cold_load_script": 87.0, "test_bake_with_autotune": 66.0,
    "bf16_staging_kernel_matches_reference_executor_at_long_context[llama-3.2-1b": 32.0,
    "test_kernel_matches_reference_executor_and_is_stable": 28.0, "test_verify_baked_tiny_package": 25.0,
    "greedy_tokens_on_the_gpu": 21.0, "agree_with_eager[inductor-graph]": 22.0, "test_load_from_hub": 18.0,
    # the merge and K/V prefetch tests, session 17 (4 shards at once: calls take longer than alone)
    "many_splits[gemma-2b": 77.0, "many_splits": 15.0, "kv_prefetch_gives_bit_identical": 14.0,
    # the head-slices test, session 18 (4 shards at once)
    "head_slices_give_bit_identical_logits_near_0_at_split_boundaries_and_at_capacity[gemma-2b": 34.0,
    "head_slices_give_bit_identical_logits_near_0_at_split_boundaries_and_at_capacity[smollm": 22.0,
    "head_slices_give_bit_identical": 15.0,
    "pass_chunks_give": 16.0,  # session 21 (4 shards): 16.4 s Qwen2.5-0.5B, 12.9 SmolLM
    "kv_pipeline_gives_bit_identical": 12.0,  # session 21 (4 shards): 11.0 s OLMo-2-1B; the others not timed
    "fold_merge_gives_the_default": 20.0,  # session 23: 4 cases in 55 s alone; the suite's shards run slower
    "mma_attention_matches_the_lane_group": 32.0,  # session 33: 4 cases in 130 s alone (four builds each)
    "mma_attention_kernel_matches_its_reference": 15.0,  # session 33: one build + a CPU reference (not timed yet)
    # tests/test_fused_o_gpu.py (session 34-35, not timed yet): four, three and one builds per case
    "fused_o_gives_the_default_bits": 30.0, "fused_o_on_the_tensor_cores": 25.0,
    "fused_o_kernel_matches_the_reference": 15.0,
    # tests/test_global_down_gpu.py (session 40, not timed yet): three builds; a 2-layer Mistral-7B + its reference
    "global_down_input_gives_the_staged": 30.0, "wide_mlp_matches_the_reference_executor[mistral": 40.0,
    "wide_mlp_matches_the_reference_executor": 25.0,
    # tests/test_mma_wide_gpu.py (session 41, not run yet): three builds per case; one build + its reference
    "mma_wide_matches_the_lane_group": 35.0, "mma_wide_kernel_matches_its_reference": 30.0,
    # tests/test_fused_mlp_gpu.py (session 43, alone on an H100): two builds per case; one build + its reference
    "fused_mlp_gives_the_fused_o_logits": 35.0, "fused_mlp_kernel_matches_the_reference": 12.0,
    # tests/test_fused_split_gpu.py (session 44, not run yet): four builds per case; one build + its reference
    "fused_split_gives_the_fused_o_logits": 45.0, "fused_split_kernel_matches_the_reference": 12.0,
}


def seconds(nodeid: str) -> float:
    return next((cost for fragment, cost in SECONDS.items() if fragment in nodeid), DEFAULT_SECONDS)


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError:
            raise ValueError(f"--shard {text!r}: use I/N, e.g. 0/4 (parts are numbered from 0)") from None
        if not 0 <= index < count:
            raise ValueError(f"--shard {text!r}: I must be in [0, N), e.g. 0/{max(count, 1)}")
        return cls(index, count)


def group_key(item) -> str:
    """Items with the same key share a wider-than-function fixture instance: the module path plus each such
    fixture's name and parameter; an item with none keys on its own node id."""
    shared = []
    fixture_info = getattr(item, "_fixtureinfo", None)
    for name, definitions in (fixture_info.name2fixturedefs.items() if fixture_info else []):
        if name.startswith("_") or not definitions or definitions[-1].scope not in ("module", "session", "package"):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        shared.append(f"{name}={params[name]!r}" if name in params else name)
    if not shared:
        return item.nodeid
    return f"{item.nodeid.split('::')[0]}::{','.join(sorted(shared))}"


def assign(keys: list[str], costs: list[float], count: int) -> list[int]:
    """The part of each item, from its group key and cost (see the module docstring)."""
    groups: dict[str, list[int]] = {}
    for position, key in enumerate(keys):
        groups.setdefault(key, []).append(position)
    loads = [0.0] * count
    part_of = [0] * len(keys)
    for members in sorted(groups.values(), key=lambda m: (-sum(costs[i] for i in m), m[0])):
        part = min(range(count), key=lambda p: (loads[p], p))
        loads[part] += sum(costs[i] for i in members)
        for position in members:
            part_of[position] = part
    return part_of


def select(items: list, shard: Shard) -> tuple[list, list]:
    """(kept, deselected) items of ``shard``."""
    parts = assign([group_key(item) for item in items], [seconds(item.nodeid) for item in items], shard.count)
    kept = [item for item, part in zip(items, parts) if part == shard.index]
    dropped = [item for item, part in zip(items, parts) if part != shard.index]
    return kept, dropped
