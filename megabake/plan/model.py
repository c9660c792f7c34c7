"""Plan data model: the dataclasses a plan is made of, its canonical JSON and hash, and queries on it.

Contract: a :class:`Plan` is pure data (ints, floats, strings, lists, dicts); ``plan.to_json()`` is its canonical
text (sorted keys, fixed indent) and ``plan.hash`` the sha256 of it; ``Plan.from_json`` / ``plan_from_dict`` read
it back. Stage tilings record only the flags a tiling uses, so plans made before a flag existed keep their bytes
and hash; likewise a ``Rotary`` names ``long_inv_freq`` / ``long_from`` (long-RoPE past its original range) only
when it switches, and a ``PackedWeight`` its ``interleave`` and ``scale`` only where they are not the identity.
Building a plan from IR is ``megabake.plan.build_plan``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

from .stages import ATTN_WINDOW, HEAD_NORMS, STAGE_BIAS

PLAN_VERSION = 1
WARP = 32


@dataclass
class ModelDims:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    eps: float
    norm_offset: float
    attn_scale: float
    act: str  # the gated MLP's activation: one of megabake.plan.stages.ACTIVATIONS
    embed_scale: float = 1.0  # x = embedding(ids) * embed_scale (Gemma: sqrt(hidden) as the model rounds it)
    final_softcap: float = 0.0  # logits = c * tanh(logits / c) when c > 0 (Gemma 2's final_logit_softcapping)
    rotary_dim: int = 0  # partial rotary: the first rotary_dim features of a head rotate, the rest pass; 0 = all
    whole_qk_norm: bool = False  # q/k RMSNorm over the whole projection (OLMo-2), not per head (Qwen3)

    @property
    def rotated(self) -> int:
        """Features of a head that RoPE rotates (pairs i, i + rotated / 2)."""
        return self.rotary_dim or self.head_dim

    @property
    def q_rows(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_rows + 2 * self.kv_rows

    @property
    def gate_up_rows(self) -> int:
        return 2 * self.intermediate


@dataclass
class LayerBinding:
    """Which HF parameters and IR ops one decoder layer is made of."""

    index: int
    params: dict[str, str]  # role -> HF parameter fqn (input_norm, q, k, v, o, post_norm, gate, up, down)
    ops: dict[str, list[str]]  # stage role -> IR op ids
    fx_nodes: dict[str, list[str]]  # stage role -> FX node names
    hf_modules: dict[str, list[str]]  # stage role -> HF module paths
    window: int = 0  # sliding-window attention: keys (position - window, position]; 0 = every cached key
    rope_table: int = 0  # which of the plan's rotary tables this layer rotates with (Gemma 3: per layer type)


@dataclass
class Buffer:
    name: str
    role: str  # weight | table | state | workspace | input | output | sync
    dtype: str
    shape: list[int]


@dataclass
class PackedWeight:
    """A packed weight buffer: ``sources[layer]`` lists parts concatenated along rows: ``(fqn, 0)`` is an HF
    parameter, ``(fqn, start, stop)`` rows ``start:stop`` of one (a fused projection), ``("", n)`` is n rows of
    zeros (a bias a projection does not have, next to one it has)."""

    buffer: str
    per_layer: bool
    sources: list[list[tuple[str, int]]]
    # > 0: each layer's concatenated rows reordered in blocks of this many rows, alternating between the first and
    # the second half (a gated GEMV's gate | up, ``stages.GATED_BLOCK``); 0 (left out of plan.json): as concatenated
    interleave: int = 0
    # every packed value times this (in fp32, before the cast to the buffer's dtype): the projections' output scale
    # (``Linear.scale``: Granite's residual_multiplier on w_o / w_down), or the LM head's folded into final_norm
    # (Granite's 1 / logits_scaling; the head may be the tied embedding); 1.0 (left out of plan.json): unscaled
    scale: float = 1.0


@dataclass
class Tiling:
    kind: str  # rows (GEMV rows over warps) | heads (one (batch, head) per CTA) | chunks (elements over CTAs)
    #          | kv_splits (split-KV attention: (split, batch, KV head) items over CTAs; per_tile = minimum
    #          positions per split, unroll = K/V rows in flight per lane group)
    units: int  # rows, heads or elements covered
    per_tile: int
    tiles: int
    unroll: int = 4  # GEMV: 16-byte loads in flight per lane and row (K-loop unroll)
    # GEMV tile t -> warp: False (warp-major): global warp t % (ctas*warps) = cta*warps + warp, so a small GEMV
    # fills the first CTAs; True (CTA-major): cta = t % ctas, warp = (t // ctas) % warps, every SM streams.
    spread: bool = False
    # GEMV: the first K chunk of each warp's first tile is loaded into registers before the barrier that
    # precedes the stage (weights do not depend on it), so the stage starts with data in hand.
    preload: bool = False
    # GEMV: software-pipelined K loop: the loads of a warp's next chunk (next tile included) are issued before
    # the current chunk is reduced, so two chunks per warp are in flight instead of one (same summation order;
    # a K that is not whole chunks ends each tile with a partial, masked chunk).
    pipeline: bool = False
    # GEMV: 0, or the depth of a per-warp shared-memory ring that cp.async fills ``stages - 1`` chunks ahead
    # of the chunk being reduced (no registers held while in flight; same summation order). With ``preload``
    # the first ``stages - 1`` chunks are copied before the barrier that precedes the stage.
    stages: int = 0
    # GEMV: 0, or the tensor-core path (mma.sync, bf16 inputs, fp32 sums; ``per_tile`` = 8 rows) with this many
    # warps of a CTA sharing each tile, each reducing 1/mma of K (``tuning.mma_split``; experimental).
    mma: int = 0
    # GEMV (the gate/up stage, plain register tiling): its 2-row pairs are a gate row and its up row (packed
    # with ``interleave`` 1) and it writes act(gate) * up once, as the tensor-core path does (experimental).
    gated: bool = False
    # split-KV attention: 0, or the slices a KV group's query heads are dealt in when few splits are active (short
    # contexts): item (split, batch, KV head, slice) takes group / head_slices query heads (``plan.attention``)
    head_slices: int = 0


@dataclass
class Stage:
    index: int
    name: str
    scope: str  # prologue | layer | epilogue
    kind: str  # embed | norm_gemv | attention | gemv_residual | act_gemv_residual | norm_gemv_out
    reads: list[str]
    writes: list[str]
    tiling: Tiling
    roles: list[str]  # which LayerBinding / global op roles it implements
    barrier_after: bool = True


@dataclass
class Rotary:
    inv_freq_buffer: str  # model buffer fqn (from the graph placeholder's target)
    attention_scaling: float
    head_dim: int
    ops: list[str] = field(default_factory=list)
    # long-RoPE past its original range (Phi-3-128k, Phi-4-mini): table rows p >= long_from rotate with these fp32
    # inverse frequencies (the long factors), rows below with ``inv_freq_buffer``'s (the short ones); the same
    # attention scaling. [] and 0 (left out of plan.json) for every other model and bucket.
    long_inv_freq: list[float] = field(default_factory=list)
    long_from: int = 0


@dataclass
class Plan:
    version: int
    dims: ModelDims
    batch: int
    capacity: int
    ctas: int
    threads: int
    smem_bytes: int
    weight_dtype: str
    buffers: list[Buffer]
    packed: list[PackedWeight]
    stages: list[Stage]
    layers: list[LayerBinding]
    rotary: Rotary
    globals: dict[str, dict[str, list[str]]]  # embed / final_norm / lm_head: ops, fx_nodes, hf_modules
    tied_lm_head: bool
    layout: str = "pre_norm"  # megabake.plan.stages.LAYOUTS: pre_norm (Llama) | sandwich (Gemma 2)
    rope_tables: list[Rotary] = field(default_factory=list)  # several tables (Gemma 3); [] = the one ``rotary``
    # GEMV input rows in shared memory: fp32, or bf16 where fp32 rows do not fit (large batches); only bf16 is
    # written to plan.json, so fp32 plans keep their bytes and hash
    staging_dtype: str = "float32"
    # where the down projection reads its input rows: "smem" (staged) or "global" (the bf16 ``act`` buffer, for
    # buckets whose intermediate-wide rows overflow shared memory); only "global" is written to plan.json
    down_input: str = "smem"

    # -- identity -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = asdict(self)
        for stage in data["stages"]:  # only tilings that use them name these: older plans keep bytes and hash
            for flag in ("spread", "preload", "pipeline", "stages", "mma", "gated", "head_slices"):
                if not stage["tiling"].get(flag):
                    stage["tiling"].pop(flag, None)
        if data["dims"]["embed_scale"] == 1.0:  # recorded only where it scales: older plans keep their hash
            data["dims"].pop("embed_scale")
        if not data["dims"]["final_softcap"]:
            data["dims"].pop("final_softcap")
        for key in ("rotary_dim", "whole_qk_norm"):
            if not data["dims"][key]:
                data["dims"].pop(key)
        if data["layout"] == "pre_norm":  # likewise: the layout is named only when it is not the first one
            data.pop("layout")
        for layer in data["layers"]:  # and a layer's window and rotary table only when it has them
            for key in ("window", "rope_table"):
                if not layer[key]:
                    layer.pop(key)
        if not data["rope_tables"]:
            data.pop("rope_tables")
        if data["staging_dtype"] == "float32":
            data.pop("staging_dtype")
        if data["down_input"] == "smem":
            data.pop("down_input")
        for packed in data["packed"]:
            if not packed["interleave"]:
                packed.pop("interleave")
            if packed["scale"] == 1.0:
                packed.pop("scale")
        for rotary in [data["rotary"], *data.get("rope_tables", [])]:  # long-RoPE fields only when switched
            for key in ("long_inv_freq", "long_from"):
                if not rotary[key]:
                    rotary.pop(key)
        return data

    def to_json(self) -> str:
        """Canonical text of plan.json (sorted keys, fixed indent, trailing newline)."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=1, default=_json_default) + "\n"

    @property
    def hash(self) -> str:
        """sha256 of the canonical plan.json bytes."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return plan_from_dict(json.loads(text))

    # -- queries ------------------------------------------------------------------------------------
    @property
    def warps(self) -> int:
        return self.threads // WARP

    @property
    def barriers_per_step(self) -> int:
        prologue = [s for s in self.stages if s.scope == "prologue" and s.barrier_after]
        layer = [s for s in self.stages if s.scope == "layer" and s.barrier_after]
        epilogue = [s for s in self.stages if s.scope == "epilogue" and s.barrier_after]
        return len(prologue) + len(layer) * self.dims.layers + len(epilogue)

    def bias_of(self, stage_name: str) -> str | None:
        """The fp32 bias buffer a GEMV stage adds to its outputs, or None (no projection in it has a bias)."""
        name = STAGE_BIAS.get(stage_name)
        return name if name and any(b.name == name for b in self.buffers) else None

    @property
    def windows(self) -> list[int]:
        """Per layer: the sliding window, or 0 where attention reads every cached key."""
        return [layer.window for layer in self.layers]

    @property
    def has_windows(self) -> bool:
        """Some layer attends over a sliding window: the kernel reads ``attn_window`` [layers] (int32)."""
        return any(b.name == ATTN_WINDOW for b in self.buffers)

    def attn_window_table(self) -> list[int]:
        """``attn_window``'s values: the window of each layer, the KV capacity where a layer has none (so the
        first visible key, ``max(position + 1 - window, 0)``, is 0 there)."""
        return [layer.window or self.capacity for layer in self.layers]

    @property
    def rotaries(self) -> list[Rotary]:
        """Every rotary table the kernel rotates with: ``rope_tables``, or the one ``rotary``."""
        return self.rope_tables or [self.rotary]

    @property
    def has_rope_tables(self) -> bool:
        """Several rotary tables: ``rope_cos``/``rope_sin`` are [tables, capacity, head_dim] and ``rope_table``
        [layers] (int32) says which one each layer uses."""
        return len(self.rope_tables) > 1

    @property
    def has_head_norms(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (Qwen3): weights in the ``qk_norms`` buffer."""
        return any(b.name == HEAD_NORMS for b in self.buffers)

    def buffer(self, name: str) -> Buffer:
        for buf in self.buffers:
            if buf.name == name:
                return buf
        raise KeyError(name)

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step streams (embedding: one row per sequence)."""
        size = {"bfloat16": 2, "float16": 2, "float32": 4}[self.weight_dtype]
        total = 0
        for buf in self.buffers:
            if buf.role != "weight":
                continue
            count = math.prod(buf.shape)
            if buf.name == "embed" and not self.tied_lm_head:
                count = self.batch * buf.shape[-1]
            elem = 4 if buf.dtype == "float32" else size
            total += count * elem
        return total


def _json_default(value):
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def plan_from_dict(data: dict) -> Plan:
    data = dict(data)
    data["dims"] = ModelDims(**data["dims"])
    data["buffers"] = [Buffer(**b) for b in data["buffers"]]
    data["packed"] = [PackedWeight(p["buffer"], p["per_layer"], [[tuple(s) for s in layer] for layer in p["sources"]],
                                   p.get("interleave", 0), p.get("scale", 1.0)) for p in data["packed"]]
    data["stages"] = [Stage(**{**s, "tiling": Tiling(**s["tiling"])}) for s in data["stages"]]
    data["layers"] = [LayerBinding(**layer) for layer in data["layers"]]
    data["rotary"] = Rotary(**data["rotary"])
    data["rope_tables"] = [Rotary(**r) for r in data.get("rope_tables", [])]
    return Plan(**data)
