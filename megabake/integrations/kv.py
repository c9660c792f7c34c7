"""KV-cache transfer between Hugging Face caches and a :class:`~megabake.runtime.MegakernelDecoder`'s own cache.

Contract: the decoder keeps its KV cache as ``[L, Bd, KVH, C, D]`` tensors; transformers (>= 5) keeps one
``[B, KVH, S, D]`` tensor per layer (``cache.layers[i].keys`` / ``.values``, plus a 0-d ``cumulative_length``
tensor for a ``StaticLayer``). A megakernel step reads only the decoder's cache, so whoever serves decode steps
keeps the two in step with a :class:`DecoderCacheSync`:

* ``load(keys, values, length)``: the decoder's cache becomes HF's positions ``[0, length)`` of rows
  ``[0, B)`` (everything else zero): used before the first megakernel step of a sequence.
* ``is_current(witness, length)``: the decoder already holds that HF cache up to ``length``. The witness is
  HF's layer-0 key tensor; it is current when it is the tensor last loaded or written (same object) and its
  version counter has not moved since. PyTorch bumps that counter on every in-place write, eager or compiled
  (Inductor included), so any write that did not come through the sync (an eager prefill, ``cache.reset()``,
  a fallback step) forces a reload. Inference-mode tensors have no version counter: then it always reloads.
* ``step_kv(position, batch)``: the K/V the last megakernel step wrote at ``position``, per layer
  ``[B, KVH, D]``; :func:`write_static_step` stores them into HF's static tensors and advances each
  ``cumulative_length`` by one, exactly the in-place writes of HF's ``StaticLayer.update`` for one token.

:func:`prefix_mask_ok` says whether an attention mask lets position ``p`` see exactly ``[0, p]``, or with a
sliding window ``w`` exactly ``[p - w + 1, p]``: the only masks the megakernel implements (no padding);
:func:`mask_window` gives the window a decoder's plan bakes for a mask (per layer type of transformers' mask
mapping, or the one window every layer shares).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass
class _Witness:
    tensor: "weakref.ref[torch.Tensor]"
    version: int | None
    length: int


def tensor_version(tensor: torch.Tensor) -> int | None:
    """``tensor._version``, or None for inference-mode tensors (which do not track writes)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


class DecoderCacheSync:
    """Which HF cache the decoder's KV cache mirrors, and up to which position (module doc)."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.loads = 0
        self._witness: _Witness | None = None

    def is_current(self, witness: torch.Tensor, length: int) -> bool:
        known = self._witness
        if known is None or known.tensor() is not witness or known.length != length:
            return False
        return known.version is not None and known.version == tensor_version(witness)

    def remember(self, witness: torch.Tensor, length: int) -> None:
        """Record that the decoder now mirrors ``witness``'s cache up to ``length``."""
        self._witness = _Witness(weakref.ref(witness), tensor_version(witness), length)

    def forget(self) -> None:
        self._witness = None

    def load(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Copy HF's positions ``[0, length)`` of every layer into the decoder (rest zeroed)."""
        k_cache, v_cache = self.decoder.kv_cache()
        check_layout(k_cache, keys, length)
        self.decoder.reset()
        batch = keys[0].shape[0]
        if length:
            dst = [k_cache[i, :batch, :, :length] for i in range(len(keys))]
            dst += [v_cache[i, :batch, :, :length] for i in range(len(values))]
            src = [k[:, :, :length] for k in keys] + [v[:, :, :length] for v in values]
            torch._foreach_copy_(dst, src)
        self.loads += 1
        self.remember(keys[0], length)

    def step_kv(self, position: int, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The decoder's K and V at ``position`` for rows ``[0, batch)``: per layer ``[batch, KVH, D]``."""
        k_cache, v_cache = self.decoder.kv_cache()
        layers = k_cache.shape[0]
        return ([k_cache[i, :batch, :, position] for i in range(layers)],
                [v_cache[i, :batch, :, position] for i in range(layers)])


def check_layout(k_cache: torch.Tensor, keys: list[torch.Tensor], length: int) -> None:
    """HF's per-layer tensors must fit the decoder's cache: same layers, heads, head size, batch, length."""
    from ..errors import InputError

    layers, batch, heads, capacity, head_dim = k_cache.shape
    first = keys[0]
    if len(keys) != layers or first.shape[1] != heads or first.shape[3] != head_dim:
        raise InputError(f"the Hugging Face cache has {len(keys)} layers of {first.shape[1]} KV heads x "
                         f"{first.shape[3]} but the decoder's has {layers} layers of {heads} KV heads x {head_dim}: "
                         "the decoder was baked for another model")
    if first.shape[0] > batch:
        raise InputError(f"batch of {first.shape[0]} sequences is larger than the baked bucket (batch {batch}); "
                         f"bake a bucket with batch {first.shape[0]}")
    if length > capacity:
        raise InputError(f"{length} cached positions do not fit the decoder's KV capacity {capacity}; bake a "
                         "bucket with a larger capacity")


def write_static_step(keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[torch.Tensor],
                      new_keys: list[torch.Tensor], new_values: list[torch.Tensor], position: int) -> None:
    """Store one token's K/V at ``position`` of HF's static tensors and add 1 to every ``cumulative_length``."""
    dst = [k[:, :, position] for k in keys] + [v[:, :, position] for v in values]
    torch._foreach_copy_(dst, list(new_keys) + list(new_values))
    if lengths:
        torch._foreach_add_(lengths, 1)


def mask_window(decoder, mask_key: str | None = None) -> int:
    """The sliding window a 4-D mask for ``decoder`` may show: with ``mask_key`` (transformers' mask mapping:
    "full_attention", "sliding_attention") the plan's window for that layer type, else the window every layer
    of the plan shares (0: none, or windows that differ by layer, which one mask cannot show)."""
    windows = set(getattr(getattr(decoder, "plan", None), "windows", None) or [0])
    sliding = windows - {0}
    if mask_key is not None:
        return sliding.pop() if "sliding" in mask_key and len(sliding) == 1 else 0
    return windows.pop() if len(windows) == 1 else 0


def prefix_mask_ok(mask: torch.Tensor, position, window: int = 0) -> torch.Tensor:
    """0-d bool tensor: ``mask`` lets the token at ``position`` (int or 0-d tensor) see exactly ``[0, position]``,
    or, with a sliding ``window``, exactly the last ``window`` positions up to it (the keys the baked attention
    reads: transformers' sliding-window mask past the window).

    A 2-D mask ``[B, n]`` (1 = attend) must be all ones with ``n == position + 1`` (a padding mask: the model
    applies any window itself); a 4-D mask ``[B, 1, 1, C]`` (bool: True = attend; float: 0 = attend, additive)
    must allow exactly those slots.
    """
    allowed = mask == 0 if mask.is_floating_point() else mask.bool()
    if mask.ndim == 2:
        ok = allowed.all()
        return ok & (torch.as_tensor(position, device=mask.device) + 1 == mask.shape[-1])
    if mask.ndim != 4 or mask.shape[2] != 1:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    slots = torch.arange(mask.shape[-1], device=mask.device)
    position = torch.as_tensor(position, device=mask.device)
    expected = slots <= position
    if window:
        expected &= slots > position - window
    return (allowed == expected).all()
