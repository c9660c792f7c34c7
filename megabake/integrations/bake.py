"""In-memory bake: a live Hugging Face model -> a bound :class:`~megabake.runtime.MegakernelDecoder`.

Contract: ``bake_decoder(model, batch=1, capacity=128)`` runs capture -> IR (strict) -> plan -> codegen for one
``(batch, capacity)`` bucket and binds the result, without writing a package or running the bake's checks
(``megabake.bake`` does those). The decoder runs where the model lives: the compiled megakernel when the model
is on a CUDA device (a Hopper GPU is required: :class:`DeviceError` otherwise), the plan's reference executor
when it is on the CPU. Errors are the bake's own: :class:`UnsupportedGraphError` names the FX node the IR
cannot express, :class:`PlanError` a bucket that does not fit.

``model`` itself is never modified. Capture runs on a private fp32 CPU copy (``torch.export`` of the decode step
needs fp32 weights and sets the model's ``generation_config``); the decoder binds a private copy whose modules
are new but whose parameters share the model's storage whenever they already have the decoder's dtype and
device (so no weight memory is duplicated), and are converted copies otherwise (a CUDA decoder computes in bf16:
an fp32 CUDA model costs one bf16 copy of its weights). The decoder packs the weights into its own buffers, so
later in-place edits of ``model``'s weights are not seen: bake again.
"""

from __future__ import annotations

import copy

import torch

from ..errors import InputError

MODEL_FORWARD_PATCH = "__megabake_served__"  # marks a forward replaced by a drop-in server


def bake_decoder(model, *, batch: int = 1, capacity: int = 128, threads: int = 256):
    """Bake ``model``'s decode step for one bucket and bind it (module doc)."""
    from ..compiler import compile_step
    from ..runtime import MegakernelDecoder

    check_bucket(batch, capacity)
    device = model_device(model)
    backend, ctas = decoder_target(device)
    twin = private_copy(model, dtype=torch.float32, device=torch.device("cpu"))
    with torch.inference_mode(False), torch.enable_grad():  # the export graph the IR reads is grad mode's
        compiled = compile_step(twin, batch=batch, capacity=capacity, ctas=ctas, threads=threads)
    dtype = torch.bfloat16 if backend == "cuda" else None
    bound = private_copy(model, dtype=dtype, device=device)
    return MegakernelDecoder(compiled.plan, compiled.generated.source, bound, device=device, backend=backend)


def check_bucket(batch, capacity) -> None:
    for name, value, least in (("batch", batch, 1), ("capacity", capacity, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(f"{name} must be an int >= {least}, got {value!r}")


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        raise InputError(f"{type(model).__name__} is not a torch model with parameters: pass a Hugging Face "
                         "causal LM (e.g. AutoModelForCausalLM.from_pretrained(...))") from None


def decoder_target(device: torch.device) -> tuple[str, int]:
    """(decoder backend, CTAs of the plan) for a model on ``device``."""
    from ..baking import DEFAULT_GPU_CLASS, parse_gpu_class
    from ..runtime import require_hopper

    if device.type == "cuda":
        return "cuda", require_hopper(device).sm_count
    if device.type == "cpu":
        return "reference", parse_gpu_class(DEFAULT_GPU_CLASS)[1]
    raise InputError(f"the model is on {device}; MegaBake runs megakernels on CUDA (Hopper) GPUs and the "
                     "reference executor on the CPU: move the model to 'cuda' or 'cpu'")


def private_copy(model, *, dtype: torch.dtype | None = None, device: torch.device | None = None):
    """A copy of ``model``'s module tree (same classes and submodules, attributes shared shallowly, hooks and
    state dicts copied) whose parameters share ``model``'s storage where they already have ``dtype`` / ``device``
    and are converted copies elsewhere; buffers are copies; rotary buffers stay exact fp32. Nothing is deep
    copied, so models holding unpicklable state (CUDA events, locks) copy too."""
    from ..rope import exact_rotary_buffers, restore_rotary_buffers

    params: dict[int, torch.nn.Parameter] = {}

    def parameter(param):
        if id(param) not in params:  # tied weights stay tied
            same = (dtype is None or param.dtype == dtype) and (device is None or param.device == device)
            data = param.detach() if same else param.detach().to(device=device, dtype=dtype)
            params[id(param)] = torch.nn.Parameter(data, requires_grad=False)
        return params[id(param)]

    def buffer(value):
        if value is None:
            return None
        target = dtype if dtype is not None and value.is_floating_point() else value.dtype
        return value.detach().to(device=device or value.device, dtype=target, copy=True)

    twin = _clone_tree(model, parameter, buffer)
    restore_rotary_buffers(twin, exact_rotary_buffers(model))
    twin.eval()
    return twin


def _clone_tree(module, parameter, buffer):
    twin = copy.copy(module)  # a new object whose __dict__ holds the same attribute values
    for name, value in module.__dict__.items():
        if isinstance(value, dict) and "hook" in name:
            twin.__dict__[name] = type(value)(value)  # hooks registered on the copy stay on the copy
    twin._parameters = {name: None if p is None else parameter(p) for name, p in module._parameters.items()}
    twin._buffers = {name: buffer(b) for name, b in module._buffers.items()}
    twin._modules = {name: None if child is None else _clone_tree(child, parameter, buffer)
                     for name, child in module._modules.items()}
    twin._compiled_call_impl = None  # Module.compile() state would call back into the original model
    patched = twin.__dict__.get("forward")
    if hasattr(patched, MODEL_FORWARD_PATCH) or hasattr(patched, "_torchdynamo_orig_callable"):
        del twin.forward  # a drop-in server's or torch.compile's wrapper of the original model's forward
    return twin
