"""The ``loader_warp`` build (session 51 candidate, ``codegen.generate(plan, loader_warp=True)``, ``codegen.loader``,
``bodies/loader.py``): what it emits (with session 52's gates and drain too), how it deals the rows, what it
refuses, and a CuTe DSL compile for sm_90a (no GPU). Its logits (the fused default's bits) run on the GPU:
tests/test_loader_warp_gpu.py."""

from __future__ import annotations

import re

import pytest

from megabake.codegen import generate
from megabake.codegen.bodies.loader import SLOT_BYTES as BODY_SLOT_BYTES
from megabake.codegen.bodies.loader import first_group
from megabake.codegen.loader import (ATTENTION_GATE_MIN_KV_SHARE, DEFAULT_DRAIN, DEFAULT_GATES, DEFAULT_INFLIGHT,
                                     DEFAULT_MIN_LAYER_BYTES, SLOT_BYTES, default_loader_gates, layer_kv_bytes,
                                     layer_weight_bytes, loader_geometry, loader_refusal)
from megabake.plan import EXPERIMENTAL_LAYOUTS_ENV, GPU_VERIFIED_FEATURES, feature_enabled
from megabake.plan.tuning import HOPPER_SMEM_PER_BLOCK
from megabake.runtime.compile import compile_check, load_module
from tests.compiler_fixtures import compile_preset

FORCED = {"fused_mlp": True, "bulk_down": True}  # Qwen2.5-0.5B's default leaves the fused MLP off


@pytest.fixture(scope="module")
def qwen3():
    return compile_preset("qwen3-0.6b", layers=2, vocab=512, capacity=4096).plan


def _kernel(source: str) -> str:
    return source.split("def megakernel(", 1)[1].split("\ndef launch(", 1)[0]


def test_the_loader_streams_every_weight_and_the_consumers_copy_none(qwen3):
    # the "qkv" gate alone: Qwen3-0.6B's default at 4096 adds "attention", whose split-step order has a test of its own
    source = generate(qwen3, loader_warp=True, loader_gates=DEFAULT_GATES).source
    kernel = _kernel(source)
    consumers, loader = kernel.split("\n    else:  # warp WARPS, the loader", 1)
    assert "\nBLOCK = (THREADS + LOADER_THREADS, 1, 1)" in source and "\nLOADER_THREADS = 128 " in source
    assert "cute.arch.setmaxregister_increase(REGISTERS[0])" in consumers
    assert "cute.arch.setmaxregister_decrease(REGISTERS[1])" in loader and "if tidx < THREADS + 32:" in loader
    assert "\nLOADER_THREADS = 32 " in generate(qwen3, loader_warp=True, loader_warpgroup=False).source
    for copy in ("gemv_ring_prefill(", "prefetch_rows(", "fused_o_load(", "mlp_down_bulk(", "gemv_rows_streamed("):
        assert "bodies." + copy not in kernel, copy
    assert consumers.count("bodies.gemv_slots(") == 3  # QKV, gate/up, LM head
    # the loader's copies in the consumers' order: the first layer's QKV rows; per layer the W_O block, the next
    # layer's QKV rows (a ring of their own), W_down, gate/up; then the LM head
    order = re.findall(r"bodies\.(loader_\w+)\(\s*(?:weight|w_o|w_cta)=([a-z_]+\[?[^,]*)", loader)
    assert order == [("loader_rows", "w_qkv[0"), ("loader_o_block", "w_o[layer"), ("loader_rows", "w_qkv[layer + 1"),
                     ("loader_down", "w_down_cta[layer"), ("loader_rows", "cute.local_tile(w_gate_up[layer"),
                     ("loader_rows", "lm_head")], order
    assert "if layer + 1 < LAYERS:" in loader and "s_qslots, s_qfull, s_qempty" not in consumers.replace("\n", " ")
    assert consumers.count("ring=s_qslots, full=s_qfull, empty=s_qempty") == 1  # the QKV GEMV reads its own ring
    # one ring for all (as session 51 first measured): per layer QKV, the W_O block, gate/up, W_down; the LM head
    shared = _kernel(generate(qwen3, loader_warp=True, loader_qkv_ring=False).source).split("\n    else:  # warp", 1)[1]
    order = re.findall(r"bodies\.(loader_\w+)\(\s*(?:weight|w_o|w_cta)=([a-z_]+)", shared)
    assert order == [("loader_rows", "w_qkv"), ("loader_o_block", "w_o"), ("loader_rows", "cute"),
                     ("loader_down", "w_down_cta"), ("loader_rows", "lm_head")], order
    assert "s_qslots" not in shared
    # every unit index the consumers wait for is one the loader fills: the same expressions on both sides
    # (the loader fills the first layer's QKV units before its loop and the next layer's inside it)
    loads = {re.sub(r"^(0|\(layer \+ 1\)) \*", "layer *", seq) for seq in re.findall(r"seq0=([^,]+),", loader)}
    assert sorted(re.findall(r"seq0=([^,]+),", consumers)) == sorted(loads)
    # no CTA barrier waits for the loader warp: the kernel's and the copied bodies' meet THREADS threads only
    assert "cute.arch.sync_threads()" not in source
    assert source.count("cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)") >= 10
    # every mbarrier (the QKV ring's too) is initialised before the barrier that lets any warp use one
    assert consumers.rindex("cute.arch.mbarrier_init(") < consumers.index("cute.arch.barrier(barrier_id=0, ")
    assert "wait_block(bar=s_wo_full" in consumers and "release_block(bar=s_wo_empty" in consumers
    assert "release_block(bar=s_down_empty" in consumers
    # without it the build streams nothing from a loader (where it is built by default: the next test)
    assert "loader_rows" not in generate(qwen3, loader_warp=False).source


