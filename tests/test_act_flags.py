"""The ``act_flags`` build (session 37 candidate, ``megabake.codegen.act_flags``): where it applies, what it emits
instead of the gate/up -> down grid barrier, and a CuTe DSL compile for sm_90a (no GPU). Its bits against the default
build run on the H200: tests/test_act_flags_gpu.py."""

from __future__ import annotations

import pytest

from megabake.codegen import generate
from megabake.codegen.act_flags import act_flags_refusal, gate_up_owners
from megabake.runtime.compile import compile_check, load_module
from tests.compiler_fixtures import compile_preset


@pytest.fixture(scope="module")
def smollm():
    return compile_preset("smollm-135m", layers=2, vocab=4096, capacity=2048)


def _called(source: str) -> list[str]:
    kernel = source.split("# ====")[0]
    return [line.strip().split("(")[0] for line in kernel.splitlines() if line.strip().startswith("bodies.")]


def _layer_loop(source: str) -> str:
    """The kernel's layer loop, its whitespace runs as single spaces (calls are wrapped at 120 columns)."""
    kernel = source.split("# ====")[0]
    return _flat(kernel[kernel.index("for layer in range(LAYERS):"):kernel.index("(epilogue) ----")])


def _flat(text: str) -> str:
    """``text`` with its whitespace runs as single spaces and none after an opening parenthesis."""
    return " ".join(text.split()).replace("( ", "(")


@pytest.mark.parametrize("fused_o", [None, False])
def test_act_flags_drop_one_grid_barrier_per_layer_and_keep_every_other_call(smollm, fused_o):
    """Per layer: the gate/up GEMV writes flagged words (``flagged=True``) into this layer's half of its buffer
    (``act_now``, by layer parity), its stage ends without an arrival or a wait (the down GEMV's ring fill stays),
    the down stage polls the words (``act_flags_to_smem``) where the default copies them, then unsets the next
    layer's half (``act_next``; the prologue unsets both halves for the first layer). Every other call is the
    default build's, in order."""
    plan = smollm.plan
    build = {} if fused_o is None else {"fused_o": fused_o}
    default = generate(plan, **build).source
    flagged = generate(plan, act_flags=True, **build).source
    assert "\nACT_FLAGS = True\n" in flagged and "ACT_FLAGS" not in default.split("# ====")[0]
    old, new = _called(default), _called(flagged)
    waits = old.count("bodies.grid_wait")
    assert new.count("bodies.grid_wait") == waits - 1 and new.count("bodies.grid_arrive") == waits - 1  # in the loop
    expected = [name for name in old]
    at = expected.index("bodies.copy_to_smem")
    expected[at] = "bodies.act_flags_to_smem"
    # the arrival after the gate/up GEMV and the wait before the down staging go
    before = expected[:at]
    wait = len(before) - 1 - before[::-1].index("bodies.grid_wait")
    arrive = len(before) - 1 - before[::-1].index("bodies.grid_arrive")
    expected = [name for i, name in enumerate(expected) if i not in (wait, arrive)]
    expected.insert(expected.index("bodies.act_flags_to_smem") + 1, "bodies.flags_reset")
    expected.insert(expected.index("bodies.embed_gather") + 1, "bodies.flags_reset")
    assert new == expected
    loop_text = _layer_loop(flagged)
    assert "act=1, flagged=True)" in loop_text and loop_text.count("flagged=True") == 1
    assert "bias=act_now, s_vec=s_vec, out=act_now," in loop_text
    assert "bodies.act_flags_to_smem(act=act_now," in loop_text
    assert ("bodies.flags_reset(words=act_next, cta=cta, tidx=tidx, active=cutlass.min(LAYERS - 1 - layer, 1), "
            "rows=BATCH, cols=INTER,") in loop_text
    prologue = _flat(flagged.split("# ====")[0].split("for layer in range(LAYERS):")[0])
    assert "bodies.flags_reset(words=gate_up, cta=cta, tidx=tidx, active=1, rows=BATCH, cols=2 * INTER," in prologue
    header = flagged.split('"""')[1]
    per_step = plan.barriers_per_step - plan.dims.layers
    assert f"{per_step} grid barriers per step" in header and "act_flags" in header


def test_the_default_build_writes_no_flags(smollm):
    source = generate(smollm.plan).source
    assert "flagged=True" not in source.split("# ====")[0]
    assert "bodies.act_flags_" not in source.split("# ====")[0]


@pytest.mark.parametrize("preset,ctas", [("smollm-135m", 132), ("tiny-llama", 132), ("qwen3-0.6b", 132),
                                         ("tiny-llama", 96)])
