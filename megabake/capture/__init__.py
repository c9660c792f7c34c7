"""Capture: a Hugging Face causal LM + a static KV cache -> an exported single-token decode step.

Contract: ``capture_decode_step(model, batch, capacity)`` returns a :class:`CapturedStep` holding the
``torch.export`` program of one decode step (ATen ops; KV cache as buffers mutated in place by
``index_copy_``), the mapping from graph placeholders to the model's parameters and cache buffers, and the
provenance of every node (HF module path, source line). Nothing here knows about kernels.
We use the library path that exists: ``transformers.integrations.executorch``'s static-cache export.

Long-RoPE (Phi-3-128k, Phi-4-mini; transformers' ``longrope``) switches between short and long frequency factors
on a data-dependent branch (``max(position_ids) + 1 > original_max_position_embeddings``) that torch.export cannot
trace: the step is exported as plain RoPE over the short factors (``original_inv_freq``), and for a bucket larger
than the original range ``CapturedStep.long_rope`` records, per rotary buffer fqn, the long factors' fp32
``inv_freq`` (as transformers computes it at the switch) and the switch position: a one-token decode step at
position ``p >= original_max_position_embeddings`` rotates with the long ones (the plan's rotary tables hold them
from that row on; the attention scaling is the same for both).
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

from ..errors import MegaBakeError, UnsupportedGraphError
from ..rope import long_rope_rotaries, use_short_factors

_WRAPPER_PREFIX = "model."  # the executorch wrapper holds the HF model as attribute "model"


@dataclass
class CapturedStep:
    """An exported decode step and what its placeholders stand for."""

    program: "torch.export.ExportedProgram"
    model: torch.nn.Module
    config: object
    batch: int
    capacity: int
    parameters: dict[str, str] = field(default_factory=dict)  # placeholder -> HF parameter fqn
    cache_buffers: dict[str, tuple[int, str]] = field(default_factory=dict)  # placeholder -> (layer, k|v)
    other_buffers: dict[str, str] = field(default_factory=dict)  # placeholder -> buffer target
    user_inputs: list[str] = field(default_factory=list)  # [input_ids, cache_position]
    seconds: float = 0.0
    # long-RoPE past its original range: rotary inv_freq buffer fqn (HF, no wrapper prefix) -> (the long factors'
    # fp32 inv_freq, the first position that rotates with them); empty for a bucket within the range
    long_rope: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)

    @property
    def graph(self):
        return self.program.graph

    def parameter_tensor(self, placeholder: str) -> torch.Tensor:
        return self.model.get_parameter(self.parameters[placeholder])

    def buffer_tensor(self, placeholder: str) -> torch.Tensor:
        target = self.other_buffers[placeholder]
        if target in self.program.state_dict:
            return self.program.state_dict[target]
        return self.program.constants[target]


def hf_module_path(node) -> str:
    """The innermost HF module path of an FX node, without the export wrapper's prefix."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path[len(_WRAPPER_PREFIX):] if path.startswith(_WRAPPER_PREFIX) else path


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def source_line(node) -> str:
    """'file.py:LINE in func' of the innermost frame of the node's stack trace, or ''."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    path, line, func = frames[-1]
    return f"{path.rsplit('site-packages/', 1)[-1]}:{line} in {func}"


def full_length_static_cache(config, capacity: int):
    """A transformers ``StaticCache`` whose every layer holds ``capacity`` positions, the layout of the captured
    step and of the megakernel's cache: a sliding-window layer keeps each key at its position and the model's
    sliding-window mask limits what attention sees (transformers' own StaticCache would make such a layer a
    window-long ring, whose slots are not positions)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=config, max_cache_len=capacity)
    cache.layers = [layer if type(layer) is StaticLayer else StaticLayer(max_cache_len=capacity)
                    for layer in cache.layers]
    return cache


def _static_cache_generation_config(model, batch: int, capacity: int, device: str):
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=capacity,
        cache_config={"batch_size": batch, "max_cache_len": capacity, "device": device},
    )


