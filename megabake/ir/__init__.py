"""IR: an exported ATen decode step -> a list of typed semantic ops, each carrying its FX origin.

Contract: ``lower(captured, strict=True)`` returns an :class:`IRGraph` of ops (Embedding, RMSNorm,
Linear, RoPE, KVAppend, DecodeAttention, GatedAct, Add) in program order. Ops are recognised by what the
ATen nodes compute (``x * rsqrt(mean(x^2) + eps) * w`` is an RMSNorm whatever its module is called), never
by module names. View/layout/dtype nodes are transparent; nodes that only compute positions or the causal
mask are folded into the ops that consume them. In strict mode any other node raises
:class:`UnsupportedGraphError` naming the feature in words where one is recognisable (sliding-window attention,
logit soft-capping, partial rotary embedding, LayerNorm, eager attention, ...), then
the FX node, its target, the HF module path and the source line.

Fields beyond the Llama basics (all defaulted, so a Llama-family IR is unchanged by them):

* ``Embedding.scale`` (1.0 unless scaled): ``embedding(ids) * c`` where ``c`` is a scalar constant (a lifted
  tensor constant, a floating buffer such as Gemma's ``embed_scale``, or a Python number) is one Embedding op
  with ``scale = c``; the mul joins its ``fx_nodes`` and its ``out`` is the mul's output. ``c`` is the exact
  value the model multiplies by, read from the captured constant after the graph's own casts (a bf16 model
  multiplies by the bf16-rounded sqrt(hidden)). A non-scalar or non-constant factor is refused.
* ``RotaryTable.slot`` / ``region_inputs``: a rotary region computing several tables from several inv_freq buffers
  (Gemma 3: one per layer type) gives one RotaryTable per buffer; each RoPE op names the table it uses.
* ``DecodeAttention.window``: see the masks below.
* ``Softcap``: ``cap * tanh(x / cap)`` (div, tanh, mul by the same scalar; Gemma 2's final logit soft-capping).
* ``GatedAct.act``: ``"silu"`` (aten.silu), ``"gelu_tanh"`` (aten.gelu, approximate='tanh') or ``"gelu"``
  (aten.gelu, approximate='none'), each as ``act(gate) * up``.
* ``Linear.weight_rows`` (None = the whole weight): a fused projection (Phi-3's ``qkv_proj`` sliced into q/k/v,
  its ``gate_up_proj`` chunked into gate/up) becomes one Linear op per slice over the rows ``[start, stop)`` of
  the same weight (and of the bias, when there is one); ``out_features = stop - start``. Only a step-1 slice,
  ``split``/``split_with_sizes``/``chunk`` + getitem, or ``narrow`` of a Linear's output along its feature
  (last) dimension is lowered so. Such an op's ``fx_nodes`` are the fused linear node and the slice node(s);
  its ``hf_module`` is the fused projection's module. The fused Linear itself is dropped from ``ops`` when every
  use of its output is such a slice (downstream sees separate q/k/v, gate/up projections); it is kept when its
  whole output is also used directly.
* ``Linear.scale`` (1.0 unless scaled): ``linear(x) * c`` or ``linear(x) / c`` where ``c`` is a scalar constant (a
  Python number or a one-element constant) is one Linear op with ``scale = c`` (``1 / c``); the mul/div joins its
  ``fx_nodes`` and its ``out`` is the mul/div's output (Granite's ``residual_multiplier`` on the o and down
  outputs, its logits ``/ logits_scaling``). A division whose result feeds a tanh is a soft-capping's, not a
  scale. The unscaled output must have no other use; a scaled fused projection's row-range Linears keep its scale.

Inference no-ops lower to nothing (the value passes through unchanged): layout and dtype changes (view,
reshape, transpose, permute, expand, to/_to_copy, type_as, clone, contiguous, alias, detach, lift_fresh_copy),
a full-range slice, a zero-width slice concatenated onto a value (Phi-3's ``q_pass`` when the rotary covers the
whole head), and dropout in eval mode (``train=False`` or ``p=0``; dropout with ``train=True, p>0`` is
refused). Masks built from positions only are folded. A sliding-window mask (transformers' ``sliding_window``
mask builders: key ``k`` is visible from query ``q`` when ``q - window < k <= q``) is folded into the
attention that reads it: ``DecodeAttention.window`` is the window when it is smaller than the KV capacity, else 0
(the mask then equals the causal one). Only the nodes that depend on the window constant carry it (a
:class:`WindowMask` value); a model mixing sliding and full layers (Gemma 2) gets a window on its sliding ones.
"""

from __future__ import annotations

import re
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
    scale: float = 1.0  # embedding(ids) * scale (Gemma's sqrt(hidden) normalizer), exact as the model multiplies


@dataclass
class RMSNorm(Op):
    inp: str = ""
    weight: str = ""
    eps: float = 1e-6
    weight_offset: float = 0.0  # Gemma-style (1 + w) -> 1.0
    width: int = 0  # features normalised together (a head's for Qwen3's q/k norms, the projection's for OLMo-2's)


