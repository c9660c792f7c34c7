"""Eager Hugging Face decoding over a transformers ``StaticCache``: the reference side of verification.

Contract: :class:`ReferenceDecoder` wraps an HF causal LM with its own ``StaticCache``
(``max_cache_len = capacity``) and offers the decoder interface the megakernel has: ``prefill(ids[B, P])``
and ``step(ids[B], position) -> fp32 logits [B, V]`` (new tensors), ``kv_cache() -> (keys, values)`` each
``[L, B, KVH, C, D]``. :class:`DecodeStep` is the same decode step as a ``torch.nn.Module`` taking the
position as a 1-element tensor, so ``torch.compile(fullgraph=True)`` and CUDA graphs can capture it.

transformers 5.x ``StaticLayer.update`` writes at its own counter ``cumulative_length`` (not at a
``cache_position`` argument); both classes set that counter to the requested position before every step,
so a step is a pure function of (token, position, cache) and may be repeated at the same position.
``reference_models(model)`` gives (eager bf16, fp32) copies of one model's weights.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch


def new_static_cache(model, capacity: int):
    from ..capture import full_length_static_cache

    return full_length_static_cache(model.config, capacity)


def _set_length(cache, position) -> None:
    """Point every layer's write counter at ``position`` (an int or a 1-element tensor)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            if isinstance(position, torch.Tensor):
                layer.cumulative_length.copy_(position.reshape(()))
            else:
                layer.cumulative_length.fill_(int(position))


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


@contextmanager
def exact_fp32():
    """Full-precision fp32 matmuls (no TF32) for the duration of the fp32 reference."""
    previous = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


class DecodeStep(torch.nn.Module):
    """One decode step of ``model`` over ``cache``: (ids [B, 1], position [1]) -> logits [B, V]."""

    def __init__(self, model, cache):
        super().__init__()
        self.model = model
        self.cache = cache

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        _set_length(self.cache, position)
        position_ids = position.reshape(1, 1).expand(input_ids.shape[0], 1)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, position_ids=position_ids, use_cache=True)
        return out.logits[:, -1, :]


class ReferenceDecoder:
    """Eager HF decoding with a StaticCache; same interface as the megakernel decoder (see module doc)."""

    def __init__(self, model, *, capacity: int, fp32: bool = False):
        self.model = model
        self.capacity = capacity
        self.fp32 = fp32
        self.device = model_device(model)
        self.cache = new_static_cache(model, capacity)
        self.module = DecodeStep(model, self.cache)

    @contextmanager
    def _precision(self):
        if self.fp32:
            with exact_fp32():
                yield
        else:
            yield

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        ids = prompt_ids.to(self.device)
        positions = torch.arange(ids.shape[1], device=self.device).unsqueeze(0).expand(ids.shape[0], -1)
        _set_length(self.cache, 0)
        with self._precision():
            out = self.model(input_ids=ids, past_key_values=self.cache, position_ids=positions, use_cache=True)
        return out.logits[:, -1, :].float()

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, position: int) -> torch.Tensor:
        if not 0 <= position < self.capacity:
            raise ValueError(f"position {position} outside the cache [0, {self.capacity})")
        ids = token_ids.to(self.device).reshape(-1, 1)
        pos = torch.tensor([position], dtype=torch.long, device=self.device)
        with self._precision():
            return self.module(ids, pos).float()

    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.stack([layer.keys for layer in self.cache.layers])
        values = torch.stack([layer.values for layer in self.cache.layers])
        return keys, values


def reference_models(model):
    """(eager bf16 model, fp32 model) holding ``model``'s weights; the bf16 one is ``model`` if already bf16.

    Both keep exact fp32 RoPE frequencies (``megabake.rope.cast_model``), as HF's own
    ``from_pretrained(dtype=torch.bfloat16)`` does: eager bf16 is the model a user would run.
    """
    from ..rope import cast_model

    bf16 = model if model_dtype(model) == torch.bfloat16 else copy.deepcopy(model)
    bf16 = cast_model(bf16, dtype=torch.bfloat16)
    fp32 = cast_model(copy.deepcopy(model), dtype=torch.float32)
    return bf16.eval(), fp32.eval()
