"""Where the flagged-word builds apply: ``generate(plan, act_flags=True)``, ``o_flags=True`` and ``qkv_flags=True``
(candidates since session 37; :func:`o_flags_refusal` and :func:`qkv_flags_refusal` for the last two).

Contract: pure functions of a :class:`~megabake.plan.Plan` and the build's other choices; no code is written
here. An ``act_flags`` build drops the grid barrier between each layer's gate/up GEMV and its down projection: the
gate/up GEMV's gated write stores every act(gate) * up word with a relaxed store (its warp's lane 0 runs a
``fence.acq_rel.gpu`` before its first: release), and the down stage's staging polls the words until none holds
``bodies.FLAG_UNSET`` (the bits the layer before unset there), then fences (acquire) and meets its own CTA
(``bodies.act_flags_to_smem``). The same values reach the same shared memory, so the logits are the default
build's, bit for bit. One grid barrier less per layer (SmolLM-135M: 121 -> 91 on a fused step).

Why it is safe where :func:`act_flags_refusal` finds nothing: the layer is pre-norm (the gate/up staging reads x,
the down projection accumulates into x, nothing else crosses the interval but, in a ``fused_o`` build, ``o_mid``),
and every CTA owns at least one gate/up tile. So a CTA that has seen every word has, through each writer's release
and its own acquire, every CTA's gate/up staging behind it: their reads of x (which its down projection then
overwrites) and their writes of ``o_mid`` (which it adds). The words of a layer live in one half of the gate/up
buffer by layer parity; the down stage of the layer before unsets that half (``bodies.flags_reset``, the prologue
for the first layer): its last readers polled it a layer earlier, behind the down projection's grid barrier, and the
down projection's grid barrier lies between the unsetting and the next writes.

``o_flags`` does the same for a ``fused_o`` step's attention -> gate/up barrier: the fused attention writes its
``o_part`` words with relaxed stores and the gate/up staging polls them (``bodies.rmsnorm_partials_to_smem``). No
fence is needed there: nothing but o_part crosses that interval (:func:`o_flags_refusal`). A fused SmolLM-135M step
with both meets 61 grid barriers instead of 121. ``qkv_flags`` drops the QKV -> attention barrier of a fused step the
same way, and a split step's too (each CTA's fused attention, or each split-KV item, polls its KV group's words, then
fences: its plain loads of them follow); with all three a fused step meets one grid barrier per layer (the down
projection's) and the prologue's: 31 on SmolLM-135M (a split step 91: its attention -> O and O -> gate/up ones stay).
"""

from __future__ import annotations

from ..plan import Plan
from ..plan.stages import spec_of

GATE_UP, DOWN = "norm_gate_up", "down_residual"


def _layer_stage(plan: Plan, name: str):
    return next((s for s in plan.stages if s.scope == "layer" and s.name == name), None)