@pytest.mark.parametrize("preset,capacity", [("qwen3-0.6b", 4096), ("qwen2.5-0.5b", 4096), ("smollm-135m", 2048)])
def test_every_row_of_every_stream_is_copied_and_reduced_once(preset, capacity):
    """Full-size plans: each CTA's run of rows, its units of whole rows in one slot, and the groups dealt over the
    warps by ``bodies.loader.first_group`` cover every row of each streamed weight exactly once; and the ring, the
    W_O block and the W_down columns fit a Hopper CTA's shared memory."""
    plan = compile_preset(preset, capacity=capacity).plan
    geometry = loader_geometry(plan)
    assert SLOT_BYTES == BODY_SLOT_BYTES and 3 <= geometry.slots and geometry.smem_bytes <= HOPPER_SMEM_PER_BLOCK
    warps = plan.warps
    for stream in geometry.streams:
        # a bound of a lap or more would wait for a phase the loader has not armed: it must stay below the ring
        assert stream.inflight < geometry.ring_slots(stream.stage), stream
        assert stream.stage != "norm_qkv" or geometry.qkv_slots == stream.units  # one slot per QKV unit
        assert stream.unit_rows * stream.cols * 2 <= SLOT_BYTES and stream.unit_rows % stream.group == 0
        ctas = plan.ctas if stream.stage != "norm_gate_up" else 1  # gate/up: each CTA's own block
        seen = [0] * stream.rows
        for cta in range(ctas):
            row0 = cta * stream.per_cta
            owned = max(min(stream.rows - row0, stream.per_cta), 0)
            per_unit = stream.unit_rows // stream.group
            for unit in range(stream.units):
                present = max(min(owned - unit * stream.unit_rows, stream.unit_rows), 0)
                for warp in range(warps):
                    for g in range(first_group(warp, unit, per_unit, warps), per_unit, warps):
                        assert (unit * per_unit + g) % warps == warp
                        if g * stream.group < present:
                            for r in range(stream.group):
                                seen[row0 + unit * stream.unit_rows + g * stream.group + r] += 1
        assert seen == [1] * stream.rows, stream.stage


