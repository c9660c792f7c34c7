"""``megabake.make_backend()``: a ``torch.compile`` backend that runs one-token decode steps on the megakernel.

Contract: ``torch.compile(model, backend=make_backend(), fullgraph=True)`` (or ``model.compile(backend=...)``,
which ``model.generate`` then calls). Dynamo hands the backend one FX graph per call shape; each is classified
from its inputs (Dynamo's placeholder sources and the real example tensors) and its in-place writes:

* **decode**: reads one new token per sequence (``input_ids`` [B, 1], found as the embedding's index input)
  and every layer's ``keys`` / ``values`` / ``cumulative_length`` of a static HF cache
  (``past_key_values.layers[i]``, transformers >= 5); writes only those, in place; returns only the logits
  [B, 1, V]; its other inputs are the owning model's parameters and buffers, ``position_ids`` and the attention
  mask. Its calls run on a megakernel decoder for that model (found in the compiled frame: the Hugging Face
  model whose parameters are the graph's, by identity; or ``make_backend(model=...)``). The bucket is (B,
  ``capacity``), ``capacity`` = ``make_backend(capacity=...)`` or the HF cache's length rounded up to a power
  of two (at least 32, at most ``max_position_embeddings``). Bakes are cached on the backend by (model
  identity, config hash, batch, capacity): once per model and bucket, however many graphs use it. The bake
  (``bake_decoder``) happens at the graph's first call, because ``torch.export`` cannot run inside Dynamo's
  compilation; its errors surface there too.
* **prefill** (a prompt, or a first token that creates the cache) and **other** graphs: Inductor
  (``other="inductor"``) or the graph as traced (``other="eager"``).

A decode call reads its position from ``cumulative_length`` (the slot HF's ``StaticLayer`` writes), checks that
``position_ids`` and the mask agree (no padding) and that it fits the bucket, loads the decoder's KV cache from
HF's tensors when they are not the ones it last mirrored (``kv.DecoderCacheSync``: a prefill by Inductor, a
reset, an eager call), runs ``decoder.step``, then performs the graph's own in-place writes: the step's K/V
into HF's tensors at the position and ``cumulative_length += 1``, so HF's cache stays exact for later prefills,
eager calls and the caller. With ``check_first_call`` (default) the first megakernel call of a graph on each
bucket also runs the graph as traced and compares logits and the new K/V (relative L2 under 1e-3 for the fp32
reference executor with fp32 GEMV inputs, 2e-2 where its plan stages them in bf16, 0.1 for bf16 kernels): a graph
that computes more than the model's forward (a scaled or post-processed output) is caught before it is trusted.

``fallback`` says what runs a decode graph or call the megakernel cannot serve: ``"inductor"`` (default),
``"eager"``, or ``"error"`` (strict): the bake's own error (:class:`UnsupportedGraphError` naming the FX node,
:class:`PlanError`, :class:`DeviceError`), :class:`UnsupportedGraphError` for a graph outside the decode
contract, :class:`InputError` for a call outside the bucket (padding, position past capacity), raised at the
call. ``backend.report`` holds one :class:`GraphRecord` per compiled graph: kind, path, why, call counts.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import asdict, dataclass, field

import torch

from ..errors import InputError, MegaBakeError, UnsupportedGraphError
from .bake import bake_decoder, check_bucket
from .kv import DecoderCacheSync, mask_window, prefix_mask_ok, write_static_step

FALLBACKS = ("inductor", "eager", "error")
OTHERS = ("inductor", "eager")
MIN_CAPACITY = 32
_CACHE_SOURCE = re.compile(r"\.layers\[(\d+)\]\.(keys|values|cumulative_length)$")
_ROOT_SOURCE = re.compile(r"^([LG])\[(['\"])(.+?)\2\]")
_VIEWS = {"view", "reshape", "getitem", "__getitem__", "select", "narrow", "transpose", "permute", "expand",
          "unsqueeze", "squeeze", "as_strided", "view_as", "flatten", "unflatten", "t", "contiguous", "slice",
          "unbind", "split", "chunk", "movedim", "swapaxes", "detach", "expand_as"}


@dataclass
class GraphRecord:
    """What served one compiled graph, and why."""

    graph: int
    kind: str  # decode | prefill | other
    path: str  # megakernel | inductor | eager | error
    reason: str
    calls: int = 0
    megakernel_calls: int = 0
    fallback_calls: int = 0
    bucket: str = ""  # e.g. "batch 1, capacity 64, reference"
    last_fallback: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GraphLayout:
    """A graph's inputs by role (indices into its arguments) and its outputs."""

    kind: str
    tokens: int | None = None
    position_ids: int | None = None
    mask: int | None = None
    keys: dict[int, int] = field(default_factory=dict)  # layer -> argument index
    values: dict[int, int] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    module_tensors: list[int] = field(default_factory=list)
    roots: list[str] = field(default_factory=list)  # Dynamo source roots of the module tensors, e.g. L['self']
    unknown: list[str] = field(default_factory=list)
    mutated: set[int] = field(default_factory=set)
    outputs: list = field(default_factory=list)  # example values (None where not a tensor)
    describe: str = ""

    @property
    def cache_inputs(self) -> set[int]:
        return set(self.keys.values()) | set(self.values.values()) | set(self.lengths.values())


