"""CPU tests of GEMV tuning in the plan, the timeline build of module.py, exact RoPE frequencies after a
bf16 cast, and the order in which the verifier builds its baselines."""

from __future__ import annotations

import difflib
import re

import pytest
import torch

from megabake.codegen import generate, timeline_labels
from megabake.errors import MegaBakeError, PlanError
from megabake.plan import DEFAULT_TUNING, GEMV_STAGES, GemvTuning, Plan, build_plan, kv_splits
from megabake.plan.reference import reference_executor_for
from megabake.plan.rotary import exact_inv_freq, recover_rotary
from megabake.runtime.compile import load_module
from tests.compiler_fixtures import body_calls, compile_preset


@pytest.fixture(scope="module")
def tiny():
    """The plain register tiling: the baseline every tuning here is compared with (the default streams)."""
    return compile_preset("tiny-llama", tuning=DEFAULT_TUNING)


def _plan(tiny, tuning):
    inv_freq, scaling = recover_rotary(tiny.captured, tiny.ir)
    return build_plan(tiny.ir, inv_freq_buffer=inv_freq, rotary_scaling=scaling, tuning=tuning)


def test_tuning_reaches_plan_hash_and_module(tiny):
    tuned = _plan(tiny, {"norm_gate_up": GemvTuning(per_tile=1, unroll=16)})
    stage = next(s for s in tuned.stages if s.name == "norm_gate_up")
    assert (stage.tiling.per_tile, stage.tiling.unroll) == (1, 16)
    assert stage.tiling.tiles == stage.tiling.units
    assert tuned.hash != tiny.plan.hash
    module = load_module(generate(tuned).source)
    assert module.GEMV_UNROLL["norm_gate_up"] == 16 and module.ROWS_PER_TILE["norm_gate_up"] == 1
    assert module.GEMV_UNROLL["norm_qkv"] == 4 and module.ROWS_PER_TILE["norm_qkv"] == 2


def test_tuned_plan_still_matches_eager_on_the_reference_executor(tiny):
    tuned = _plan(tiny, {name: GemvTuning(per_tile=3, unroll=2) for name in GEMV_STAGES})
    executor = reference_executor_for(tuned, tiny.model)
    default = reference_executor_for(tiny.plan, tiny.model)
    for position, token in enumerate([3, 17, 5]):
        got = executor.step(torch.tensor([token]), position)
        want = default.step(torch.tensor([token]), position)
    assert torch.allclose(got, want, atol=1e-5)
    assert len(executor.tile_owners["norm_qkv"]) == -(-tuned.dims.qkv_rows // 3)


def test_bad_tuning_is_refused(tiny):
    with pytest.raises(PlanError, match="unknown GEMV stage"):
        _plan(tiny, {"attention": GemvTuning()})
    with pytest.raises(PlanError, match="per_tile 1..8"):
        GemvTuning(per_tile=0)


def test_timeline_module_stores_a_clock_after_every_stage(tiny):
    source = generate(tiny.plan, timeline=True).source
    module = load_module(source)
    labels = timeline_labels(tiny.plan)
    assert module.TIMELINE_SLOTS == 1 + len(labels)
    assert len(labels) == tiny.plan.barriers_per_step + 1  # the last stage ends without a barrier
    assert source.count("cute.arch.globaltimer()") == 1 + 1 + 5 + 1  # start, prologue, layer loop, epilogue
    assert "globaltimer" not in generate(tiny.plan).source  # packages never carry the clock


def test_phases_timeline_stores_a_clock_after_every_phase(tiny):
    """``timeline="phases"``: staging, GEMV, prefetch and barrier wait of every stage in slots of their own;
    the intervals of a stage add up to that stage's interval of the stage-level timeline (the same clocks)."""
    from megabake.codegen import TIMELINE_PHASES, stage_phases

    source = generate(tiny.plan, timeline=TIMELINE_PHASES).source
    module = load_module(source)
    labels = timeline_labels(tiny.plan, phases=True)
    assert module.TIMELINE_SLOTS == 1 + len(labels) and module.TIMELINE_PHASES is True
    qkv = next(s for s in tiny.plan.stages if s.name == "norm_qkv")
    assert stage_phases(tiny.plan, qkv) == ["rmsnorm_to_smem", "gemv_rows", "prefetch", "barrier"]
    assert "layer1.norm_qkv.barrier" in labels and labels[-1] == "norm_lm_head.gemv_rows"
    per_stage = {s.name: len(stage_phases(tiny.plan, s)) for s in tiny.plan.stages}
    stage_level = timeline_labels(tiny.plan)
    assert len(labels) == sum(per_stage[label.split(".")[-1]] for label in stage_level)
    # one store per phase in the generated text (the layer loop's once), plus the kernel start
    assert source.count("cute.arch.globaltimer()") == 1 + sum(per_stage.values())
    slots = [int(line.split("barrier[")[1].split("]")[0].split(" ")[0]) for line in source.splitlines()
             if "= cute.arch.globaltimer()" in line]  # the layer loop's: the first layer's slot
    counts = {scope: sum(per_stage[s.name] for s in tiny.plan.stages if s.scope == scope)
              for scope in ("prologue", "layer", "epilogue")}
    loop_end = 2 + counts["prologue"] + counts["layer"]  # start, prologue, the loop's phases: consecutive
    epilogue = loop_end + counts["layer"] * (tiny.plan.dims.layers - 1)  # ... the epilogue after every layer's
    assert slots == list(range(1, loop_end)) + list(range(epilogue, epilogue + counts["epilogue"]))
    assert epilogue + counts["epilogue"] - 1 == 1 + len(labels)  # the last slot closes the last interval
    with pytest.raises(ValueError, match="timeline="):
        generate(tiny.plan, timeline="stages")


def test_per_cta_timeline_stores_every_ctas_phase_clocks_in_its_own_row(tiny):
    """``timeline="phases-per-cta"``: the phases build's clocks, the same slots, in every CTA's own row of
    ``TIMELINE_STRIDE`` (each after a CTA-wide sync); it compiles for sm_90a; ``cta_timelines`` reads each CTA's
    row relative to the earliest start, and ``stage_timeline`` still reads CTA 0's."""
    from types import SimpleNamespace

    from megabake.codegen import TIMELINE_PER_CTA, TIMELINE_PHASES
    from megabake.runtime import MegakernelDecoder
    from megabake.runtime.compile import compile_check

    source = generate(tiny.plan, timeline=TIMELINE_PER_CTA).source
    module = load_module(source)
    labels = list(module.TIMELINE_LABELS)  # named as this build runs them (its merge, its fused stages)
    assert len(labels) == len(timeline_labels(tiny.plan, phases=True))
    ctas = tiny.plan.ctas
    assert module.TIMELINE_STRIDE == 1 + len(labels) and module.TIMELINE_SLOTS == module.TIMELINE_STRIDE * ctas
    assert module.TIMELINE_PHASES is True and module.TIMELINE_PER_CTA is True

    def slots(text: str, prefix: str) -> list[str]:
        return [line.split("barrier[")[1].split("]")[0].removeprefix(prefix) for line in text.splitlines()
                if "= cute.arch.globaltimer()" in line]

    kernel = source.split("\n# ====")[0]
    phased = generate(tiny.plan, timeline=TIMELINE_PHASES).source.split("\n# ====")[0]
    assert slots(kernel, "cta * TIMELINE_STRIDE + ") == slots(phased, "")
    assert kernel.count("cute.arch.sync_threads()") - phased.count("cute.arch.sync_threads()") == len(slots(phased, ""))
    result = compile_check(tiny.plan, module)
    assert result.ok, result.error

    stride = module.TIMELINE_STRIDE
    clocks = torch.zeros(1 + stride * ctas, dtype=torch.int64)
    for cta in range(ctas):  # CTA c starts 1 us after CTA c - 1 and spends (k + c) us in interval k
        row = [5_000_000 + 1000 * cta]
        for k in range(1, stride):
            row.append(row[-1] + 1000 * (k + cta))
        clocks[1 + cta * stride:1 + (cta + 1) * stride] = torch.tensor(row)
    stand_in = SimpleNamespace(module=module, plan=tiny.plan, buffers={"barrier": clocks})
    names, rows = MegakernelDecoder.cta_timelines(stand_in)
    assert names == labels and len(rows) == ctas and all(len(r) == stride for r in rows)
    assert rows[0][0] == 0.0 and rows[3][0] == 3.0 and rows[3][2] - rows[3][1] == 2.0 + 3
    assert MegakernelDecoder.stage_timeline(stand_in) == [(label, float(k + 1)) for k, label in enumerate(labels)]
    with pytest.raises(MegaBakeError, match="phases-per-cta"):
        phases_only = load_module(generate(tiny.plan, timeline=TIMELINE_PHASES).source)
        MegakernelDecoder.cta_timelines(SimpleNamespace(module=phases_only, plan=tiny.plan))


def test_timeline_module_compiles_for_sm90a(tiny):
    from megabake.runtime.compile import compile_check

    result = compile_check(tiny.plan, load_module(generate(tiny.plan, timeline=True).source))
    assert result.ok, result.error
    result = compile_check(tiny.plan, load_module(generate(tiny.plan, timeline="phases").source))
    assert result.ok, result.error


def test_stage_timeline_needs_a_timeline_build(tiny):
    from megabake.runtime import MegakernelDecoder

    decoder = MegakernelDecoder(tiny.plan, tiny.generated.source, tiny.model, device="cpu")
    with pytest.raises(MegaBakeError, match="timeline=True"):
        decoder.stage_timeline()


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "smollm-135m"])
def test_exact_inv_freq_survives_a_bf16_cast(preset):
    import dataclasses

    from megabake.presets import get_preset

    spec = get_preset(preset)
    small = dataclasses.replace(spec, config=dict(spec.config, num_hidden_layers=1, vocab_size=64))
    model = small.build_model()
    fqn = "model.rotary_emb.inv_freq"
    exact = model.get_buffer(fqn).clone()
    model.to(torch.bfloat16)
    assert not torch.equal(model.get_buffer(fqn).float(), exact)  # the cast rounded the buffer
    assert torch.equal(exact_inv_freq(model, fqn), exact)


