"""Recognition: typed IR -> the decoder's parts (embedding, identical blocks, final norm, LM head) by dataflow.

Contract: ``recognise(ir)`` returns ``(embedding, blocks, final_norm, lm_head)``; each :class:`Block` maps the
roles of one decoder layer (input_norm, q, k, v, q_rope, k_rope, k_append, v_append, attention, o, attn_add,
post_norm, gate, up, act, down, mlp_add; optionally q_norm, k_norm (per head or over the whole projection),
post_attn_norm, post_ffn_norm; OLMo-2's post-norm layout has no input_norm / post_norm) to its IR ops, found
by following values from op to op (never by module names). ``model_dims(blocks, final_norm, lm_head)`` reads the model's
dimensions and checks that every block has the same shape. Anything else raises :class:`PlanError` naming the
layer and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..ir import Add, DecodeAttention, Embedding, GatedAct, IRGraph, KVAppend, Linear, RMSNorm, RoPE, Softcap
from .model import WARP, ModelDims
from .stages import ACTIVATIONS


@dataclass
class Block:
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
    if isinstance(op, Softcap):
        return [op.inp]
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


@dataclass
class Decoder:
    """The recognised decoder: embedding, identical blocks, final norm, LM head (and its soft-capping), and the
    layout of its blocks (``pre_norm``: Llama; ``sandwich``: norms before and after attention and MLP)."""

    embed: Embedding
    blocks: list[Block]
    final_norm: RMSNorm
    lm_head: Linear
    softcap: Softcap | None
    layout: str


def recognise_decoder(ir: IRGraph) -> Decoder:
    embed, blocks, final_norm, lm_head = recognise(ir)
    users = _consumers(ir)
    softcap = None
    if lm_head.out != ir.output:
        softcap = _only([u for u in users.get(lm_head.out, []) if isinstance(u, Softcap)], "soft-capping",
                        lm_head.hf_module)
        if softcap.out != ir.output:
            raise PlanError(f"the soft-capped LM head ({softcap.hf_module}) does not produce the step's output")
    layouts = {_layout_of(block) for block in blocks}
    if len(layouts) > 1:
        raise PlanError(f"the layers mix decoder layouts ({', '.join(sorted(layouts))}: norms before and/or after "
                        "attention and the MLP); layers must be identical")
    return Decoder(embed, blocks, final_norm, lm_head, softcap, layouts.pop())


def _layout_of(block: Block) -> str:
    """``pre_norm`` (Llama), ``sandwich`` (Gemma 2: norms before and after) or ``post_norm`` (OLMo-2: after only)."""
    if "post_attn_norm" not in block.ops:
        return "pre_norm"
    return "sandwich" if "input_norm" in block.ops else "post_norm"


def recognise(ir: IRGraph) -> tuple[Embedding, list[Block], RMSNorm, Linear]:
    users = _consumers(ir)
    producer = ir.producer()
    embed = _only(ir.of_kind(Embedding), "embedding", "the token ids")
    residual = embed.out
    blocks: list[Block] = []
    while True:
        direct = [u for u in users.get(residual, []) if isinstance(u, Linear)]
        if len(direct) == 3 and not any(isinstance(u, RMSNorm) for u in users.get(residual, [])):
            # OLMo-2: the q/k/v projections read the residual stream itself
            block = _recognise_block(len(blocks), residual, None, direct, users, producer)
            blocks.append(block)
            residual = block.ops["mlp_add"].out
            continue
        norm = _only([u for u in users.get(residual, []) if isinstance(u, RMSNorm)], "RMSNorm", residual)
        linears = [u for u in users.get(norm.out, []) if isinstance(u, Linear)]
        if len(linears) == 1:  # final norm -> LM head
            lm_head = linears[0]
            capped = [u for u in users.get(lm_head.out, []) if isinstance(u, Softcap)]
            if lm_head.out != ir.output and not (capped and capped[0].out == ir.output):
                raise PlanError(f"the last linear ({lm_head.hf_module}) does not produce the step's output")
            break
        block = _recognise_block(len(blocks), residual, norm, linears, users, producer)
        blocks.append(block)
        residual = block.ops["mlp_add"].out
    if not blocks:
        raise PlanError("no decoder layer found between the embedding and the LM head")
    return embed, blocks, norm, lm_head


def _recognise_block(index, residual, norm, linears, users, producer) -> Block:
    """One decoder layer from its q/k/v projections (of ``norm``'s output, or of the residual itself when
    ``norm`` is None: OLMo-2)."""
    ops: dict[str, object] = {"input_norm": norm} if norm is not None else {}
    source = norm.hf_module if norm is not None else f"the layer {index} input"
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
                        f"{len(linears)} projections of {source}); expected q/k/v projections with RoPE "
                        "on q and k and a static-cache attention")
    ops["attention"] = attn
    o_proj = _only([u for u in users.get(attn.out, []) if isinstance(u, Linear)], "o-projection", attn.hf_module)
    attn_out = _post_norm(o_proj, users, ops, "post_attn_norm")
    add1 = _only([u for u in users.get(attn_out, []) if isinstance(u, Add)], "residual add", o_proj.hf_module)
    if residual not in (add1.a, add1.b):
        raise PlanError(f"layer {index}: the attention residual add does not add the layer input")
    mlp_source, norm2 = add1.out, None
    if norm is not None or any(isinstance(u, RMSNorm) for u in users.get(add1.out, [])):
        norm2 = _only([u for u in users.get(add1.out, []) if isinstance(u, RMSNorm)], "post-attention RMSNorm",
                      add1.hf_module)
        mlp_source = norm2.out
    mlp_in = [u for u in users.get(mlp_source, []) if isinstance(u, Linear)]
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
    mlp_out = _post_norm(down, users, ops, "post_ffn_norm")
    if ("post_attn_norm" in ops) != ("post_ffn_norm" in ops):
        raise PlanError(f"layer {index}: a norm after only one of attention and the MLP is not supported (the "
                        "sandwich layout normalises both outputs before their residual adds)")
    add2 = _only([u for u in users.get(mlp_out, []) if isinstance(u, Add)], "MLP residual add", down.hf_module)
    if add1.out not in (add2.a, add2.b):
        raise PlanError(f"layer {index}: the MLP residual add does not add the attention residual")
    if (norm is None) != (norm2 is None):
        raise PlanError(f"layer {index}: a norm before only one of attention and the MLP is not supported")
    if norm is None and "post_attn_norm" not in ops:
        raise PlanError(f"layer {index}: no norm before or after attention and the MLP (an unnormalised residual "
                        "stream is not a layout the megakernel has)")
    ops.update(o=o_proj, attn_add=add1, gate=gate, up=up, act=act, down=down, mlp_add=add2)
    if norm2 is not None:
        ops["post_norm"] = norm2
    return Block(index, ops)


def _post_norm(projection: Linear, users: dict, ops: dict, role: str) -> str:
    """The value a projection adds to the residual: its output, or an RMSNorm of it (Gemma 2's post-attention
    and post-feed-forward norms, recorded as ``role``)."""
    norms = [u for u in users.get(projection.out, []) if isinstance(u, RMSNorm)]
    if len(norms) == 1 and len(users.get(projection.out, [])) == 1:
        ops[role] = norms[0]
        return norms[0].out
    return projection.out


POWER_OF_TWO_HEAD_DIMS = (32, 64, 128, 256)  # the unsplit attention: head_dim / 8 lanes must divide a warp
MAX_HEAD_DIM = 256  # split-KV attention: head_dim / 8 lanes (padded to a power of two) per cached row, <= a warp


def model_dims(embed: Embedding, blocks: list[Block], final_norm: RMSNorm, lm_head: Linear,
               softcap: Softcap | None = None) -> ModelDims:
    first = blocks[0].ops
    attn: DecodeAttention = first["attention"]
    norm: RMSNorm = first.get("input_norm") or first["post_attn_norm"]
    dims = ModelDims(
        hidden=first["q"].in_features, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
        head_dim=attn.head_dim, intermediate=first["gate"].out_features, vocab=lm_head.out_features,
        layers=len(blocks), eps=norm.eps, norm_offset=norm.weight_offset, attn_scale=attn.scale,
        act=first["act"].act, embed_scale=float(getattr(embed, "scale", 1.0)),
        final_softcap=float(softcap.cap) if softcap is not None else 0.0, rotary_dim=first["q_rope"].rotary_dim,
        whole_qk_norm="q_norm" in first and first["q_norm"].width not in (0, attn.head_dim),
    )
    for block in blocks:
        _check_block_shape(block, dims)
    if final_norm.eps != dims.eps or final_norm.weight_offset != dims.norm_offset:
        raise PlanError("the final norm differs from the layer norms (eps or weight offset)")
    return dims


def _check_block_shape(block: Block, dims: ModelDims) -> None:
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
    for role in ("q_norm", "k_norm", "post_norm", "post_attn_norm", "post_ffn_norm"):
        norm = ops.get(role)
        if norm is not None and (norm.eps != dims.eps or norm.weight_offset != dims.norm_offset):
            raise PlanError(f"{norm.hf_module}: a norm whose eps or weight offset differs from the input norm "
                            "is not supported")
    if "q_norm" in ops:
        widths = (dims.q_rows, dims.kv_rows) if dims.whole_qk_norm else (dims.head_dim, dims.head_dim)
        if (ops["q_norm"].width, ops["k_norm"].width) not in ((0, 0), widths):
            raise PlanError(f"layer {block.index}: q/k norms over {ops['q_norm'].width} and {ops['k_norm'].width} "
                            f"features; supported: per head ({dims.head_dim}) or over the whole projection "
                            f"({dims.q_rows} and {dims.kv_rows}), the same in every layer")
    for role in ("q_rope", "k_rope"):
        if ops[role].rotary_dim != dims.rotary_dim:
            raise PlanError(f"layer {block.index} {role} rotates {ops[role].rotary_dim or dims.head_dim} features of "
                            f"a head, layer 0 {dims.rotated}: layers must be identical")
    head_dim = ops["attention"].head_dim
    if head_dim % 8 or not 32 <= head_dim <= MAX_HEAD_DIM:
        raise PlanError(f"head_dim {head_dim} ({ops['attention'].hf_module}) is not supported: decode attention "
                        f"reads each cached row with head_dim / 8 lanes (16-byte loads) of one warp; supported: "
                        f"multiples of 8 from 32 to {MAX_HEAD_DIM}")
    if "q_norm" in ops and head_dim % 32:
        raise PlanError(f"head_dim {head_dim} with per-head q/k norms ({ops['q_norm'].hf_module}) is not supported: "
                        "one warp reduces a head in steps of 32; supported: multiples of 32")
    if block.ops["act"].act != dims.act:
        raise PlanError(f"layer {block.index} uses activation {block.ops['act'].act!r}, layer 0 {dims.act!r}: "
                        "layers must be identical")
    if dims.act not in ACTIVATIONS:
        raise PlanError(f"activation {dims.act!r} of the gated MLP ({block.ops['act'].hf_module}) is not supported; "
                        f"supported: {', '.join(ACTIVATIONS)}")
