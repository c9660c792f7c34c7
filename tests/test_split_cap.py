"""The ``split_cap`` build (session 60; Qwen2.5-0.5B b1's default since session 64, when its GPU tests passed on an
H100): split-KV attention dealt over at most ``split_cap`` splits per KV group (``codegen.generate(plan,
split_cap=N)``, ``plan.attention.capped_splits``). Only the module's ``KV_SPLITS`` changes; the runtime's reference
executor deals over it too, and the capped dealing covers every visible key once (its fp32 logits equal the plan's
dealing's to fp32 order). Its kernel numerics run on the GPU: tests/test_fused_split_gpu.py."""

from __future__ import annotations

import difflib

import pytest
import torch

from megabake.codegen import generate
from megabake.plan.attention import chunk_quantum, kv_splits, split_schedule
from tests.compiler_fixtures import compile_preset

SCHEDULE = {"mma_attention": True, "mma_schedule": True, "fused_o": True}  # gpu_tune's fused-mma-schedule


@pytest.fixture(scope="module")
def qwen25():
    """Qwen2.5-0.5B's shape at batch 1: 66 splits a KV group, 7 query heads per KV head of 64 dims."""
    return compile_preset("qwen2.5-0.5b", layers=1, vocab=512, capacity=4096)


def _changed_lines(a: str, b: str) -> list[str]:
    return [line for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and line[:3] not in ("---", "+++")]


def test_the_cap_changes_only_the_splits_the_module_deals(qwen25):
    plan = qwen25.plan
    assert kv_splits(plan) == 66
    plain = {"mma_schedule": False}  # the lane-group dealing (the split_cap feature's default adds the schedule)
    assert _changed_lines(generate(plan, split_cap=False).source, generate(plan, split_cap=16, **plain).source) == [
        "-KV_SPLITS = 66", "+KV_SPLITS = 16"]
    assert _changed_lines(generate(plan, split_cap=False, **SCHEDULE).source,
                          generate(plan, split_cap=16, **SCHEDULE).source) == [
        "-KV_SPLITS = 66", "+KV_SPLITS = 16"]
    assert "\nKV_SPLITS = 66\n" in generate(plan, split_cap=100, **plain).source  # a cap above the plan's splits


def test_refusals_name_the_cause_and_the_fix(qwen25):
    for bad in (1, 6, True, 2.5, "16"):  # below the 7 head slices (or 2), or not an int
        with pytest.raises(ValueError, match=r"split_cap=.*one per head slice \(7 in this plan\); pass an int of 7"):
            generate(qwen25.plan, split_cap=bad)
    unsplit = compile_preset("tiny-llama", capacity=128).replan(split_kv=False)
    assert not kv_splits(unsplit.plan)
    with pytest.raises(ValueError, match="attention is not split: build without it"):
        generate(unsplit.plan, split_cap=16)


def test_the_capped_dealing_covers_every_key_once(qwen25):
    """From one random cache at position 4000, the reference backend of a capped module (fp32 lane-group
    arithmetic: ``mma_attention=False``) gives the plan's dealing's logits to fp32 order: a key dealt twice or
    left out gives O(1). The two dealings differ there (8 splits of 7 one-head slices x 512 keys against 16 of
    whole groups x 256), and the decoder reads the cap from the module."""
    from megabake.runtime import MegakernelDecoder

    plan, position = qwen25.plan, 4000
    tiling = next(s.tiling for s in plan.stages if s.kind == "attention")
    quantum = chunk_quantum(plan)
    assert split_schedule(tiling, position + 1, quantum=quantum) != split_schedule(tiling, position + 1,
                                                                                   quantum=quantum, splits=16)
    logits, dealt = [], []
    for cap in (None, 16):
        source = generate(plan, mma_attention=False, split_cap=cap).source
        decoder = MegakernelDecoder(plan, source, qwen25.model, device="cpu")
        generator = torch.Generator().manual_seed(60)
        for name in ("k_cache", "v_cache"):
            buffer = decoder.buffers[name]
            buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
        logits.append(decoder.step(torch.tensor([17]), position).float().clone())
        dealt.append(decoder.dealt_splits)
    assert dealt == [0, 16]
    assert torch.isfinite(logits[0]).all()
    difference = float((logits[1] - logits[0]).norm() / logits[0].norm())
    assert difference < 1e-5, difference


@pytest.mark.parametrize("build", [SCHEDULE, {}], ids=["fused-mma-schedule", "default"])
def test_a_capped_fused_build_compiles_for_sm90a(build, tmp_path):
    """The capped build on the tensor-core dealing (gpu_tune's fused-mma-schedule-cap16) and on the default's
    (cap16: what the ``split_cap`` feature builds)."""
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check, load_module

    plan = compile_preset("qwen2.5-0.5b", layers=2, vocab=512, capacity=4096).plan
    module = load_module(generate(plan, split_cap=16, **build).source)
    assert module.KV_SPLITS == 16 and module.FUSED_SPLIT is True and module.FOLD_SPLITS == 16
    result = compile_check(plan, module, dump_dir=str(tmp_path))
    assert result.ok, result.error