def test_exact_inv_freq_falls_back_to_a_buffer_it_cannot_explain(tiny):
    import copy

    model = copy.deepcopy(tiny.model).to(torch.bfloat16)
    fqn = "model.rotary_emb.inv_freq"
    model.get_buffer(fqn).mul_(2)  # not what the config says: keep the model's own values
    assert torch.equal(exact_inv_freq(model, fqn), model.get_buffer(fqn).float())


def test_hand_captured_graph_is_built_after_graph_trees():
    from megabake.verification.baselines import BASELINES, build_order
    from megabake.verification.commands import KNOWN_BASELINES

    assert build_order(["inductor-graph", "inductor-reduce-overhead", "eager"]) == [
        "inductor-reduce-overhead", "eager", "inductor-graph"]
    assert build_order(["inductor-default-graph", "inductor-graph", "inductor-reduce-overhead"]) == [
        "inductor-reduce-overhead", "inductor-default-graph", "inductor-graph"]
    assert set(KNOWN_BASELINES) == set(BASELINES)  # the CLI accepts exactly the baselines that exist


def test_from_package_refuses_a_model_of_another_config(tiny):
    from megabake.presets import config_hash
    from megabake.runtime import check_model_matches

    check_model_matches({"model": {"config_hash": config_hash(tiny.model.config)}}, tiny.model)
    with pytest.raises(MegaBakeError, match="different model revision"):
        check_model_matches({"model": {"config_hash": "0" * 64}}, tiny.model)


def test_spread_tiling_deals_tiles_cta_major_with_the_same_numerics(tiny):
    from megabake.runtime.compile import compile_check

    spread = _plan(tiny, {name: GemvTuning(per_tile=2, unroll=4, spread=True) for name in GEMV_STAGES})
    assert all(s.tiling.spread for s in spread.stages if s.tiling.kind == "rows")
    assert '"spread": true' in spread.to_json() and '"spread"' not in tiny.plan.to_json()  # old plans keep their hash
    source = generate(spread).source
    assert "swarp = (tidx // 32) * CTAS + cta" in source
    assert any(call["weight"] == "w_qkv[layer, None, None]" and call["gwarp"] == "swarp"
               for call in body_calls(source, "gemv_rows"))
    assert "swarp" not in tiny.generated.kernel_source
    executor = reference_executor_for(spread, tiny.model)
    default = reference_executor_for(tiny.plan, tiny.model)
    for position, token in enumerate([3, 17, 5]):
        got = executor.step(torch.tensor([token]), position)
        want = default.step(torch.tensor([token]), position)
    assert torch.equal(got, want)
    owners = executor.tile_owners["norm_qkv"]
    assert owners[0] == (0, 0) and owners[1] == (1, 0) and owners[spread.ctas] == (0, 1)  # CTA-major
    assert len({cta for cta, _ in owners.values()}) == min(spread.ctas, len(owners))
    result = compile_check(spread, load_module(source))
    assert result.ok, result.error
    assert Plan.from_json(spread.to_json()).hash == spread.hash


def _waits(line: str) -> bool:
    """Where a CTA waits at a grid barrier: the default split barrier's wait, or an "atom" barrier's one call."""
    return "bodies.grid_wait(" in line or "bodies.grid_barrier(" in line


def test_preload_issues_the_first_chunk_before_the_barrier(tiny):
    from megabake.runtime.compile import compile_check

    tuning = {name: GemvTuning(2, 4, spread=True, preload=True) for name in GEMV_STAGES if name != "norm_lm_head"}
    plan = _plan(tiny, tuning)
    assert '"preload": true' in plan.to_json() and '"preload"' not in tiny.plan.to_json()
    lines = generate(plan).source.splitlines()
    preloads = [i for i, line in enumerate(lines) if "bodies.gemv_preload(" in line]
    barriers = [i for i, line in enumerate(lines) if _waits(line)]
    assert len(preloads) == 5  # after embed, and after each layer stage whose next stage is a GEMV
    assert all(any(b > p and not any(p < q < b for q in preloads if q != p) for b in barriers) for p in preloads)
    assert sum("bodies.gemv_rows_pre(" in line for line in lines) == 4  # the LM head loads as usual
    assert "pre_norm_qkv = cute.make_rmem_tensor" in "\n".join(lines)
    result = compile_check(plan, load_module("\n".join(lines) + "\n"))
    assert result.ok, result.error
    with pytest.raises(PlanError, match="preload is not supported for the LM head"):
        _plan(tiny, {"norm_lm_head": GemvTuning(preload=True)})


def test_attention_preload_loads_cached_rows_before_the_barrier(tiny):
    from megabake.runtime.compile import compile_check

    inv_freq, scaling = recover_rotary(tiny.captured, tiny.ir)
    plan = build_plan(tiny.ir, inv_freq_buffer=inv_freq, rotary_scaling=scaling, attention_preload=True)
    attention = next(s for s in plan.stages if s.name == "attention")
    assert attention.tiling.preload and '"preload": true' in plan.to_json()
    source = generate(plan).source
    lines = source.splitlines()
    preload = next(i for i, line in enumerate(lines) if "bodies.attention_preload(" in line)
    barrier = next(i for i, line in enumerate(lines) if i > preload and _waits(line))
    early = next(i for i, line in enumerate(lines) if "bodies.decode_attention_early(" in line)
    assert preload < barrier < early  # issued in the QKV stage, before the barrier that precedes attention
    arrival = next(i for i, line in enumerate(lines) if i > preload - 12 and "bodies.grid_arrive(" in line)
    assert preload < arrival < barrier  # it reads the KV cache that attention appends to: before the arrival
    assert "s_new = cute.make_tensor(s_vec.iterator" in source
    result = compile_check(plan, load_module(source))
    assert result.ok, result.error
    with pytest.raises(PlanError, match="one \\(batch, head\\) tile per CTA"):
        build_plan(tiny.ir, ctas=3, inv_freq_buffer=inv_freq, rotary_scaling=scaling, attention_preload=True)
    assert "attention_preload" not in tiny.generated.kernel_source


