"""IR: an exported ATen decode step -> a list of typed semantic ops, each carrying its FX origin.

Contract: ``lower(captured, strict=True)`` returns an :class:`IRGraph` of ops (Embedding, RMSNorm,
Linear, RoPE, KVAppend, DecodeAttention, GatedAct, Add) in program order. Ops are recognised by what the
ATen nodes compute (``x * rsqrt(mean(x^2) + eps) * w`` is an RMSNorm whatever its module is called), never
by module names. View/layout/dtype nodes are transparent; nodes that only compute positions or the causal
mask are folded into the ops that consume them. In strict mode any other node raises
:class:`UnsupportedGraphError` naming the FX node, its target, the HF module path and the source line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture import CapturedStep, hf_module_path, source_line
from ..errors import UnsupportedGraphError

aten = torch.ops.aten

# ----------------------------------------------------------------------------------------------- ops


@dataclass
class Op:
    """Base of all IR ops. ``out`` names the produced value; ``fx_nodes`` the ATen nodes it covers."""

    id: str
    out: str
    fx_nodes: list[str] = field(default_factory=list)
    hf_module: str = ""
    source: str = ""

    @property
    def kind(self) -> str:
        return type(self).__name__


@dataclass
class Embedding(Op):
    table: str = ""  # HF parameter fqn
    ids: str = "input_ids"


@dataclass
class RMSNorm(Op):
    inp: str = ""
    weight: str = ""
    eps: float = 1e-6
    weight_offset: float = 0.0  # Gemma-style (1 + w) -> 1.0


@dataclass
class Linear(Op):
    inp: str = ""
    weight: str = ""
    bias: str | None = None
    out_features: int = 0
    in_features: int = 0


@dataclass
class RoPE(Op):
    inp: str = ""
    head_dim: int = 0
    table: str = ""  # id of the RotaryTable op that provides cos/sin


@dataclass
class RotaryTable(Op):
    """cos/sin as a function of position only; evaluated for every cache slot at bind time."""

    submodule: str = ""
    inv_freq: str = ""  # buffer placeholder
    head_dim: int = 0


@dataclass
class KVAppend(Op):
    layer: int = 0
    which: str = "k"  # k | v
    cache: str = ""  # cache placeholder
    value: str = ""


@dataclass
class DecodeAttention(Op):
    layer: int = 0
    q: str = ""
    k_append: str = ""  # id of the KVAppend op of keys
    v_append: str = ""
    scale: float = 1.0
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0


@dataclass
class GatedAct(Op):
    gate: str = ""
    up: str = ""
    act: str = "silu"


@dataclass
class Add(Op):
    a: str = ""
    b: str = ""


@dataclass
class IRGraph:
    """Typed ops in program order plus the graph's interface."""

    ops: list[Op]
    output: str
    hidden_size: int
    vocab_size: int
    batch: int
    capacity: int
    dtype: str

    def by_id(self) -> dict[str, Op]:
        return {op.id: op for op in self.ops}

    def producer(self) -> dict[str, Op]:
        return {op.out: op for op in self.ops}

    def of_kind(self, kind) -> list[Op]:
        return [op for op in self.ops if isinstance(op, kind)]

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[op.kind] = counts.get(op.kind, 0) + 1
        return counts


# ----------------------------------------------------------------------------------- value classes
# While walking the graph every FX node is classified. Plain activations map to IR value names; the
# intermediate steps of a multi-node pattern carry a partial record until the pattern completes.


@dataclass(frozen=True)
class Act:
    name: str  # IR value


@dataclass(frozen=True)
class Param:
    fqn: str


@dataclass(frozen=True)
class Position:
    """Anything computed from the cache position / token index only (positions, causal masks)."""


@dataclass(frozen=True)
class Cache:
    placeholder: str
    layer: int
    which: str
    append_op: str | None = None


@dataclass(frozen=True)
class Rotary:
    table: str  # RotaryTable op id
    part: str | None = None  # None (tuple), "cos", "sin"