@dataclass
class Linear(Op):
    inp: str = ""
    weight: str = ""
    bias: str | None = None
    out_features: int = 0
    in_features: int = 0
    weight_rows: tuple[int, int] | None = None  # None: the whole weight; (start, stop): those rows (and bias)
    scale: float = 1.0  # the output times this scalar (weight and bias alike; Granite's residual_multiplier)


@dataclass
class RoPE(Op):
    inp: str = ""
    head_dim: int = 0
    table: str = ""  # id of the RotaryTable op that provides cos/sin
    rotary_dim: int = 0  # partial rotary (Phi-4-mini): the first rotary_dim features rotate, the rest pass; 0 = all


@dataclass
class RotaryTable(Op):
    """cos/sin as a function of position only; evaluated for every cache slot at bind time."""

    submodule: str = ""
    inv_freq: str = ""  # buffer placeholder
    head_dim: int = 0
    slot: int = 0  # outputs (2 * slot, 2 * slot + 1) of its region are this table's cos and sin
    region_inputs: list[str] = field(default_factory=list)  # the region's operands: placeholders, "" = positions


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
    window: int = 0  # sliding window: keys (position - window, position] are visible; 0 = every cached key


@dataclass
class GatedAct(Op):
    gate: str = ""
    up: str = ""
    act: str = "silu"


@dataclass
class Softcap(Op):
    """``cap * tanh(x / cap)`` (Gemma 2's final logit soft-capping)."""

    inp: str = ""
    cap: float = 0.0


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
class RotaryRegion:
    """A rotary region computing several tables (Gemma 3: one per layer type): item k is table k // 2's cos
    (k even) or sin (k odd)."""

    tables: tuple[str, ...]  # RotaryTable op ids, in output order


@dataclass(frozen=True)
class WindowMask:
    """A causal mask limited to the last ``window`` positions (computed from positions and the window only)."""

    window: int


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


@dataclass(frozen=True, eq=False)
class Const:
    """A constant tensor (a lifted constant or a floating buffer other than inv_freq), after its casts."""

    value: torch.Tensor
    origin: str  # placeholder it came from


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
    # identity casts / aliases: inference no-ops
    aten.detach.default, aten.detach_.default, aten.lift_fresh_copy.default, aten.type_as.default,
    aten.alias_copy.default, aten.view_as.default, aten.reshape_as.default,
}
_DROPOUT_OPS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
                aten.feature_alpha_dropout.default}
_MASK_OPS = {aten.new_ones.default, aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
# Pure ops evaluated on constants (a buffer cast to the hidden dtype, sqrt of a constant, ...)
_CONST_FOLD_OPS = _LAYOUT_OPS | {
    aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.pow.Tensor_Scalar,
    aten.sqrt.default, aten.rsqrt.default, aten.neg.default, aten.reciprocal.default,
}
_SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unsafe_split.Tensor}
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_POSITION_OPS = {
    aten.select.int, aten.copy_.default, aten.arange.default, aten.arange.start, aten.add.Tensor,
    aten.add_.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor, aten.sub.Tensor,
    aten.unsqueeze.default, aten.expand.default, aten.to.dtype_layout, aten.to.dtype, aten.view.default,
    aten.reshape.default, aten.slice.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default,
    aten.index.Tensor, aten.full.default, aten.where.self, aten.scalar_tensor.default,
    # a mask made additive (eager attention) is still a function of positions only
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
}