def _prefetch_tiles(source: str) -> list[int]:
    """``max_tiles`` of every ``bodies.prefetch_rows`` call in the kernel (not the appended bodies)."""
    kernel = source.split("\n# ====")[0]
    return [int(m) for m in re.findall(r"bodies\.prefetch_rows\([^)]*?max_tiles=(\d+)\)", kernel, re.S)]


def test_l2_prefetch_budget_sets_the_tiles_asked_for_before_each_barrier(tiny):
    """``generate(plan, prefetch_bytes=N)``: before each grid barrier every warp asks L2 for as many of the next
    GEMV's tiles as N bytes over the whole grid allow (at least one, at most the warp's tiles), 0 for none, and
    nothing else in the kernel changes (a prefetch has no effect on results); a build without it compiles for
    sm_90a; a bad budget is refused with its cause. The default (``codegen.default_prefetch_bytes``, session 26)
    asks for none before a GEMV that fills its cp.async ring before the barrier (every one of the streaming
    default) and ``PREFETCH_BUDGET_BYTES`` before the others (the plain tiling)."""
    from megabake.codegen import PREFETCH_BUDGET_BYTES
    from megabake.runtime.compile import compile_check

    inv_freq, scaling = recover_rotary(tiny.captured, tiny.ir)
    plan = build_plan(tiny.ir, ctas=2, inv_freq_buffer=inv_freq, rotary_scaling=scaling, tuning=DEFAULT_TUNING)
    default = generate(plan).source  # the plain tiling: nothing fills a ring
    assert generate(plan, prefetch_bytes=PREFETCH_BUDGET_BYTES).source == default
    warps = plan.ctas * plan.warps
    gate_up = next(s for s in plan.stages if s.name == "norm_gate_up")
    per_warp = -(-gate_up.tiling.tiles // warps)  # the O projection's barrier prefetches gate/up's tiles
    assert per_warp > 2
    tile_round = gate_up.tiling.per_tile * plan.dims.hidden * 2 * warps  # bytes of one tile for every warp
    assert max(_prefetch_tiles(default)) == per_warp  # 16 MB holds every tile of this small model
    two = _prefetch_tiles(generate(plan, prefetch_bytes=2 * tile_round).source)
    assert max(two) == 2 and min(two) >= 1
    assert _prefetch_tiles(generate(plan, prefetch_bytes=1).source) == [1] * len(two)  # at least one tile
    none = generate(plan, prefetch_bytes=0).source
    assert _prefetch_tiles(none) == [0] * len(two) and len(two) >= 4

    def masked(source):
        return re.sub(r"max_tiles=\d+", "max_tiles=N", source)

    assert masked(none) == masked(default)  # nothing else differs
    result = compile_check(plan, load_module(none))
    assert result.ok, result.error
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch budget per barrier in bytes"):
            generate(plan, prefetch_bytes=bad)

    streamed = build_plan(tiny.ir, ctas=2, inv_freq_buffer=inv_freq, rotary_scaling=scaling)  # ring + preload
    assert streamed.stages[1].tiling.stages == 4 and streamed.stages[1].tiling.preload
    streamed_default = generate(streamed).source
    assert _prefetch_tiles(streamed_default) == [0] * len(two)  # every GEMV after a barrier fills its ring
    old_default = generate(streamed, prefetch_bytes=PREFETCH_BUDGET_BYTES).source  # the default until session 26
    assert min(_prefetch_tiles(old_default)) >= 1
    assert masked(old_default) == masked(streamed_default)


def test_kv_prefetch_asks_l2_for_cached_rows_before_the_barrier_that_precedes_attention(tiny):
    """The default build (``kv_prefetch=True`` since session 16): one ``split_kv_prefetch`` per layer, after the
    QKV GEMV and before the grid barrier that precedes split-KV attention (sliding-window layers pass their first
    key); it compiles for sm_90a; ``kv_prefetch=False`` and the unsplit attention have none, and the prefetch is
    the only difference between the two builds."""
    from megabake.runtime.compile import compile_check

    source = generate(tiny.plan).source
    lines = source.splitlines()
    prefetch = [i for i, line in enumerate(lines) if "bodies.split_kv_prefetch(" in line]
    assert len(prefetch) == 1  # inside the layer loop
    barrier = next(i for i, line in enumerate(lines) if i > prefetch[0] and _waits(line))
    attention = next(i for i, line in enumerate(lines) if "bodies.split_kv_attention(" in line)
    qkv = max(i for i, line in enumerate(lines) if "bodies.gemv_rows" in line and i < prefetch[0])
    assert qkv < prefetch[0] < barrier < attention
    assert "first_key=0" in "\n".join(lines[prefetch[0]:barrier])
    assert "bodies.split_kv_prefetch(" in tiny.generated.kernel_source
    without = generate(tiny.plan, kv_prefetch=False).source
    assert "bodies.split_kv_prefetch(" not in without and "def split_kv_prefetch(" not in without
    kernel, kernel_without = source.split("\n# ====")[0].splitlines(), without.split("\n# ====")[0].splitlines()
    edits = [op for op in difflib.SequenceMatcher(a=kernel_without, b=kernel, autojunk=False).get_opcodes()
             if op[0] != "equal"]
    assert [(tag, j1) for tag, _, _, j1, _ in edits] == [("insert", prefetch[0])]  # the call, nothing else
    result = compile_check(tiny.plan, load_module(source))
    assert result.ok, result.error
    into_l1 = generate(tiny.plan, kv_prefetch_l1=True).source  # a candidate: the same call, the L1 flag set
    assert into_l1.replace("to_l1=True", "to_l1=False") == source and "to_l1=True" in into_l1
    assert 'cache_level="L1"' in into_l1 and compile_check(tiny.plan, load_module(into_l1)).ok
    with pytest.raises(ValueError, match="needs kv_prefetch=True"):
        generate(tiny.plan, kv_prefetch=False, kv_prefetch_l1=True)

    inv_freq, scaling = recover_rotary(tiny.captured, tiny.ir)
    unsplit = build_plan(tiny.ir, inv_freq_buffer=inv_freq, rotary_scaling=scaling, split_kv=False)
    assert "split_kv_prefetch(" not in generate(unsplit, kv_prefetch=True).source.split("\n# ====")[0]


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma-2b"])
def test_merge_preload_is_a_flag_of_split_kv_attention_and_compiles(preset):
    """``generate(plan, merge_preload=True)`` (the default wherever it fits since session 17): the split-KV
    attention call's argument turns the merge's preload on; nothing else in the kernel changes; it compiles for
    sm_90a with one output per thread (tiny-llama) and with eight (gemma-2b's head_dim 256: 2 preloaded splits,
    then blocks of 8)."""
    from megabake.runtime.compile import compile_check

    compiled = compile_preset(preset, layers=2, vocab=512, capacity=1024)
    plain = generate(compiled.plan, merge_preload=False, fused_o=False).source.split("\n# ====")[0]
    preloaded = generate(compiled.plan, merge_preload=True, fused_o=False).source.split("\n# ====")[0]
    changed = [(a, b) for a, b in zip(plain.splitlines(), preloaded.splitlines()) if a != b]
    assert len(plain.splitlines()) == len(preloaded.splitlines()) and len(changed) == 1
    assert "merge_preload=False" in changed[0][0]
    assert changed[0][1] == changed[0][0].replace("merge_preload=False", "merge_preload=True")
    result = compile_check(compiled.plan, load_module(generate(compiled.plan, merge_preload=True).source))
    assert result.ok, result.error


@pytest.mark.parametrize("preset,spread", [("tiny-llama", False), ("gemma-2b", True)])
def test_default_merge_preloads_and_spreads_only_wide_groups(preset, spread):
    """The default build (session 17, measured on the H200) preloads the merge wherever it fits and spreads it
    only over groups of SPREAD_MERGE_MIN_OUTPUTS outputs or more (gemma-2b: 8 query heads x 256 on one KV head;
    tiny-llama: 2 x 64): the default module is the one asked for with those flags, the spread one compiles
    together with the preload (the preloaded last-arrival merge runs where too few splits are active), and a
    plan without splits has neither argument."""
    from megabake.codegen import SPREAD_MERGE_MIN_OUTPUTS, default_merge
    from megabake.runtime.compile import compile_check

    compiled = compile_preset(preset, layers=2, vocab=512, capacity=1024)
    dims = compiled.plan.dims
    assert (dims.n_heads // dims.n_kv_heads * dims.head_dim >= SPREAD_MERGE_MIN_OUTPUTS) == spread
    assert default_merge(compiled.plan) == (True, spread)
    source = generate(compiled.plan).source
    assert source == generate(compiled.plan, merge_preload=True, spread_merge=spread).source
    call = " ".join(source[source.index("bodies.split_kv_attention("):].split(")\n")[0].split())
    assert f"merge_preload=True, spread_merge={spread}, head_slices=HEAD_SLICES," in call
    assert ("bodies.split_kv_counts_reset(" in source.split("\n# ====")[0]) == spread
    if spread:
        result = compile_check(compiled.plan, load_module(source))
        assert result.ok, result.error
    short = compile_preset(preset, layers=2, vocab=512, capacity=128)
    if not kv_splits(short.plan):
        assert default_merge(short.plan) == (True, False)
        assert "merge_preload" not in generate(short.plan).source.split("\n# ====")[0]


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma-2b"])
def test_spread_merge_flags_attention_resets_counters_after_its_barrier_and_compiles(preset):
    """``generate(plan, spread_merge=True)`` (the default for wide groups since session 17): the attention call's
    last argument is set, and the stage after attention starts by zeroing the groups' counters
    (``split_kv_counts_reset``: the spread merge leaves them at the arrivals); it compiles for sm_90a (one and
    eight outputs per thread)."""
    from megabake.runtime.compile import compile_check

    compiled = compile_preset(preset, layers=2, vocab=512, capacity=1024)
    default = generate(compiled.plan, spread_merge=False, fold_merge=False,
                       fused_o=False).source.split("\n# ====")[0].splitlines()  # the spread merge is never fused
    source = generate(compiled.plan, spread_merge=True).source
    lines = source.split("\n# ====")[0].splitlines()
    reset = [i for i, line in enumerate(lines) if "bodies.split_kv_counts_reset(" in line]
    attention = next(i for i, line in enumerate(lines) if "bodies.split_kv_attention(" in line)
    barrier_after = next(i for i in range(attention, len(lines)) if _waits(lines[i]))
    assert len(reset) == 1 and barrier_after < reset[0]  # once per layer, in the stage after attention's barrier
    assert any("o_residual" in line for line in lines[barrier_after:reset[0]])  # that stage's banner comes first
    reset_end = next(i for i in range(reset[0], len(lines)) if lines[i].endswith(")"))  # the call, wrapped or not
    assert [line for line in lines[:reset[0]] + lines[reset_end + 1:] if "spread_merge=True" not in line] == \
        [line for line in default if "spread_merge=False" not in line]
    result = compile_check(compiled.plan, load_module(source))
    assert result.ok, result.error


def test_merge_preload_refuses_splits_that_overflow_the_attention_scratch(tiny):
    """The preload keeps each split's max and sum (2 x splits per head) in the warps' partial scratch of
    (head_dim + 2) x warps floats: a plan with more splits than half of that is refused, naming the sizes."""
    import dataclasses

    attention = next(s for s in tiny.plan.stages if s.kind == "attention")
    too_many = (tiny.plan.dims.head_dim + 2) * tiny.plan.warps // 2 + 1
    wide = dataclasses.replace(attention, tiling=dataclasses.replace(attention.tiling,
                                                                      tiles=attention.tiling.units * too_many))
    plan = dataclasses.replace(tiny.plan, stages=[wide if s is attention else s for s in tiny.plan.stages])
    with pytest.raises(ValueError, match=f"2 x {too_many} splits"):
        generate(plan, merge_preload=True)
    generate(plan)  # the default merge has room for them


def test_fold_merge_stages_the_o_projection_from_the_partials_and_changes_nothing_else():
    """``generate(plan, fold_merge=True)`` (the default since session 24): attention merges only above
    ``FOLD_SPLITS`` active splits, the O projection stages its row through ``merge_splits_to_smem`` (which reads
    the partials, with the same split dealing as attention), and nothing else changes; the default build is the
    folded one while ``FOLD_MERGE`` is on (``fold_merge=False`` is the build without it). SmolLM-1.7B: all 4
    splits fold (32 heads x 66 floats x 4 B each, 33 KB per CTA); OLMo-2-1B: 8 of 8."""
    from megabake.codegen import FOLD_MERGE, fold_splits

    compiled = compile_preset("smollm-1.7b", layers=2, vocab=512, capacity=2048)
    assert fold_splits(compiled.plan) == 4
    assert fold_splits(compile_preset("olmo-2-1b", layers=2, vocab=512, capacity=4096).plan) == 8
    plain = generate(compiled.plan, fold_merge=False).source.split("\n# ====")[0]
    folded = generate(compiled.plan, fold_merge=True).source.split("\n# ====")[0]
    assert (generate(compiled.plan).source.split("\n# ====")[0] == folded) is FOLD_MERGE
    assert "\nFOLD_SPLITS = 4\n" in folded and "FOLD_SPLITS" not in plain
    staging = body_calls(folded, "merge_splits_to_smem")
    assert len(staging) == 1 and staging[0]["part"] == "attn_part" and staging[0]["fold"] == "FOLD_SPLITS"
    copies = [c["src"] for c in body_calls(plain, "copy_to_smem")]  # the O projection's row; the gated down's
    assert copies.count("attn") == 1 and [c["src"] for c in body_calls(folded, "copy_to_smem")] == \
        [src for src in copies if src != "attn"]
    assert [c.get("merge_above") for c in body_calls(folded, "split_kv_attention")] == ["FOLD_SPLITS"]
    assert [c.get("merge_above") for c in body_calls(plain, "split_kv_attention")] == [None]
    changed = [line for line in difflib.ndiff(plain.splitlines(), folded.splitlines()) if line[:2] in ("- ", "+ ")]
    assert len(changed) == 8, changed  # the constant, attention's last line (-1 +1), the staging call (-1 +4)


@pytest.mark.parametrize("preset,why", [("gemma-2b", "the spread merge is on"),
                                        ("tiny-llama", "attention is not split")])
def test_fold_merge_is_refused_where_it_cannot_fold(preset, why):
    """gemma-2b's one KV head spreads its merge over the items (no partials left to fold); a bucket whose
    attention is one CTA per head has no splits. Both refusals name the cause and the fix."""
    split_kv = preset == "gemma-2b"
    compiled = compile_preset(preset, layers=2, vocab=512, capacity=1024).replan(split_kv=split_kv)
    assert bool(kv_splits(compiled.plan)) is split_kv
    with pytest.raises(ValueError, match=f"fold_merge needs .* but {why}.*: build without it"):
        generate(compiled.plan, fold_merge=True)
    generate(compiled.plan)  # the default picks what fits


@pytest.mark.parametrize("preset,batch,items", [("qwen2.5-0.5b", 8, [7]), ("smollm-135m", 1, [3]),
                                                 ("llama-3.2-1b", 1, [4, 2]), ("qwen3-0.6b", 1, [2]),
                                                 ("smollm-1.7b", 1, []), ("gemma-2b", 1, [])])
def test_mma_attention_takes_items_of_2_to_8_heads_of_64_or_128_and_is_refused_elsewhere(preset, batch, items):
    """``generate(plan)`` (since session 33; ``mma_attention=True`` asks for it): the split-KV items the plan can
    deal (the KV group, or its head slices) of 2-8 query heads of 64 or 128 dims go to the tensor cores (Qwen2.5-0.5B
    batch 8: groups of 7; Llama-3.2-1B: 4, or 2 per slice). Where none can (SmolLM-1.7B: one query head per KV head;
    gemma-2b: heads of 256, which only an ``mma_wide`` build takes, the default where it applies since session 42:
    tests/test_mma_wide.py) the narrow build (``mma_wide=False``) is the lane-group loop and asking for them is
    refused by name. Otherwise module.py with ``mma_attention=False`` differs from the default only in the constant
    and the attention call's keyword."""
    from megabake.codegen import default_mma_attention
    from megabake.plan.attention import mma_attention_items

    compiled = compile_preset(preset, layers=2, vocab=512, batch=batch, capacity=1024)
    assert mma_attention_items(compiled.plan) == items
    assert default_mma_attention(compiled.plan) == bool(items)
    default = generate(compiled.plan, fused_o=False).source  # fused steps: tests/test_fused_o.py
    lane_group = generate(compiled.plan, mma_attention=False).source
    assert "MMA_ATTENTION" not in lane_group
    if not items:
        assert generate(compiled.plan, fused_o=False, mma_wide=False).source == lane_group
        with pytest.raises(ValueError, match="mma_attention puts split-KV items of 2-8 query heads .* build without it"):
            generate(compiled.plan, mma_attention=True, mma_wide=False)
        return
    assert generate(compiled.plan, mma_attention=True, fused_o=False).source == default
    assert [c.get("mma_attention") for c in body_calls(default, "split_kv_attention")] == ["MMA_ATTENTION"]
    changed = [line for line in difflib.ndiff(lane_group.splitlines(), default.splitlines())
               if line[:2] in ("- ", "+ ")]
    assert len(changed) == 3, changed  # the constant (+1), attention's last line (-1 +1)
    with pytest.raises(ValueError, match="mma_schedule deals split-KV items for the tensor cores: it needs"):
        generate(compiled.plan, mma_attention=False, mma_schedule=True)
    scheduled = generate(compiled.plan, mma_attention=True, mma_schedule=True).source
    dealing = ["split_kv_attention", "split_kv_prefetch", "merge_splits_to_smem"]  # each calls split_schedule
    assert {name: [c.get("mma_slices") for c in body_calls(scheduled, name)] for name in dealing} == \
        {name: ["MMA_SLICES"] * len(body_calls(default, name)) for name in dealing}


def test_the_mma_attention_fragment_algebra_is_softmax_attention():
    """``scripts/mma_attention_emulate.py`` builds every lane's fragments as ``bodies._mma_softmax_chunk`` does and
    applies m16n8k16 with the PTX layouts: in float64 it equals softmax attention (2-8 heads, 64 and 128 dims, and
    256 as an ``mma_wide`` build deals them; one key, masked tails, chunks that start past 0). The executable spec
    of the kernel's mapping."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "mma_attention_emulate.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    errors = [float(line.split("|")[4]) for line in result.stdout.splitlines()[2:]]
    assert len(errors) == 8 and max(errors) < 1e-12, result.stdout


def test_the_mma_schedule_deals_whole_groups_over_shorter_chunks_where_heads_come_free():
    """``split_schedule(..., mma_slices=mma_slice_mask(plan))`` (an ``mma_schedule`` build) weighs an item that
    runs on the tensor cores by its chunk alone: Qwen2.5-0.5B at batch 1 deals its 7-head groups whole (one MMA
    item per chunk) where the default deals 7 one-head slices, over 128-position chunks at 4095 instead of 512; a
    dealing the default already gives whole groups (batch 8) is unchanged, and without a mask nothing changes."""
    from megabake.plan.attention import mma_slice_mask, split_schedule

    one = compile_preset("qwen2.5-0.5b", layers=2, vocab=512, capacity=4096).plan
    eight = compile_preset("qwen2.5-0.5b", layers=2, vocab=512, capacity=4096, batch=8).plan
    tiling = next(s.tiling for s in one.stages if s.kind == "attention")
    assert mma_slice_mask(one) == 1 << 1 and mma_slice_mask(one, head_slices=False) == 1 << 1
    assert (split_schedule(tiling, 4095).chunk, split_schedule(tiling, 4095).slices) == (512, 7)
    dealt = split_schedule(tiling, 4095, mma_slices=mma_slice_mask(one))
    assert (dealt.chunk, dealt.active, dealt.slices) == (128, 32, 1)
    assert split_schedule(tiling, 17, mma_slices=mma_slice_mask(one)).slices == 1
    wide = next(s.tiling for s in eight.stages if s.kind == "attention")
    for visible in (17, 1000, 4095):
        assert split_schedule(wide, visible, mma_slices=mma_slice_mask(eight)).chunk == \
            split_schedule(wide, visible).chunk
    assert mma_slice_mask(compile_preset("smollm-1.7b", layers=2, vocab=512, capacity=1024).plan) == 0


def test_kv_prefetch_is_capped_at_the_shortest_split_chunk_by_default(tiny):
    """Session 29: the default K/V prefetch asks for at most the first ``MIN_CHUNK`` rows of each CTA's item (a
    short context's item whole; at 4000 positions the uncapped prefetch of the whole item slowed the QKV GEMV's
    weight stream: Phi-3-mini 2.462 -> 2.377 ms capped, 2.364 without). ``kv_prefetch_rows`` sets the cap, the
    only difference in module.py; it compiles for sm_90a; bad caps are refused by name."""
    from megabake.codegen import default_kv_prefetch_rows
    from megabake.runtime.compile import compile_check

    attention = next(s.tiling for s in tiny.plan.stages if s.kind == "attention")
    assert default_kv_prefetch_rows(tiny.plan) == attention.per_tile == 128
    source = generate(tiny.plan).source
    assert "max_rows=128)" in source and source == generate(tiny.plan, kv_prefetch_rows=128).source
    uncapped = generate(tiny.plan, kv_prefetch_rows=1 << 20).source
    assert uncapped.replace(f"max_rows={1 << 20})", "max_rows=128)") == source
    assert compile_check(tiny.plan, load_module(uncapped)).ok
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="kv_prefetch_rows=.*an int >= 1"):
            generate(tiny.plan, kv_prefetch_rows=bad)


def test_kv_prefetch_of_a_sliding_window_starts_at_the_window():
    from tests.compiler_fixtures import compile_preset

    compiled = compile_preset("tiny-mistral", capacity=512)
    assert any(compiled.plan.windows)
    kernel = generate(compiled.plan).source.split("\n# ====")[0]
    call = kernel[kernel.index("bodies.split_kv_prefetch("):]
    assert "first_key=cutlass.max(pos + 1 - attn_window[layer], 0)" in call[:call.index("bodies.", 10)]


def test_pipelined_gemv_plans_generates_and_compiles_with_the_same_numerics(tiny):
    from megabake.runtime.compile import compile_check

    # (2, 1): K = 256 is one chunk per tile, 512 two; (2, 2) and (1, 8): partial chunks (K = 256 < 512, 1024).
    tuning = {name: GemvTuning(2, 1, spread=True, pipeline=True) for name in GEMV_STAGES}
    tuning["o_residual"] = GemvTuning(1, 1, preload=True, pipeline=True)  # the preloaded tile seeds the pipe
    tuning["norm_gate_up"] = GemvTuning(2, 2, preload=True, pipeline=True)
    tuning["down_residual"] = GemvTuning(1, 8, pipeline=True)
    plan = _plan(tiny, tuning)
    assert all(s.tiling.pipeline for s in plan.stages if s.tiling.kind == "rows")
    assert '"pipeline": true' in plan.to_json() and '"pipeline"' not in tiny.plan.to_json()  # old hashes hold
    source = generate(plan).source
    calls = body_calls(source, "gemv_rows_pipelined")
    assert len(calls) == 5 and not body_calls(source, "gemv_rows") and not body_calls(source, "gemv_rows_pre")
    assert sum(call["pre"] in ("pre_o_residual", "pre_norm_gate_up") and call["has_bias"] == "False"
               and call["preloaded"] == "True" for call in calls) == 2  # preloaded
    assert sum(call["has_bias"] == "False" and call["preloaded"] == "False" for call in calls) == 3
    assert "gemv_rows_pipelined" not in tiny.generated.kernel_source
    executor, default = reference_executor_for(plan, tiny.model), reference_executor_for(tiny.plan, tiny.model)
    for position, token in enumerate([3, 17, 5]):
        assert torch.equal(executor.step(torch.tensor([token]), position),
                           default.step(torch.tensor([token]), position))
    result = compile_check(plan, load_module(source), dump_dir=None)
    assert result.ok, result.error
    assert Plan.from_json(plan.to_json()).hash == plan.hash


def test_pipelined_gemv_refuses_register_tiles_that_do_not_fit(tiny):
    with pytest.raises(PlanError, match=r"norm_qkv: a pipelined K loop holds two tiles of per_tile x unroll = 16 "
                                        r"16-byte vectors per lane; at most 8"):
        _plan(tiny, {"norm_qkv": GemvTuning(4, 4, pipeline=True)})


def test_pipelined_gemv_refuses_large_ctas(tiny):
    inv_freq, scaling = recover_rotary(tiny.captured, tiny.ir)
    with pytest.raises(PlanError, match=r"at most 256 threads per CTA \(got 512\)"):
        build_plan(tiny.ir, threads=512, inv_freq_buffer=inv_freq, rotary_scaling=scaling,
                   tuning={"down_residual": GemvTuning(1, 1, pipeline=True)})


def test_sass_schedule_summary_shows_loads_ahead_of_arithmetic():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "sass_inspect.py"
    spec = importlib.util.spec_from_file_location("sass_inspect", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sass = "\n".join([
        "        /*0100*/                   LDG.E.128 R16, desc[UR16][R6.64+0x600] ;",
        "        /*0110*/              @!P0 LDG.E.128 R12, desc[UR16][R4.64+0x1000] ;",
        "        /*0120*/                   NOP ;",
        "        /*0130*/                   FFMA R0, R12, R0, RZ ;",
        "        /*0140*/                   FFMA R2, R13, R4, R0 ;",
        "        /*0150*/                   IMAD.U32 R4, R5, 0x10000, RZ ;",
        "        /*0160*/                   FFMA R2, R14, R4, R2 ;",
        "        /*0170*/               @P0 BRA `(.L_x_10) ;",
        "        /*0180*/                   STL.64 [R1], R12 ;",
    ])
    assert module.schedule(sass) == "2LDG 1NOP 3FFMA 1BRA 1STL"
    loop = "\n".join([
        ".L_x_3:",
        "        /*0200*/                   LDG.E.128 R16, desc[UR16][R6.64] ;",
        "        /*0210*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;",
        "        /*0220*/                   MUFU.EX2 R5, R5 ;",
        "        /*0230*/              @P1 BRA `(.L_x_3) ;",
        ".L_x_4:",
        "        /*0240*/                   FFMA R0, R12, R0, RZ ;",
        "        /*0250*/              @P2 BRA `(.L_x_4) ;",
        "        /*0260*/                   BRA `(.L_x_5) ;",
        "        /*0270*/              @P3 BRA `(.L_x_3) ;",  # an outer loop around both
    ])
    assert module.loops_with(loop, "MUFU") == ["1LDG 1SHFL 1MUFU 1BRA"]  # not the loop without one, nor a jump ahead
    assert module.loops_with(loop, "FFMA") == ["1FFMA 1BRA"]


def _pipelined_schedule(rows, kvecs, per_tile, unroll, total_warps, gwarp, warp_size=32):
    """A line-by-line Python mirror of ``bodies.gemv_rows_pipelined``'s index arithmetic for one warp: yields
    ("add", lane, row, kv) in the order each lane accumulates, and ("write", row) when a tile is written;
    also checks that every consumed chunk is the one loaded one step earlier."""
    tiles = -(-rows // per_tile)
    chunk = warp_size * unroll
    chunks = -(-kvecs // chunk)
    steps = (tiles - gwarp + total_warps - 1) // total_warps * chunks
    loaded = (gwarp, 0) if gwarp < tiles else None  # cur: (tile, kbase) in registers
    for step in range(steps):
        after = min(step + 1, steps - 1)
        nxt = (gwarp + after // chunks * total_warps, after % chunks * chunk)
        c = step % chunks
        tile = gwarp + step // chunks * total_warps
        assert loaded == (tile, c * chunk), (step, loaded, tile, c)  # the chunk in hand is this step's
        for lane in range(warp_size):
            for u in range(unroll):
                kv = c * chunk + u * warp_size + lane
                if kv < kvecs:
                    for r in range(per_tile):
                        yield ("add", lane, tile * per_tile + r, kv)  # accumulator r (its row may be past the end)
        if c == chunks - 1:
            for r in range(per_tile):
                if tile * per_tile + r < rows:
                    yield ("write", tile * per_tile + r)
        loaded = nxt


@pytest.mark.parametrize("rows, kvecs, per_tile, unroll, total_warps", [
    (3072, 256, 2, 4, 1056),  # Llama-1B QKV: whole chunks, about 1.5 tiles per warp
    (2048, 1024, 2, 4, 1056),  # Llama-1B down: 8 chunks per tile
    (960, 72, 2, 4, 1056),  # SmolLM QKV: one partial chunk, fewer tiles than warps
    (49152, 72, 4, 2, 1056),  # SmolLM LM head shape: many tiles per warp, partial chunks
    (1792, 112, 1, 8, 64),  # Qwen2.5 hidden 896: partial chunk, tiles > warps
    (7, 40, 2, 1, 3),  # odd rows (a clamped last row), a partial second chunk
])
def test_pipelined_schedule_sums_every_vector_once_in_gemv_rows_order(rows, kvecs, per_tile, unroll, total_warps):
    """Each lane adds each of its row's K vectors exactly once, in ascending order (the order gemv_rows uses,
    so results are bit-identical), every row is written once, and the pipe always consumes what it loaded."""
    added, written = {}, []
    for gwarp in range(total_warps):
        for event in _pipelined_schedule(rows, kvecs, per_tile, unroll, total_warps, gwarp):
            if event[0] == "add":
                _, lane, row, kv = event
                added.setdefault(row, {}).setdefault(lane, []).append(kv)
            else:
                written.append(event[1])
    assert sorted(written) == list(range(rows))
    for row in range(rows):
        for lane in range(32):
            expected = list(range(lane, kvecs, 32))
            assert added[row][lane] == expected, (row, lane)


def test_streamed_gemv_plans_its_ring_generates_and_compiles(tiny):
    from megabake.plan import ring_bytes
    from megabake.runtime.compile import compile_check

    tuning = {name: GemvTuning(2, 1, stages=3) for name in GEMV_STAGES}
    tuning["down_residual"] = GemvTuning(1, 8, spread=True, stages=4)  # a partial chunk (K = 512 < 2048)
    plan = _plan(tiny, tuning)
    assert '"stages": 4' in plan.to_json() and '"stages": 0' not in tiny.plan.to_json()  # old hashes hold
    assert all("stages" not in stage["tiling"] for stage in tiny.plan.to_dict()["stages"])
    ring = ring_bytes(tuning.values(), plan.threads)
    assert ring == 8 * 4 * 8 * 512  # 8 warps x 4 stages x 8 vectors per lane x 32 lanes x 16 bytes
    assert plan.smem_bytes == tiny.plan.smem_bytes + ring + 16
    source = generate(plan, fused_split=False, spare_ring=False).source  # no O-stage GEMV; spare_ring: test_spare_warp
    assert "RING_STAGES = 4" in source and "RING_VECTORS = 8" in source and "s_ring = smem.allocate_tensor(" in source
    calls = [line.strip() for line in source.splitlines() if "bodies.gemv_rows" in line]
    assert len(calls) == 5 and all(c.startswith("bodies.gemv_rows_streamed(") for c in calls), calls
    assert "s_ring" not in tiny.generated.kernel_source
    executor, default = reference_executor_for(plan, tiny.model), reference_executor_for(tiny.plan, tiny.model)
    for position, token in enumerate([3, 17, 5]):
        assert torch.equal(executor.step(torch.tensor([token]), position),
                           default.step(torch.tensor([token]), position))
    result = compile_check(plan, load_module(source))
    assert result.ok, result.error
    assert Plan.from_json(plan.to_json()).hash == plan.hash


@pytest.mark.parametrize("kwargs, message", [
    ({"stages": 1}, r"stages=1: a cp.async ring needs 2..8 stages"),
    ({"stages": 4, "pipeline": True}, r"replaces the register pipeline; use stages with pipeline=False"),
])
def test_streamed_gemv_refuses_bad_rings(kwargs, message):
    with pytest.raises(PlanError, match=message):
        GemvTuning(2, 4, **kwargs)


def test_streamed_gemv_refuses_a_ring_that_does_not_fit(tiny):
    with pytest.raises(PlanError, match=r"a cp.async ring of 8 stages x 8 vectors per lane needs 262144 bytes .* "
                                        r"use stages <= 6, or fewer rows per tile x unroll"):
        _plan(tiny, {"norm_qkv": GemvTuning(2, 4, stages=8)})


def _streamed_schedule(steps, stages):
    """Mirror of gemv_rows_streamed's ring bookkeeping: (event, step, slot) in program order."""
    for ahead in range(stages - 1):
        if ahead < steps:
            yield ("copy", ahead, ahead % stages)
        yield ("commit", ahead, None)
    for step in range(steps):
        ahead = step + stages - 1
        if ahead < steps:
            yield ("copy", ahead, ahead % stages)
        yield ("commit", ahead, None)
        yield ("wait", step, stages - 1)
        yield ("read", step, step % stages)


