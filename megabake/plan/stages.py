"""Stage table: every barrier interval of the megakernel's decode step, described once.

Contract: ``STAGE_TABLE`` lists one :class:`StageSpec` per stage, in execution order (prologue, the layer loop,
epilogue). A spec says which IR roles the stage implements, what it reads and writes, and for a GEMV stage how
its input row is staged in shared memory (:class:`VectorInput`) and which packed weight it multiplies by
(:class:`Gemv`: the projection roles packed along its rows, their shape as ``ModelDims`` attribute names, the
output buffer, whether it accumulates into it, and its optional fp32 bias buffer). The plan
(``megabake.plan.build_plan``) builds its stages, weight buffers, packing and bias buffers from this table; the
code generator (``megabake.codegen``) emits each stage's body calls, its L2 prefetch and ring/register preload
of the next GEMV from it; the reference executor (``megabake.plan.reference``) runs it. Adding a stage kind
(a norm after a projection, a fused projection, another activation) means adding a spec here and, where it
needs new device code, a body; nothing else keys on stage-name strings.

Dimension names (``Gemv.rows`` / ``Gemv.cols``, ``VectorInput.width``) are ``ModelDims`` attributes;
``DIMENSION_CONSTANTS`` maps each to the constant expression of the generated module.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_NORMS = "qk_norms"  # [L, 2, head_dim] fp32: Qwen3's q_norm and k_norm weights, applied before RoPE


@dataclass(frozen=True)
class VectorInput:
    """How a GEMV stage stages its fp32 input row(s) in shared memory before multiplying.

    ``kind``: ``rmsnorm`` (RMSNorm of ``source`` by the norm weight ``norm_role``, recomputed by every CTA),
    ``copy`` (``source`` as is) or ``gated_act`` (``act(gate) * up`` of ``source`` = [gate | up], the model's
    activation)."""

    kind: str
    source: str
    width: str  # ModelDims attribute: the row length
    norm_role: str = ""  # rmsnorm: the norm weight's role (input_norm / post_norm: per-layer; final_norm: global)


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

STAGES_BY_NAME = {spec.name: spec for spec in STAGE_TABLE}
GEMV_STAGES = tuple(spec.name for spec in STAGE_TABLE if spec.gemv is not None)
LAYER_GEMVS = tuple(spec for spec in STAGE_TABLE if spec.per_layer and spec.gemv is not None)
# Per-layer RMSNorm weights, packed as slots of the ``norms`` buffer [layers, slots, hidden] in this order.
LAYER_NORM_ROLES = tuple(spec.vector.norm_role for spec in STAGE_TABLE
                         if spec.per_layer and spec.vector is not None and spec.vector.kind == "rmsnorm")
# Linear biases (Qwen2's q/k/v; Llama's attention_bias / mlp_bias): GEMV stage -> its fp32 bias buffer
STAGE_BIAS = {spec.name: spec.gemv.bias for spec in LAYER_GEMVS if spec.gemv.bias}
# Workspace rows between stages: buffer -> its width (a ModelDims attribute), in buffer order.
WORKSPACES = {"x": "hidden", "qkv": "qkv_rows", "attn": "q_rows", "gate_up": "gate_up_rows"}
# ModelDims attribute -> the generated module's constant expression.
DIMENSION_CONSTANTS = {"hidden": "HIDDEN", "q_rows": "Q_ROWS", "qkv_rows": "QKV_ROWS", "intermediate": "INTER",
                       "gate_up_rows": "2 * INTER", "vocab": "VOCAB"}


# Activations of the gated MLP, act(gate) * up: IR name -> body that stages it in shared memory.
ACTIVATIONS = {"silu": "silu_mul_to_smem", "gelu_tanh": "gelu_mul_to_smem", "gelu": "gelu_mul_to_smem"}


def spec_of(stage) -> StageSpec:
    """The table entry of a plan stage (by name)."""
    return STAGES_BY_NAME[stage.name]


def norm_slot(role: str) -> int:
    """The slot of a per-layer norm role in the ``norms`` buffer."""
    return LAYER_NORM_ROLES.index(role)


def next_gemv(stage_name: str) -> tuple[StageSpec, str] | None:
    """The GEMV stage that runs next after the barrier ending ``stage_name`` (wrapping to the next layer's first
    GEMV), and how its layer index relates: ``first`` (layer 0, from the prologue), ``same`` or ``next``.
    None for a stage that does not prefetch (attention, the epilogue)."""
    spec = STAGES_BY_NAME[stage_name]
    if not spec.prefetches_next_gemv:
        return None
    if spec.scope == "prologue":
        return LAYER_GEMVS[0], "first"
    position = LAYER_GEMVS.index(spec)
    if position + 1 < len(LAYER_GEMVS):
        return LAYER_GEMVS[position + 1], "same"
    return LAYER_GEMVS[0], "next"
