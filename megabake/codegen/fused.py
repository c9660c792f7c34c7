"""Where a ``generate(plan, fused_o=True)`` build applies, and its geometry (a candidate since session 34).

Contract: pure functions of a :class:`~megabake.plan.Plan` and the build's other choices; no code is written
here. A fused build runs a short-context step's attention and O projection in one barrier interval
(``bodies.fused_attention_o``, module comment above ``bodies.fused_o_step``; a step is fused where its visible
positions fit the first split-KV chunk, ``MIN_CHUNK``): CTA ``c`` takes KV group
``c % n_kv_heads`` and row block ``c // n_kv_heads`` of W_O, whose bf16 block must fit the idle cp.async ring.
It needs the pre-norm residual layout (x += O(attn); x += down(act(gate/up(norm(x))))) at batch 1, split-KV
attention and the split grid barrier; :func:`fused_o_refusal` names what is missing otherwise. A ``fused_split``
build (session 44, on top of fused_o) deals W_O the same way at every step: a step of several splits runs its
split-KV items, counts them per KV group (``FUSED_SPLIT_BUFFERS``), and each CTA then waits for its group, merges it
and multiplies its block (``bodies.split_o_block``); :func:`fused_split_refusal`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, kv_splits, ring_shape
from ..plan.stages import spec_of

FUSED_O_BUFFERS = ("o_mid", "o_part")  # fp32 [1, hidden] residual after attention, [n_kv_heads, hidden] partials
# a fused_split build's int64 [layers, n_kv_heads] arrival counters of each layer's split-KV items per KV group
FUSED_SPLIT_BUFFERS = ("o_count",)


@dataclass(frozen=True)
class FusedGeometry:
    """How a fused step deals W_O: ``blocks`` row blocks of ``block_rows`` rows per KV group, ``cols`` columns
    (the group's query heads x head_dim) each, in ``block_bytes`` of the ``ring_bytes`` of shared memory; with
    ``fused_kv_smem`` the group's cached K and V rows (at most ``MIN_CHUNK`` each) take ``kv_bytes`` after it."""

    blocks: int
    block_rows: int
    cols: int
    block_bytes: int
    ring_bytes: int
    kv_bytes: int


def fused_geometry(plan: Plan) -> FusedGeometry:
    d = plan.dims
    most = plan.ctas // d.n_kv_heads  # CTAs per KV group
    block_rows = -(-d.hidden // max(most, 1))
    blocks = -(-d.hidden // block_rows) if most else 0  # no block wholly past the last row
    cols = (d.n_heads // d.n_kv_heads) * d.head_dim
    stages, vectors = ring_shape(s.tiling for s in plan.stages if s.tiling.kind == "rows")
    attention = next((s.tiling for s in plan.stages if s.kind == "attention"), None)
    min_chunk = attention.per_tile if attention is not None and kv_splits(plan) else 0
    return FusedGeometry(blocks, block_rows, cols, block_rows * cols * 2, plan.warps * stages * vectors * 256 * 2,
                         2 * min_chunk * d.head_dim * 2)


def _layer_stage(plan: Plan, name: str):
    return next((s for s in plan.stages if s.scope == "layer" and s.name == name), None)


def fused_o_refusal(plan: Plan, *, spread_merge: bool = False, split_barrier: bool = True) -> str | None:
    """Why ``fused_o`` cannot build this plan (with these other choices), or None where it can."""
    if plan.batch != 1:
        return f"it deals batch 1 only (this bucket has batch {plan.batch}; bake --batch 1)"
    if not kv_splits(plan):
        return "attention is not split-KV in this plan"
    stages = {name: _layer_stage(plan, name) for name in ("o_residual", "norm_gate_up", "down_residual")}
    if any(stage is None for stage in stages.values()):
        return "the layer has no o_residual / norm_gate_up / down_residual stages"
    layer = [s for s in plan.stages if s.scope == "layer"]
    at = next((i for i, s in enumerate(layer) if s.kind == "attention"), 0)
    if not 0 < at < len(layer) - 1 or (layer[at - 1].name, layer[at + 1].name) != ("norm_qkv", "o_residual"):
        return ("the layer's stages are not QKV projection, attention, O projection in a row (the W_O block is "
                "loaded while the grid meets after the QKV projection)")
    o_spec, up_spec, down_spec = (spec_of(stages[n], plan) for n in ("o_residual", "norm_gate_up", "down_residual"))
    pre_norm = (o_spec.gemv.out == "x" and o_spec.gemv.accumulate and up_spec.vector.kind == "rmsnorm"
                and up_spec.vector.source == "x" and down_spec.gemv.out == "x" and down_spec.gemv.accumulate)
    if not pre_norm:
        return "the model's residual layout is not pre-norm (post-attention / sandwich norms)"
    if plan.bias_of("o_residual") or plan.bias_of("down_residual"):
        return "the O or down projection has a bias"
    if any(stages[n].tiling.kind != "rows" or stages[n].tiling.mma for n in ("o_residual", "down_residual")):
        return "the O or down projection runs on the tensor-core GEMV"
    geometry = fused_geometry(plan)
    if geometry.blocks < 1:
        return f"{plan.dims.n_kv_heads} KV groups need more CTAs than the grid's {plan.ctas}"
    if geometry.block_bytes > geometry.ring_bytes:
        return (f"a W_O block of {geometry.block_rows} x {geometry.cols} bf16 ({geometry.block_bytes} bytes) does "
                f"not fit the cp.async ring ({geometry.ring_bytes} bytes)")
    if spread_merge:
        return "the spread split-KV merge is on (spread_merge=False turns it off)"
    if not split_barrier:
        return "it needs the split grid barrier (barrier='split', no watchdog)"
    return None


def fused_kv_refusal(plan: Plan) -> str | None:
    """Why ``fused_kv_smem`` (a fused step's cached K/V rows in shared memory) cannot build this ``fused_o``
    plan, or None where it can."""
    if plan.has_windows:
        return "the model has sliding windows (the rows would not start at 0)"
    geometry = fused_geometry(plan)
    if geometry.block_bytes + geometry.kv_bytes > geometry.ring_bytes:
        return (f"the W_O block ({geometry.block_bytes} bytes) and the group's K/V rows ({geometry.kv_bytes}) do not "
                f"fit the cp.async ring ({geometry.ring_bytes} bytes)")
    return None


def fused_split_refusal(plan: Plan, *, fused_o: bool, fused_kv_smem: bool = False) -> str | None:
    """Why ``generate(plan, fused_split=True)`` (every step's O projection in attention's interval: the split
    steps' too, ``bodies.split_o_block``) cannot build this plan, or None where it can."""
    if not fused_o:  # fused_o_refusal also asks for split-KV attention
        return "it extends fused_o (fused_o=True, where fused_o_refusal allows it)"
    if fused_kv_smem:  # bodies.fused_o_load would copy a split step's whole context into MIN_CHUNK rows
        return "fused_kv_smem copies a step's cached K/V rows with its W_O block, and split steps have more than fit"
    return None
