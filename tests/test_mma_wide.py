"""``generate(plan, mma_wide=True)`` (session 41; the default build where it applies since its GPU tests passed on an
H100 in session 42): split-KV items of 2-8 query heads of 256 dims (Gemma's heads) scored and summed on the tensor
cores, which ``mma_wide=False`` leaves on the lane-group loop. On the CPU: which items it takes, its refusals,
module.py's constant and call, the decoder and the reference executor mirroring its rounding, the CuTe DSL compile
for sm_90a, and ``codegen.default_mma_wide`` (on where the plan deals such items while the feature is in
``GPU_VERIFIED_FEATURES``, or asked for by ``MEGABAKE_EXPERIMENTAL_LAYOUTS``). The fragment algebra at 256 dims:
``scripts/mma_attention_emulate.py``; the kernel's GPU tests: ``tests/test_mma_wide_gpu.py``."""

from __future__ import annotations

import difflib

import pytest
import torch

import megabake.plan as plan_module
from megabake.codegen import generate
from megabake.plan.attention import mma_attention_items, split_schedule
from megabake.plan.reference import reference_executor_for
from tests.compiler_fixtures import body_calls, compile_preset


@pytest.mark.parametrize("preset,batch,items", [("gemma-2b", 1, [8, 4, 2]), ("gemma-2b", 8, [8, 4, 2]),
                                                 ("gemma-2-2b", 1, [2]), ("gemma-3-1b", 1, [4, 2])])
def test_mma_wide_takes_the_items_of_heads_of_256_and_changes_only_its_constant_and_call(preset, batch, items,
                                                                                         monkeypatch):
    """Gemma's KV groups (8, 2 and 4 query heads of 256) and their head slices of 2+ heads go to the tensor cores
    in an ``mma_wide`` build (the default) and to none with ``mma_wide=False``; module.py differs from the narrow
    build (the lane-group loop) in the two constants and the attention call's keywords only."""
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    compiled = compile_preset(preset, layers=2, vocab=512, batch=batch, capacity=1024)
    assert mma_attention_items(compiled.plan) == [] and mma_attention_items(compiled.plan, wide=True) == items
    default = generate(compiled.plan, mma_wide=False).source
    assert "MMA_WIDE" not in default and "MMA_ATTENTION" not in default
    wide = generate(compiled.plan, mma_wide=True).source
    assert generate(compiled.plan).source == wide
    assert "\nMMA_WIDE = True\n" in wide and "\nMMA_ATTENTION = True\n" in wide
    assert [(c.get("mma_attention"), c.get("mma_wide")) for c in body_calls(wide, "split_kv_attention")] == \
        [("MMA_ATTENTION", "MMA_WIDE")]
    assert generate(compiled.plan, mma_wide=True, mma_attention=True).source == wide
    changed = [line for line in difflib.ndiff(default.splitlines(), wide.splitlines()) if line[:2] in ("- ", "+ ")]
    assert changed[:2] == ["+ MMA_ATTENTION = True", "+ MMA_WIDE = True"] and len(changed) <= 5, changed

    def unwrapped(source: str) -> str:  # the call's keywords may wrap onto another line
        return "".join(source.split())

    extra = ("MMA_ATTENTION=True", "MMA_WIDE=True", ",mma_attention=MMA_ATTENTION", ",mma_wide=MMA_WIDE")
    stripped = unwrapped(wide)
    for text in extra:
        stripped = stripped.replace(text, "")
    assert stripped == unwrapped(default)


def test_mma_wide_is_refused_where_it_has_nothing_to_take():
    llama = compile_preset("llama-3.2-1b", layers=2, vocab=512, capacity=1024).plan
    with pytest.raises(ValueError, match=r"mma_wide puts .* of 256 dims .* none \(4 heads of 64 dims per KV group\)"):
        generate(llama, mma_wide=True)
    smollm = compile_preset("smollm-1.7b", layers=2, vocab=512, capacity=1024).plan
    with pytest.raises(ValueError, match="mma_wide puts"):
        generate(smollm, mma_wide=True)
    gemma = compile_preset("gemma-2b", layers=2, vocab=512, capacity=1024).plan
    with pytest.raises(ValueError, match="it needs mma_attention on"):
        generate(gemma, mma_wide=True, mma_attention=False)


