"""The plain GEMV's gated write (tiling ``+gated`` on the gate/up stage; the default since session 15).

At batch 1 the down stage's staging evaluates the MLP's activation in every CTA: each of the 132 CTAs reads the
whole gate and up rows and computes act(gate) * up (H200, session 14 phase clocks: 21 us of SmolLM-135M's step,
31 us of Llama-3.2-1B's). With ``+gated`` the gate/up GEMV's packed rows pair gate row i with up row i (interleave
1), a 2-row tile's warp reduces both and writes act(gate) * up once, and the down stage copies the row, as the
tensor-core GEMV has done since session 13. Checked here on the CPU: the text form and its refusals, the opt-in,
the plan (layout, packing, JSON), the reference executor against the unfused plan, and a CuTe DSL compile for
sm_90a. Its GPU test (``pytest -m gpu tests/test_gpu_decode.py -k gated_gemv``) passed on the H200 in session 15,
where it measured -2.3% (SmolLM-135M) and -2.8% (Llama-3.2-1B) GPU time per step with bit-identical logits, and
became the default of the plain and ring tilings for SiLU and tanh-GELU models (``plan.GATED_DEFAULT_ACTIVATIONS``).
"""

from __future__ import annotations

import pytest
import torch

from megabake.errors import PlanError
from megabake.plan import GemvTuning
from megabake.plan.reference import reference_executor_for
from tests.compiler_fixtures import body_calls, compile_preset

EXPERIMENTAL = "MEGABAKE_EXPERIMENTAL_LAYOUTS"
GATED = {"norm_gate_up": GemvTuning(2, 4, gated=True)}


def test_text_form_round_trips_and_refuses_what_it_cannot_run():
    assert GemvTuning.parse("2x4+gated") == GemvTuning(2, 4, gated=True)
    assert GemvTuning.parse("2x4+spread+gated").spec == "2x4+spread+gated"
    assert GemvTuning.parse("2x4+gated+spread+ring4+preload").spec == "2x4+spread+preload+ring4+gated"
    for spec, why in (("1x8+gated", "even number of rows"), ("2x4+preload+gated", "plain register tiling or"),
                      ("2x4+pipeline+gated", "the cp.async ring"), ("8x8+mma+gated", r"\+mma applies")):
        with pytest.raises(PlanError, match=why):
            GemvTuning.parse(spec)


def test_uniform_tuning_keeps_gated_on_the_gate_up_stage_only():
    from megabake.runtime.autotune import uniform_tuning

    tuning = uniform_tuning(GemvTuning.parse("2x4+spread+gated"))
    assert tuning["norm_gate_up"].gated
    assert all(not t.gated and t.spread for name, t in tuning.items() if name != "norm_gate_up")


def test_gated_write_is_the_default_where_it_applies_and_the_gate_up_stages_alone(monkeypatch):
    from megabake.plan import _with_gated_write
    from megabake.plan.tuning import streaming_tuning

    monkeypatch.delenv(EXPERIMENTAL, raising=False)
    compiled = compile_preset("tiny-llama", capacity=64)
    default = next(s for s in compiled.plan.stages if s.name == "norm_gate_up").tiling
    assert default.gated and default.stages and not default.mma
    assert not any(s.tiling.gated for s in compiled.plan.stages if s.name != "norm_gate_up")
    assert compiled.replan(tuning=GATED).plan.stages  # asked for by name, no opt-in
    ring = streaming_tuning(4)
    assert _with_gated_write(ring, "silu")["norm_gate_up"].gated
    assert _with_gated_write(ring, "gelu") == ring  # exact GELU's gated write has not run on a GPU
    pipelined = {**ring, "norm_gate_up": GemvTuning(2, 4, pipeline=True)}
    assert _with_gated_write(pipelined, "silu") == pipelined  # a tiling that cannot gate keeps its own write
    with pytest.raises(PlanError, match=r"stage\(s\) \['down_residual'\] have no activation"):
        compiled.replan(tuning={"down_residual": GemvTuning(2, 4, gated=True)})


RING_GATED = {"norm_gate_up": GemvTuning.parse("2x4+spread+preload+ring4+gated")}