@pytest.mark.parametrize("steps, stages", [(0, 4), (1, 4), (3, 4), (17, 4), (9, 2), (30, 8)])
def test_streamed_ring_reads_each_chunk_after_it_landed_and_before_it_is_overwritten(steps, stages):
    groups, slot_holds, landed_needed = [], {}, {}
    for event, step, arg in _streamed_schedule(steps, stages):
        if event == "copy":
            assert slot_holds.get(arg) in (None, "read"), (step, arg)  # never overwrite an unread chunk
            slot_holds[arg] = step
            landed_needed[step] = len(groups)  # the group this copy belongs to (committed next)
        elif event == "commit":
            groups.append(step)
        elif event == "wait":  # at most `arg` newest groups may still be pending
            done = len(groups) - arg
            assert landed_needed[step] < done, (step, landed_needed[step], done)
        else:
            assert slot_holds[arg] == step, (step, arg)  # the slot holds this step's chunk
            slot_holds[arg] = "read"
    assert all(v == "read" for v in slot_holds.values())


def test_streamed_gemv_with_preload_fills_its_ring_before_the_barrier(tiny):
    from megabake.runtime.compile import compile_check

    tuning = {name: GemvTuning(2, 1, spread=True, preload=True, stages=3) for name in GEMV_STAGES}
    tuning["norm_lm_head"] = GemvTuning(2, 1, stages=3)  # the LM head never preloads
    plan = _plan(tiny, tuning)
    source = generate(plan, fused_split=False, spare_ring=False).source  # no O-stage GEMV; spare_ring: test_spare_warp
    lines = source.splitlines()
    prefills = [i for i, line in enumerate(lines) if "bodies.gemv_ring_prefill(" in line]
    barriers = [i for i, line in enumerate(lines) if _waits(line)]
    assert len(prefills) == 5  # after embed, and before each barrier whose next stage is a layer GEMV
    assert all(any(b > p and not any(p < q < b for q in prefills if q != p) for b in barriers) for p in prefills)
    down_prefill = next(c for c in body_calls(source, "gemv_ring_prefill") if "w_qkv[cutlass.min(layer + 1" in c["weight"])
    assert down_prefill["active"] == "cutlass.min(LAYERS - 1 - layer, 1)"  # no copies after the last layer
    streamed = body_calls(source, "gemv_rows_streamed")
    assert sum(c["stages"] == "3" and c["prefilled"] == "True" for c in streamed) == 4
    assert (streamed[-1]["stages"], streamed[-1]["prefilled"]) == ("3", "False")
    assert not any("pre_norm_qkv = cute.make_rmem_tensor" in line for line in lines)  # no register tile
    result = compile_check(plan, load_module("\n".join(lines) + "\n"))
    assert result.ok, result.error


