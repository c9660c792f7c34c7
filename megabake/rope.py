"""The one source of RoPE frequencies for everything that writes or reads the KV cache.

Contract: a model's rotary ``inv_freq`` buffers (and transformers' ``original_inv_freq``) are exact fp32
values, whatever dtype its weights are cast to. ``Module.to(torch.bfloat16)`` rounds those buffers too, so a
bf16 copy would rotate the prompt's keys (prefill, eager references) with rounded frequencies while the
megakernel rotates new keys with exact ones: an angle error of about ``position * 2^-9 * inv_freq`` radians,
whole radians at position 2000. HF's own ``from_pretrained(dtype=torch.bfloat16)`` keeps them fp32, so exact
fp32 frequencies are also what a user's eager bf16 model computes with.

* ``exact_inv_freq(model, fqn)``: the fp32 frequencies behind buffer ``fqn``, recomputed from the rotary
  module's config when the buffer was rounded (kept only when they round to the buffer), on the CPU.
* ``exact_rotary_buffers(model)``: ``{fqn: fp32 tensor}`` for every rotary buffer of ``model``.
* ``long_rope_rotaries(model)``: ``[(name, module)]`` of its long-RoPE rotaries (Phi-3-128k, Phi-4-mini), and
  ``use_short_factors(rotary)``: make one plain RoPE over its short factors (``inv_freq`` = ``original_inv_freq``,
  ``rope_type`` "default"), what transformers' own update picks within ``original_max_position_embeddings``.
* ``cast_model(model, dtype=..., device=...)``: ``model.to(...)`` in place, then every rotary buffer restored
  to its exact fp32 value on the model's device. Every path that casts a model (runtime binding, prefill,
  verification references, autotune, baselines) goes through it.
"""

from __future__ import annotations

import re

import torch

ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")  # also "<layer type>_inv_freq" (Gemma 3: one table per type)
_ROTARY_LEAF = re.compile(r"(?:(\w+?)_)??(?:original_)?inv_freq")


def _rotary_leaf(leaf: str) -> tuple[bool, str | None]:
    """Whether a buffer name is a rotary frequency table, and the layer type it belongs to (None: the model's)."""
    match = _ROTARY_LEAF.fullmatch(leaf)
    return (True, match.group(1)) if match else (False, None)


def exact_inv_freq(model, fqn: str) -> torch.Tensor:
    """The fp32 inverse frequencies behind ``model``'s rotary buffer ``fqn`` (see module doc), on the CPU."""
    buffer = model.get_buffer(fqn).detach()
    if buffer.dtype == torch.float32:
        return buffer.cpu().clone()
    owner = model.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else model
    recomputed = _recompute_inv_freq(owner, _rotary_leaf(fqn.rpartition(".")[2])[1])
    if recomputed is not None and recomputed.shape == buffer.shape and torch.equal(
            recomputed.to(buffer.dtype), buffer.cpu()):
        return recomputed
    return buffer.float().cpu().clone()


def exact_rotary_buffers(model) -> dict[str, torch.Tensor]:
    """Every rotary frequency buffer of ``model`` (names in :data:`ROTARY_BUFFERS`) as exact fp32, on the CPU."""
    exact = {}
    for fqn, _ in model.named_buffers():
        if _rotary_leaf(fqn.rpartition(".")[2])[0]:
            exact[fqn] = exact_inv_freq(model, fqn)
    return exact


def restore_rotary_buffers(model, exact: dict[str, torch.Tensor]) -> None:
    """Put fp32 ``exact`` values back as ``model``'s rotary buffers (dtype included), on each buffer's device."""
    for fqn, values in exact.items():
        owner_name, _, leaf = fqn.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        device = owner._buffers[leaf].device
        owner._buffers[leaf] = values.to(device=device, dtype=torch.float32).clone()


def long_rope_rotaries(model) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if getattr(m, "rope_type", None) == "longrope"]


def use_short_factors(rotary) -> None:
    rotary.register_buffer("inv_freq", rotary.original_inv_freq.clone(), persistent=False)
    rotary.rope_type = "default"


def cast_model(model, *, dtype: torch.dtype | None = None, device=None):
    """``model.to(device, dtype)`` in place, keeping exact fp32 rotary buffers; returns ``model``."""
    exact = exact_rotary_buffers(model)
    model.to(device=device, dtype=dtype)
    restore_rotary_buffers(model, exact)
    return model


def _recompute_inv_freq(rotary_module, layer_type: str | None = None) -> torch.Tensor | None:
    config = getattr(rotary_module, "config", None)
    rope_type = getattr(rotary_module, "rope_type", None)
    if isinstance(rope_type, dict):  # one table per layer type (Gemma 3): rope_type[layer type]
        rope_type = rope_type.get(layer_type)
    if config is None or rope_type is None:
        return None
    options = {"layer_type": layer_type} if layer_type else {}
    try:
        if rope_type == "default":
            init = rotary_module.compute_default_rope_parameters
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, _ = init(config, "cpu", **options)
    except Exception:  # an init we cannot call the standard way: fall back to the buffer
        return None
    return inv_freq.detach().float().cpu()
