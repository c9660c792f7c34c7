"""Stage table: every barrier interval of the megakernel's decode step, described once.

Contract: a :class:`Layout` lists one :class:`StageSpec` per stage, in execution order (prologue, the layer loop,
epilogue), with its per-layer norm slots and workspaces; ``LAYOUTS`` holds ``pre_norm`` (``STAGE_TABLE``: Llama
and most families), ``sandwich`` (``SANDWICH_TABLE``: Gemma 2's norms before and after attention and the MLP) and
``post_norm`` (``POST_NORM_TABLE``: OLMo-2's norms after them only),
and ``layout_of(plan)`` / ``spec_of(stage, plan)`` find a plan's entries. A spec says which IR roles the stage
implements, what it reads and writes, and for a GEMV stage how its input row is staged in shared memory
(:class:`VectorInput`) and which packed weight it multiplies by (:class:`Gemv`: the projection roles packed
along its rows, their shape as ``ModelDims`` attribute names, the output buffer, whether it accumulates into
it, and its optional fp32 bias buffer). The plan
(``megabake.plan.build_plan``) builds its stages, weight buffers, packing and bias buffers from this table; the
code generator (``megabake.codegen``) emits each stage's body calls, its L2 prefetch and ring/register preload
of the next GEMV from it; the reference executor (``megabake.plan.reference``) runs it. Adding a stage kind
(a norm after a projection, a fused projection, another activation) means adding a spec here and, where it
needs new device code, a body; nothing else keys on stage-name strings.

Dimension names (``Gemv.rows`` / ``Gemv.cols``, ``VectorInput.width``) are ``ModelDims`` attributes;
``DIMENSION_CONSTANTS`` maps each to the constant expression of the generated module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

HEAD_NORMS = "qk_norms"  # fp32 q/k norm weights, applied before RoPE: [L, 2, head_dim] per head (Qwen3), or
# [L, q_rows + kv_rows] over the whole projection (OLMo-2; the same offsets as the q | k rows of ``qkv``)
ATTN_WINDOW = "attn_window"  # [L] int32: each layer's sliding window (the KV capacity where it has none)
ROPE_TABLE = "rope_table"  # [L] int32: each layer's rotary table, when the model has several (Gemma 3)


@dataclass(frozen=True)
class VectorInput:
    """How a GEMV stage stages its fp32 input row(s) in shared memory before multiplying.

    ``kind``: ``rmsnorm`` (RMSNorm of ``source`` by the norm weight ``norm_role``, recomputed by every CTA),
    ``copy`` (``source`` as is), ``gated_act`` (``act(gate) * up`` of ``source`` = [gate | up], the model's
    activation) or ``residual_norm`` (post-norm layouts, below; without ``norm_role`` the staged row is the new
    residual itself, OLMo-2)."""

    kind: str
    source: str
    width: str  # ModelDims attribute: the row length
    norm_role: str = ""  # rmsnorm: the norm weight's role (input_norm / post_norm: per-layer; final_norm: global)
    # residual_norm (post-norm layouts): the staged row is norm_role(source + delta_norm_role(delta)), the pending
    # residual add of a normalised projection output; delta_layer: whose norm weights (same | previous | last
    # layer); write_back: the buffer one CTA stores ``source + norm(delta)`` into (the next residual)
    delta: str = ""
    delta_norm_role: str = ""
    delta_layer: str = "same"
    write_back: str = ""


@dataclass(frozen=True)
class Gemv:
    """One GEMV: ``out[b, r] (+)= bias[r] + sum_c weight[r, c] * vec[b, c]`` over a packed weight."""

    weight: str  # packed weight buffer ("lm_head" is bound to the embedding when the head is tied)
    roles: tuple[str, ...]  # projection roles concatenated along the weight's rows, in order
    rows: str  # ModelDims attribute
    cols: str  # ModelDims attribute
    out: str
    accumulate: bool  # True: add into ``out`` (a residual), False: overwrite it
    bias: str | None = None  # fp32 bias buffer [layers, rows] when some projection of the stage has a bias
    # gated: the GEMV applies the MLP's activation as it writes (the tensor-core GEMV, :func:`gated_act_layout`):
    # its packed rows alternate GATED_BLOCK gate rows and GATED_BLOCK up rows, and it writes act(gate) * up into
    # the first rows / 2 columns of ``out``
    gated: bool = False


@dataclass(frozen=True)
class StageSpec:
    name: str
    scope: str  # prologue | layer | epilogue
    kind: str  # the stage kind recorded in plan.json (embed | norm_gemv | attention | gemv_residual | ...)
    roles: tuple[str, ...]  # the IR op roles (LayerBinding / global) the stage implements
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    vector: VectorInput | None = None
    gemv: Gemv | None = None
    barrier_after: bool = True
    # roles only some models have (Qwen3's per-head q/k norms), listed before ``roles`` when present, with the
    # buffer that holds their weights added to ``reads``
    optional_roles: tuple[str, ...] = ()
    optional_reads: tuple[str, ...] = ()

    @property
    def per_layer(self) -> bool:
        return self.scope == "layer"

    @property
    def prefetches_next_gemv(self) -> bool:
        """Before the barrier that ends it, the stage prefetches (and preloads) the next GEMV's weights: the
        prologue and every layer GEMV do; attention does not (the GEMV before it already did)."""
        return self.scope == "prologue" or (self.scope == "layer" and self.gemv is not None)


STAGE_TABLE: tuple[StageSpec, ...] = (
    StageSpec("embed", "prologue", "embed", ("embed",), ("tokens", "embed"), ("x",)),
    StageSpec("norm_qkv", "layer", "norm_gemv", ("input_norm", "q", "k", "v"), ("x", "norms", "w_qkv"), ("qkv",),
              vector=VectorInput("rmsnorm", "x", "hidden", norm_role="input_norm"),
              gemv=Gemv("w_qkv", ("q", "k", "v"), "qkv_rows", "hidden", "qkv", False, bias="bias_qkv")),
    StageSpec("attention", "layer", "attention", ("q_rope", "k_rope", "k_append", "v_append", "attention"),
              ("qkv", "rope_cos", "rope_sin", "k_cache", "v_cache", "position"), ("attn", "k_cache", "v_cache"),
              optional_roles=("q_norm", "k_norm"), optional_reads=(HEAD_NORMS,)),
    StageSpec("o_residual", "layer", "gemv_residual", ("o", "attn_add"), ("attn", "w_o", "x"), ("x",),
              vector=VectorInput("copy", "attn", "q_rows"),
              gemv=Gemv("w_o", ("o",), "hidden", "q_rows", "x", True, bias="bias_o")),
    StageSpec("norm_gate_up", "layer", "norm_gemv", ("post_norm", "gate", "up"), ("x", "norms", "w_gate_up"),
              ("gate_up",), vector=VectorInput("rmsnorm", "x", "hidden", norm_role="post_norm"),
              gemv=Gemv("w_gate_up", ("gate", "up"), "gate_up_rows", "hidden", "gate_up", False,
                        bias="bias_gate_up")),
    StageSpec("down_residual", "layer", "act_gemv_residual", ("act", "down", "mlp_add"), ("gate_up", "w_down", "x"),
              ("x",), vector=VectorInput("gated_act", "gate_up", "intermediate"),
              gemv=Gemv("w_down", ("down",), "hidden", "intermediate", "x", True, bias="bias_down")),
    StageSpec("norm_lm_head", "epilogue", "norm_gemv_out", ("final_norm", "lm_head"), ("x", "final_norm", "embed"),
              ("logits",), vector=VectorInput("rmsnorm", "x", "hidden", norm_role="final_norm"),
              gemv=Gemv("lm_head", ("lm_head",), "vocab", "hidden", "logits", False), barrier_after=False),
)

# Sandwich layout (Gemma 2): RMSNorm before and after attention and before and after the MLP. The o and down
# GEMVs write their own rows (``o_out``, ``down_out``); the residual add of their normalised output is folded into
# the next stage's staging, every CTA recomputing ``x' = x + norm(out)`` and one CTA storing it in the other
# residual buffer (``x`` <-> ``x_mid``), so the layout has as many grid barriers as the pre-norm one. The embedding
# writes ``x_mid`` and zeroes ``down_out``, so layer 0's staging (the "previous layer's" MLP output) adds nothing.
SANDWICH_TABLE: tuple[StageSpec, ...] = (
    StageSpec("embed", "prologue", "embed", ("embed",), ("tokens", "embed"), ("x_mid", "down_out")),
    StageSpec("norm_qkv", "layer", "residual_norm_gemv", ("input_norm", "q", "k", "v"),
              ("x_mid", "down_out", "norms", "w_qkv"), ("x", "qkv"),
              vector=VectorInput("residual_norm", "x_mid", "hidden", norm_role="input_norm", delta="down_out",
                                 delta_norm_role="post_ffn_norm", delta_layer="previous", write_back="x"),
              gemv=Gemv("w_qkv", ("q", "k", "v"), "qkv_rows", "hidden", "qkv", False, bias="bias_qkv")),
    STAGE_TABLE[2],  # attention
    StageSpec("o_residual", "layer", "gemv", ("o",), ("attn", "w_o"), ("o_out",),
              vector=VectorInput("copy", "attn", "q_rows"),
              gemv=Gemv("w_o", ("o",), "hidden", "q_rows", "o_out", False, bias="bias_o")),
    StageSpec("norm_gate_up", "layer", "residual_norm_gemv", ("post_attn_norm", "attn_add", "post_norm", "gate", "up"),
              ("x", "o_out", "norms", "w_gate_up"), ("x_mid", "gate_up"),
              vector=VectorInput("residual_norm", "x", "hidden", norm_role="post_norm", delta="o_out",
                                 delta_norm_role="post_attn_norm", delta_layer="same", write_back="x_mid"),
              gemv=Gemv("w_gate_up", ("gate", "up"), "gate_up_rows", "hidden", "gate_up", False,
                        bias="bias_gate_up")),
    StageSpec("down_residual", "layer", "act_gemv", ("act", "down", "post_ffn_norm", "mlp_add"), ("gate_up", "w_down"),
              ("down_out",), vector=VectorInput("gated_act", "gate_up", "intermediate"),
              gemv=Gemv("w_down", ("down",), "hidden", "intermediate", "down_out", False, bias="bias_down")),
    StageSpec("norm_lm_head", "epilogue", "residual_norm_gemv_out", ("final_norm", "lm_head"),
              ("x_mid", "down_out", "norms", "final_norm", "embed"), ("logits",),
              vector=VectorInput("residual_norm", "x_mid", "hidden", norm_role="final_norm", delta="down_out",
                                 delta_norm_role="post_ffn_norm", delta_layer="last"),
              gemv=Gemv("lm_head", ("lm_head",), "vocab", "hidden", "logits", False), barrier_after=False),
)


# Post-norm layout (OLMo-2): RMSNorm after attention and after the MLP, none before them. As the sandwich layout
# (the residual add of the normalised o / down output is folded into the next stage's staging), but the staged
# row is the new residual itself (``norm_role`` empty: no norm before the projections).
POST_NORM_TABLE: tuple[StageSpec, ...] = (
    SANDWICH_TABLE[0],  # embed: x_mid, down_out zeroed
    StageSpec("norm_qkv", "layer", "residual_gemv", ("q", "k", "v"), ("x_mid", "down_out", "norms", "w_qkv"),
              ("x", "qkv"),
              vector=VectorInput("residual_norm", "x_mid", "hidden", delta="down_out", delta_norm_role="post_ffn_norm",
                                 delta_layer="previous", write_back="x"),
              gemv=Gemv("w_qkv", ("q", "k", "v"), "qkv_rows", "hidden", "qkv", False, bias="bias_qkv")),
    STAGE_TABLE[2],  # attention
    SANDWICH_TABLE[3],  # o: its own rows (o_out)
    StageSpec("norm_gate_up", "layer", "residual_gemv", ("post_attn_norm", "attn_add", "gate", "up"),
              ("x", "o_out", "norms", "w_gate_up"), ("x_mid", "gate_up"),
              vector=VectorInput("residual_norm", "x", "hidden", delta="o_out", delta_norm_role="post_attn_norm",
                                 delta_layer="same", write_back="x_mid"),
              gemv=Gemv("w_gate_up", ("gate", "up"), "gate_up_rows", "hidden", "gate_up", False,
                        bias="bias_gate_up")),
    SANDWICH_TABLE[5],  # down: its own rows (down_out)
    SANDWICH_TABLE[6],  # final norm of x_mid + post_ffn_norm(down_out), LM head
)


@dataclass(frozen=True)
class Layout:
    """One decoder layout: its stages and what follows from them."""

    name: str
    stages: tuple[StageSpec, ...]
    norm_roles: tuple[str, ...]  # per-layer RMSNorm weights, the slots of ``norms`` [layers, slots, hidden]
    workspaces: dict  # workspace buffer -> its width (a ModelDims attribute), in buffer order

    @cached_property  # looked up per stage and layer by the reference executor
    def by_name(self) -> dict[str, StageSpec]:
        return {spec.name: spec for spec in self.stages}

    @cached_property
    def layer_gemvs(self) -> tuple[StageSpec, ...]:
        return tuple(spec for spec in self.stages if spec.per_layer and spec.gemv is not None)


LAYOUTS = {
    "pre_norm": Layout("pre_norm", STAGE_TABLE, ("input_norm", "post_norm"),
                       {"x": "hidden", "qkv": "qkv_rows", "attn": "q_rows", "gate_up": "gate_up_rows"}),
    "sandwich": Layout("sandwich", SANDWICH_TABLE, ("input_norm", "post_attn_norm", "post_norm", "post_ffn_norm"),
                       {"x": "hidden", "qkv": "qkv_rows", "attn": "q_rows", "gate_up": "gate_up_rows",
                        "x_mid": "hidden", "o_out": "hidden", "down_out": "hidden"}),
    "post_norm": Layout("post_norm", POST_NORM_TABLE, ("post_attn_norm", "post_ffn_norm"),
                        {"x": "hidden", "qkv": "qkv_rows", "attn": "q_rows", "gate_up": "gate_up_rows",
                         "x_mid": "hidden", "o_out": "hidden", "down_out": "hidden"}),
}
PRE_NORM = LAYOUTS["pre_norm"]
STAGES_BY_NAME = PRE_NORM.by_name
GEMV_STAGES = tuple(spec.name for spec in STAGE_TABLE if spec.gemv is not None)  # the same in every layout
LAYER_GEMVS = PRE_NORM.layer_gemvs
LAYER_NORM_ROLES = PRE_NORM.norm_roles
# Linear biases (Qwen2's q/k/v; Llama's attention_bias / mlp_bias): GEMV stage -> its fp32 bias buffer (every
# layout names the same ones)
STAGE_BIAS = {spec.name: spec.gemv.bias for spec in LAYER_GEMVS if spec.gemv.bias}
WORKSPACES = PRE_NORM.workspaces
# ModelDims attribute -> the generated module's constant expression.
DIMENSION_CONSTANTS = {"hidden": "HIDDEN", "q_rows": "Q_ROWS", "qkv_rows": "QKV_ROWS", "intermediate": "INTER",
                       "gate_up_rows": "2 * INTER", "vocab": "VOCAB"}


# Activations of the gated MLP, act(gate) * up: IR name -> body that stages it in shared memory.
ACTIVATIONS = {"silu": "silu_mul_to_smem", "gelu_tanh": "gelu_mul_to_smem", "gelu": "gelu_mul_to_smem"}
# ... and its code in the tensor-core GEMV that applies it as it writes (bodies.gemv_rows_mma's ``gated``)
GATED_ACT_CODES = {"silu": 1, "gelu_tanh": 2, "gelu": 3}


GATED_BLOCK = 4  # gate rows, then as many up rows, per 8-row tile of a gated GEMV's packed weight (tensor cores)
GATED_PLAIN_BLOCK = 1  # ... and per row pair of the plain GEMV's gated write (+gated: gate row i, then up row i)


def gated_act_layout(layout: Layout) -> Layout:
    """``layout`` with the MLP's activation moved from the down projection's staging into the gate/up GEMV: it
    writes act(gate) * up once ([batch, intermediate], the first half of ``gate_up``), and every CTA of the down
    stage copies that row instead of reading gate | up and evaluating the activation itself (at batch 8 that
    staging read 8 x 2 x intermediate fp32 values per CTA; Llama-3.2-1B's down stage was 54 us per layer, 13 at
    batch 1: H200, session 13). The tensor-core GEMV implements the gated write (its 8-row tiles hold 4 gate
    and the 4 matching up rows)."""
    def fused(spec: StageSpec) -> StageSpec:
        if spec.name == "norm_gate_up":
            return replace(spec, roles=spec.roles + ("act",), gemv=replace(spec.gemv, gated=True))
        if spec.name == "down_residual":
            return replace(spec, roles=tuple(r for r in spec.roles if r != "act"),
                           vector=VectorInput("copy", spec.vector.source, "intermediate"))
        return spec

    return replace(layout, stages=tuple(fused(spec) for spec in layout.stages))


GATED_LAYOUTS = {name: gated_act_layout(layout) for name, layout in LAYOUTS.items()}


def layout_of(plan) -> Layout:
    """The layout a plan was built for (``plan.layout``; plans made before layouts existed are pre-norm), with the
    activation in the gate/up GEMV where that stage applies it (:func:`gated_act_layout`, :func:`gates_in_gemv`)."""
    name = getattr(plan, "layout", "pre_norm")
    return GATED_LAYOUTS[name] if gates_in_gemv(plan.stages) else LAYOUTS[name]


def gates_in_gemv(stages) -> bool:
    """The gate/up stage of these plan stages applies the activation as it writes: it runs on the tensor cores, or
    on the plain tiling with ``+gated``."""
    return any(stage.name == "norm_gate_up" and (stage.tiling.mma or stage.tiling.gated) for stage in stages)


def spec_of(stage, plan=None) -> StageSpec:
    """The table entry of a plan stage (by name, in the plan's layout)."""
    return (layout_of(plan) if plan is not None else PRE_NORM).by_name[stage.name]


def norm_slot(role: str, plan=None) -> int:
    """The slot of a per-layer norm role in the ``norms`` buffer."""
    return (layout_of(plan) if plan is not None else PRE_NORM).norm_roles.index(role)


def next_gemv(stage_name: str, plan=None) -> tuple[StageSpec, str] | None:
    """The GEMV stage that runs next after the barrier ending ``stage_name`` (wrapping to the next layer's first
    GEMV), and how its layer index relates: ``first`` (layer 0, from the prologue), ``same`` or ``next``.
    None for a stage that does not prefetch (attention, the epilogue)."""
    layout = layout_of(plan) if plan is not None else PRE_NORM
    spec = layout.by_name[stage_name]
    if not spec.prefetches_next_gemv:
        return None
    gemvs = layout.layer_gemvs
    if spec.scope == "prologue":
        return gemvs[0], "first"
    position = gemvs.index(spec)
    if position + 1 < len(gemvs):
        return gemvs[position + 1], "same"
    return gemvs[0], "next"
