"""The ``fused_split`` build on the GPU (session 44 candidate, ``bodies.split_o_block``): every step's O projection
in attention's interval, a split step's CTAs waiting on their KV group's arrival counter instead of a grid barrier.
Against the ``fused_o`` build it extends, from one random KV cache, at split steps (near the first split boundary,
halfway, at capacity - 1) and fused ones; a second run must give the same bits (a moving result is a race);
against the CPU reference executor; and the counters must hold each layer's item count after a step."""

from __future__ import annotations

import pytest
import torch

from tests.test_fused_o_gpu import _compiled, _fused_and_split_positions
from tests.test_gpu_decode import _assert_random_cache_steps_match, _logits_over_random_cache

pytestmark = pytest.mark.gpu

# tiny-mistral's sliding windows keep every step within one split (fused), so it would not reach split_o_block
PRESETS = [("smollm-135m", 2048), ("qwen2.5-0.5b", 4096), ("qwen3-0.6b", 4096), ("llama-3.2-1b", 1024)]


@pytest.mark.parametrize("preset,capacity", PRESETS)
def test_fused_split_gives_the_fused_o_logits_to_fp32_order_and_the_same_bits_twice(preset, capacity):
    """The split items and their merge are the fused_o build's arithmetic (the group's merge in the same order);
    the O projection's sum order differs (a W_O block per KV group, the groups then summed in the staging), so
    logits agree to fp32 order (1e-4 over 2 layers), not bit for bit; with fused_mlp on top too where it fits
    (Llama-3.2-1B's W_down columns do not)."""
    from megabake.codegen.fused_mlp import fused_mlp_refusal

    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    assert split, "no split step among the positions: the test would not reach split_o_block"
    positions = split + fused
    base = {"fused_o": True, "fused_split": False, "fused_mlp": False}  # the fused_o build alone (not the default)
    builds = [base, {**base, "fused_split": True}, {**base, "fused_split": True}]
    if fused_mlp_refusal(compiled.plan, fused_o=True) is None:
        builds.append({**base, "fused_split": True, "fused_mlp": True})
    fused_o, fused_split, again, *with_mlp = _logits_over_random_cache(compiled, positions, 1, builds)
    assert torch.isfinite(fused_split).all()
    assert torch.equal(again, fused_split)
    for i, position in enumerate(positions):
        for other in [fused_split] + with_mlp:
            assert float((other[i] - fused_o[i]).norm() / fused_o[i].norm()) < 1e-4, position


@pytest.mark.parametrize("preset,capacity,build", [
    ("smollm-135m", 2048, {}), ("qwen3-0.6b", 4096, {}),
    # session 45 candidate: the dealing made for the tensor cores (whole groups over shorter chunks) under fused_o
    ("smollm-135m", 2048, {"mma_attention": True, "mma_schedule": True, "fused_o": True}),
    ("qwen2.5-0.5b", 4096, {"mma_attention": True, "mma_schedule": True, "fused_o": True}),
    # session 60 candidate: ... dealt over at most 16 of the plan's 66 / 44 splits a KV group (split_cap; since
    # session 62 what the split_cap feature builds: codegen.default_mma_schedule and default_split_cap)
    ("qwen2.5-0.5b", 4096, {"mma_attention": True, "mma_schedule": True, "fused_o": True, "split_cap": 16}),
    ("smollm-135m", 2048, {"mma_attention": True, "mma_schedule": True, "fused_o": True, "split_cap": 16}),
    # ... and the cap on the default's own dealing (session 61's split_cap feature; lost 7% at 1000, session 62)
    ("qwen2.5-0.5b", 4096, {"split_cap": 16}),
])
def test_fused_split_kernel_matches_the_reference_executor(preset, capacity, build):
    """The fused_split build on the default's other choices (split items and fused groups on the tensor cores,
    mirrored by the reference executor) against the CPU reference at the usual tolerance; also with
    ``mma_schedule``, whose split steps deal whole KV groups (``split_o_block`` then waits for fewer, longer
    items), and with ``split_cap`` on top (the runtime's reference executor deals over the module's ``KV_SPLITS``)."""
    from megabake.codegen import generate

    compiled = _compiled(preset, capacity)
    fused, split = _fused_and_split_positions(compiled, capacity)
    source = generate(compiled.plan, fused_split=True, **build).source
    assert "\nFUSED_SPLIT = True\n" in source
    _assert_random_cache_steps_match(compiled, compiled.model, seed=44, positions=fused + split, source=source)


def test_the_counters_hold_each_layers_items_and_replays_give_the_same_bits():
    """After a split step (SmolLM-135M at 1500, 2 layers) every layer's row of ``o_count`` holds, per KV group,
    the items the dealing made (``plan.attention.split_schedule``: active splits x head slices), the counters are
    zeroed by every launch (the same counts after 30 replays), and the replays give the same logits."""
    from megabake.codegen import generate
    from megabake.plan.attention import PASS_CHUNKS, chunk_quantum, split_schedule
    from megabake.runtime import MegakernelDecoder

    compiled = _compiled("smollm-135m", 2048)
    plan = compiled.plan
    decoder = MegakernelDecoder(plan, generate(plan, fused_split=True).source, compiled.model, device="cuda")
    generator = torch.Generator().manual_seed(45)
    for name in ("k_cache", "v_cache"):
        buffer = decoder.buffers[name]
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
    tiling = next(s.tiling for s in plan.stages if s.kind == "attention")
    schedule = split_schedule(tiling, 1501, quantum=chunk_quantum(plan, PASS_CHUNKS))
    assert schedule.active > 1
    token = torch.tensor([17])
    logits = decoder.step(token, 1500).float().clone()
    counts = decoder.buffers["o_count"].cpu()
    assert counts.dtype == torch.int64
    assert torch.equal(counts, torch.full_like(counts, schedule.active * schedule.slices))
    for _ in range(30):
        assert torch.equal(decoder.step(token, 1500).float(), logits)
    assert torch.equal(decoder.buffers["o_count"].cpu(), counts)