def test_gates_make_the_loader_wait_for_the_consumers_arrivals(qwen3):
    """loader_gates (session 52): thread 0 arrives on a CTA mbarrier right after the grid arrival of the gated
    stage (so the copies the loader issues next are not in flight at that arrival's release), and the loader waits
    for that layer's phase right before the copies the gate holds back; loader_drain waits for the W_O block and
    the W_down columns to land."""
    source = generate(qwen3, loader_warp=True, loader_gates=("mlp", "qkv"), loader_drain=True).source
    consumers, loader = _kernel(source).split("\n    else:  # warp WARPS, the loader", 1)
    assert "\nLOADER_GATES = ('qkv', 'mlp')" in source and "\nLOADER_GATE_COUNT = 2" in source
    # per layer: QKV's arrival then gate 0; the O stage's arrival; the MLP's arrival then gate 1
    layer = consumers.split("for layer in range(LAYERS):", 1)[1]
    assert re.findall(r"bodies\.(grid_arrive|gate_arrive)\((?:gates=s_gate, gate=(\d))?", layer) == [
        ("grid_arrive", ""), ("gate_arrive", "0"), ("grid_arrive", ""), ("grid_arrive", ""), ("gate_arrive", "1")]
    prologue = consumers.split("for layer in range(LAYERS):", 1)[0]
    assert "bodies.grid_arrive(" in prologue and "gate_arrive(" not in prologue  # the embedding's barrier: no gate
    steps = re.findall(r"(mbarrier_wait\(s_gate\.iterator \+ \d, .*?% 2\)|bodies\.loader_\w+\(|"
                       r"wait_block\(bar=s_\w+)", loader)
    assert steps == ["bodies.loader_rows(",  # the first layer's QKV rows
                     "mbarrier_wait(s_gate.iterator + 1, (layer - 1) % 2)", "bodies.loader_o_block(",
                     "wait_block(bar=s_wo_full", "mbarrier_wait(s_gate.iterator + 0, layer % 2)",
                     "bodies.loader_rows(", "bodies.loader_down(", "wait_block(bar=s_down_bar", "bodies.loader_rows(",
                     "mbarrier_wait(s_gate.iterator + 1, (LAYERS - 1) % 2)", "bodies.loader_rows("], steps
    assert "if layer > 0:  # loader_gates 'mlp'" in loader
    assert consumers.rindex("cute.arch.mbarrier_init(s_gate") < consumers.index("cute.arch.barrier(barrier_id=0, ")
    only_qkv = generate(qwen3, loader_warp=True, loader_gates=("qkv",), loader_drain=False).source
    assert "gate=1" not in only_qkv and only_qkv.count("bodies.gate_arrive(gates=s_gate, gate=0, tidx=tidx)") == 1
    assert "wait_block(bar=s_down_bar" not in _kernel(only_qkv).split("\n    else:  # warp WARPS", 1)[1]
    plain = generate(qwen3, loader_warp=True, loader_gates=(), loader_drain=False).source
    assert "s_gate" not in plain
    smem = [int(re.search(r"\nSMEM_BYTES = (\d+)", text).group(1)) for text in (plain, only_qkv, source)]
    assert smem == [smem[0], smem[0] + 8, smem[0] + 16]  # each gate's mbarrier is counted
    # 'attention': thread 0 arrives after attention's (the O stage's) grid arrival in every step; the loader waits
    # for it in split steps only, after the 'qkv' gate, then issues the gate/up rows, W_down and the next layer's QKV
    # rows in the order they are read; fused steps keep the QKV rows first
    split = generate(qwen3, loader_warp=True, loader_gates=("attention", "qkv")).source
    consumers, loader = _kernel(split).split("\n    else:  # warp WARPS, the loader", 1)
    layer = consumers.split("for layer in range(LAYERS):", 1)[1]
    assert re.findall(r"bodies\.(grid_arrive|gate_arrive)\((?:gates=s_gate, gate=(\d))?", layer) == [
        ("grid_arrive", ""), ("gate_arrive", "0"), ("grid_arrive", ""), ("gate_arrive", "1"), ("grid_arrive", "")]
    waits = loader.index("mbarrier_wait(s_gate.iterator + 0, layer % 2)")
    split_step, fused_step = re.split(r"\n +else:\n", loader.split(
        "if bodies.fused_o_step(pos, 0, MIN_CHUNK) == 0:\n", 1)[1], maxsplit=1)
    assert waits < loader.index("if bodies.fused_o_step(pos, 0, MIN_CHUNK) == 0:\n")
    order = ["mbarrier_wait(s_gate.iterator + 1, layer % 2)", "(w_gate_up[layer", "bodies.loader_down(",
             "weight=w_qkv[layer + 1"]
    assert [split_step.index(text) for text in order] == sorted(split_step.index(text) for text in order)
    fused_step = fused_step.split("weight=lm_head", 1)[0]  # up to the LM head, after the layer loop
    assert "s_gate" not in fused_step
    order = ["weight=w_qkv[layer + 1", "bodies.loader_down(", "(w_gate_up[layer"]
    assert [fused_step.index(text) for text in order] == sorted(fused_step.index(text) for text in order)