def test_default_tuning_is_the_deepest_streaming_ring_that_fits(tiny):
    """The default streams through a 4-stage cp.async ring (32 KB a stage at 256 threads); a bucket whose other
    shared memory leaves less room gets 3 or 2 stages, else the plain tiling. The LM head never preloads."""
    from megabake.plan import HOPPER_SMEM_PER_BLOCK, STREAMING_DEFAULT, default_tuning

    stage_bytes = 8 * 8 * 512
    for other, stages in ((10_000, 4), (HOPPER_SMEM_PER_BLOCK - 4 * stage_bytes, 3),
                          (HOPPER_SMEM_PER_BLOCK - 3 * stage_bytes, 2), (HOPPER_SMEM_PER_BLOCK - stage_bytes, 0)):
        tuning = default_tuning(256, other)
        assert {t.stages for t in tuning.values()} == {stages}, (other, stages)
        if stages:
            assert tuning["norm_qkv"] == STREAMING_DEFAULT.__class__(2, 4, spread=True, preload=True, stages=stages)
            assert not tuning["norm_lm_head"].preload
        else:
            assert tuning == dict(DEFAULT_TUNING)
    inv_freq, scaling = recover_rotary(tiny.captured, tiny.ir)
    default = build_plan(tiny.ir, inv_freq_buffer=inv_freq, rotary_scaling=scaling)
    assert {s.tiling.stages for s in default.stages if s.tiling.kind == "rows"} == {4}
    assert default.smem_bytes == tiny.plan.smem_bytes + 4 * stage_bytes + 16


