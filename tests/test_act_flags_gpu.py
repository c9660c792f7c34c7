"""The flagged-word builds on the H200 (session 37 candidates, ``megabake.codegen.act_flags``): each layer's gate/up
GEMV and down projection (``act_flags``), a fused step's attention and gate/up staging (``o_flags``) and its QKV
projection and attention (``qkv_flags``) meet through flagged words instead of a grid barrier. The words carry the
same values to the same shared memory, so every step must give the default build's logits bit for bit, at fused and
split steps, over consecutive positions (each launch's prologue unsets the words the previous launch left written),
in CUDA graph replays and in the greedy graph of several launches; a second run must give the same bits (a moving
result is a race). A missing word would hang the step: these run under the device call's timeout."""

from __future__ import annotations

import pytest
import torch

from tests.compiler_fixtures import compile_preset
from tests.test_gpu_decode import _logits_over_random_cache

pytestmark = pytest.mark.gpu


def _compiled(preset: str, capacity: int, batch: int = 1):
    from megabake.runtime import gpu_info

    return compile_preset(preset, layers=2, vocab=4096, capacity=capacity, batch=batch, ctas=gpu_info().sm_count)


def _positions(compiled, capacity: int) -> list[int]:
    """Near 0 (fused steps where the build fuses), the first split boundaries, a run of consecutive positions,
    halfway and capacity - 1."""
    per_tile = next(s.tiling for s in compiled.plan.stages if s.kind == "attention").per_tile
    wanted = {0, 1, 2, 63, 64, per_tile - 1, per_tile, per_tile + 1, capacity // 2, capacity - 1}
    wanted |= set(range(200, 216))
    return sorted(p for p in wanted if p < capacity)


@pytest.mark.parametrize("preset,capacity,fused_o", [("smollm-135m", 2048, None), ("smollm-135m", 2048, False),
                                                     ("qwen2.5-0.5b", 4096, None), ("qwen3-0.6b", 4096, None),
                                                     ("llama-3.2-1b", 1024, None), ("tiny-mistral", 256, None),
                                                     ("tiny-phi3", 256, None)])
def test_flagged_builds_give_the_default_bits(preset, capacity, fused_o):
    """From one random KV cache, one step at each position (fused and split steps; sliding windows on tiny-mistral
    and tiny-phi3): ``act_flags`` and all three flags (on fused builds; ``o_flags`` and ``qkv_flags`` alone too on
    SmolLM-135M and Qwen3-0.6B) give the default build's logits (the same fused_o choice) bit for bit, and a second
    run of the last build its own."""
    compiled = _compiled(preset, capacity)
    positions = _positions(compiled, capacity)
    # the helper builds every split-KV item on the lane-group loop (mma_attention=False), where the default would not
    # fuse: ask for the fused build (its groups on the lane loop then) or the split one outright
    base = {"fused_o": fused_o is None}
    every = {"act_flags": True, "o_flags": True, "qkv_flags": True}
    alone = [{"o_flags": True}, {"qkv_flags": True}] if preset in ("smollm-135m", "qwen3-0.6b") else []
    flagged = [{"act_flags": True}] + ([] if fused_o is False else alone + [every])
    builds = [base] + [{**base, **flags} for flags in flagged] + [{**base, **flagged[-1]}]
    default, *results, again = _logits_over_random_cache(compiled, positions, 1, builds)
    assert torch.equal(again, results[-1])
    for build, logits in zip(flagged, results):
        assert torch.isfinite(logits).all(), build
        for i, position in enumerate(positions):
            assert torch.equal(logits[i], default[i]), (build, position)


def test_act_flags_repeat_a_position_and_run_greedy_graphs():
    """Graph replays of one position (the same token each time: the cache row is rewritten with the same values)
    give the same logits every time and the default build's, and the greedy graph (several launches in one CUDA
    graph, the argmax fed back on the device) gives the default build's tokens."""
    from megabake.codegen import generate
    from megabake.runtime import MegakernelDecoder

    compiled = _compiled("smollm-135m", 2048)
    results = {}
    for name, build in (("default", {}), ("flags", {"act_flags": True, "o_flags": True, "qkv_flags": True})):
        decoder = MegakernelDecoder(compiled.plan, generate(compiled.plan, **build).source, compiled.model,
                                    device="cuda")
        generator = torch.Generator().manual_seed(37)
        for buffer in ("k_cache", "v_cache"):
            decoder.buffers[buffer].copy_(torch.randn(decoder.buffers[buffer].shape,
                                                      generator=generator).to(decoder.buffers[buffer].dtype))
        repeats = [decoder.step([17], 40).cpu().clone() for _ in range(6)]
        assert all(torch.equal(r, repeats[0]) for r in repeats), name
        tokens = decoder.greedy_tokens([23], 41, 24)
        results[name] = (repeats[0], tokens)
        del decoder
    assert torch.equal(results["flags"][0], results["default"][0])
    assert torch.equal(results["flags"][1], results["default"][1])