def test_gate_up_owners_follow_the_kernels_dealing(preset, ctas):
    """The owners :func:`gate_up_owners` counts are the CTAs whose warps the kernel's dealing gives a gate/up tile
    (tile t to the warp whose ``swarp`` (spread) or ``gwarp`` is t modulo the grid's warps)."""
    plan = compile_preset(preset, layers=1, vocab=512, capacity=256, ctas=ctas).plan
    stage = next(s for s in plan.stages if s.name == "norm_gate_up")
    owners = set()
    for cta in range(plan.ctas):
        for warp in range(plan.warps):
            index = warp * plan.ctas + cta if stage.tiling.spread else cta * plan.warps + warp
            if index < stage.tiling.tiles:
                owners.add(cta)
    assert gate_up_owners(plan) == owners
    assert len(owners) <= plan.ctas


@pytest.mark.parametrize("preset,options,reason", [
    ("smollm-135m", {"timeline": True}, "timeline"),
    ("smollm-135m", {"watchdog": True}, "watchdog"),
    ("tiny-gemma2", {}, "not pre-norm"),
    ("olmo-2-1b", {}, "not pre-norm"),
])
def test_act_flags_refuse_what_they_cannot_build(preset, options, reason):
    plan = compile_preset(preset, layers=1, vocab=512, capacity=256).plan
    with pytest.raises(ValueError, match=reason):
        generate(plan, act_flags=True, **options)


def test_act_flags_refuse_tensor_core_gate_up_and_grids_a_gate_up_cannot_cover():
    """Batch 8 runs the gate/up GEMV on the tensor cores (no flagged write there); a grid with more CTAs than
    gate/up tiles leaves CTAs whose reads of x no flag orders before the down projection's writes."""
    batch8 = compile_preset("smollm-135m", layers=1, vocab=512, capacity=256, batch=8).plan
    assert "tensor-core" in act_flags_refusal(batch8)
    wide = compile_preset("tiny-llama", layers=1, vocab=512, capacity=256, ctas=1024).plan
    reason = act_flags_refusal(wide)
    assert reason is not None and "own a gate/up tile" in reason
    with pytest.raises(ValueError, match="own a gate/up tile"):
        generate(wide, act_flags=True)


@pytest.mark.parametrize("preset,capacity,build", [("smollm-135m", 2048, {"o_flags": True, "qkv_flags": True,
                                                                           "flag_backoff": 256}),
                                                   ("qwen3-0.6b", 4096, {"fused_o": False}),
                                                   ("qwen2.5-0.5b", 4096, {"o_flags": True, "qkv_flags": True})])
