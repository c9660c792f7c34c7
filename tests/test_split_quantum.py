"""``generate(plan, split_quantum=N)`` (session 42, a candidate for ``scripts/gpu_session.sh PARTS=split-quantum``):
split-KV chunks rounded to N positions instead of the tiling's chunk. What it deals (``plan.split_schedule`` with
that quantum, as the kernel's ``bodies.split_schedule``), that module.py changes in ``CHUNK_QUANTUM`` alone, its
refusals, and the CuTe DSL compile for sm_90a."""

from __future__ import annotations

import difflib

import pytest

from megabake.codegen import generate
from megabake.plan.attention import split_schedule
from tests.compiler_fixtures import compile_preset


def _gemma_b1(layers: int = 2):
    return compile_preset("gemma-2b", layers=layers, vocab=512, batch=1, capacity=4096)


def test_longer_chunks_deal_fewer_wider_items_at_long_contexts():
    """gemma-2b at batch 1 and 4000 positions: the default deals 63 chunks of 64 positions in 2 slices (items of 4
    heads, 4 of a CTA's 8 warps busy on the tensor cores); 128-position chunks deal 32 chunks in 4 slices, 256 16
    chunks in 8 (one-head slices); short contexts stay one item either way."""
    plan = _gemma_b1().plan
    tiling = next(s.tiling for s in plan.stages if s.kind == "attention")
    assert tiling.per_tile == 64
    dealt = {q: split_schedule(tiling, 4001, quantum=q) for q in (64, 128, 256)}
    assert [(d.chunk, d.active, d.slices) for d in dealt.values()] == [(64, 63, 2), (128, 32, 4), (256, 16, 8)]
    assert all(split_schedule(tiling, 40, quantum=q).active == 1 for q in (64, 128, 256))


def test_module_py_changes_in_its_chunk_quantum_alone():
    plan = _gemma_b1().plan
    default = generate(plan).source
    assert "\nCHUNK_QUANTUM = 64\n" in default
    longer = generate(plan, split_quantum=128).source
    changed = [line for line in difflib.ndiff(default.splitlines(), longer.splitlines()) if line[:2] in ("- ", "+ ")]
    assert changed == ["- CHUNK_QUANTUM = 64", "+ CHUNK_QUANTUM = 128"]


def test_split_quantum_refusals():
    compiled = _gemma_b1()
    for bad in (96, 0, -64):
        with pytest.raises(ValueError, match=r"split_quantum=.*: use a positive multiple of this plan's split-KV "
                                             r"chunk \(64 positions\)"):
            generate(compiled.plan, split_quantum=bad)
    with pytest.raises(ValueError, match="without pass_chunks"):
        generate(compiled.plan, split_quantum=128, pass_chunks=True)
    unsplit = compiled.replan(split_kv=False).plan
    with pytest.raises(ValueError, match="no split-KV attention: build without it"):
        generate(unsplit, split_quantum=128)


def test_a_split_quantum_build_compiles_for_sm_90a():
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check, load_module

    plan = _gemma_b1(layers=1).plan
    result = compile_check(plan, load_module(generate(plan, split_quantum=128).source))
    assert result.ok, result.error