def test_the_items_gate_releases_a_split_steps_copies_once_the_ctas_items_are_done(qwen3):
    """loader_gates "items" (session 61 candidate, in place of "attention"): thread 0 arrives right after the CTA's
    attention body in both branches (one phase a layer), so in a split step before ``split_o_block`` waits for the
    KV group's other items, and not after the O stage's grid arrival; the loader's split-step copies wait for it in
    the "attention" gate's order (gate/up rows, W_down, the next layer's QKV rows). It refuses "attention" too."""
    source = generate(qwen3, loader_warp=True, loader_gates=("qkv", "items")).source
    consumers, loader = _kernel(source).split("\n    else:  # warp WARPS, the loader", 1)
    assert "\nLOADER_GATES = ('qkv', 'items')" in source
    layer = consumers.split("for layer in range(LAYERS):", 1)[1]
    calls = re.findall(r"bodies\.(grid_arrive|gate_arrive|fused_attention_o|split_kv_attention|split_o_block)\("
                       r"(?:gates=s_gate, gate=(\d))?", layer)
    assert calls == [("grid_arrive", ""), ("gate_arrive", "0"), ("fused_attention_o", ""), ("gate_arrive", "1"),
                     ("split_kv_attention", ""), ("gate_arrive", "1"), ("split_o_block", ""), ("grid_arrive", ""),
                     ("grid_arrive", "")], calls
    split_step = loader.split("if bodies.fused_o_step(pos, 0, MIN_CHUNK) == 0:\n", 1)[1]
    split_step = split_step.split("\n        else:", 1)[0]
    assert "# loader_gates 'items': a split step waits until this CTA's split-KV items are done, then" in loader
    order = ["mbarrier_wait(s_gate.iterator + 1, layer % 2)", "(w_gate_up[layer", "bodies.loader_down(",
             "weight=w_qkv[layer + 1"]
    assert [split_step.index(text) for text in order] == sorted(split_step.index(text) for text in order)
    attention = generate(qwen3, loader_warp=True, loader_gates=("qkv", "attention")).source
    assert _kernel(attention).count("gate_arrive(") == _kernel(source).count("gate_arrive(") - 1  # one per branch
    with pytest.raises(ValueError, match="'items' and 'attention' both hold a split step's copies"):
        generate(qwen3, loader_warp=True, loader_gates=("qkv", "items", "attention"))