def test_act_flags_build_compiles_for_sm90a(preset, capacity, build, tmp_path):
    """CuTe DSL compiles the flagged builds for sm_90a (SmolLM-135M and Qwen2.5-0.5B, a QKV bias, with every flag),
    and their PTX has what the memory-model argument needs: the polls are relaxed gpu-scope loads, the words relaxed
    gpu-scope stores, fences on both sides of the activation's words (and after the qkv polls)."""
    compiled = compile_preset(preset, layers=2, vocab=4096, capacity=capacity)
    source = generate(compiled.plan, act_flags=True, **build).source
    result = compile_check(compiled.plan, load_module(source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    ptx = "\n".join(p.read_text() for p in tmp_path.rglob("*.ptx"))
    assert "ld.relaxed.gpu.global.b32" in ptx and "st.relaxed.gpu.global" in ptx
    assert ptx.count("fence.acq_rel.gpu") >= 2
    assert ("%clock" in ptx) == bool(build.get("flag_backoff"))  # the backoff spins on the SM clock


def test_o_flags_drop_a_fused_steps_barrier_after_attention(smollm):
    """``o_flags``: a fused step's attention writes flagged o_part words (``flagged=O_FLAGS``), meets no grid barrier
    after it, and the gate/up staging polls the words (``flagged=O_FLAGS``); a split step (``fo == 0``) still
    arrives and waits twice (after attention and after the O projection). The prologue and each layer's down stage
    (for the next layer) unset o_part."""
    plan = smollm.plan
    source = generate(plan, o_flags=True).source
    kernel = source.split("# ====")[0]
    flat = _flat(kernel)
    assert "\nO_FLAGS = True\n" in kernel and "\nO_FLAGS = False\n" in generate(plan).source
    prologue, loop = flat.split("for layer in range(LAYERS):")
    assert "bodies.flags_reset(words=o_part, cta=cta, tidx=tidx, active=1, rows=N_KV_HEADS, cols=HIDDEN," in prologue
    down = loop[loop.index("stage 5: down_residual"):]
    assert down.index("bodies.copy_to_smem(") < down.index("bodies.flags_reset(words=o_part") < down.index(
        "bodies.gemv_rows_streamed(")
    assert "flagged=O_FLAGS, poll_qkv=QKV_FLAGS, backoff=FLAG_BACKOFF)" in flat
    assert "eps=EPS, flagged=O_FLAGS, backoff=FLAG_BACKOFF)" in flat
    lines = [line.strip() for line in kernel.splitlines()]
    fused = lines.index(next(line for line in lines if line.startswith("bodies.fused_attention_o(")))
    gate_up = lines.index("# ---- stage 4: norm_gate_up (layer) ----")
    between = lines[fused:gate_up]
    arrivals = [i for i, line in enumerate(between) if line.startswith("bodies.grid_arrive(")]
    waits = [i for i, line in enumerate(between) if line.startswith("bodies.grid_wait(")]
    assert len(arrivals) == 2 and len(waits) == 2
    # the first arrival and the last wait each open an "if fo == 0:" block; the rest sit in the O stage's
    assert between[arrivals[0] - 1] == "if fo == 0:" and between[waits[-1] - 1] == "if fo == 0:"
    header = source.split('"""')[1]
    assert f"({plan.barriers_per_step - 2 * plan.dims.layers} where the context fits MIN_CHUNK" in header


def test_qkv_flags_drop_every_steps_barrier_after_the_qkv_projection(smollm):
    """``qkv_flags``: the QKV GEMV writes flagged words; no step (fused or split) arrives or waits at a grid barrier
    after it; the fused attention polls its group's words (``poll_qkv=QKV_FLAGS``) and so do a split step's items
    (``split_kv_attention(..., poll_qkv=QKV_FLAGS)``); the prologue and each layer's down stage unset them. With all
    three flags a fused step meets one grid barrier per layer, a split step three."""
    plan = smollm.plan
    source = generate(plan, act_flags=True, o_flags=True, qkv_flags=True).source
    kernel = source.split("# ====")[0]
    assert "\nQKV_FLAGS = True\n" in kernel and "\nQKV_FLAGS = False\n" in generate(plan).source
    flat = _flat(kernel)
    assert "flagged=O_FLAGS, poll_qkv=QKV_FLAGS, backoff=FLAG_BACKOFF)" in flat
    assert "mma_attention=MMA_ATTENTION, poll_qkv=QKV_FLAGS, backoff=FLAG_BACKOFF)" in flat  # the split step's items
    assert "bodies.flags_reset(words=qkv, cta=cta, tidx=tidx, active=1, rows=BATCH, cols=QKV_ROWS," in flat
    loop = kernel.split("for layer in range(LAYERS):")[1]
    lines = [line.strip() for line in loop.splitlines()]
    qkv = lines.index("# ---- stage 1: norm_qkv (layer) ----")
    attention = next(i for i, line in enumerate(lines) if line.startswith("# ---- stage 2: attention"))
    between = lines[qkv:attention]
    assert "act=0, flagged=True)" in " ".join(between)
    assert not [line for line in between if line.startswith(("bodies.grid_arrive(", "bodies.grid_wait("))]
    assert "bodies.split_kv_prefetch(" in " ".join(between)  # the prefetches and ring fills stay
    assert "bodies.flags_reset(words=qkv, cta=cta, tidx=tidx, active=cutlass.min(LAYERS - 1 - layer, 1)," in flat
    header = source.split('"""')[1]
    per_step = plan.barriers_per_step - 2 * plan.dims.layers
    assert f"{per_step} grid barriers per step ({per_step - 2 * plan.dims.layers} where the context fits" in header
    assert per_step - 2 * plan.dims.layers == 1 + plan.dims.layers  # the prologue's and one per layer
    default_loop = generate(plan).source.split("for layer in range(LAYERS):")[1]
    assert default_loop.count("bodies.grid_wait(") - loop.count("bodies.grid_wait(") == 2  # qkv's and act's


def test_qkv_flags_refuse_a_norm_over_the_whole_projection():
    """OLMo-2's q/k norm reads every KV group's words: a group's poll would not cover them."""
    from megabake.codegen.act_flags import qkv_flags_refusal

    plan = compile_preset("olmo-2-1b", layers=2, vocab=4096, capacity=1024).plan
    assert plan.dims.whole_qk_norm
    assert "whole projection" in qkv_flags_refusal(plan, fused_o=True)


@pytest.mark.parametrize("flag", ["o_flags", "qkv_flags"])
def test_fused_step_flags_need_the_fused_build(smollm, flag):
    with pytest.raises(ValueError, match="needs fused_o"):
        generate(smollm.plan, fused_o=False, **{flag: True})


def test_flag_backoff_is_a_count_of_clocks_for_flagged_builds(smollm):
    """``flag_backoff`` (SM clocks between poll rounds) reaches the module as FLAG_BACKOFF, which every poll takes;
    it is refused without a flag and where it is not an int >= 0."""
    source = generate(smollm.plan, act_flags=True, o_flags=True, qkv_flags=True, flag_backoff=300).source
    kernel = _flat(source.split("# ====")[0])
    assert "\nFLAG_BACKOFF = 300\n" in source
    assert kernel.count("backoff=FLAG_BACKOFF") == 4  # the activation, o_part and qkv polls (fused and split)
    assert "\nFLAG_BACKOFF = 0\n" in generate(smollm.plan).source  # fused builds pass it (unused) to their bodies
    with pytest.raises(ValueError, match="needs act_flags, o_flags or qkv_flags"):
        generate(smollm.plan, flag_backoff=100)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="flag_backoff="):
            generate(smollm.plan, act_flags=True, flag_backoff=bad)