@pytest.mark.parametrize("preset, tuning", [("tiny-llama", GATED), ("tiny-gemma", GATED), ("tiny-llama", RING_GATED)])
def test_gated_plan_pairs_rows_and_matches_the_unfused_plan(preset, tuning, monkeypatch):
    """The gate/up stage writes act(gate) * up (SiLU; Gemma's tanh GELU), the down stage copies it, the packed
    gate/up rows alternate one gate and one up row, plan.json says so (and only such plans say it), and the
    reference executor's logits equal the unfused plan's to fp32 rounding (the same products in another row
    order) over advancing steps."""
    from megabake.plan.model import Plan
    from megabake.plan.stages import spec_of

    compiled = compile_preset(preset, capacity=64)
    fused, unfused = compiled.replan(tuning=tuning).plan, compiled.replan(tuning={}).plan
    gate_up = next(s for s in fused.stages if s.name == "norm_gate_up")
    down = next(s for s in fused.stages if s.name == "down_residual")
    assert gate_up.tiling.gated and spec_of(gate_up, fused).gemv.gated and "act" in gate_up.roles
    assert spec_of(down, fused).vector.kind == "copy" and "act" not in down.roles
    assert {p.buffer: p.interleave for p in fused.packed if p.interleave} == {"w_gate_up": 1}
    assert '"gated": true' in fused.to_json() and '"gated"' not in unfused.to_json()
    assert Plan.from_json(fused.to_json()) == fused
    want, got = reference_executor_for(unfused, compiled.model), reference_executor_for(fused, compiled.model)
    tokens = torch.tensor([7])
    for position in range(5):
        expected = want.step(tokens, position)
        assert torch.allclose(got.step(tokens, position), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_gated_bias_is_interleaved_like_its_weight(monkeypatch):
    """Llama's mlp_bias: the gate/up bias is packed in the same row order as the weight (pairs of one)."""
    from tests.compiler_fixtures import compile_model
    from tests.test_compiler import _randomise_biases, _small

    model = _randomise_biases(_small("LlamaForCausalLM", mlp_bias=True))
    compiled = compile_model(model)
    fused, unfused = compiled.replan(tuning=GATED).plan, compiled.replan(tuning={}).plan
    assert {p.buffer: p.interleave for p in fused.packed if p.interleave} == {"w_gate_up": 1, "bias_gate_up": 1}
    want, got = reference_executor_for(unfused, model), reference_executor_for(fused, model)
    tokens = torch.tensor([3])
    for position in range(3):
        expected = want.step(tokens, position)
        assert torch.allclose(got.step(tokens, position), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("tuning, body", [(GATED, "gemv_rows_gated"), (RING_GATED, "gemv_rows_streamed")])
def test_gated_kernel_calls_the_gated_gemv_and_compiles_for_sm90a(tuning, body, monkeypatch):
    """The kernel's gate/up stage is the gated GEMV body (plain or cp.async ring) with the activation's code, the
    down stage stages a copy (no SiLU in the kernel), and the module compiles for sm_90a; the unfused plan's
    module.py writes without an activation."""
    pytest.importorskip("cutlass")
    from megabake.codegen import generate
    from megabake.runtime.compile import compile_check, load_module

    compiled = compile_preset("tiny-llama", capacity=64)
    plan = compiled.replan(tuning=tuning).plan
    source = generate(plan).source
    kernel = source.split("\n# ====")[0]
    assert kernel.count(f"bodies.{body}(") == 1 and "silu_mul_to_smem" not in kernel
    assert [call["act"] for call in body_calls(kernel, body)] == ["1"]  # fused_mlp's call tiles its weight first
    unfused = generate(compiled.replan(tuning={}).plan).source.split("\n# ====")[0]
    assert "silu_mul_to_smem" in unfused and "act=1" not in unfused
    result = compile_check(plan, load_module(source))
    assert result.ok, result.error


def test_device_constants_match_the_plan():
    """The bodies cannot import the plan (module.py is self-contained): their copies of its constants must agree —
    the tensor-core gated tile's gate rows, and the activation codes the gated writes switch on."""
    from megabake.codegen.bodies import gemv
    from megabake.plan.stages import GATED_ACT_CODES, GATED_BLOCK

    assert gemv.MMA_GATED == GATED_BLOCK
    assert GATED_ACT_CODES == {"silu": 1, "gelu_tanh": 2, "gelu": 3}  # bodies._gated_act's branches