def gate_up_owners(plan: Plan) -> set[int]:
    """The CTAs that own at least one tile of the gate/up GEMV, as its dealing gives them out (tile t to warp
    t % total warps, counted CTA-major where the stage is spread: ``swarp = warp * CTAS + cta``)."""
    stage = _layer_stage(plan, GATE_UP)
    total_warps = plan.ctas * plan.warps
    owners = set()
    for tile in range(min(stage.tiling.tiles, total_warps)):
        owners.add(tile % plan.ctas if stage.tiling.spread else tile // plan.warps)
    return owners


def act_flags_refusal(plan: Plan, *, timeline: bool = False, watchdog: bool = False) -> str | None:
    """Why ``act_flags`` cannot build this plan (with these other choices), or None where it can."""
    gate_up, down = _layer_stage(plan, GATE_UP), _layer_stage(plan, DOWN)
    if gate_up is None or down is None or down.index != gate_up.index + 1:
        return "the layer has no gate/up GEMV followed by the down projection"
    up_spec, down_spec = spec_of(gate_up, plan), spec_of(down, plan)
    if not up_spec.gemv.gated:
        return "the gate/up GEMV does not apply the activation in its write (no +gated tiling)"
    if gate_up.tiling.kind != "rows" or gate_up.tiling.mma or not gate_up.tiling.stages:
        return "the gate/up GEMV is not the streamed cp.async ring on rows (tensor-core or register tilings)"
    pre_norm = (up_spec.vector.kind == "rmsnorm" and up_spec.vector.source == "x" and down_spec.gemv.out == "x"
                and down_spec.gemv.accumulate and down_spec.vector.kind == "copy"
                and down_spec.vector.source == up_spec.gemv.out)
    if not pre_norm:
        return "the model's MLP layout is not pre-norm (post-attention / sandwich norms)"
    if plan.staging_dtype != "float32":
        return f"the bucket stages its GEMV inputs as {plan.staging_dtype} (the words are copied as fp32 bits)"
    owners = gate_up_owners(plan)
    if len(owners) < plan.ctas:
        return (f"only {len(owners)} of the grid's {plan.ctas} CTAs own a gate/up tile ({gate_up.tiling.tiles} "
                "tiles): a CTA without one would not order its reads of x before the down projection's writes")
    if timeline:
        return "a timeline build clocks the barrier it drops: build the timeline without act_flags"
    if watchdog:
        return "a watchdog build counts every grid barrier: build it without act_flags"
    return None


def o_flags_refusal(plan: Plan, *, fused_o: bool) -> str | None:
    """Why ``o_flags`` cannot build this plan, or None where it can: it flags a ``fused_o`` step's ``o_part`` words
    (the gate/up staging polls them), so it needs the fused build. Where it applies nothing else crosses the
    interval it drops: a fused step's attention reads qkv, the K/V cache and W_O and writes o_part and its K/V row,
    and the gate/up stage reads x and o_part and writes o_mid and the activation. The words are unset in the down
    stage of the layer before, after its staging (every CTA's polls of them are behind a grid barrier there, or
    behind its release of the activation words), and in the prologue; the down projection's grid barrier then lies
    between the unsetting and this layer's writes."""
    if not fused_o:
        return "it flags a fused step's o_part words: it needs fused_o (a batch-1 plan the fused build takes)"
    return None


def qkv_flags_refusal(plan: Plan, *, fused_o: bool) -> str | None:
    """Why ``qkv_flags`` cannot build this plan, or None where it can: in a ``fused_o`` build the QKV GEMV writes its
    words flagged (relaxed stores) and each CTA's fused attention (a fused step) or each active split-KV item (a
    longer step) polls its KV group's query, key and value words, then fences (no stale L1 line of them) and meets
    its CTA. Nothing else crosses that interval: the QKV projection reads x, its weights and norms; a fused step's
    attention writes o_part (unset in the down stage of the layer before, or the prologue) and its K/V row, a split
    step's items their K/V row, partials, arrival counters and ``attn``, none of which a CTA reads in the QKV
    interval (their readers of the layer before are behind its down projection's grid barrier; the K/V prefetch
    only asks L2 for rows). The qkv words are unset in the down stage of the layer before (every CTA's attention is
    behind a grid barrier there, or behind its release of the activation words) and the prologue. A group's words
    are all an item reads of qkv unless the q/k norm spans the whole projection (OLMo-2), which is refused."""
    if not fused_o:
        return "it flags the qkv words of a fused_o build: it needs fused_o (a batch-1 plan the fused build takes)"
    if plan.dims.whole_qk_norm:
        return "the q/k norm spans the whole projection (every KV group's words), not one group's"
    qkv = _layer_stage(plan, "norm_qkv")
    if qkv is None or qkv.tiling.kind != "rows" or qkv.tiling.mma or not qkv.tiling.stages:
        return "the QKV GEMV is not the streamed cp.async ring on rows (tensor-core or register tilings)"
    spec = spec_of(qkv, plan)
    if spec.gemv.out != "qkv" or spec.gemv.accumulate:
        return "the QKV GEMV does not write the qkv buffer"
    return None