def test_the_reference_rounds_the_wide_items_only_in_an_mma_wide_build():
    """``ReferenceExecutor(..., mma_attention=True, mma_wide=True)`` (what a GPU check of an ``mma_wide`` module
    compares with) rounds gemma-2b's tensor-core items: at batch 8 and 1000 keys the dealing gives whole 8-head
    groups (logits moved by the bf16 rounding of q and p, 1e-3 to 2e-2); at 5 keys one-head slices (the lane-group
    loop: the same logits); without ``mma_wide`` no item of 256 dims is rounded (the default build's reference)."""
    compiled = compile_preset("gemma-2b", layers=2, vocab=512, batch=8, capacity=1024)
    tiling = next(s.tiling for s in compiled.plan.stages if s.kind == "attention")
    assert split_schedule(tiling, 1001).slices == 1 and split_schedule(tiling, 6).slices == 8
    plain, narrow, wide = (reference_executor_for(compiled.plan, compiled.model, dtype=torch.bfloat16)
                           for _ in range(3))
    narrow.mma_attention = wide.mma_attention = wide.mma_wide = True
    generator = torch.Generator().manual_seed(41)
    for name in ("k_cache", "v_cache"):
        cache = torch.randn(plain.buffers[name].shape, generator=generator).bfloat16()
        for executor in (plain, narrow, wide):
            executor.buffers[name].copy_(cache)
    tokens = torch.randint(1, 512, (8,), generator=generator)
    want = plain.step(tokens, 5)  # each step appends its key and value: every executor takes the same steps
    assert torch.equal(wide.step(tokens, 5), want) and torch.equal(narrow.step(tokens, 5), want)
    want = plain.step(tokens, 1000)
    assert torch.equal(narrow.step(tokens, 1000), want)
    error = float((wide.step(tokens, 1000) - want).norm() / want.norm())
    assert 1e-3 < error < 2e-2, error


def test_a_decoder_reads_mma_wide_from_its_module(monkeypatch):
    """``MegakernelDecoder.mma_wide`` reads module.py's ``MMA_WIDE``; its reference (the CPU backend, and what
    ``reference_executor()`` builds for a GPU check) mirrors it."""
    from megabake.runtime import MegakernelDecoder

    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)

    compiled = compile_preset("gemma-2b", layers=2, vocab=512, batch=8, capacity=1024)
    decoders = [MegakernelDecoder(compiled.plan, generate(compiled.plan, **build).source, compiled.model,
                                  device="cpu") for build in ({"mma_wide": False}, {})]
    assert [(d.mma_attention, d.mma_wide) for d in decoders] == [(False, False), (True, True)]
    assert [(d._reference.mma_attention, d._reference.mma_wide) for d in decoders] == [(False, False), (True, True)]


def test_the_mma_wide_build_compiles_for_sm_90a(tmp_path):
    """The wide build of gemma-2b at batch 8 (the default) compiles for sm_90a with more MMAs than the narrow build
    (``mma_wide=False``, whose PTX the change left byte for byte as the default was before it: checked against the
    tree before it when it landed)."""
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check, load_module

    plan = compile_preset("gemma-2b", layers=1, vocab=512, batch=8, capacity=1024).plan
    counts = []
    for name, build in (("narrow", {"mma_wide": False}), ("wide", {})):
        result = compile_check(plan, load_module(generate(plan, **build).source), dump_dir=str(tmp_path / name))
        assert result.ok, result.error
        counts.append(next((tmp_path / name).glob("*.ptx")).read_text().count("mma.sync"))
    assert counts[1] > counts[0], counts


def test_mma_wide_is_the_default_build_where_it_applies(monkeypatch):
    """``generate(plan)`` puts heads of 256 on the tensor cores where the plan deals such items, since ``mma_wide``
    is in ``GPU_VERIFIED_FEATURES``; it changes nothing elsewhere or where ``mma_attention=False`` asks for the
    lane-group loop. On a tree where the feature is not verified, ``MEGABAKE_EXPERIMENTAL_LAYOUTS=mma_wide`` is
    what turns it on (so `megabake bake` and ``benchmarks/decode.py`` could measure it first)."""
    from megabake.codegen import default_mma_wide

    gemma = compile_preset("gemma-2b", layers=1, vocab=512, batch=8, capacity=1024).plan
    llama = compile_preset("llama-3.2-1b", layers=1, vocab=512, capacity=1024).plan
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    narrow, wide, llama_default = (generate(gemma, mma_wide=False).source, generate(gemma, mma_wide=True).source,
                                   generate(llama).source)
    assert "mma_wide" in plan_module.GPU_VERIFIED_FEATURES
    assert default_mma_wide(gemma) and not default_mma_wide(llama)
    assert not default_mma_wide(gemma, mma_attention=False)
    assert generate(gemma).source == wide != narrow
    assert generate(gemma, mma_attention=False).source == narrow
    assert generate(llama).source == llama_default and "MMA_WIDE" not in llama_default

    unverified = tuple(name for name in plan_module.GPU_VERIFIED_FEATURES if name != "mma_wide")
    monkeypatch.setattr(plan_module, "GPU_VERIFIED_FEATURES", unverified)
    assert not default_mma_wide(gemma) and generate(gemma).source == narrow
    monkeypatch.setenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", "global_down_input mma_wide")
    assert default_mma_wide(gemma) and generate(gemma).source == wide
    assert generate(llama).source == llama_default