def test_the_default_builds_the_paced_loader_where_a_layer_streams_16_mb(qwen3, monkeypatch):
    """generate(plan) picks the loader (paced: DEFAULT_GATES, DEFAULT_INFLIGHT, DEFAULT_DRAIN) only once the
    ``loader_warp`` feature is enabled, and then only at batch 1 where a layer streams at least 16 MB and nothing
    the caller asked for rules it out."""
    monkeypatch.delenv(EXPERIMENTAL_LAYOUTS_ENV, raising=False)
    assert ("LOADER_THREADS" in generate(qwen3).source) is ("loader_warp" in GPU_VERIFIED_FEATURES)
    plain = generate(qwen3, loader_warp=False).source
    monkeypatch.setenv(EXPERIMENTAL_LAYOUTS_ENV, "loader_warp")
    assert feature_enabled("loader_warp")
    paced = {"loader_warp": True, "loader_gates": default_loader_gates(qwen3), "loader_inflight": DEFAULT_INFLIGHT,
             "loader_drain": DEFAULT_DRAIN}
    assert paced == {"loader_warp": True, "loader_gates": ("qkv", "attention"), "loader_inflight": 1,
                     "loader_drain": True}  # Qwen3-0.6B at capacity 4096 reads much K/V: test_the_attention_gate...
    default = generate(qwen3)
    assert default.source == generate(qwen3, **paced, **FORCED).source != plain
    record = default.codegen["loader_warp"]  # what a bake records and folds into the package's plan tag
    assert (record["gates"], record["drain"], record["inflight"]["norm_gate_up"]) == (["qkv", "attention"], True, 1)
    assert generate(qwen3, loader_warp=False).codegen == {}
    assert generate(qwen3, loader_gates=("qkv", "attention")).codegen["loader_warp"]["gates"] == ["qkv", "attention"]
    qwen25 = compile_preset("qwen2.5-0.5b", layers=1, vocab=512, capacity=4096).plan
    assert layer_weight_bytes(qwen25) >= DEFAULT_MIN_LAYER_BYTES
    paced25 = {**paced, "loader_gates": DEFAULT_GATES}
    assert generate(qwen25).source == generate(qwen25, **paced25, **FORCED).source  # fused_mlp on for the loader
    for preset, capacity in (("smollm-135m", 2048), ("gemma-3-270m", 2048)):  # 7 MB and 11 MB a layer
        small = compile_preset(preset, layers=1, vocab=512, capacity=capacity).plan
        assert layer_weight_bytes(small) < DEFAULT_MIN_LAYER_BYTES and loader_refusal(
            small, fused_o=True, fused_split=True, fused_mlp=True, bulk_down=True, fused_kv_smem=False,
            early_down=None, barrier="split") is None
        assert "LOADER_THREADS" not in generate(small).source, preset
    batch2 = compile_preset("qwen3-0.6b", layers=1, vocab=512, capacity=4096, batch=2).plan
    assert "LOADER_THREADS" not in generate(batch2).source
    for options in ({"spare_loads": True}, {"fused_mlp": False}, {"watchdog": True}, {"early_down": "wait"},
                    {"loader_warp": False}, {"self_contained": False}):
        assert "LOADER_THREADS" not in generate(qwen3, **options).source, options
    assert "LOADER_THREADS" in generate(qwen3, timeline=True).source


def test_the_attention_gate_is_added_where_a_layer_reads_much_k_v():
    """default_loader_gates (session 55): ("qkv", "attention") where the K/V cache a layer reads at the bucket's
    capacity is at least a quarter of its weight bytes, else ("qkv",). Measured: the gate won 2.7% at 4000 on
    Qwen3-0.6B (K/V 0.53 of the weights at capacity 4096) and lost 8% on Qwen2.5-0.5B (0.07)."""
    assert DEFAULT_GATES == ("qkv",) and ATTENTION_GATE_MIN_KV_SHARE == 0.25
    cases = {("qwen3-0.6b", 4096): ("qkv", "attention"), ("qwen3-0.6b", 1024): ("qkv",),
             ("qwen2.5-0.5b", 4096): ("qkv",), ("qwen2.5-0.5b", 8192): ("qkv",)}
    for (preset, capacity), gates in cases.items():
        plan = compile_preset(preset, layers=1, vocab=512, capacity=capacity).plan
        share = layer_kv_bytes(plan) / layer_weight_bytes(plan)
        assert default_loader_gates(plan) == gates, (preset, capacity, share)
    qwen3 = compile_preset("qwen3-0.6b", layers=1, vocab=512, capacity=4096).plan
    d = qwen3.dims
    assert layer_kv_bytes(qwen3) == 2 * 2 * d.n_kv_heads * d.head_dim * 4096 == 16 << 20


def test_the_default_loader_changes_only_the_qwen_presets_at_batch_1(monkeypatch):
    """With the feature on, of every non-tiny preset at batch 1 only Qwen3-0.6B and Qwen2.5-0.5B build the loader (the rest
    stream under 16 MB a layer or are refused: rows wider than a slot, shared memory, soft-capping). This is what
    makes scripts/gpu_session.sh's loader-flip part (the GPU tests whose ids name qwen) the whole of the GPU tests
    the flip changes: a preset joining this set must join that part too."""
    from megabake.presets import PRESETS

    monkeypatch.setenv(EXPERIMENTAL_LAYOUTS_ENV, "loader_warp")
    built = set()
    for name in (n for n in PRESETS if not n.startswith("tiny-")):  # the tiny ones stream 1-2 MB a layer
        plan = compile_preset(name, layers=1, vocab=512, capacity=256).plan
        if "LOADER_THREADS" in generate(plan).source:
            built.add(name)
    assert built == {"qwen3-0.6b", "qwen2.5-0.5b"}
    status = _bench_status()  # its re-bench list dates these presets' batch-1 cells by the loader's session
    assert built == status.LOADER_PRESETS


