"""A stand-in decoder with the ``MegakernelDecoder`` interface, built from eager HF forwards.

Contract: ``EagerDecoder(model, *, batch=1, capacity=128, exact=True, perturb=None)`` behaves like
``MegakernelDecoder`` for verification: ``model``, ``batch``, ``capacity``, ``vocab_size``, ``device``,
``weight_bytes``, ``reset()``, ``prefill(ids[B, P]) -> [B, V]``, ``step(ids[B] or B ints, position) ->
fp32 [B, V]`` (a view of a static buffer) and ``kv_cache() -> (keys, values)`` each ``[L, B, KVH, C, D]`` bf16.
``exact=True`` computes with an fp32 copy of the weights (closer to fp32 than eager bf16 is: numerics
must pass); ``exact=False`` runs ``model`` itself. ``perturb(step_index, logits) -> logits`` injects
errors (tests of the failure path). It lets the verify harness run where no megakernel exists: CPU tests,
and a GPU smoke test of the timing harness.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from .reference import ReferenceDecoder, model_device


class EagerDecoder:
    def __init__(self, model, *, batch: int = 1, capacity: int = 128, exact: bool = True,
                 perturb: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        self.model = model
        self.batch = batch
        self.capacity = capacity
        self.vocab_size = int(model.config.vocab_size)
        self.device = model_device(model)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        from ..rope import cast_model

        runner_model = cast_model(copy.deepcopy(model), dtype=torch.float32) if exact else model
        self._runner = ReferenceDecoder(runner_model, capacity=capacity, fp32=exact)
        self._perturb = perturb
        self._steps = 0
        self._out = torch.empty(batch, self.vocab_size, dtype=torch.float32, device=self.device)

    def reset(self) -> None:
        for layer in self._runner.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys.zero_()
                layer.values.zero_()
        self._steps = 0

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        if prompt_ids.shape[0] != self.batch:
            raise ValueError(f"prompt batch {prompt_ids.shape[0]} != bucket batch {self.batch}")
        return self._runner.prefill(prompt_ids)

    def step(self, token_ids, position: int) -> torch.Tensor:
        """``token_ids``: a [B] tensor or B ints, as ``MegakernelDecoder.step`` takes them (the timing harness
        passes host ints, so that no candidate pays a device-to-host copy per call)."""
        logits = self._runner.step(torch.as_tensor(token_ids), position)
        if self._perturb is not None:
            logits = self._perturb(self._steps, logits)
        self._steps += 1
        self._out.copy_(logits)
        return self._out

    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._runner.kv_cache()
        return keys.to(torch.bfloat16), values.to(torch.bfloat16)