def test_the_split_cap_feature_builds_the_capped_tensor_core_schedule_only_where_groups_have_more_splits(
        qwen25, monkeypatch):
    """``codegen.default_mma_schedule`` / ``default_split_cap`` (session 62): off while the ``split_cap`` feature is
    not enabled (here: taken out of ``GPU_VERIFIED_FEATURES``); with it, Qwen2.5-0.5B's default (66 splits a KV
    group, 7-head groups that fit a tensor-core item) is byte for byte the build H100 timed fastest at 1000 and 4000
    (gpu_tune's fused-mma-schedule-cap16: the schedule, fused_o kept, 16 splits that the O blocks merge), and the
    runtime reads its dealing from the module. ``split_cap=False``, ``fused_o=False``, ``mma_attention=False``,
    ``group_fold=False`` or ``fused_split=False`` keep the plain default's dealing; the cap never comes alone (it
    lost 7% at 1000); Qwen3-0.6B (16 splits a group already) and SmolLM-135M (3-head groups, which lost at 1000:
    ``SPLIT_CAP_MIN_GROUP_HEADS``) are unchanged."""
    import megabake.plan as plan_module
    from megabake.codegen import default_split_cap
    from megabake.runtime import MegakernelDecoder

    plan = qwen25.plan
    verified = tuple(f for f in plan_module.GPU_VERIFIED_FEATURES if f != "split_cap")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", verified)
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    plain = generate(plan).source
    assert default_split_cap(plan, group_fold=True, mma_schedule=True) is None
    assert "\nKV_SPLITS = 66\n" in plain and "\nMMA_SLICES = " not in plain

    monkeypatch.setenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", "split_cap")
    assert default_split_cap(plan, group_fold=True, mma_schedule=True) == 16
    assert default_split_cap(plan, group_fold=True, mma_schedule=False) is None
    assert default_split_cap(plan, group_fold=False, mma_schedule=True) is None
    scheduled = generate(plan).source
    assert scheduled == generate(plan, split_cap=16, **SCHEDULE).source
    assert "\nKV_SPLITS = 16\n" in scheduled and "\nFOLD_SPLITS = 16\n" in scheduled
    assert "\nMMA_SLICES = " in scheduled and "\nFUSED_SPLIT = True\n" in scheduled
    for off in ({"split_cap": False}, {"fused_o": False}, {"mma_attention": False}, {"group_fold": False},
                {"fused_split": False}):
        source = generate(plan, **off).source
        assert "\nKV_SPLITS = 66\n" in source and "\nMMA_SLICES = " not in source, off
    assert generate(plan, split_cap=False).source == plain
    cap_alone = generate(plan, mma_schedule=False, split_cap=16).source  # an explicit build, not a default
    assert "\nKV_SPLITS = 16\n" in cap_alone and "\nMMA_SLICES = " not in cap_alone
    decoder = MegakernelDecoder(plan, scheduled, qwen25.model, device="cpu")
    assert decoder.dealt_splits == 16
    qwen3 = compile_preset("qwen3-0.6b", layers=1, vocab=512, capacity=4096).plan
    assert kv_splits(qwen3) == 16 and default_split_cap(qwen3, group_fold=True, mma_schedule=True) is None
    assert generate(qwen3).source == _without_feature(qwen3, monkeypatch)
    # SmolLM-135M (44 splits of 3-head groups) lost 2% at 1000 with the capped schedule (session 63): unchanged
    smollm = compile_preset("smollm-135m", layers=1, vocab=512, capacity=2048).plan
    assert kv_splits(smollm) > 16 and default_split_cap(smollm, group_fold=True, mma_schedule=True) is None
    assert generate(smollm).source == _without_feature(smollm, monkeypatch)


def test_qwen25_b1_builds_the_capped_schedule_by_default(qwen25, monkeypatch):
    """``split_cap`` is in ``GPU_VERIFIED_FEATURES`` (session 64: the 15 Qwen2.5-0.5B GPU tests passed with it on, on
    an H100), so with nothing exported Qwen2.5-0.5B's batch-1 default is the capped tensor-core schedule, and
    ``split_cap=False`` gives back the uncapped default of before (gpu_tune's ``no-split-cap``)."""
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    default = generate(qwen25.plan).source
    assert default == generate(qwen25.plan, split_cap=16, **SCHEDULE).source
    assert "\nKV_SPLITS = 16\n" in default
    assert "\nKV_SPLITS = 66\n" in generate(qwen25.plan, split_cap=False).source


def _without_feature(plan, monkeypatch) -> str:
    """``plan``'s default module with ``MEGABAKE_EXPERIMENTAL_LAYOUTS`` unset."""
    with monkeypatch.context() as scoped:
        scoped.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
        return generate(plan).source


def test_among_the_presets_the_split_cap_feature_can_change_only_qwen25():
    """``codegen.split_cap_fits_group`` (session 63: 7+ query heads a KV group, one tensor-core item) holds for
    Qwen2.5-0.5B's groups alone, so with the feature on no other preset's module changes at any batch or capacity,
    and the GPU tests that name qwen2.5-0.5b are the ones it can move (gpu_session.sh ``PARTS=split-cap-suite``)."""
    from megabake.codegen import split_cap_fits_group
    from megabake.presets import PRESETS
    from tests.test_loader_warp import _bench_status

    def group(config: dict) -> tuple[int, int]:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return heads // config.get("num_key_value_heads", heads), head_dim

    fits = {name for name, preset in PRESETS.items() if split_cap_fits_group(*group(preset.config))}
    assert fits == {"qwen2.5-0.5b"} == _bench_status().SPLIT_CAP_PRESETS  # the scorecard dates these by session 64
    assert not split_cap_fits_group(3, 64) and not split_cap_fits_group(8, 256) and split_cap_fits_group(8, 128)