def test_watchdog_build_gives_up_waiting_and_records_where(tiny):
    """``generate(plan, watchdog=True)`` (debugging a hang): every grid barrier is the watched one, the module
    declares its per-CTA slots, it compiles for sm_90a, and neither packages nor timelines carry it."""
    pytest.importorskip("cutlass")
    from megabake.runtime import MegakernelDecoder
    from megabake.runtime.compile import compile_check

    source = generate(tiny.plan, watchdog=True).source
    module = load_module(source)
    assert module.WATCH_SLOTS == 2 * tiny.plan.ctas and module.WATCH_POLLS > 1000
    kernel = source.split("\n# ====")[0]
    assert "bodies.grid_barrier(barrier" not in kernel and kernel.count("bodies.grid_barrier_watched(") == 1 + 5
    assert "grid_barrier_watched" not in generate(tiny.plan).source
    result = compile_check(tiny.plan, module)
    assert result.ok, result.error
    with pytest.raises(ValueError, match="watchdog build has no timeline"):
        generate(tiny.plan, watchdog=True, timeline=True)
    decoder = MegakernelDecoder(tiny.plan, tiny.generated.source, tiny.model, device="cpu")
    with pytest.raises(MegaBakeError, match="watchdog=True"):
        decoder.barrier_watch()