@dataclass
class _Bucket:
    model: "weakref.ref"
    decoder: object
    sync: DecoderCacheSync
    label: str


class _Misfit(Exception):
    """One call the megakernel cannot serve; the message says why."""


# ------------------------------------------------------------------------------------------- graph reading


def source_name(node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return node.name
    name = source.name
    return name() if callable(name) else str(name)


def _example(node):
    return node.meta.get("example_value", node.meta.get("val"))


def _base_placeholder(node, index: dict) -> int | None:
    """The argument index of the placeholder that ``node`` is (a view of), or None."""
    while hasattr(node, "op"):
        if node.op == "placeholder":
            return index.get(node)
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op not in ("call_method", "call_function") or name not in _VIEWS or not node.args:
            return None
        node = node.args[0]
    return None


def _written_inputs(gm, index: dict) -> set[int]:
    written = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        base = str(name).split(".")[0]
        targets = []
        if (base.endswith("_") and not base.startswith("_")) or base == "setitem":
            targets.append(node.args[0] if node.args else None)
        if "out" in node.kwargs:
            targets.append(node.kwargs["out"])
        for target in targets:
            found = _base_placeholder(target, index)
            if found is not None:
                written.add(found)
    return written


def _token_input(gm, index: dict) -> int | None:
    found = {_base_placeholder(node.args[0], index) for node in gm.graph.nodes
             if node.op == "call_function" and getattr(node.target, "__name__", "") == "embedding" and node.args}
    found.discard(None)
    return found.pop() if len(found) == 1 else None


def inspect_graph(gm, example_inputs) -> GraphLayout:
    """Read a Dynamo graph's inputs by role, its writes and outputs (module doc)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    index = {node: i for i, node in enumerate(placeholders)}
    layout = GraphLayout(kind="other", tokens=_token_input(gm, index))
    for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
        _classify_input(layout, i, source_name(node), example)
    layout.mutated = _written_inputs(gm, index)
    output = next(node for node in gm.graph.nodes if node.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    layout.outputs = [_example(out) if hasattr(out, "op") else None for out in outs]
    layout.kind, layout.describe = _kind(layout, example_inputs)
    return layout


def _classify_input(layout: GraphLayout, i: int, source: str, example) -> None:
    if not torch.is_tensor(example) or i == layout.tokens:
        return  # sizes (SymInts) and the token ids
    cache = _CACHE_SOURCE.search(source)
    if cache:
        {"keys": layout.keys, "values": layout.values, "cumulative_length": layout.lengths}[cache.group(2)][
            int(cache.group(1))] = i
    elif "._parameters[" in source or "._buffers[" in source:
        layout.module_tensors.append(i)
        root = _ROOT_SOURCE.match(source)
        if root and root.group(0) not in layout.roots:
            layout.roots.append(root.group(0))
    elif source.endswith("['position_ids']"):
        layout.position_ids = i
    elif source.endswith("['attention_mask']"):
        layout.mask = i
    else:
        layout.unknown.append(source)


def _kind(layout: GraphLayout, example_inputs) -> tuple[str, str]:
    if layout.tokens is None:
        return "other", "no token-id input feeds an embedding"
    shape = tuple(example_inputs[layout.tokens].shape)
    if len(shape) == 2 and shape[1] == 1 and layout.keys:
        return "decode", f"one new token per sequence (input_ids {list(shape)}) on a cache"
    return "prefill", f"input_ids {list(shape)}" + ("" if layout.keys else " creating the cache")


def decode_problem(layout: GraphLayout, model, example_inputs, missing: str = "") -> str | None:
    """Why the megakernel cannot serve this decode graph, or None."""
    if layout.unknown:
        return (f"it reads {', '.join(layout.unknown[:3])}, which a decode step of the model does not (token ids, "
                "position_ids, attention_mask, the static cache and the model's weights)")
    if model is None:
        return (f"no Hugging Face model owning the graph's parameters was found ({missing or 'none given'}): "
                "pass make_backend(model=model)")
    owned = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    strangers = [i for i in layout.module_tensors if id(example_inputs[i]) not in owned]
    if strangers:
        return f"{len(strangers)} of its module tensors are not {type(model).__name__}'s parameters or buffers"
    return _cache_problem(layout, model, example_inputs) or _output_problem(layout, model, example_inputs)


def _cache_problem(layout: GraphLayout, model, example_inputs) -> str | None:
    layers = model.config.get_text_config().num_hidden_layers
    wanted = set(range(layers))
    if set(layout.keys) != wanted or set(layout.values) != wanted:
        return f"it reads the cache tensors of layers {sorted(layout.keys)} but the model has {layers} layers"
    if not layout.mutated & (set(layout.keys.values()) | set(layout.values.values())):
        return ("it replaces the cache's tensors instead of writing them in place (a DynamicCache): the "
                "megakernel serves static caches; pass past_key_values=StaticCache(...) or "
                "cache_implementation='static'")
    if set(layout.lengths) != wanted:
        if _has_sliding_window(model.config):
            return ("its cache has no cumulative_length per layer: transformers' StaticCache makes sliding-window "
                    "layers window-long rings (StaticSlidingWindowLayer) whose slots are not positions; the "
                    "megakernel keeps every position: pass past_key_values=megabake.capture."
                    "full_length_static_cache(model.config, capacity)")
        return "its cache has no cumulative_length per layer (transformers >= 5 StaticCache layout expected)"
    if layout.mutated != layout.cache_inputs:
        extra = sorted(layout.mutated - layout.cache_inputs)
        return (f"it writes inputs other than the cache in place ({extra})" if extra
                else "it leaves some of the cache's tensors unwritten")
    return None


def _has_sliding_window(config) -> bool:
    config = config.get_text_config()
    return bool(getattr(config, "sliding_window", None)) or "sliding_attention" in (getattr(config, "layer_types",
                                                                                            None) or ())


def _output_problem(layout: GraphLayout, model, example_inputs) -> str | None:
    batch = example_inputs[layout.tokens].shape[0]
    vocab = model.config.get_text_config().vocab_size
    outs = layout.outputs
    if len(outs) != 1 or not torch.is_tensor(outs[0]):
        return f"it returns {len(outs)} outputs; a decode step returns only the logits"
    out = outs[0]
    if tuple(out.shape) != (batch, 1, vocab) or not out.is_floating_point():
        return f"its output {tuple(out.shape)} {out.dtype} is not the logits [{batch}, 1, {vocab}]"
    if out.requires_grad:
        return "it records autograd (grad mode): the megakernel runs inference only; call under torch.no_grad()"
    return None


def find_model(layout: GraphLayout, example_inputs, explicit=None):
    """The Hugging Face model owning the graph's module tensors: ``explicit``, else found from the sources'
    roots in the frame Dynamo is compiling (outermost PreTrainedModel first). Returns (model or None, why)."""
    wanted = {id(example_inputs[i]) for i in layout.module_tensors}
    if not wanted:
        return None, "the graph has no parameter inputs"
    candidates = [explicit] if explicit is not None else _frame_candidates(layout.roots)
    for candidate in candidates:
        owned = {id(t) for t in candidate.parameters()} | {id(t) for t in candidate.buffers()}
        if wanted <= owned:
            return candidate, ""
    return None, "no candidate model owns all of the graph's parameters"


def _frame_candidates(roots: list[str]) -> list:
    from transformers import PreTrainedModel

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        frame = InstructionTranslator.current_tx()
        scopes = {"L": frame.f_locals, "G": frame.f_globals}
    except Exception:  # Dynamo internals moved: only make_backend(model=...) can name the model then
        return []
    found = []
    for root in roots:
        match = _ROOT_SOURCE.match(root)
        obj = scopes[match.group(1)].get(match.group(3)) if match else None
        if isinstance(obj, torch.nn.Module):
            found += [m for m in obj.modules() if isinstance(m, PreTrainedModel) and m not in found]
    return found


def bucket_capacity(cache_length: int, max_positions: int | None) -> int:
    """The smallest power of two >= ``cache_length`` (at least 32), capped at ``max_positions``."""
    capacity = MIN_CAPACITY
    while capacity < cache_length:
        capacity *= 2
    return min(capacity, max_positions) if max_positions else capacity


def _inductor_patches(options: dict) -> dict:
    """Inductor config patches for torch.compile's ``mode`` and ``options`` (as torch.compile applies them)."""
    from torch._inductor import list_mode_options

    mode = options.get("mode")
    patches = dict(list_mode_options(mode)) if mode and mode != "default" else {}
    patches.update({key.replace("-", "_"): value for key, value in (options.get("options") or {}).items()})
    return patches


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------- the backend


class MegaBakeBackend:
    """A ``torch.compile`` backend (module doc). Holds the bake cache and the report; no global state."""

    __name__ = "megabake"

    def __init__(self, *, fallback: str = "inductor", other: str = "inductor", capacity: int | None = None,
                 check_first_call: bool = True, model=None):
        if fallback not in FALLBACKS:
            raise InputError(f"fallback={fallback!r} is not one of {', '.join(map(repr, FALLBACKS))}: what runs a "
                             "decode step the megakernel cannot serve ('error' refuses it)")
        if other not in OTHERS:
            raise InputError(f"other={other!r} is not one of {', '.join(map(repr, OTHERS))}: the torch.compile "
                             "backend for graphs that are not one-token decode steps")
        if capacity is not None:
            check_bucket(1, capacity)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise InputError(f"model must be the Hugging Face model being compiled, got {type(model).__name__}")
        self.fallback, self.other, self.capacity = fallback, other, capacity
        self.check_first_call = bool(check_first_call)
        self._model = weakref.ref(model) if model is not None else None
        self.report: list[GraphRecord] = []
        self._buckets: dict[tuple, _Bucket] = {}

    def __copy__(self) -> "MegaBakeBackend":
        return self  # a service holding bakes and the report, not a value: transformers' CompileConfig.to_dict()

    def __deepcopy__(self, memo) -> "MegaBakeBackend":  # deep-copies its fields, the backend included
        return self

    def __repr__(self) -> str:
        return f"MegaBakeBackend(fallback={self.fallback!r}, other={self.other!r}, capacity={self.capacity})"

    def __call__(self, gm, example_inputs, **options):
        layout = inspect_graph(gm, example_inputs)
        number = len(self.report)
        if layout.kind != "decode":
            record = self._record(number, layout.kind, self.other, f"not a one-token decode step: {layout.describe}")
            return _Counted(self._compile(gm, example_inputs, self.other, options), record)
        model, why = find_model(layout, example_inputs, self._model() if self._model else None)
        problem = decode_problem(layout, model, example_inputs, why)
        if problem and self.fallback != "error":
            record = self._record(number, "decode", self.fallback, f"the megakernel cannot serve it: {problem}")
            return _Counted(self._compile(gm, example_inputs, self.fallback, options), record)
        path = "error" if problem else "megakernel"
        record = self._record(number, "decode", path, problem or layout.describe)
        return _DecodeGraph(self, record, gm, layout, model, problem, options)

    def _record(self, number: int, kind: str, path: str, reason: str) -> GraphRecord:
        record = GraphRecord(graph=number, kind=kind, path=path, reason=reason)
        self.report.append(record)
        return record

    @staticmethod
    def _compile(gm, example_inputs, name: str, options: dict):
        """``gm`` through Inductor (honouring torch.compile's ``mode`` / ``options``) or as traced."""
        if name == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=_inductor_patches(options) or None)

    # ------------------------------------------------------------------------------------- bakes
    def bucket(self, model, batch: int, cache_length: int) -> _Bucket:
        """The decoder for ``model`` at (batch, capacity for ``cache_length``): cached, else baked now."""
        from ..presets import config_hash

        max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        capacity = self.capacity or bucket_capacity(cache_length, max_positions)
        key = (id(model), config_hash(model.config), batch, capacity)
        known = self._buckets.get(key)
        if known is not None and known.model() is model:
            return known
        self._buckets = {k: b for k, b in self._buckets.items() if b.model() is not None}  # drop dead models'
        decoder = bake_decoder(model, batch=batch, capacity=capacity)
        label = f"batch {batch}, capacity {capacity}, {decoder.backend}"
        self._buckets[key] = _Bucket(weakref.ref(model), decoder, DecoderCacheSync(decoder), label)
        return self._buckets[key]

    def prepare(self, model, *, batch: int = 1, cache_length: int = 128):
        """Bake ``model``'s bucket for HF caches of ``cache_length`` now, before compiling: the first decode
        call then finds it cached. (A bake runs ``torch.export``, which makes Dynamo re-trace the frames it had
        compiled once; baking ahead avoids that.) Returns the decoder."""
        check_bucket(batch, cache_length)
        return self.bucket(model, batch, cache_length).decoder

    def decoders(self) -> list:
        """The decoders baked so far (one per model and bucket)."""
        return [bucket.decoder for bucket in self._buckets.values()]

    def summary(self) -> str:
        """One line per compiled graph: kind, path, calls, why."""
        lines = []
        for r in self.report:
            counts = f"{r.calls} calls" + (f" ({r.megakernel_calls} megakernel, {r.fallback_calls} fallback)"
                                          if r.kind == "decode" else "")
            lines.append(f"graph {r.graph}: {r.kind} -> {r.path}, {counts}; {r.reason}"
                         + (f" [{r.bucket}]" if r.bucket else ""))
        return "\n".join(lines)