def _bench_status():
    """benchmarks/status.py as a module (not a package: loaded from its file, as tests/test_bench_status.py does)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "status.py"
    spec = importlib.util.spec_from_file_location("bench_status", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_status"] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_the_loader_refuses_what_it_cannot_build(qwen3):
    qwen25 = compile_preset("qwen2.5-0.5b", layers=1, vocab=512, capacity=4096).plan
    with pytest.raises(ValueError, match="fused_mlp=True, bulk_down=True"):
        generate(qwen25, loader_warp=True, fused_mlp=False)
    # its plain default leaves the fused MLP off (32-bit W_down copies); the loader turns it on with bulk_down
    assert generate(qwen25, loader_warp=True).source == generate(qwen25, loader_warp=True, **FORCED).source
    for options, why in [({"self_contained": False}, "self-contained"), ({"watchdog": True}, "loader_warp"),
                         ({"spare_loads": True}, "spare_loads"), ({"early_down": "wait"}, "early_down"),
                         ({"loader_inflight": -1}, "loader_inflight=-1"),
                         ({"loader_inflight": 99}, "the ring has"), ({"fused_split": False}, "fused_split"),
                         ({"loader_gates": ("lm_head",)}, "loader_gates=.*distinct names"),
                         ({"loader_gates": "qkv"}, "loader_gates='qkv'"),
                         ({"loader_gates": ("qkv", "qkv")}, "distinct"),
                         ({"loader_gates": ("qkv",), "loader_qkv_ring": False}, "loader_qkv_ring=True")]:
        with pytest.raises(ValueError, match=why):
            generate(qwen3, loader_warp=True, **options)
    for options in ({"loader_gates": ("qkv",)}, {"loader_drain": True}):
        with pytest.raises(ValueError, match="loader_warp=True"):
            generate(qwen3, loader_warp=False, **options)
    llama = compile_preset("llama-3.2-1b", layers=1, vocab=512, capacity=1024).plan
    with pytest.raises(ValueError, match="loader_warp|fused_mlp"):
        generate(llama, loader_warp=True, **FORCED)  # its W_down block does not fit shared memory


@pytest.mark.parametrize("warpgroup,threads,gates", [(True, 384, None), (False, 288, None),
                                                     (True, 384, ("qkv", "attention", "mlp")),
                                                     (True, 384, ("qkv", "items"))])
def test_the_loader_build_compiles_for_sm90a(tmp_path, warpgroup, threads, gates):
    """With its own warpgroup the loader lowers its registers and the consumers raise theirs (setmaxnreg); either
    way no barrier after the start waits for the loader's threads. ``gates``: paced by them, with the drain."""
    plan = compile_preset("qwen2.5-0.5b", layers=1, vocab=512, capacity=4096).plan
    pacing = {"loader_gates": gates, "loader_drain": True} if gates else {}
    source = generate(plan, loader_warp=True, loader_warpgroup=warpgroup, **pacing, **FORCED).source
    result = compile_check(plan, load_module(source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    ptx = max(tmp_path.glob("*.ptx"), key=lambda p: p.stat().st_mtime).read_text()
    assert f".reqntid {threads}, 1, 1" in ptx and "cp.async.bulk.shared" in ptx and "mbarrier.try_wait" in ptx
    counts = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)
    assert sorted(set(counts)) == ([("dec", "40"), ("inc", "232")] if warpgroup else []), counts
    barriers = set(re.findall(r"bar\.sync\s+(\d+),?\s*(\d*);", ptx))
    assert barriers == {("0", str(threads)), ("1", "256")}, barriers