@pytest.mark.parametrize("barrier, relaxed", [("red", "False"), ("red-fence", "True")])
def test_red_barrier_build_compiles_and_keeps_the_kernel_otherwise(tiny, barrier, relaxed, tmp_path):
    """``generate(plan, barrier="red" | "red-fence")`` (A/B candidates of ``scripts/gpu_tune.py --barriers``):
    every grid barrier is ``grid_barrier_red`` with its register target, the rest of the kernel is the default's
    line for line, it compiles for sm_90a (also as a phases timeline) with a ``red.release`` arrival and the polls
    asked for, and bad combinations are refused."""
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check

    default = generate(tiny.plan, barrier="atom").source.split("\n# ====")[0]
    red = generate(tiny.plan, barrier=barrier).source
    kernel = red.split("\n# ====")[0]
    assert "bodies.grid_barrier(" not in kernel
    assert kernel.count("bodies.grid_barrier_red(barrier=barrier, next_target=bar_next,") == 6
    assert kernel.count(f"relaxed_polls={relaxed})") == 6
    differing = [line for line in kernel.splitlines() if line not in default.splitlines()]
    assert all("bar_next" in line for line in differing), differing
    assert "def grid_barrier_red(" in red and "def grid_barrier_red(" not in generate(tiny.plan, barrier="atom").source
    result = compile_check(tiny.plan, load_module(red), dump_dir=str(tmp_path))
    assert result.ok, result.error
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert "red.release.gpu.global.add.u64" in ptx
    assert ("ld.relaxed.gpu.global.b64" in ptx) == (relaxed == "True")
    phases = generate(tiny.plan, barrier=barrier, timeline="phases").source
    assert "bodies.grid_barrier(" not in phases.split("\n# ====")[0]
    assert compile_check(tiny.plan, load_module(phases)).ok
    with pytest.raises(ValueError, match="barrier='fence'"):
        generate(tiny.plan, barrier="fence")
    with pytest.raises(ValueError, match="watchdog build has its own barrier"):
        generate(tiny.plan, barrier=barrier, watchdog=True)