def capture_decode_step(model, *, batch: int = 1, capacity: int = 128) -> CapturedStep:
    """Export one decode step (one new token per sequence at a runtime cache position)."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    if batch < 1 or capacity < 2:
        raise MegaBakeError(f"bucket batch={batch}, capacity={capacity} is invalid: need batch >= 1, capacity >= 2")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and capacity > max_pos:
        raise MegaBakeError(
            f"KV capacity {capacity} exceeds the model's max_position_embeddings {max_pos}; "
            f"bake with --capacity {max_pos} or less"
        )
    _check_layer_types(model.config)
    started = time.perf_counter()
    device = str(next(model.parameters()).device)
    _static_cache_generation_config(model, batch, capacity, device)
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=batch, max_cache_len=capacity)
    input_ids = torch.full((batch, 1), 1, dtype=torch.long, device=device)
    cache_position = torch.tensor([min(3, capacity - 1)], dtype=torch.long, device=device)
    with warnings.catch_warnings(), _long_rope_as_short_factors(model, capacity) as long_rope, \
            _dropping_dynamo_compiled_functions():
        warnings.simplefilter("ignore")
        try:
            program = exportable.export(input_ids=input_ids, cache_position=cache_position)
        except Exception as exc:  # torch.export failures are long; keep the cause, add the fix
            raise MegaBakeError(
                f"torch.export of the decode step failed for {type(model).__name__}: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}. The model must support transformers' "
                "static-cache export (StaticCache + TorchExportableModuleForDecoderOnlyLM)."
            ) from exc
    step = CapturedStep(program=program, model=model, config=model.config, batch=batch, capacity=capacity,
                        long_rope=long_rope)
    _classify_placeholders(step)
    step.seconds = time.perf_counter() - started
    return step


_DYNAMO_COMPILED_FN_PREFIX = "__compiled_fn_"


@contextlib.contextmanager
def _dropping_dynamo_compiled_functions():
    """Remove the compiled functions that ``torch.export``'s Dynamo capture installs into the globals of the module it
    traced (torch 2.13: ``torch._dynamo.functional_export``) and never removes: each one holds the captured graph
    module and, through it, every weight of the exported model, so each capture leaked its model's size for the life
    of the process (a CPU test run grew to 24 GB and was OOM-killed; a user baking several buckets paid the same).
    The ``CapturedStep`` keeps the program; only these stray module-global references go. Every export resets
    Dynamo's caches before tracing, so no later call can reach a removed name."""
    def compiled_function_names() -> set[tuple[str, str]]:
        return {(module_name, key) for module_name, module in list(sys.modules.items())
                if module_name.startswith("torch") and module is not None
                for key in list(getattr(module, "__dict__", {})) if key.startswith(_DYNAMO_COMPILED_FN_PREFIX)}

    before = compiled_function_names()
    try:
        yield
    finally:
        for module_name, key in compiled_function_names() - before:
            vars(sys.modules[module_name]).pop(key, None)


@contextlib.contextmanager
def _long_rope_as_short_factors(model, capacity: int):
    """transformers' long-RoPE (Phi-3-128k, Phi-4-mini) rotates with short or long frequency factors chosen by the
    largest position (a data-dependent branch torch.export cannot trace): the step is exported as plain RoPE over
    the short ones (``original_inv_freq``; the model's ``inv_freq`` is set to them, as transformers' own update
    does within the range). Yields ``{inv_freq fqn: (long inv_freq, switch position)}`` for the rotaries whose
    original range the bucket passes (``capacity > original_max_position_embeddings``), else ``{}``."""
    rotaries = long_rope_rotaries(model)
    long_rope: dict[str, tuple[torch.Tensor, int]] = {}
    for name, rotary in rotaries:
        original = (getattr(rotary.config, "rope_parameters", None) or {}).get("original_max_position_embeddings")
        if original is None:
            raise UnsupportedGraphError(
                f"long-RoPE scaling ({type(rotary).__name__}) without original_max_position_embeddings in its "
                "rope_parameters: the position where transformers switches to the long frequency factors is "
                "unknown; set it in the model's config")
        if capacity > int(original):
            long_rope[f"{name}.inv_freq" if name else "inv_freq"] = (_long_inv_freq(rotary, int(original)),
                                                                     int(original))
        use_short_factors(rotary)
    try:
        yield long_rope
    finally:
        for _, rotary in rotaries:
            rotary.rope_type = "longrope"


def _long_inv_freq(rotary, original: int) -> torch.Tensor:
    """The long factors' inverse frequencies in fp32 on the CPU, computed as transformers'
    ``longrope_frequency_update`` does past the original range (``rope_init_fn(config, device,
    seq_len=original + 1)``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, "cpu", seq_len=original + 1)
    short = rotary.original_inv_freq
    if inv_freq.shape != short.shape:
        raise UnsupportedGraphError(
            f"long-RoPE scaling ({type(rotary).__name__}): the long factors give {inv_freq.numel()} frequencies, "
            f"the short ones {short.numel()}; the config's long_factor and short_factor must be the same length")
    return inv_freq.detach().to(dtype=torch.float32).cpu().clone()


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # layers with a KV cache (the IR judges windows)


def _check_layer_types(config) -> None:
    """Hybrid models (Qwen3.5 / Qwen3-Next: Gated DeltaNet linear-attention layers; Mamba-style layers) keep a
    recurrent state beside the KV cache: refuse them by the layer type, before export fails obscurely."""
    config = getattr(config, "get_text_config", lambda: config)()
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other:
        counts = ", ".join(f"{t} x{layer_types.count(t)}" for t in sorted(set(layer_types)))
        raise UnsupportedGraphError(
            f"{type(config).__name__} has {', '.join(repr(t) for t in other)} layers ({counts}): hybrid "
            "linear-attention / recurrent layers keep a per-sequence recurrent state beside the KV cache, which the "
            "megakernel does not have yet (only softmax attention over a static KV cache is baked; docs/MODELS.md "
            "says what it would take). Run it with torch.compile(model, backend=megabake.make_backend()) "
            "(unsupported graphs go through Inductor).")


_CACHE_TARGET = re.compile(r"^(key|value)_cache_(\d+)$")


def _classify_placeholders(step: CapturedStep) -> None:
    from torch.export.graph_signature import InputKind

    for spec in step.program.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            target = spec.target
            step.parameters[name] = target[len(_WRAPPER_PREFIX):] if target.startswith(_WRAPPER_PREFIX) else target
        elif spec.kind == InputKind.BUFFER:
            match = _CACHE_TARGET.match(spec.target or "")
            if match:
                step.cache_buffers[name] = (int(match.group(2)), "k" if match.group(1) == "key" else "v")
            else:
                step.other_buffers[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            step.user_inputs.append(name)