class _Lowering:
    def __init__(self, captured: CapturedStep, strict: bool):
        self.captured = captured
        self.strict = strict
        self.env: dict[str, Any] = {}
        self.ops: list[Op] = []
        self.counter = 0
        self.output = ""
        self.nodes = {node.name: node for node in captured.graph.nodes}
        self.embeddings: dict[str, Embedding] = {}  # value name -> the Embedding op producing it
        self.linears: dict[str, Linear] = {}  # value name -> the Linear op producing it
        self.fused: dict[str, Linear] = {}  # id -> a Linear whose output was sliced into row-range Linears
        self.sliced: set[str] = set()  # FX nodes lowered into row-range Linears (slice / split / narrow)
        self.rotary_parts: dict[str, tuple[str, int]] = {}  # partial rotary: x[..., :rotary_dim] -> (x, rotary_dim)

    # -- helpers --------------------------------------------------------------------------------
    def fail(self, node, why: str):
        feature = self.feature(node)
        if feature and feature not in why:
            why = f"{feature}: {why}"
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

    def consumers(self, name: str) -> set[str]:
        """The FX nodes that use value ``name``, looking through transparent (layout/no-op) nodes."""
        through = self.transparent_to(name)
        return {user.name for n in through for user in self.nodes[n].users
                if user.name not in through and user.target is not aten._assert_tensor_metadata.default}

    def transparent_to(self, name: str) -> set[str]:
        """``name`` and the layout/no-op nodes that pass it through unchanged."""
        names, stack = {name}, [self.nodes[name]]
        while stack:
            for user in stack.pop().users:
                if user.op == "call_function" and (user.target in _LAYOUT_OPS or user.target in _DROPOUT_OPS) \
                        and user.args and getattr(user.args[0], "name", None) in names and user.name not in names:
                    names.add(user.name)
                    stack.append(user)
        return names

    def sliding_window(self) -> int | None:
        window = getattr(self.captured.config, "sliding_window", None)
        return int(window) if isinstance(window, int) and not isinstance(window, bool) else None

    def feature(self, node) -> str | None:
        """The model feature a failing node belongs to, in words, when one is recognisable."""
        funcs = [func for _, _, func in _frames(node)]
        config = self.captured.config
        capacity = self.captured.capacity
        if _in_mask(node, "sliding_window"):
            window = self.sliding_window()
            if window is None:
                return "sliding-window attention (the window size is not in the model config)"
            if window < capacity:
                return (f"sliding-window attention (sliding_window={window} is smaller than the KV capacity "
                        f"{capacity})")
            return f"sliding-window attention (sliding_window={window})"
        if _in_mask(node, "chunked"):
            size = getattr(config, "attention_chunk_size", None)
            return "chunked attention" + (f" (attention_chunk_size={size})" if size else "")
        softcap = self.softcapping(node)
        if softcap:
            return softcap
        target = node.target
        if getattr(target, "__name__", "") == "wrap_with_set_grad_enabled":
            tables = [self.env.get(a.name) for a in node.args if hasattr(a, "op")]
            tables = [t.fqn for t in tables if isinstance(t, Param)]
            if len(tables) > 1:
                return (f"per-layer-type rotary embeddings ({len(tables)} inv_freq tables in one rotary region: "
                        f"{', '.join(tables)}; one RoPE table per model is supported)")
        if target in (aten.native_layer_norm.default, aten.layer_norm.default):
            return "LayerNorm (mean-centred normalisation with a bias; only RMSNorm is supported)"
        rotary = self.partial_rotary()
        if rotary and any("rotary" in func or "rotate_half" in func for func in funcs):
            return rotary
        if target in _DROPOUT_OPS:
            return "dropout in training mode"
        if target is aten.linear.default and node.args:
            source = self.env.get(getattr(node.args[0], "name", ""))
            if isinstance(source, Partial) and source.kind == "activated":
                return ("an ungated MLP activation (act(x) feeds the down projection directly; only gated "
                        "act(gate) * up MLPs are supported)")
        if target in (aten.bmm.default, aten.matmul.default, aten._softmax.default, aten.softmax.int) and \
                any("attention" in func for func in funcs):
            cap = getattr(config, "attn_logit_softcapping", None)
            return ("eager attention (matmul + softmax instead of scaled_dot_product_attention"
                    + (f", with attention logit soft-capping attn_logit_softcapping={cap}" if cap else "")
                    + "; load the model with attn_implementation='sdpa')")
        return None

    def softcapping(self, node) -> str | None:
        """``cap * tanh(x / cap)`` (Gemma2's attention and final logit soft-capping), seen from any of its nodes."""
        def is_tanh(n):
            return getattr(n, "target", None) is aten.tanh.default

        near = [node] + [a for a in node.args if hasattr(a, "op")] + list(node.users)
        if not any(is_tanh(n) for n in near):
            return None
        tanh = next(n for n in near if is_tanh(n))
        scaled_in = any(getattr(a, "target", None) in (aten.div.Tensor, aten.mul.Tensor) for a in tanh.args)
        scaled_out = any(u.target is aten.mul.Tensor and any(_scalar(a) for a in u.args) for u in tanh.users)
        if not (scaled_in and scaled_out):
            return None
        config = self.captured.config
        if _feeds_output(tanh):
            cap = getattr(config, "final_logit_softcapping", None)
            return "final logit soft-capping" + (f" (final_logit_softcapping={cap})" if cap else "")
        funcs = [func for _, _, func in _frames(tanh)]
        if "self_attn" in hf_module_path(tanh) or any("attention" in func for func in funcs):
            cap = getattr(config, "attn_logit_softcapping", None)
            return "attention logit soft-capping" + (f" (attn_logit_softcapping={cap})" if cap else "")
        return "attention/final logit soft-capping"

    def rotary_dim(self) -> int | None:
        """Partial rotary (``partial_rotary_factor`` < 1): the number of leading head features that rotate."""
        factor = self._partial_rotary_factor()
        if factor is None:
            return None
        return int(self._head_dim() * factor)

    def _head_dim(self) -> int:
        config = self.captured.config
        heads = getattr(config, "num_attention_heads", 0) or 0
        return getattr(config, "head_dim", None) or (int(config.hidden_size) // heads if heads else 0)

    def _partial_rotary_factor(self) -> float | None:
        config = self.captured.config
        factor = getattr(config, "partial_rotary_factor", None)
        if factor is None:
            factor = getattr(config, "rotary_pct", None)
        if factor is None:
            factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor") \
                if isinstance(getattr(config, "rope_parameters", None), dict) else None
        if factor is None or float(factor) >= 1.0:
            return None
        return float(factor)

    def partial_rotary(self) -> str | None:
        factor = self._partial_rotary_factor()
        if factor is None:
            return None
        head_dim = self._head_dim()
        return (f"partial rotary embedding (rotary_dim={int(head_dim * float(factor))} of head_dim={head_dim}, "
                f"partial_rotary_factor={factor})")

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
            if target.endswith("inv_freq"):
                return Param(target)
            value = _tensor_or_none(lambda: cap.buffer_tensor(node.name))
            return Const(value, node.name) if value is not None and value.is_floating_point() else Position()
        lifted = getattr(cap.program.graph_signature, "inputs_to_lifted_tensor_constants", {}) or {}
        if node.name in lifted:  # a tensor constant created in forward (torch.tensor(normalizer, dtype=...))
            value = _tensor_or_none(lambda: cap.program.constants[lifted[node.name]])
            return Const(value, node.name) if value is not None and value.is_floating_point() else Position()
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
        values = [a for a in args if isinstance(a, _VALUES)]
        if any(isinstance(a, Const) for a in values) and all(isinstance(a, Const) for a in values) \
                and target in _CONST_FOLD_OPS:
            folded = self.fold(node)
            if folded is not None:
                return folded
        mask = self.mask_region(node, values)
        if mask is not None:
            return mask
        windowed = self.windowed(node, args, values)
        if windowed is not None:
            return windowed
        tensor_args = [a for a in args if a is not None and not isinstance(a, (int, float, bool, list, tuple))]
        if all(isinstance(a, (Position, Const)) for a in tensor_args) and target in _POSITION_OPS:
            return Position()
        if target in _DROPOUT_OPS:
            return self.dropout(node, args)
        if target in _LAYOUT_OPS and tensor_args:
            return self.layout(node, args[0])
        if target in _SPLIT_OPS:
            result = self.split(node, args)
            if result is not None:
                return result
        handler = _ELEMENTWISE.get(target)
        if handler is not None:
            result = handler(self, node, args)
            if result is not None:
                return result
        if not self.strict:
            return Partial("opaque", (node.name,))
        self.fail(node, f"no IR op computes {name} with operands {', '.join(_describe(a) for a in args)}")

    def fold(self, node):
        """Evaluate a pure op whose tensor operands are all constants."""
        def sub(a):
            if hasattr(a, "name") and hasattr(a, "op"):
                value = self.env.get(a.name)
                if not isinstance(value, Const):
                    raise LookupError(a.name)
                return value.value
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a

        try:
            with torch.no_grad():
                result = node.target(*[sub(a) for a in node.args], **{k: sub(v) for k, v in node.kwargs.items()})
        except Exception:  # noqa: BLE001 - not foldable: fall through to the ordinary rules
            return None
        if not isinstance(result, torch.Tensor):
            return None
        origin = next(v.origin for v in (self.env.get(a.name) for a in node.args if hasattr(a, "op"))
                      if isinstance(v, Const))
        return Const(result, origin)

    def mask_region(self, node, values):
        """Nodes of a sliding-window mask. When the window covers the whole cache the mask is causal (Position);
        otherwise the node that subtracts the window (``q - window``) and everything computed from it is a
        :class:`WindowMask`, and the rest of the region (positions, the causal part) stays Position."""
        if not _in_mask(node, "sliding_window"):
            return None
        window = self.sliding_window()
        if window is None:
            self.fail(node, "the attention mask is not the plain causal mask over the KV cache, and the "
                      "megakernel's decode attention is causal over every cache slot up to the position")
        if not all(isinstance(a, (Position, Const, WindowMask)) for a in values) or \
                not (node.target in _POSITION_OPS or node.target in _MASK_OPS or node.target in _LAYOUT_OPS):
            return None
        if window >= self.captured.capacity:
            return Position()  # kv > q - window holds for every slot: the mask is causal
        subtracts_window = node.target in (aten.sub.Tensor, aten.add.Tensor) and \
            any(isinstance(a, int) and not isinstance(a, bool) and abs(a) == window for a in node.args)
        if any(isinstance(a, WindowMask) for a in values) or subtracts_window:
            return WindowMask(window)
        return Position()

    def windowed(self, node, args, values):
        """A sliding-window mask passed on outside its builder (sliced, viewed, cast): still the same mask."""
        masks = {a for a in values if isinstance(a, WindowMask)}
        if not masks:
            return None
        if len(masks) == 1 and all(isinstance(a, (Position, Const, WindowMask)) for a in values) and \
                (node.target in _POSITION_OPS or node.target in _MASK_OPS or node.target in _LAYOUT_OPS):
            return masks.pop()
        self.fail(node, "a sliding-window mask used other than as scaled_dot_product_attention's attn_mask")

    def dropout(self, node, args):
        p = args[1] if len(args) > 1 else node.kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else node.kwargs.get("train", False)
        if train and p:
            self.fail(node, f"dropout in training mode (p={p}, train=True) is not an inference op; "
                      "put the model in eval() mode before baking")
        return self.layout(node, args[0])

    def layout(self, node, source):
        if isinstance(source, (Act, Cache, Position, Rotary, Param, Const)):
            return source
        if isinstance(source, Partial) and source.kind in ("normed", "token_ids", "rmsnorm_done", "rope_done"):
            return source
        self.fail(node, f"layout change of {_describe(source)}")

    # -- pattern pieces -------------------------------------------------------------------------
    def rotary(self, node, args):
        """A grad-mode region of positions and inv_freq buffers: one RotaryTable per buffer (cos, sin outputs in
        buffer order; Gemma 3 has one per layer type)."""
        submod, operands = args[1], args[2:]
        tables = [i for i, a in enumerate(operands) if isinstance(a, Param)]
        positions = [a for a in operands if isinstance(a, Position)]
        if not (isinstance(submod, Partial) and tables and len(tables) + len(positions) == len(operands)):
            self.fail(node, "a grad-mode region with operands "
                      f"{', '.join(_describe(a) for a in operands)} (inv_freq buffers and the positions expected)")
        values = node.meta.get("val")
        if not isinstance(values, (tuple, list)) or len(values) != 2 * len(tables):
            self.fail(node, f"a rotary region of {len(tables)} inv_freq table(s) without a cos and sin for each")
        dim = int(values[0].shape[-1])
        inputs = [a.name if isinstance(operands[i], Param) else "" for i, a in enumerate(node.args[2:])]
        ops = [self.emit(RotaryTable, node, [node.name], submodule=submod.args[0], inv_freq=node.args[2 + i].name,
                         head_dim=dim, slot=slot, region_inputs=inputs)
               for slot, i in enumerate(tables)]
        return Rotary(ops[0].id) if len(ops) == 1 else RotaryRegion(tuple(op.id for op in ops))

    def getitem(self, node, args):
        source, index = args
        if isinstance(source, Rotary) and index in (0, 1):
            return Rotary(source.table, "cos" if index == 0 else "sin")
        if isinstance(source, RotaryRegion) and isinstance(index, int) and 0 <= index < 2 * len(source.tables):
            return Rotary(source.tables[index // 2], "cos" if index % 2 == 0 else "sin")
        if isinstance(source, Partial) and source.kind == "split" and isinstance(index, int):
            value, bounds, split_node = source.args
            if -len(bounds) <= index < len(bounds):
                start, stop = bounds[index]
                return self.row_linear(node, self.linears[value], start, stop, [split_node, node.name])
        self.fail(node, f"item {index} of {_describe(source)}")

    def embedding(self, node, args):
        table, ids = args[0], args[1]
        if not (isinstance(table, Param) and isinstance(ids, Partial) and ids.kind == "token_ids"):
            self.fail(node, "embedding that is not a parameter table indexed by the input token ids")
        op = self.emit(Embedding, node, [node.name], table=table.fqn, ids="input_ids")
        self.embeddings[node.name] = op
        return Act(node.name)

    def embedding_scale(self, node, emb: Act, factor):
        """``embedding(ids) * c``: fold a scalar constant ``c`` into the Embedding op."""
        op = self.embeddings[emb.name]
        what = "the embedding output multiplied by"
        if isinstance(factor, Const):
            if factor.value.numel() != 1:
                self.fail(node, f"embedding scale: {what} a constant of shape {tuple(factor.value.shape)} "
                          "(only a scalar constant can be folded into the Embedding op)")
            value = float(factor.value.detach().reshape(()).float().item())
        elif _scalar(factor):
            value = float(factor)
        else:
            self.fail(node, f"embedding scale: {what} {_describe(factor)}, not a scalar constant (only a "
                      "constant factor such as Gemma's sqrt(hidden_size) can be folded into the Embedding op)")
        if op.scale != 1.0:
            self.fail(node, "embedding scale: the embedding output is scaled twice")
        others = self.consumers(emb.name) - {node.name}
        if others:
            self.fail(node, f"embedding scale: the unscaled embedding output is also used by {sorted(others)}")
        op.scale = value
        op.out = node.name
        op.fx_nodes.append(node.name)
        del self.embeddings[emb.name]
        return Act(node.name)

    def linear_scale(self, node, out: Act, factor: float):
        """``linear(x) * c`` (``factor`` c) or ``linear(x) / c`` (``factor`` 1 / c): fold ``c`` into the Linear op."""
        op = self.linears[out.name]
        others = self.consumers(out.name) - {node.name}
        if others:
            self.fail(node, f"linear scale: {op.hf_module or op.weight}'s output is scaled by {factor:g} and also "
                      f"used unscaled by {sorted(others)} (only a scale of its only use folds into the Linear op)")
        op.scale *= factor
        op.out = node.name
        op.fx_nodes.append(node.name)
        del self.linears[out.name]
        self.linears[node.name] = op
        return Act(node.name)

    def split(self, node, args):
        """split / split_with_sizes / chunk of a Linear's output along its features: row ranges of its weight."""
        x = args[0]
        fused = self.sliceable_linear(node, x)
        if fused is None:
            return None
        rank = len(self.shape(node.args[0]))
        size = self.shape(node.args[0])[-1]
        dim = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
        if dim not in (-1, rank - 1):
            self.fail(node, f"fused projection: a split of {fused.hf_module or fused.weight}'s output along "
                      f"dimension {dim}, not its feature dimension")
        if node.target is aten.split_with_sizes.default:
            sizes = list(args[1])
        elif node.target is aten.chunk.default:
            step = -(-size // int(args[1]))
            sizes = [min(step, size - s) for s in range(0, size, step)]
        else:
            sizes = [min(int(args[1]), size - s) for s in range(0, size, int(args[1]))]
        bounds, start = [], 0
        for n in sizes:
            bounds.append((start, start + int(n)))
            start += int(n)
        if start != size:
            return None
        self.sliced.add(node.name)
        return Partial("split", (x.name, tuple(bounds), node.name))

    def sliceable_linear(self, node, x) -> Linear | None:
        """The Linear whose output ``node`` slices (as produced, before any view), or None."""
        if not isinstance(x, Act) or x.name not in self.linears:
            return None
        linear_node = self.nodes.get(x.name)
        if linear_node is None or self.shape(node.args[0]) != self.shape(linear_node):
            return None
        return self.linears[x.name]

    def row_linear(self, node, fused: Linear, start: int, stop: int, covered: list[str]):
        """One Linear over rows [start, stop) of a fused projection's weight (and bias)."""
        base = fused.weight_rows[0] if fused.weight_rows is not None else 0
        self.counter += 1
        op = Linear(id=f"linear_{self.counter}", out=node.name, fx_nodes=[*fused.fx_nodes, *covered],
                    hf_module=fused.hf_module, source=source_line(node), inp=fused.inp, weight=fused.weight,
                    bias=fused.bias, out_features=stop - start, in_features=fused.in_features,
                    weight_rows=(base + start, base + stop), scale=fused.scale)
        self.ops.append(op)
        self.linears[node.name] = op
        self.fused[fused.id] = fused
        self.sliced.add(node.name)
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
        op = self.emit(Linear, node, [node.name], inp=inp.name, weight=weight.fqn,
                       bias=bias.fqn if bias is not None else None, out_features=int(out_f), in_features=int(in_f))
        self.linears[node.name] = op
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
              and (mask is None or isinstance(mask, (Position, WindowMask))))
        if not ok or node.kwargs.get("is_causal") or (len(args) > 5 and args[5]):
            self.fail(node, "attention that is not over this layer's freshly appended static KV cache")
        q_shape = self.shape(node.args[0])
        n_heads, head_dim = int(q_shape[1]), int(q_shape[-1])
        kv_heads = int(self.captured.model.config.num_key_value_heads)
        scale = node.kwargs.get("scale")
        scale = float(scale) if scale is not None else head_dim ** -0.5
        window = mask.window if isinstance(mask, WindowMask) else 0
        self.emit(DecodeAttention, node, [node.name], layer=k.layer, q=q.name, k_append=k.append_op,
                  v_append=v.append_op, scale=scale, n_heads=n_heads, n_kv_heads=kv_heads, head_dim=head_dim,
                  window=window)
        return Act(node.name)

    def drop_fused(self) -> None:
        """Drop a fused projection every use of which became a row-range Linear."""
        for op_id, fused in self.fused.items():
            if self.consumers(fused.out) <= self.sliced and fused.out != self.output:
                self.ops = [op for op in self.ops if op.id != op_id]

    def graph(self) -> IRGraph:
        self.drop_fused()
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
    if isinstance(value, Partial) and value.kind in ("capped_div", "capped_tanh"):
        step = "/" if value.kind == "capped_div" else "tanh of /"
        return (f"activation {value.args[0]} {step} {value.args[1]:g} (a division by a scalar lowers only as part "
                "of soft-capping c * tanh(x / c) or as a Linear's output scale)")
    if isinstance(value, Partial):
        return f"partial {value.kind}"
    if isinstance(value, Position):
        return "position"
    if isinstance(value, Rotary):
        return f"rotary {value.part}"
    if isinstance(value, Const):
        if value.value.numel() == 1:
            return f"constant {value.value.reshape(()).item():g} ({str(value.value.dtype).replace('torch.', '')})"
        return f"constant tensor of shape {tuple(value.value.shape)}"
    return repr(value)


def _scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _frames(node) -> list[tuple[str, str, str]]:
    """(file, line, function) of every frame of the node's stack trace, outermost first."""
    return _FRAME.findall(node.meta.get("stack_trace") or "")


def _in_mask(node, kind: str) -> bool:
    """Whether the node was traced inside one of transformers' mask builders whose name contains ``kind``."""
    return any("masking_utils" in path and kind in func for path, _, func in _frames(node))


def _feeds_output(node) -> bool:
    """Whether ``node`` reaches the graph output through scalar muls/divs and layout nodes only."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        for user in current.users:
            if user.op == "output":
                return True
            if user.name not in seen and (user.target in _LAYOUT_OPS or user.target in (aten.mul.Tensor,
                                                                                        aten.div.Tensor)):
                seen.add(user.name)
                stack.append(user)
    return False


def _tensor_or_none(get) -> torch.Tensor | None:
    try:
        value = get()
    except (KeyError, AttributeError):
        return None
    return value if isinstance(value, torch.Tensor) else None


_VALUES = (Act, Param, Position, Cache, Rotary, RotaryRegion, Partial, Const, WindowMask)


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
    step = args[4] if len(args) > 4 else node.kwargs.get("step", 1)
    if isinstance(x, Act) and lw.shape(node.args[0]):
        in_shape = lw.shape(node.args[0])
        rank = len(in_shape)
        size = in_shape[dim] if -rank <= dim < rank else 0
        lo, hi = _bounds(start, end, size)
        if step == 1 and lo == 0 and hi == size:
            return x  # a full-range slice is the identity
        fused = lw.sliceable_linear(node, x)
        if fused is not None:
            if dim not in (-1, rank - 1) or step != 1:
                lw.fail(node, f"fused projection: a slice of {fused.hf_module or fused.weight}'s output that is not "
                        f"a step-1 range of its feature dimension (dim={dim}, step={step})")
            if lo >= hi:
                lw.fail(node, f"fused projection: an empty slice [{start}:{end}] of {fused.hf_module}'s output")
            return lw.row_linear(node, fused, lo, hi, [node.name])
        if lo >= hi:
            return Partial("empty", (x.name, node.name))  # Phi-3's q[..., rotary_dim:] when rotary_dim == head_dim
        part = _rotary_part_slice(lw, node, x, dim, step, lo, hi, size)
        if part is not None:
            return part
    return _rotate_half_slice(lw, node, x, dim, start, end)


def _rotary_part_slice(lw: _Lowering, node, x: Act, dim, step, lo: int, hi: int, size: int):
    """Partial rotary: ``x[..., :rotary_dim]`` (rotated: a value of its own, remembered in ``rotary_parts``) and
    ``x[..., rotary_dim:]`` (passed through) of a head tensor; :func:`_cat` joins them into one RoPE op."""
    rotary_dim = lw.rotary_dim()
    if not rotary_dim or step != 1 or dim not in (-1, len(lw.shape(node.args[0])) - 1) or x.name in lw.rotary_parts:
        return None
    if lo == 0 and hi == rotary_dim < size:
        lw.rotary_parts[node.name] = (x.name, rotary_dim)
        return Act(node.name)
    if lo == rotary_dim and hi == size:
        return Partial("rotary_pass", (x.name, rotary_dim, [node.name]))
    return None


def _narrow(lw: _Lowering, node, args):
    x, dim, start, length = _finish(args[0]), args[1], args[2], args[3]
    fused = lw.sliceable_linear(node, x)
    if fused is None or not isinstance(start, int):
        return None
    rank = len(lw.shape(node.args[0]))
    if dim not in (-1, rank - 1):
        lw.fail(node, f"fused projection: a narrow of {fused.hf_module or fused.weight}'s output along dimension "
                f"{dim}, not its feature dimension")
    size = lw.shape(node.args[0])[-1]
    lo, hi = _bounds(start, start + length, size)
    if lo == 0 and hi == size:
        return x
    return lw.row_linear(node, fused, lo, hi, [node.name])


def _bounds(start, end, size: int) -> tuple[int, int]:
    """Python slice bounds normalised to [0, size]."""
    lo = 0 if start is None else int(start)
    hi = size if end is None else int(end)
    lo = max(lo + size, 0) if lo < 0 else min(lo, size)
    hi = max(hi + size, 0) if hi < 0 else min(hi, size)
    return lo, max(lo, hi)


def _rotate_half_slice(lw: _Lowering, node, x, dim, start, end):
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
    nodes = [p for p in node.args[0] if hasattr(p, "name")]
    if len(nodes) == len(node.args[0]) > 1:  # cat with empty tensors (a zero-width pass-through) is the identity
        full = [p for p in nodes if not (isinstance(lw.val(p), Partial) and lw.val(p).kind == "empty")]
        if len(full) == 1 and lw.shape(full[0]) == lw.shape(node) and lw.val(full[0]) is not None:
            return lw.val(full[0])
    if dim not in (-1, len(lw.shape(node)) - 1):  # rotate-half concatenates along the head dimension only
        return None
    parts = [lw.val(p) if hasattr(p, "name") else p for p in node.args[0]]
    joined = _join_partial_rotary(lw, node, parts)
    if joined is not None:
        return joined
    if len(parts) == 2 and isinstance(parts[0], Partial) and isinstance(parts[1], Partial):
        neg, lo = parts
        if neg.kind == "neg_hi" and lo.kind == "half" and lo.args[1] == "lo" and neg.args[0] == lo.args[0]:
            return Partial("rotate_half", (neg.args[0], neg.args[1] + lo.args[2] + [node.name]))
    return None


def _join_partial_rotary(lw: _Lowering, node, parts):
    """``cat([rope(x[..., :r]), x[..., r:]], -1)``: the RoPE op of the rotated part becomes one RoPE of ``x``
    with ``rotary_dim = r`` (its output is the cat)."""
    if len(parts) != 2 or not all(isinstance(p, Partial) for p in parts):
        return None
    done, passed = parts
    if done.kind != "rope_done" or passed.kind != "rotary_pass":
        return None
    rope = next((op for op in lw.ops if isinstance(op, RoPE) and op.out == done.args[0]), None)
    if rope is None or lw.rotary_parts.get(rope.inp) != (passed.args[0], passed.args[1]):
        return None
    rope.fx_nodes += [rope.inp] + list(passed.args[2]) + [node.name]
    rope.inp, rope.rotary_dim, rope.out = passed.args[0], passed.args[1], node.name
    rope.head_dim = int(lw.shape(node)[-1])
    return Partial("rope_done", (node.name,))


def _mul(lw: _Lowering, node, args):
    a, b = args[0], args[1]
    for x, y in ((a, b), (b, a)):
        capped = _softcap(lw, node, x, y)
        if capped is not None:
            return capped
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
                        weight_offset=offset, width=int(lw.shape(node)[-1]) if lw.shape(node) else 0)
                return Partial("rmsnorm_done", (node.name,))
        if isinstance(_finish(x), Act) and isinstance(y, Rotary) and y.part == "cos":
            return Partial("rope_cos", (_finish(x).name, y.table, [node.name]))
        if isinstance(x, Partial) and x.kind == "rotate_half" and isinstance(y, Rotary) and y.part == "sin":
            return Partial("rope_sin", (x.args[0], y.table, x.args[1] + [node.name]))
        if isinstance(x, Partial) and x.kind == "activated" and isinstance(_finish(y), Act):
            lw.emit(GatedAct, node, [x.args[2], node.name], gate=x.args[0], up=_finish(y).name, act=x.args[1])
            return Act(node.name)
    for x, y in ((a, b), (b, a)):
        if isinstance(x, Act) and x.name in lw.embeddings and not isinstance(y, (Partial, Rotary)):
            return lw.embedding_scale(node, x, y)
        factor = _scalar_constant(y)
        if isinstance(x, Act) and x.name in lw.linears and factor is not None:
            return lw.linear_scale(node, x, factor)
    return None


def _scalar_constant(value) -> float | None:
    """A Python number or a one-element constant tensor as a float; None for anything else."""
    if _scalar(value):
        return float(value)
    if isinstance(value, Const) and value.value.numel() == 1:
        return float(value.value.detach().reshape(()).float().item())
    return None


def _div(lw: _Lowering, node, args):
    """``x / c`` with a scalar ``c``: a scaled Linear's output (``Linear.scale = 1 / c``) unless a tanh follows, else
    the first node of a soft-capping ``cap * tanh(x / cap)``."""
    x, cap = _finish(args[0]), _scalar_constant(args[1])
    if not isinstance(x, Act) or not cap:
        return None
    if x.name in lw.linears and not any(lw.nodes[n].target is aten.tanh.default for n in lw.consumers(node.name)):
        return lw.linear_scale(node, x, 1.0 / cap)
    if _scalar(args[1]) and cap > 0:
        return Partial("capped_div", (x.name, cap, [node.name]))
    return None


def _tanh(lw: _Lowering, node, args):
    x = args[0]
    if isinstance(x, Partial) and x.kind == "capped_div":
        return Partial("capped_tanh", (x.args[0], x.args[1], x.args[2] + [node.name]))
    return None


def _softcap(lw: _Lowering, node, x, y):
    """The last node of ``cap * tanh(x / cap)``: one Softcap op (the caps must be the same number)."""
    if isinstance(x, Partial) and x.kind == "capped_tanh" and isinstance(y, (int, float)) and float(y) == x.args[1]:
        lw.emit(Softcap, node, x.args[2] + [node.name], inp=x.args[0], cap=x.args[1])
        return Act(node.name)
    return None


def _activation(kind: str):
    def rule(lw: _Lowering, node, args):
        x = _finish(args[0])
        if isinstance(x, Act):
            return Partial("activated", (x.name, kind, node.name))
        return None

    return rule


_GELU_ACTS = {"tanh": "gelu_tanh", "none": "gelu"}


def _gelu(lw: _Lowering, node, args):
    approximate = node.kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    kind = _GELU_ACTS.get(approximate)
    return _activation(kind)(lw, node, args) if kind else None


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
    aten.gelu.default: _gelu,
    aten.narrow.default: _narrow,
    aten.div.Tensor: _div,
    aten.tanh.default: _tanh,
}


def lower(captured: CapturedStep, *, strict: bool = True) -> IRGraph:
    """Lower the exported step into typed IR ops (see module docstring)."""
    return _Lowering(captured, strict).run()