def test_split_barrier_arrives_before_the_ring_fill_and_waits_after_it(tiny, tmp_path):
    """``generate(plan, barrier="split")`` (the default since session 27; ``barrier="atom"`` is the one-call
    barrier before it, ``scripts/gpu_tune.py --builds atom-barrier``): every grid
    barrier becomes an arrival right after the stage's own calls and a wait after the calls issued ahead of the
    barrier (the next GEMV's ring fill and prefetches), so exactly those calls sit between the halves; the rest
    of the kernel is the default's line for line, and it compiles for sm_90a (also as a per-CTA timeline) with a
    ``red.release`` arrival."""
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check

    default = generate(tiny.plan, barrier="atom").source.split("\n# ====")[0]
    split = generate(tiny.plan, barrier="split", fused_split=False).source  # fused_split: no O-stage barrier
    assert generate(tiny.plan, fused_split=False).source == split  # the default since session 27
    kernel = split.split("\n# ====")[0]
    arrival, wait = "bodies.grid_arrive(barrier=barrier, next_target=bar_next,", "bodies.grid_wait(barrier=barrier,"
    assert "bodies.grid_barrier(" not in kernel
    assert kernel.count(arrival) == kernel.count(wait) == 6
    lines = [line.strip() for line in kernel.splitlines()]
    default_lines = [line.strip() for line in default.splitlines()]
    # each default barrier's preceding calls now sit between an arrival and its wait
    arrivals = [i for i, line in enumerate(lines) if line.startswith("bodies.grid_arrive(")]
    waits = [i for i, line in enumerate(lines) if line.startswith("bodies.grid_wait(")]
    between = [lines[a + 1:w] for a, w in zip(arrivals, waits)]
    assert sum(any("prefetch_rows(" in line for line in chunk) for chunk in between) == 5
    assert any(any("split_kv_prefetch(" in line for line in chunk) for chunk in between)
    assert all(not any(line.startswith("bodies.gemv_rows") or "split_kv_attention(" in line for line in chunk)
               for chunk in between)
    for a in arrivals:  # an arrival comes right after a stage's last body call (the previous call's arguments)
        assert not any(lines[a - 1].startswith(f"bodies.{name}(") for name in ("prefetch_rows", "gemv_ring_prefill"))
    without_barriers = [line for line in lines if "grid_arrive(" not in line and "grid_wait(" not in line
                        and "bar_next" not in line]
    assert without_barriers == [line for line in default_lines if "grid_barrier(" not in line]
    assert "def grid_arrive(" in split and "def grid_wait(" in split
    result = compile_check(tiny.plan, load_module(split), dump_dir=str(tmp_path))
    assert result.ok, result.error
    assert "red.release.gpu.global.add.u64" in next(tmp_path.glob("*.ptx")).read_text()
    per_cta = generate(tiny.plan, barrier="split", timeline="phases-per-cta").source
    assert compile_check(tiny.plan, load_module(per_cta)).ok
    with pytest.raises(ValueError, match="watchdog build has its own barrier"):
        generate(tiny.plan, barrier="split", watchdog=True)
    with pytest.raises(ValueError, match="barrier='fence'"):
        generate(tiny.plan, barrier="fence")
    ring = compile_preset("tiny-llama")  # the bake default: streamed GEMVs fill their rings before a barrier
    ring_kernel = generate(ring.plan, barrier="split", fused_split=False, fused_mlp=False,
                           spare_ring=False).source.split("\n# ====")[0].splitlines()
    fills = [i for i, line in enumerate(ring_kernel) if line.strip().startswith("bodies.gemv_ring_prefill(")]
    halves = [(i, "arrive" if "grid_arrive(" in line else "wait") for i, line in enumerate(ring_kernel)
              if "grid_arrive(" in line or "grid_wait(" in line]
    assert len(fills) == 5 and all([h for j, h in halves if j < i][-1] == "arrive" for i in fills)


def test_hang_probe_names_the_stage_of_every_barrier(tiny):
    """scripts/gpu_hang_probe.py runs on the GPU only; its map from a barrier ordinal to the stage that ends
    there must match the kernel's barriers (one name per barrier of a step)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_hang_probe.py"
    spec = importlib.util.spec_from_file_location("gpu_hang_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = module.barrier_stages(tiny.plan)
    assert len(names) == tiny.plan.barriers_per_step
    assert names[:3] == ["embed", "layer0.norm_qkv", "layer0.attention"] and names[-1] == "layer1.down_residual"


@pytest.mark.parametrize("timeline,split", [(True, False), ("phases", False), ("phases-per-cta", False),
                                            ("phases-per-cta", True)])
def test_fused_builds_have_timelines_whose_clocks_fill_every_slot_once(timeline, split):
    """A fused_o + fused_mlp build (session 44; these builds had no timeline before): the module names its
    intervals (``TIMELINE_LABELS``: the attention interval holds the O projection, the gate/up interval the
    whole MLP), its clock stores, over every layer, write each slot 1..N exactly once, and it compiles for sm_90a
    (the phases builds close and reopen ``if fo == 0:`` blocks around their stores). ``split``: with fused_split,
    whose attention interval has two phases (the split items or the fused step, then split_o_block) and whose O
    stage keeps only its prefetch and barrier; the build without a timeline runs the same calls."""
    from megabake.runtime.compile import compile_check

    plan = compile_preset("smollm-135m", layers=2, vocab=512, capacity=2048).plan
    source = generate(plan, timeline=timeline, fused_o=True, fused_mlp=True, fused_split=split).source
    module = load_module(source)
    labels = list(module.TIMELINE_LABELS)
    assert len(set(labels)) == len(labels)
    assert getattr(module, "TIMELINE_STRIDE", module.TIMELINE_SLOTS) == 1 + len(labels)
    written = []
    for line in source.split("\n# ====")[0].splitlines():
        if "= cute.arch.globaltimer()" in line:
            slot = line.split("barrier[")[1].split("]")[0].removeprefix("cta * TIMELINE_STRIDE + ")
            layers = range(plan.dims.layers) if "layer" in slot else [None]
            written += [eval(slot, {"layer": layer}) for layer in layers]  # noqa: S307 (our own slot expressions)
    assert sorted(written) == list(range(1, 2 + len(labels)))
    if timeline is True:
        assert "layer1.attention+o_residual" in labels and not any(l.endswith(".o_residual") for l in labels)
        assert "layer1.norm_gate_up" in labels and "layer1.down_residual" in labels
    else:
        layer0 = [label.removeprefix("layer0.") for label in labels if label.startswith("layer0.")]
        if split:
            assert layer0[4:8] == ["attention.split_kv_attention|fused_attention_o", "attention.split_o_block",
                                   "o_residual.prefetch", "o_residual.barrier"]
        else:
            assert layer0[4:6] == ["attention.split_kv_attention|fused_attention_o", "attention.split_barrier"]
        assert layer0[-4:] == ["norm_gate_up.sync_threads", "norm_gate_up.mlp_down_partial",
                               "down_residual.prefetch", "down_residual.barrier"]
    result = compile_check(plan, module)
    assert result.ok, result.error