@dataclass(frozen=True)
class Partial:
    """An unfinished pattern: kind + operands."""

    kind: str
    args: tuple


_LAYOUT_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.alias.default,
    aten.clone.default, aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
    aten.to.device, aten.permute.default,
}
_POSITION_OPS = {
    aten.select.int, aten.copy_.default, aten.arange.default, aten.arange.start, aten.add.Tensor,
    aten.add_.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor, aten.sub.Tensor,
    aten.unsqueeze.default, aten.expand.default, aten.to.dtype_layout, aten.to.dtype, aten.view.default,
    aten.reshape.default, aten.slice.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default,
    aten.index.Tensor, aten.full.default, aten.where.self, aten.scalar_tensor.default,
}


class _Lowering:
    def __init__(self, captured: CapturedStep, strict: bool):
        self.captured = captured
        self.strict = strict
        self.env: dict[str, Any] = {}
        self.ops: list[Op] = []
        self.counter = 0
        self.output = ""

    # -- helpers --------------------------------------------------------------------------------
    def fail(self, node, why: str):
        raise UnsupportedGraphError(
            f"unsupported graph node {node.name!r} (target {getattr(node.target, '__name__', node.target)}) "
            f"in HF module {hf_module_path(node) or '<root>'!r} at {source_line(node) or 'unknown source'}: "
            f"{why}. MegaBake's megakernel supports Llama-family decoders (RMSNorm, Linear, RoPE, static-cache "
            "SDPA, SiLU-gated MLP); this model cannot be baked yet: run it with torch.compile(model, "
            "backend=megabake.make_backend()) (unsupported graphs go through Inductor), or open an issue naming "
            "this node."
        )

    def emit(self, cls, node, covered: list[str], **fields) -> Op:
        self.counter += 1
        op = cls(id=f"{cls.__name__.lower()}_{self.counter}", out=node.name, fx_nodes=covered,
                 hf_module=hf_module_path(node), source=source_line(node), **fields)
        self.ops.append(op)
        return op

    def val(self, arg):
        if hasattr(arg, "name") and hasattr(arg, "op"):
            return self.env.get(arg.name)
        return arg  # python constant

    @staticmethod
    def shape(node) -> tuple[int, ...]:
        value = node.meta.get("val")
        return tuple(value.shape) if isinstance(value, torch.Tensor) else ()

    # -- walk -----------------------------------------------------------------------------------
    def run(self) -> IRGraph:
        for node in self.captured.graph.nodes:
            if node.op == "placeholder":
                self.env[node.name] = self.placeholder(node)
            elif node.op == "get_attr":
                self.env[node.name] = Partial("submodule", (node.target,))
            elif node.op == "call_function":
                self.env[node.name] = self.call(node)
            elif node.op == "output":
                result = self.val(node.args[0][0])
                if not isinstance(result, Act):
                    self.fail(node, "the step's output is not an activation (expected logits)")
                self.output = result.name
        return self.graph()

    def placeholder(self, node):
        cap = self.captured
        if node.name in cap.parameters:
            return Param(cap.parameters[node.name])
        if node.name in cap.cache_buffers:
            layer, which = cap.cache_buffers[node.name]
            return Cache(node.name, layer, which)
        if node.name in cap.other_buffers:
            target = cap.other_buffers[node.name]
            return Param(target) if target.endswith("inv_freq") else Position()
        if node.name == "input_ids":
            return Partial("token_ids", ())
        return Position()  # cache_position and other user inputs are positions

    def call(self, node):
        target = node.target
        args = [self.val(a) for a in node.args]
        if target is aten._assert_tensor_metadata.default:
            return None
        name = getattr(target, "__name__", str(target))
        if name == "wrap_with_set_grad_enabled":
            return self.rotary(node, args)
        if name == "getitem":
            return self.getitem(node, args)
        if target is aten.embedding.default:
            return self.embedding(node, args)
        if target is aten.linear.default:
            return self.linear(node, args)
        if target is aten.index_copy_.default:
            return self.kv_append(node, args)
        if target is aten.scaled_dot_product_attention.default:
            return self.attention(node, args)
        tensor_args = [a for a in args if a is not None and not isinstance(a, (int, float, bool, list, tuple))]
        if all(isinstance(a, Position) for a in tensor_args) and target in _POSITION_OPS:
            return Position()
        if target in _LAYOUT_OPS and tensor_args:
            return self.layout(node, args[0])
        handler = _ELEMENTWISE.get(target)
        if handler is not None:
            result = handler(self, node, args)
            if result is not None:
                return result
        if not self.strict:
            return Partial("opaque", (node.name,))
        self.fail(node, f"no IR op computes {name} with operands {', '.join(_describe(a) for a in args)}")

    def layout(self, node, source):
        if isinstance(source, (Act, Cache, Position, Rotary, Param)):
            return source
        if isinstance(source, Partial) and source.kind in ("normed", "token_ids", "rmsnorm_done", "rope_done"):
            return source
        self.fail(node, f"layout change of {_describe(source)}")

    # -- pattern pieces -------------------------------------------------------------------------
    def rotary(self, node, args):
        _, submod, inv_freq, positions = args
        if not (isinstance(submod, Partial) and isinstance(inv_freq, Param) and isinstance(positions, Position)):
            self.fail(node, "a grad-mode region that is not a function of positions only")
        values = node.meta.get("val")
        dim = int(values[0].shape[-1]) if isinstance(values, (tuple, list)) else 0
        placeholder = node.args[2].name
        op = self.emit(RotaryTable, node, [node.name], submodule=submod.args[0], inv_freq=placeholder, head_dim=dim)
        return Rotary(op.id)

    def getitem(self, node, args):
        source, index = args
        if isinstance(source, Rotary) and index in (0, 1):
            return Rotary(source.table, "cos" if index == 0 else "sin")
        self.fail(node, f"item {index} of {_describe(source)}")

    def embedding(self, node, args):
        table, ids = args[0], args[1]
        if not (isinstance(table, Param) and isinstance(ids, Partial) and ids.kind == "token_ids"):
            self.fail(node, "embedding that is not a parameter table indexed by the input token ids")
        self.emit(Embedding, node, [node.name], table=table.fqn, ids="input_ids")
        return Act(node.name)

    def linear(self, node, args):
        inp, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        if isinstance(inp, Partial) and inp.kind == "rmsnorm_done":
            inp = Act(inp.args[0])
        if not (isinstance(inp, Act) and isinstance(weight, Param)):
            self.fail(node, f"linear of {_describe(inp)} by {_describe(weight)} (need activation x parameter)")
        if bias is not None and not isinstance(bias, Param):
            self.fail(node, "linear bias that is not a parameter")
        out_f, in_f = self.captured.model.get_parameter(weight.fqn).shape
        self.emit(Linear, node, [node.name], inp=inp.name, weight=weight.fqn,
                  bias=bias.fqn if bias is not None else None, out_features=int(out_f), in_features=int(in_f))
        return Act(node.name)

    def kv_append(self, node, args):
        cache, dim, index, value = args
        if isinstance(value, Partial) and value.kind == "rope_done":
            value = Act(value.args[0])
        if not (isinstance(cache, Cache) and isinstance(index, Position) and isinstance(value, Act) and dim == 2):
            self.fail(node, "index_copy_ that is not a KV-cache append at the cache position along dim 2")
        op = self.emit(KVAppend, node, [node.name], layer=cache.layer, which=cache.which,
                       cache=cache.placeholder, value=value.name)
        return Cache(cache.placeholder, cache.layer, cache.which, op.id)

    def attention(self, node, args):
        q, k, v = args[0], args[1], args[2]
        mask = args[3] if len(args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(q, Partial) and q.kind == "rope_done":
            q = Act(q.args[0])
        ok = (isinstance(q, Act) and isinstance(k, Cache) and isinstance(v, Cache) and k.which == "k"
              and v.which == "v" and k.layer == v.layer and k.append_op and v.append_op
              and (mask is None or isinstance(mask, Position)))
        if not ok or node.kwargs.get("is_causal") or (len(args) > 5 and args[5]):
            self.fail(node, "attention that is not over this layer's freshly appended static KV cache")
        q_shape = self.shape(node.args[0])
        n_heads, head_dim = int(q_shape[1]), int(q_shape[-1])
        kv_heads = int(self.captured.model.config.num_key_value_heads)
        scale = node.kwargs.get("scale")
        scale = float(scale) if scale is not None else head_dim ** -0.5
        self.emit(DecodeAttention, node, [node.name], layer=k.layer, q=q.name, k_append=k.append_op,
                  v_append=v.append_op, scale=scale, n_heads=n_heads, n_kv_heads=kv_heads, head_dim=head_dim)
        return Act(node.name)

    def graph(self) -> IRGraph:
        config = self.captured.config
        dtype = str(next(self.captured.model.parameters()).dtype).replace("torch.", "")
        return IRGraph(ops=self.ops, output=self.output, hidden_size=int(config.hidden_size),
                       vocab_size=int(config.vocab_size), batch=self.captured.batch,
                       capacity=self.captured.capacity, dtype=dtype)


def _describe(value) -> str:
    if isinstance(value, Act):
        return f"activation {value.name}"
    if isinstance(value, Param):
        return f"parameter {value.fqn}"
    if isinstance(value, Cache):
        return f"KV cache {value.which}[{value.layer}]"
    if isinstance(value, Partial):
        return f"partial {value.kind}"
    if isinstance(value, Position):
        return "position"
    if isinstance(value, Rotary):
        return f"rotary {value.part}"
    return repr(value)


def _scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ---------------------------------------------------------------------- elementwise pattern rules
# Each returns a classification, or None to fall through to the strict-mode error.


def _pow(lw: _Lowering, node, args):
    x, exponent = args
    if isinstance(x, Act) and exponent == 2:
        return Partial("square", (x.name, [node.name]))
    return None


def _mean(lw: _Lowering, node, args):
    x, dims = args[0], args[1]
    keep = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
    rank = len(lw.shape(node))
    if isinstance(x, Partial) and x.kind == "square" and list(dims) in ([-1], [rank - 1]) and keep:
        return Partial("mean_square", (x.args[0], x.args[1] + [node.name]))
    return None


def _add(lw: _Lowering, node, args):
    a, b = args[0], args[1]
    if isinstance(a, Partial) and a.kind == "mean_square" and _scalar(b):
        return Partial("mean_square_eps", (a.args[0], a.args[1] + [node.name], float(b)))
    if (isinstance(a, Param) and b == 1) or (isinstance(b, Param) and a == 1):
        return Partial("param_plus_one", ((a if isinstance(a, Param) else b).fqn, node.name))
    if isinstance(a, Partial) and isinstance(b, Partial) and {a.kind, b.kind} == {"rope_cos", "rope_sin"}:
        cos, sin = (a, b) if a.kind == "rope_cos" else (b, a)
        if cos.args[0] == sin.args[0] and cos.args[1] == sin.args[1]:
            x, table = cos.args[0], cos.args[1]
            covered = list(cos.args[2]) + list(sin.args[2]) + [node.name]
            head_dim = lw.shape(node)[-1]
            lw.emit(RoPE, node, covered, inp=x, head_dim=int(head_dim), table=table)
            return Partial("rope_done", (node.name,))
        return None
    a = _finish(a)
    b = _finish(b)
    if isinstance(a, Act) and isinstance(b, Act) and lw.shape(node) == lw.shape(node.args[0]) == lw.shape(node.args[1]):
        lw.emit(Add, node, [node.name], a=a.name, b=b.name)
        return Act(node.name)
    return None


def _finish(value):
    """A completed pattern used as a plain activation."""
    if isinstance(value, Partial) and value.kind in ("rope_done", "rmsnorm_done"):
        return Act(value.args[0])
    return value


def _rsqrt(lw: _Lowering, node, args):
    (x,) = args
    if isinstance(x, Partial) and x.kind == "mean_square_eps":
        return Partial("inv_rms", (x.args[0], x.args[1] + [node.name], x.args[2]))
    return None


def _neg(lw: _Lowering, node, args):
    (x,) = args
    if isinstance(x, Partial) and x.kind == "half" and x.args[1] == "hi":
        return Partial("neg_hi", (x.args[0], x.args[2] + [node.name]))
    return None


def _slice(lw: _Lowering, node, args):
    x = _finish(args[0])  # Qwen3 slices the per-head RMSNorm output for rotate-half
    dim, start, end = (list(args[1:]) + [0, 0, None])[:3]
    if isinstance(x, Act):
        size = lw.shape(node.args[0])[-1] if lw.shape(node.args[0]) else 0
        if dim in (-1, len(lw.shape(node.args[0])) - 1) and size % 2 == 0:
            if start == 0 and end == size // 2:
                return Partial("half", (x.name, "lo", [node.name]))
            if start == size // 2 and (end is None or end >= size):
                return Partial("half", (x.name, "hi", [node.name]))
    return None


def _cat(lw: _Lowering, node, args):
    dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
    if dim not in (-1, len(lw.shape(node)) - 1):  # rotate-half concatenates along the head dimension only
        return None
    parts = [lw.val(p) if hasattr(p, "name") else p for p in node.args[0]]
    if len(parts) == 2 and isinstance(parts[0], Partial) and isinstance(parts[1], Partial):
        neg, lo = parts
        if neg.kind == "neg_hi" and lo.kind == "half" and lo.args[1] == "lo" and neg.args[0] == lo.args[0]:
            return Partial("rotate_half", (neg.args[0], neg.args[1] + lo.args[2] + [node.name]))
    return None


def _mul(lw: _Lowering, node, args):
    a, b = args[0], args[1]
    for x, y in ((a, b), (b, a)):
        if isinstance(x, Act) and isinstance(y, Partial) and y.kind == "inv_rms" and y.args[0] == x.name:
            return Partial("normed", (x.name, y.args[1] + [node.name], y.args[2]))
        if isinstance(x, Partial) and x.kind == "normed" and isinstance(y, (Param, Partial)):
            weight, offset, extra = None, 0.0, []
            if isinstance(y, Param):
                weight = y.fqn
            elif y.kind == "param_plus_one":
                weight, offset, extra = y.args[0], 1.0, [y.args[1]]
            if weight is not None:
                source, covered, eps = x.args
                lw.emit(RMSNorm, node, covered + extra + [node.name], inp=source, weight=weight, eps=eps,
                        weight_offset=offset)
                return Partial("rmsnorm_done", (node.name,))
        if isinstance(_finish(x), Act) and isinstance(y, Rotary) and y.part == "cos":
            return Partial("rope_cos", (_finish(x).name, y.table, [node.name]))
        if isinstance(x, Partial) and x.kind == "rotate_half" and isinstance(y, Rotary) and y.part == "sin":
            return Partial("rope_sin", (x.args[0], y.table, x.args[1] + [node.name]))
        if isinstance(x, Partial) and x.kind == "activated" and isinstance(_finish(y), Act):
            lw.emit(GatedAct, node, [x.args[2], node.name], gate=x.args[0], up=_finish(y).name, act=x.args[1])
            return Act(node.name)
    return None


def _activation(kind: str):
    def rule(lw: _Lowering, node, args):
        x = _finish(args[0])
        if isinstance(x, Act):
            return Partial("activated", (x.name, kind, node.name))
        return None

    return rule


_ELEMENTWISE = {
    aten.pow.Tensor_Scalar: _pow,
    aten.mean.dim: _mean,
    aten.add.Tensor: _add,
    aten.rsqrt.default: _rsqrt,
    aten.mul.Tensor: _mul,
    aten.neg.default: _neg,
    aten.slice.Tensor: _slice,
    aten.cat.default: _cat,
    aten.silu.default: _activation("silu"),
}


def lower(captured: CapturedStep, *, strict: bool = True) -> IRGraph:
    """Lower the exported step into typed IR ops (see module docstring)."""
    return _Lowering(captured, strict).run()