def make_backend(*, fallback: str = "inductor", other: str = "inductor", capacity: int | None = None,
                 check_first_call: bool = True, model=None) -> MegaBakeBackend:
    """A ``torch.compile`` backend running one-token decode steps on a megakernel (module doc)."""
    return MegaBakeBackend(fallback=fallback, other=other, capacity=capacity, check_first_call=check_first_call,
                           model=model)


class _Counted:
    """A compiled graph's callable that counts its calls in the report."""

    def __init__(self, fn, record: GraphRecord):
        self.fn, self.record = fn, record

    def __call__(self, *args):
        self.record.calls += 1
        return self.fn(*args)


class _DecodeGraph:
    """Runs one decode graph's calls on the megakernel (module doc), or its fallback."""

    def __init__(self, backend: MegaBakeBackend, record: GraphRecord, gm, layout: GraphLayout, model,
                 problem: str | None, options: dict):
        self.backend, self.record, self.gm, self.layout = backend, record, gm, layout
        self.model = weakref.ref(model) if model is not None else None
        self.problem, self.options = problem, options
        self.out_dtype = layout.outputs[0].dtype if layout.outputs and torch.is_tensor(layout.outputs[0]) else None
        self._fallback_fn = None
        self._checked: set[str] = set()  # buckets whose first call was checked against the graph
        self._last: tuple | None = None  # ((batch, cache length), bucket) of the last call

    def __call__(self, *args):
        self.record.calls += 1
        if self.problem is not None:
            return self._fallback(args, self.problem, structural=True)
        try:
            bucket = self._bucket(args)
        except MegaBakeError as exc:
            if self.backend.fallback == "error":
                raise
            self._give_up(f"the bake failed: {type(exc).__name__}: {exc}")
            return self._fallback(args, self.problem, structural=True)
        try:
            return self._serve(bucket, args)
        except _Misfit as misfit:
            return self._fallback(args, str(misfit), structural=False)

    def _give_up(self, problem: str) -> None:
        self.problem = problem
        self.record.path, self.record.reason = self.backend.fallback, f"the megakernel cannot serve it: {problem}"

    def _bucket(self, args) -> _Bucket:
        model = self.model() if self.model else None
        if model is None:
            raise MegaBakeError("the model this graph was compiled for no longer exists")
        shape = (args[self.layout.tokens].shape[0], args[self.layout.keys[0]].shape[2])  # batch, HF cache length
        if self._last is None or self._last[0] != shape:
            self._last = (shape, self.backend.bucket(model, *shape))
            self.record.bucket = self._last[1].label
        return self._last[1]

    # ------------------------------------------------------------------------------------- serving
    @torch.no_grad()
    def _serve(self, bucket: _Bucket, args):
        layout = self.layout
        keys = [args[layout.keys[i]] for i in range(len(layout.keys))]
        values = [args[layout.values[i]] for i in range(len(layout.values))]
        lengths = [args[layout.lengths[i]] for i in range(len(layout.lengths))]
        tokens, position = self._read_step(args, lengths, bucket.decoder.capacity, mask_window(bucket.decoder))
        rows = tokens.shape[0]
        if not bucket.sync.is_current(keys[0], position):
            bucket.sync.load(keys, values, position)
        if self.backend.check_first_call and bucket.label not in self._checked:
            return self._checked_step(bucket, args, tokens, position, keys, values, lengths)
        logits = bucket.decoder.step(tokens, position)
        self._store(bucket, keys, values, lengths, position, rows)
        self.record.megakernel_calls += 1
        return (self._logits(logits, rows, keys[0].device),)

    def _read_step(self, args, lengths, capacity: int, window: int = 0) -> tuple[torch.Tensor, int]:
        """Token ids (host) and the position, from one host copy; _Misfit if the call is outside the bucket. A 4-D
        mask may hide the positions before a sliding ``window`` (every layer's, as the plan bakes it)."""
        layout = self.layout
        tokens = args[layout.tokens].reshape(-1)
        positions = args[layout.position_ids].reshape(-1) if layout.position_ids is not None else tokens[:0]
        parts = [tokens, *(length.reshape(1) for length in lengths), positions]
        if layout.mask is not None:
            parts.append(prefix_mask_ok(args[layout.mask], lengths[0], window).reshape(1))
        host = torch.cat([part.to(device=tokens.device, dtype=torch.long) for part in parts]).cpu()
        sizes = [tokens.numel(), len(lengths), positions.numel()]
        host_tokens, cached, given, mask_ok = host.split([*sizes, host.numel() - sum(sizes)])
        position = int(cached[0])
        if bool((cached != position).any()):
            raise _Misfit(f"the cache's layers hold different lengths {cached.tolist()}")
        if bool((given != position).any()):
            raise _Misfit(f"position_ids {given.tolist()} differ from the cache length {position} (a padded "
                          "batch?): the megakernel decodes every sequence at the cache's position")
        if not bool(mask_ok.all()):
            seen = f"the last {window} positions up to p (its sliding window)" if window else "every cached position"
            raise _Misfit(f"the attention mask hides some of positions 0..p (padding, or a window the plan does not "
                          f"have): the megakernel attends to {seen}")
        if position >= capacity:
            raise _Misfit(f"position {position} is outside the baked KV capacity [0, {capacity}): pass "
                          "make_backend(capacity=...) large enough for the longest sequence")
        return host_tokens, position

    def _store(self, bucket: _Bucket, keys, values, lengths, position: int, rows: int) -> None:
        new_keys, new_values = bucket.sync.step_kv(position, rows)
        write_static_step(keys, values, lengths, new_keys, new_values, position)
        bucket.sync.remember(keys[0], position + 1)

    def _logits(self, logits: torch.Tensor, rows: int, device) -> torch.Tensor:
        """The megakernel's fp32 logits, not rounded to the graph's dtype: bf16 rounding makes near-ties of
        the top tokens (spacing 0.125 at logit 20), so greedy ids would differ from ``decoder.generate``'s;
        transformers' generate upcasts the logits to fp32 anyway."""
        return logits[:rows, None, :].to(device=device, dtype=torch.float32, copy=True)

    def _checked_step(self, bucket: _Bucket, args, tokens, position, keys, values, lengths):
        """First megakernel call on a bucket: also run the graph as traced and compare (module doc)."""
        saved = [length.clone() for length in lengths]
        expected = self.gm(*args)[0]  # writes HF's slot `position` and advances the lengths, as traced
        rows = tokens.shape[0]
        logits = bucket.decoder.step(tokens, position)
        error = self._disagreement(bucket, logits[:rows], expected[:, 0], keys, values, position, rows)
        tolerance = _first_call_tolerance(bucket.decoder, self.out_dtype)
        if error > tolerance:
            problem = (f"its first call disagrees with the graph run as traced (relative L2 {error:.3g} > "
                       f"{tolerance}): the graph computes something other than the model's decode step")
            bucket.sync.forget()
            if self.backend.fallback == "error":
                raise MegaBakeError(f"graph {self.record.graph}: {problem}")
            self._give_up(problem)
            self.record.fallback_calls += 1
            return (expected,)
        for length, value in zip(lengths, saved):
            length.copy_(value)
        self._store(bucket, keys, values, lengths, position, rows)
        self._checked.add(bucket.label)
        self.record.megakernel_calls += 1
        return (self._logits(logits, rows, keys[0].device),)

    @staticmethod
    def _disagreement(bucket: _Bucket, logits, expected, keys, values, position: int, rows: int) -> float:
        """Worst relative L2 of the megakernel's logits and new K/V against the graph's."""
        new_keys, new_values = bucket.sync.step_kv(position, rows)
        errors = [_rel_l2(logits, expected)]
        errors += [_rel_l2(new, k[:, :, position]) for new, k in zip(new_keys, keys)]
        errors += [_rel_l2(new, v[:, :, position]) for new, v in zip(new_values, values)]
        return max(errors)

    # ------------------------------------------------------------------------------------- fallback
    def _fallback(self, args, reason: str, *, structural: bool):
        if self.backend.fallback == "error":
            graph = f"graph {self.record.graph} (a one-token decode step)"
            if structural:
                raise UnsupportedGraphError(f"{graph}: the megakernel cannot serve it: {reason}. Fix the cause, "
                                            "or use make_backend(fallback='inductor') to run it through Inductor")
            raise InputError(f"{graph}: the megakernel cannot serve this call: {reason}. Use "
                             "make_backend(fallback='inductor') to run such calls through Inductor")
        self.record.fallback_calls += 1
        self.record.last_fallback = reason
        if self._fallback_fn is None:
            self._fallback_fn = self._compile_fallback()
        return self._fallback_fn(*args)

    def _compile_fallback(self):
        """Compiled at call time (outside Dynamo's compilation), through Dynamo again so shapes are guarded."""
        if self.backend.fallback == "eager":
            return self.gm
        if hasattr(self.gm, "real_recompile"):  # a lazy GraphModule: Dynamo does not trace its first forward
            self.gm.real_recompile()
        return torch.compile(self.gm, backend="inductor", fullgraph=True,
                             options=_inductor_patches(self.options) or None)


def _first_call_tolerance(decoder, out_dtype: torch.dtype) -> float:
    """How far a bucket's first megakernel call may be from the graph run as traced (relative L2 of logits and
    new K/V): 1e-3 for the fp32 reference executor with fp32 GEMV inputs and fp32 attention, 2e-2 where it rounds
    them to bf16 as the kernel does (batched buckets on the tensor cores: bf16 rounding moves the logits by ~5e-3;
    batch 1's fused short-context steps score whole KV groups on the tensor cores, ``decoder.fused_mma``: ~1e-3 on
    random weights), 0.1 for bf16 kernels. A graph that scales or post-processes the output is off by far more."""
    if decoder.backend != "reference" or out_dtype != torch.float32:
        return 0.1
    return 1e-3 if decoder.plan.staging_dtype == "float32" and not decoder.fused_mma else 2e-2
