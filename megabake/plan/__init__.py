"""Plan: typed IR -> stages (barrier intervals) x tiles x CTAs, buffers and packed-weight layout.

Contract: ``build_plan(ir, ctas=..., threads=...)`` returns a :class:`Plan`, pure data (dataclasses of
ints, floats and strings) whose canonical JSON (``plan.to_json()``) is hashed into ``plan.hash``. The plan
recognises the decoder by dataflow: one embedding, then blocks of
``RMSNorm -> {q,k,v} Linear -> RoPE -> KVAppend -> DecodeAttention -> o Linear -> Add -> RMSNorm ->
{gate,up} Linear -> GatedAct -> down Linear -> Add``, then RMSNorm + LM head. Identical blocks become one
runtime layer loop over packed weights ``[L, rows, cols]``. Anything else raises :class:`PlanError`.

Per step the kernel runs: prologue (embedding) | per layer: norm+QKV, attention (RoPE + KV append +
decode attention), O-proj + residual, norm+gate/up, act+down + residual | epilogue (norm + LM head),
with one grid barrier between consecutive stages. RMSNorm of one row is recomputed by every CTA that
needs it instead of costing a barrier. Linear biases (q/k/v/o, gate/up/down) become per-stage fp32 buffers
(``STAGE_BIAS``, zeros for a projection without one) that the GEMV adds as it writes; a plan without biases
has no such buffers, and its kernel is the same as before biases existed. Qwen3's per-head q/k RMSNorm
(before RoPE) is recognised through the norm and packed as ``qk_norms`` for the attention stage.
GEMV tilings and the default choice live in ``megabake.plan.tuning`` (re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

from ..errors import PlanError
from .tuning import (DEFAULT_TUNING, GEMV_STAGES, HOPPER_SMEM_PER_BLOCK, PIPELINE_MAX_THREADS,  # noqa: F401
                     PIPELINE_MAX_VECTORS, RING_VECTOR_BYTES, STREAMING_DEFAULT, GemvTuning, check_pipeline,
                     check_ring, default_tuning, ring_bytes, ring_shape, streaming_tuning)
from ..ir import (Add, DecodeAttention, Embedding, GatedAct, IRGraph, KVAppend, Linear, RMSNorm, RoPE,
                  RotaryTable)

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
    act: str

    @property
    def q_rows(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_rows + 2 * self.kv_rows


@dataclass
class LayerBinding:
    """Which HF parameters and IR ops one decoder layer is made of."""

    index: int
    params: dict[str, str]  # role -> HF parameter fqn (input_norm, q, k, v, o, post_norm, gate, up, down)
    ops: dict[str, list[str]]  # stage role -> IR op ids
    fx_nodes: dict[str, list[str]]  # stage role -> FX node names
    hf_modules: dict[str, list[str]]  # stage role -> HF module paths


@dataclass
class Buffer:
    name: str
    role: str  # weight | table | state | workspace | input | output | sync
    dtype: str
    shape: list[int]


@dataclass
class PackedWeight:
    """A packed weight buffer: ``sources[layer]`` lists parts concatenated along rows: ``(fqn, 0)`` is an HF
    parameter, ``("", n)`` is n rows of zeros (a bias a projection does not have, next to one it has)."""

    buffer: str
    per_layer: bool
    sources: list[list[tuple[str, int]]]


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

    # -- identity -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = asdict(self)
        for stage in data["stages"]:  # only tilings that use them name these: older plans keep bytes and hash
            for flag in ("spread", "preload", "pipeline", "stages"):
                if not stage["tiling"].get(flag):
                    stage["tiling"].pop(flag, None)
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
    data["packed"] = [PackedWeight(p["buffer"], p["per_layer"], [[tuple(s) for s in layer] for layer in p["sources"]])
                      for p in data["packed"]]
    data["stages"] = [Stage(**{**s, "tiling": Tiling(**s["tiling"])}) for s in data["stages"]]
    data["layers"] = [LayerBinding(**layer) for layer in data["layers"]]
    data["rotary"] = Rotary(**data["rotary"])
    return Plan(**data)


# ---------------------------------------------------------------------------------- recognition


@dataclass
class _Block:
    index: int
    ops: dict[str, object]


def _consumers(ir: IRGraph) -> dict[str, list]:
    users: dict[str, list] = {}
    for op in ir.ops:
        for value in _inputs(op):
            users.setdefault(value, []).append(op)
    return users


def _inputs(op) -> list[str]:
    if isinstance(op, RMSNorm):
        return [op.inp]
    if isinstance(op, Linear):
        return [op.inp]
    if isinstance(op, RoPE):
        return [op.inp]
    if isinstance(op, KVAppend):
        return [op.value]
    if isinstance(op, DecodeAttention):
        return [op.q]
    if isinstance(op, GatedAct):
        return [op.gate, op.up]
    if isinstance(op, Add):
        return [op.a, op.b]
    return []


def _rope_users(lin: Linear, users: dict) -> list[tuple[object, RMSNorm | None]]:
    """Users of a projection, looking through a per-head RMSNorm (Qwen3's q_norm / k_norm) to what follows it."""
    found = []
    for user in users.get(lin.out, []):
        if isinstance(user, RMSNorm):
            found += [(after, user) for after in users.get(user.out, [])]
        else:
            found.append((user, None))
    return found


def _only(items: list, what: str, where: str):
    if len(items) != 1:
        raise PlanError(f"expected exactly one {what} after {where}, found {len(items)}; "
                        "this decoder layout is not supported by the megakernel plan yet")
    return items[0]


def _recognise(ir: IRGraph) -> tuple[Embedding, list[_Block], RMSNorm, Linear, list[RoPE]]:
    users = _consumers(ir)
    producer = ir.producer()
    embed = _only(ir.of_kind(Embedding), "embedding", "the token ids")
    residual = embed.out
    blocks: list[_Block] = []
    while True:
        norm = _only([u for u in users.get(residual, []) if isinstance(u, RMSNorm)], "RMSNorm", residual)
        linears = [u for u in users.get(norm.out, []) if isinstance(u, Linear)]
        if len(linears) == 1:  # final norm -> LM head
            lm_head = linears[0]
            if lm_head.out != ir.output:
                raise PlanError(f"the last linear ({lm_head.hf_module}) does not produce the step's output")
            break
        block = _recognise_block(len(blocks), residual, norm, linears, users, producer)
        blocks.append(block)
        residual = block.ops["mlp_add"].out
    if not blocks:
        raise PlanError("no decoder layer found between the embedding and the LM head")
    ropes = ir.of_kind(RoPE)
    return embed, blocks, norm, lm_head, ropes


def _recognise_block(index, residual, norm, linears, users, producer) -> _Block:
    ops: dict[str, object] = {"input_norm": norm}
    attn = None
    for lin in linears:
        for user, head_norm in _rope_users(lin, users):
            if isinstance(user, RoPE):
                nxt = users.get(user.out, [])
                if any(isinstance(n, DecodeAttention) for n in nxt):
                    ops["q"], ops["q_rope"] = lin, user
                    attn = next(n for n in nxt if isinstance(n, DecodeAttention))
                    if head_norm is not None:
                        ops["q_norm"] = head_norm
                elif any(isinstance(n, KVAppend) for n in nxt):
                    ops["k"], ops["k_rope"] = lin, user
                    ops["k_append"] = next(n for n in nxt if isinstance(n, KVAppend))
                    if head_norm is not None:
                        ops["k_norm"] = head_norm
            elif isinstance(user, KVAppend):
                ops["v"], ops["v_append"] = lin, user
    if ("q_norm" in ops) != ("k_norm" in ops):
        raise PlanError(f"layer {index}: a per-head RMSNorm on only one of q and k is not supported")
    missing = [r for r in ("q", "k", "v", "k_append", "v_append") if r not in ops] + ([] if attn else ["attention"])
    if missing or len(linears) != 3:
        raise PlanError(f"layer {index}: could not recognise the attention block (missing {missing}, "
                        f"{len(linears)} projections of {norm.hf_module}); expected q/k/v projections with RoPE "
                        "on q and k and a static-cache attention")
    ops["attention"] = attn
    o_proj = _only([u for u in users.get(attn.out, []) if isinstance(u, Linear)], "o-projection", attn.hf_module)
    add1 = _only([u for u in users.get(o_proj.out, []) if isinstance(u, Add)], "residual add", o_proj.hf_module)
    if residual not in (add1.a, add1.b):
        raise PlanError(f"layer {index}: the attention residual add does not add the layer input")
    norm2 = _only([u for u in users.get(add1.out, []) if isinstance(u, RMSNorm)], "post-attention RMSNorm",
                  add1.hf_module)
    mlp_in = [u for u in users.get(norm2.out, []) if isinstance(u, Linear)]
    act = None
    for lin in mlp_in:
        for user in users.get(lin.out, []):
            if isinstance(user, GatedAct):
                act = user
    if act is None or len(mlp_in) != 2:
        raise PlanError(f"layer {index}: expected a gated MLP (gate/up projections into an activation product)")
    gate = next(lin for lin in mlp_in if lin.out == act.gate)
    up = next(lin for lin in mlp_in if lin.out == act.up)
    down = _only([u for u in users.get(act.out, []) if isinstance(u, Linear)], "down projection", act.hf_module)
    add2 = _only([u for u in users.get(down.out, []) if isinstance(u, Add)], "MLP residual add", down.hf_module)
    if add1.out not in (add2.a, add2.b):
        raise PlanError(f"layer {index}: the MLP residual add does not add the attention residual")
    ops.update(o=o_proj, attn_add=add1, post_norm=norm2, gate=gate, up=up, act=act, down=down, mlp_add=add2)
    return _Block(index, ops)


# ---------------------------------------------------------------------------------------- build

_STAGE_ROLES = {
    "norm_qkv": ["input_norm", "q", "k", "v"],
    "attention": ["q_rope", "k_rope", "k_append", "v_append", "attention"],
    "o_residual": ["o", "attn_add"],
    "norm_gate_up": ["post_norm", "gate", "up"],
    "down_residual": ["act", "down", "mlp_add"],
}


_OPTIONAL_ROLES = ("q_norm", "k_norm")  # Qwen3's per-head RMSNorm of q and k before RoPE
_LAYER_ROLES = {**_STAGE_ROLES, "attention": list(_OPTIONAL_ROLES) + _STAGE_ROLES["attention"]}


def _dims(blocks: list[_Block], final_norm: RMSNorm, lm_head: Linear) -> ModelDims:
    first = blocks[0].ops
    attn: DecodeAttention = first["attention"]
    norm: RMSNorm = first["input_norm"]
    dims = ModelDims(
        hidden=first["q"].in_features, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
        head_dim=attn.head_dim, intermediate=first["gate"].out_features, vocab=lm_head.out_features,
        layers=len(blocks), eps=norm.eps, norm_offset=norm.weight_offset, attn_scale=attn.scale,
        act=first["act"].act,
    )
    for block in blocks:
        _check_block_shape(block, dims)
    if final_norm.eps != dims.eps or final_norm.weight_offset != dims.norm_offset:
        raise PlanError("the final norm differs from the layer norms (eps or weight offset)")
    return dims


def _check_block_shape(block: _Block, dims: ModelDims) -> None:
    ops = block.ops
    expect = {
        "q": (dims.q_rows, dims.hidden), "k": (dims.kv_rows, dims.hidden), "v": (dims.kv_rows, dims.hidden),
        "o": (dims.hidden, dims.q_rows), "gate": (dims.intermediate, dims.hidden),
        "up": (dims.intermediate, dims.hidden), "down": (dims.hidden, dims.intermediate),
    }
    for role, shape in expect.items():
        lin: Linear = ops[role]
        if (lin.out_features, lin.in_features) != shape:
            raise PlanError(f"layer {block.index} {role} ({lin.hf_module}) has shape "
                            f"{(lin.out_features, lin.in_features)}, expected {shape}: layers must be identical")
    for role in ("q_norm", "k_norm"):
        norm = ops.get(role)
        if norm is not None and (norm.eps != dims.eps or norm.weight_offset != dims.norm_offset):
            raise PlanError(f"{norm.hf_module}: a per-head norm whose eps or weight offset differs from the layer "
                            "norms is not supported")
    if ops["attention"].head_dim % WARP != 0 or ops["attention"].head_dim > 256:
        raise PlanError(f"head_dim {ops['attention'].head_dim} must be a multiple of 32 and at most 256")
    if dims.act != "silu":
        raise PlanError(f"activation {dims.act!r} is not supported (silu only)")



# Linear biases (Qwen2's q/k/v; Llama's attention_bias / mlp_bias): GEMV stage -> (fp32 bias buffer, roles)
STAGE_BIAS = {"norm_qkv": "bias_qkv", "o_residual": "bias_o", "norm_gate_up": "bias_gate_up",
              "down_residual": "bias_down"}
HEAD_NORMS = "qk_norms"  # [L, 2, head_dim] fp32: Qwen3's q_norm and k_norm weights, applied before RoPE
_BIAS_ROLES = {"norm_qkv": ["q", "k", "v"], "o_residual": ["o"], "norm_gate_up": ["gate", "up"],
               "down_residual": ["down"]}
def _rows_tiling(rows: int, tuning: GemvTuning) -> Tiling:
    return Tiling("rows", rows, tuning.per_tile, -(-rows // tuning.per_tile), tuning.unroll, tuning.spread,
                  tuning.preload, tuning.pipeline, tuning.stages)


def build_plan(ir: IRGraph, *, ctas: int = 132, threads: int = 256, weight_dtype: str = "bfloat16",
               rotary_scaling: float = 1.0, inv_freq_buffer: str = "",
               tuning: dict[str, GemvTuning] | None = None, attention_preload: bool = False,
               split_kv: bool | None = None) -> Plan:
    """Turn recognised IR into a plan for a grid of ``ctas`` CTAs of ``threads`` threads.

    ``split_kv`` (default: on unless ``attention_preload``) splits decode attention's cached keys across CTAs
    (flash decoding, ``bodies.split_kv_attention``); off, one CTA reads a (batch, head)'s whole cache (the
    layout attention preload needs).

    ``tuning=None`` picks :func:`default_tuning` (the streaming ring that fits this bucket); a dict overrides
    the GEMV tiling of named stages (``GEMV_STAGES``) and the rest keep the plain ``DEFAULT_TUNING``.
    ``attention_preload`` loads each lane group's first cached K/V rows before the barrier that precedes
    attention (the attention stage's ``tiling.preload``; one (batch, head) tile per CTA at most).
    """
    if threads % WARP or not 64 <= threads <= 1024:
        raise PlanError(f"threads per CTA must be a multiple of 32 in [64, 1024], got {threads}")
    unknown = sorted(set(tuning or {}) - set(GEMV_STAGES))
    if unknown:
        raise PlanError(f"tuning names unknown GEMV stage(s) {unknown}; known: {list(GEMV_STAGES)}")
    if split_kv is None:
        split_kv = not attention_preload
    embed, blocks, final_norm, lm_head, ropes = _recognise(ir)
    dims = _dims(blocks, final_norm, lm_head)
    if tuning is None:
        tuning = default_tuning(threads, _smem_bytes(dims, ir.batch, ir.capacity, threads, split_kv))
    tuning = {**DEFAULT_TUNING, **tuning}
    check_pipeline(tuning, threads)
    if tuning["norm_lm_head"].preload:
        raise PlanError("GEMV preload is not supported for the LM head stage (no barrier precedes it inside the "
                        "layer loop); use preload=False for norm_lm_head")
    if lm_head.bias is not None:
        raise PlanError(f"{lm_head.hf_module} (the LM head) has a bias; an LM-head bias is not supported yet")
    biased = _biased_stages(blocks)
    head_norms = _has_head_norms(blocks)
    for k in (dims.hidden, dims.q_rows, dims.intermediate):
        if k % 8:
            raise PlanError(f"a GEMV reduction length of {k} is not a multiple of 8 (16-byte bf16 vectors)")
    batch, capacity = ir.batch, ir.capacity
    if split_kv and attention_preload:
        raise PlanError("attention preload applies to the unsplit attention: pass split_kv=False with it")
    _check_shared_memory(dims, batch, capacity, threads, split_kv)
    ring = check_ring(tuning, threads, _smem_bytes(dims, batch, capacity, threads, split_kv))
    layers = [_bind_layer(block) for block in blocks]
    tied = lm_head.weight == embed.table
    stages = _stages(dims, batch, tuning, _attention_tiling(dims, batch, ctas, threads, split_kv))
    if attention_preload:
        _check_attention_preload(dims, batch, ctas)
    for stage in stages:
        if stage.name == "attention":
            stage.tiling.preload = attention_preload
        if stage.name in biased:
            stage.reads.append(STAGE_BIAS[stage.name])
        if stage.name == "attention" and head_norms:
            stage.reads.append(HEAD_NORMS)
            stage.roles = list(_OPTIONAL_ROLES) + stage.roles
    rotary_ops = [op.id for op in ir.of_kind(RotaryTable)]
    return Plan(
        version=PLAN_VERSION, dims=dims, batch=batch, capacity=capacity, ctas=ctas, threads=threads,
        smem_bytes=_smem_bytes(dims, batch, capacity, threads, split_kv) + ring, weight_dtype=weight_dtype,
        buffers=_buffers(dims, batch, capacity, weight_dtype, tied) + _bias_buffers(dims, biased)
        + _head_norm_buffers(dims, head_norms) + _split_kv_buffers(dims, batch, stages),
        packed=_packing(blocks, embed, final_norm, lm_head, tied) + _bias_packing(blocks, biased)
        + _head_norm_packing(blocks, head_norms),
        stages=stages, layers=layers,
        rotary=Rotary(inv_freq_buffer=inv_freq_buffer, attention_scaling=rotary_scaling, head_dim=dims.head_dim,
                      ops=rotary_ops),
        globals={
            "embed": _provenance([embed]),
            "final_norm": _provenance([final_norm]),
            "lm_head": _provenance([lm_head]),
        },
        tied_lm_head=tied,
    )


def _provenance(ops) -> dict[str, list[str]]:
    return {
        "ops": [op.id for op in ops],
        "fx_nodes": [n for op in ops for n in op.fx_nodes],
        "hf_modules": sorted({op.hf_module for op in ops if op.hf_module}),
    }


def _bind_layer(block: _Block) -> LayerBinding:
    ops = block.ops
    params = {role: ops[role].weight for role in ("input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down")}
    params.update({role: ops[role].weight for role in _OPTIONAL_ROLES if role in ops})
    by_stage = {stage: [ops[r] for r in roles if r in ops] for stage, roles in _LAYER_ROLES.items()}
    return LayerBinding(
        index=block.index, params=params,
        ops={s: [op.id for op in v] for s, v in by_stage.items()},
        fx_nodes={s: [n for op in v for n in op.fx_nodes] for s, v in by_stage.items()},
        hf_modules={s: sorted({op.hf_module for op in v if op.hf_module}) for s, v in by_stage.items()},
    )


def _buffers(dims: ModelDims, batch: int, capacity: int, wdt: str, tied: bool) -> list[Buffer]:
    L, H = dims.layers, dims.hidden
    buffers = [
        Buffer("embed", "weight", wdt, [dims.vocab, H]),
        Buffer("w_qkv", "weight", wdt, [L, dims.qkv_rows, H]),
        Buffer("w_o", "weight", wdt, [L, H, dims.q_rows]),
        Buffer("w_gate_up", "weight", wdt, [L, 2 * dims.intermediate, H]),
        Buffer("w_down", "weight", wdt, [L, H, dims.intermediate]),
        Buffer("norms", "weight", "float32", [L, 2, H]),
        Buffer("final_norm", "weight", "float32", [H]),
    ]
    if not tied:
        buffers.append(Buffer("lm_head", "weight", wdt, [dims.vocab, H]))
    buffers += [
        Buffer("rope_cos", "table", "float32", [capacity, dims.head_dim]),
        Buffer("rope_sin", "table", "float32", [capacity, dims.head_dim]),
        Buffer("k_cache", "state", wdt, [L, batch, dims.n_kv_heads, capacity, dims.head_dim]),
        Buffer("v_cache", "state", wdt, [L, batch, dims.n_kv_heads, capacity, dims.head_dim]),
        Buffer("tokens", "input", "int32", [batch]),
        Buffer("position", "input", "int32", [1]),
        Buffer("x", "workspace", "float32", [batch, H]),
        Buffer("qkv", "workspace", "float32", [batch, dims.qkv_rows]),
        Buffer("attn", "workspace", "float32", [batch, dims.q_rows]),
        Buffer("gate_up", "workspace", "float32", [batch, 2 * dims.intermediate]),
        Buffer("logits", "output", "float32", [batch, dims.vocab]),
        Buffer("barrier", "sync", "int64", [1]),
    ]
    return buffers


def _packing(blocks, embed, final_norm, lm_head, tied) -> list[PackedWeight]:
    def per_layer(roles_rows):
        return [[(block.ops[role].weight, 0) for role in roles_rows] for block in blocks]

    packs = [
        PackedWeight("embed", False, [[(embed.table, 0)]]),
        PackedWeight("w_qkv", True, per_layer(["q", "k", "v"])),
        PackedWeight("w_o", True, per_layer(["o"])),
        PackedWeight("w_gate_up", True, per_layer(["gate", "up"])),
        PackedWeight("w_down", True, per_layer(["down"])),
        PackedWeight("norms", True, per_layer(["input_norm", "post_norm"])),
        PackedWeight("final_norm", False, [[(final_norm.weight, 0)]]),
    ]
    if not tied:
        packs.append(PackedWeight("lm_head", False, [[(lm_head.weight, 0)]]))
    return packs


def _biased_stages(blocks: list[_Block]) -> list[str]:
    """GEMV stages in which some layer's projection has a bias."""
    return [stage for stage, roles in _BIAS_ROLES.items()
            if any(block.ops[role].bias is not None for block in blocks for role in roles)]


def _bias_buffers(dims: ModelDims, biased: list[str]) -> list[Buffer]:
    rows = {"norm_qkv": dims.qkv_rows, "o_residual": dims.hidden, "norm_gate_up": 2 * dims.intermediate,
            "down_residual": dims.hidden}
    return [Buffer(STAGE_BIAS[stage], "weight", "float32", [dims.layers, rows[stage]]) for stage in biased]


def _bias_packing(blocks: list[_Block], biased: list[str]) -> list[PackedWeight]:
    def part(lin):
        return (lin.bias, 0) if lin.bias is not None else ("", lin.out_features)

    return [PackedWeight(STAGE_BIAS[stage], True,
                         [[part(block.ops[role]) for role in _BIAS_ROLES[stage]] for block in blocks])
            for stage in biased]


def _check_attention_preload(dims: ModelDims, batch: int, ctas: int) -> None:
    if batch * dims.n_heads > ctas:
        raise PlanError(f"attention preload needs at most one (batch, head) tile per CTA: {batch} x {dims.n_heads} "
                        f"heads > {ctas} CTAs; bake without it or with a smaller batch")
    if dims.n_heads < 2:
        raise PlanError("attention preload keeps the new K/V row in the GEMV staging buffer, which needs n_heads >= 2")


def _has_head_norms(blocks: list[_Block]) -> bool:
    present = {"q_norm" in block.ops for block in blocks}
    if len(present) > 1:
        raise PlanError("only some layers have per-head q/k norms; layers must be identical")
    return present == {True}


def _head_norm_buffers(dims: ModelDims, head_norms: bool) -> list[Buffer]:
    return [Buffer(HEAD_NORMS, "weight", "float32", [dims.layers, 2, dims.head_dim])] if head_norms else []


def _head_norm_packing(blocks: list[_Block], head_norms: bool) -> list[PackedWeight]:
    if not head_norms:
        return []
    return [PackedWeight(HEAD_NORMS, True, [[(block.ops["q_norm"].weight, 0), (block.ops["k_norm"].weight, 0)]
                                            for block in blocks])]


SPLIT_KV_UNROLL = 4  # K and V rows in flight per lane group and iteration
SPLIT_KV_MIN_CHUNK = 128  # fewest positions per split: short contexts stay in one split (no merge)
ATTN_PART = "attn_part"  # split-KV partials [B, heads, splits, head_dim + 2]: accumulator, max, sum
ATTN_COUNT = "attn_count"  # split-KV arrival counters [B * kv_heads] (int32, reset by the last arrival)


def _attention_tiling(dims: ModelDims, batch: int, ctas: int, threads: int, split_kv: bool) -> Tiling:
    if not split_kv:
        return Tiling("heads", batch * dims.n_heads, 1, batch * dims.n_heads)
    groups = batch * dims.n_kv_heads
    splits = max(1, ctas // groups)
    stride = (threads // WARP) * (WARP // (dims.head_dim // 8))  # positions one CTA pass covers
    step = stride * SPLIT_KV_UNROLL
    min_chunk = -(-SPLIT_KV_MIN_CHUNK // step) * step
    return Tiling("kv_splits", groups, min_chunk, groups * splits, unroll=SPLIT_KV_UNROLL)


def kv_splits(plan_or_tiling) -> int:
    """Splits per (batch, KV head) of a split-KV attention tiling (0 when attention is not split)."""
    tiling = plan_or_tiling
    if isinstance(plan_or_tiling, Plan):
        tiling = next(s.tiling for s in plan_or_tiling.stages if s.kind == "attention")
    return tiling.tiles // tiling.units if tiling.kind == "kv_splits" else 0


def _split_kv_buffers(dims: ModelDims, batch: int, stages: list[Stage]) -> list[Buffer]:
    tiling = next(s.tiling for s in stages if s.kind == "attention")
    splits = kv_splits(tiling)
    if not splits:
        return []
    return [Buffer(ATTN_PART, "workspace", "float32", [batch, dims.n_heads, splits, dims.head_dim + 2]),
            Buffer(ATTN_COUNT, "sync", "int32", [batch * dims.n_kv_heads])]


def _stages(dims: ModelDims, batch: int, tuning: dict[str, GemvTuning], attention: Tiling) -> list[Stage]:
    H = dims.hidden
    lm = "embed"  # tied default; the runtime binds lm_head to the right buffer
    return [
        Stage(0, "embed", "prologue", "embed", ["tokens", "embed"], ["x"], Tiling("chunks", batch * H, 256, -(-batch * H // 256)),
              ["embed"]),
        Stage(1, "norm_qkv", "layer", "norm_gemv", ["x", "norms", "w_qkv"], ["qkv"], _rows_tiling(dims.qkv_rows, tuning["norm_qkv"]),
              _STAGE_ROLES["norm_qkv"]),
        Stage(2, "attention", "layer", "attention", ["qkv", "rope_cos", "rope_sin", "k_cache", "v_cache", "position"],
              ["attn", "k_cache", "v_cache"], attention, _STAGE_ROLES["attention"]),
        Stage(3, "o_residual", "layer", "gemv_residual", ["attn", "w_o", "x"], ["x"], _rows_tiling(H, tuning["o_residual"]),
              _STAGE_ROLES["o_residual"]),
        Stage(4, "norm_gate_up", "layer", "norm_gemv", ["x", "norms", "w_gate_up"], ["gate_up"],
              _rows_tiling(2 * dims.intermediate, tuning["norm_gate_up"]), _STAGE_ROLES["norm_gate_up"]),
        Stage(5, "down_residual", "layer", "act_gemv_residual", ["gate_up", "w_down", "x"], ["x"], _rows_tiling(H, tuning["down_residual"]),
              _STAGE_ROLES["down_residual"]),
        Stage(6, "norm_lm_head", "epilogue", "norm_gemv_out", ["x", "final_norm", lm], ["logits"],
              _rows_tiling(dims.vocab, tuning["norm_lm_head"]), ["final_norm", "lm_head"], barrier_after=False),
    ]


def smem_floats(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False) -> dict[str, int]:
    """Shared-memory scratch in fp32 elements: GEMV input vectors, reductions, attention scratch (unsplit: one
    head's scores over the whole capacity; split-KV: the group's queries and per-warp partials, no capacity)."""
    warps = threads // WARP
    group = dims.n_heads // dims.n_kv_heads
    att = (group * dims.head_dim + 8 * ((group + 8) // 8) + 8 + (dims.head_dim + 2) * group * warps if split_kv
           else dims.head_dim + capacity + warps * dims.head_dim)
    return {
        "vec_width": max(dims.hidden, dims.q_rows, dims.intermediate),
        "red": warps * max(batch, 1),
        "att": att,
    }


def _check_shared_memory(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False) -> None:
    """The kernel stages each GEMV input row (fp32) and the attention scores of one head in shared memory."""
    need = _smem_bytes(dims, batch, capacity, threads, split_kv)
    if need <= HOPPER_SMEM_PER_BLOCK:
        return
    floats = smem_floats(dims, batch, capacity, threads, split_kv)
    spare = HOPPER_SMEM_PER_BLOCK - (need - 4 * capacity) if not split_kv else 0
    max_capacity = max(0, spare // 4)
    max_batch = max(0, (HOPPER_SMEM_PER_BLOCK - (need - 4 * batch * floats["vec_width"])) // (4 * floats["vec_width"]))
    fixes = [f"--batch {max_batch} or less at this capacity"] if max_batch >= 1 else []
    fixes += [f"--capacity {max_capacity} or less at this batch"] if max_capacity >= 1 else []
    fix = (" or ".join(fixes) if fixes
           else "a smaller --batch and --capacity (neither alone is enough)")
    raise PlanError(f"bucket batch={batch}, capacity={capacity} needs {need} bytes of shared memory per CTA, over "
                    f"Hopper's {HOPPER_SMEM_PER_BLOCK}: the kernel stages each sequence's {floats['vec_width']}-wide "
                    f"fp32 GEMV input and one head's attention scores on chip. For this model use {fix}")


def _smem_bytes(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool = False) -> int:
    floats = smem_floats(dims, batch, capacity, threads, split_kv)
    return 4 * (batch * floats["vec_width"] + floats["red"] + floats["att"]) + 3 * 16
