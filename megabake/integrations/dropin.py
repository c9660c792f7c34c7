"""transformers ``generate`` drop-in: the megakernel does every decode step of ``model.generate(...)``.

Contract: ``serve_decode_steps(model, decoder, fallback="error")`` returns a :class:`DecodeStepServer`. As a
context manager (or between ``attach()`` and ``detach()``) it replaces ``model.forward`` (an instance attribute
with the original's signature, so ``generate`` passes the same arguments) with a router:

* **decode step**: one new token per sequence (``input_ids`` [B, 1]) on a cache that already holds ``p``
  positions -> ``decoder.step(input_ids[:, 0], p)``, returned as ``CausalLMOutputWithPast(logits [B, 1, V]
  fp32, past_key_values=the cache)``. The step's K/V are also written into the HF cache (a ``StaticLayer`` in
  place, exactly as its ``update`` would; other layers through ``cache.update``), so the cache stays a valid
  HF cache: ``get_seq_length()``, masks, a cache returned to the caller or reused eagerly all see every token.
* **fresh prefill**: a prompt on an empty cache asking only for the last position's logits
  (``logits_to_keep=1``, what ``generate`` asks) with the bucket's batch -> ``decoder.prefill(prompt)``, the
  eager HF forward ``MegakernelDecoder.generate`` uses, whose KV is then copied into the HF cache. Same prefill,
  same steps, same fp32 argmax: greedy ``model.generate`` gives token for token ``decoder.generate``'s ids.
* **any other call with a cache** (a prompt continuing a cache, full logits asked, fewer sequences than the
  bucket) -> the model's own forward, eagerly; the decoder loads the cache's positions before its next step.
* **calls that are not decode steps** (no cache, ``inputs_embeds``, ``labels``, attention or hidden-state
  outputs, ``use_cache=False``) -> the model's own forward.

The decoder's KV cache follows the HF cache through :class:`~megabake.integrations.kv.DecoderCacheSync` (a
write to the HF cache that did not come through the server makes the decoder reload it before its next step).
A decode step the megakernel cannot serve (a padded batch: positions or mask other than ``0..p``; position
at or past the decoder's capacity; more sequences than its bucket) raises :class:`InputError` naming the cause
(``fallback="error"``, the default: the megakernel does every decode step or you are told why), or runs the
model's forward eagerly (``fallback="eager"``); ``server.stats`` counts what ran where. The replacement
forward is excluded from ``torch.compile`` tracing (transformers compiles the forward of static-cache
decoding on CUDA by itself; pass ``disable_compile=True`` to ``generate`` to skip that tracing entirely).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..errors import InputError
from .bake import MODEL_FORWARD_PATCH
from .kv import DecoderCacheSync, mask_window, prefix_mask_ok, write_static_step

FALLBACKS = ("error", "eager")
_NOT_DECODE_FLAGS = ("output_attentions", "output_hidden_states")


@dataclass
class DropInStats:
    """What served the calls made while attached."""

    decode_steps: int = 0  # one-token calls run by the megakernel
    prefills: int = 0  # prompts prefilled by decoder.prefill (then copied into the HF cache)
    eager_calls: int = 0  # calls run by the model's own forward (other prefills, non-decode calls, fallbacks)
    fallback_steps: int = 0  # decode steps run eagerly because the megakernel could not serve them
    last_fallback: str = ""  # why the last one could not


class _Misfit(Exception):
    """A decode step the megakernel cannot serve; the message says why."""


class DecodeStepServer:
    """Routes ``model``'s forward calls to ``decoder`` (module doc). Use as a context manager."""

    def __init__(self, model, decoder, *, fallback: str = "error"):
        if fallback not in FALLBACKS:
            raise InputError(f"fallback={fallback!r} is not one of {', '.join(map(repr, FALLBACKS))}: 'error' "
                             "raises when the megakernel cannot serve a decode step, 'eager' runs the model's forward")
        check_pair(model, decoder)
        self.model, self.decoder, self.fallback = model, decoder, fallback
        self.stats = DropInStats()
        self.sync = DecoderCacheSync(decoder)
        self._original = None
        self._saved = None
        self._inside = False

    # ------------------------------------------------------------------------------------- attach
    def attach(self) -> "DecodeStepServer":
        current = self.model.__dict__.get("forward")
        if current is not None and hasattr(current, MODEL_FORWARD_PATCH):
            raise InputError("this model's forward is already served by a DecodeStepServer: detach it (leave its "
                             "`with` block) before serving another decoder")
        self._saved = current
        self._original = self.model.forward
        self.model.forward = self._make_forward(self._original)
        self.sync.forget()
        return self

    def detach(self) -> None:
        if self._original is None:
            return
        if self._saved is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self._saved
        self._original = self._saved = None

    def __enter__(self) -> "DecodeStepServer":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def cache_loads(self) -> int:
        """How many times the decoder (re)loaded its KV cache from an HF cache."""
        return self.sync.loads

    def _make_forward(self, original):
        server = self

        def forward(*args, **kwargs):
            return server.route(original, args, kwargs)

        forward = torch.compiler.disable(forward)
        forward.__signature__ = inspect.signature(original)
        forward.__doc__ = original.__doc__
        setattr(forward, MODEL_FORWARD_PATCH, True)
        return forward

    # ------------------------------------------------------------------------------------- routing
    def route(self, original, args, kwargs):
        """Run one forward call on the megakernel, ``decoder.prefill`` or ``original`` (module doc)."""
        if self._inside:  # decoder.prefill runs the same model: let it through
            return original(*args, **kwargs)
        call = _arguments(original, args, kwargs)
        cache, ids = call.get("past_key_values"), call.get("input_ids")
        if not _is_cached_token_call(call, cache, ids):
            return self._eager(original, args, kwargs)
        if ids.shape[1] == 1:
            step = _read_step(call, cache, ids, self.decoder)
            past = step.position
            if past > 0:
                try:
                    return self._decode(call, cache, ids, step)
                except _Misfit as misfit:
                    return self._fallback(original, args, kwargs, str(misfit))
        else:
            past = int(cache.get_seq_length())
        if past == 0 and self._prefill_fits(call, ids):
            return self._prefill(call, cache, ids)
        return self._eager(original, args, kwargs)

    def _eager(self, original, args, kwargs):
        self.stats.eager_calls += 1
        return original(*args, **kwargs)

    def _fallback(self, original, args, kwargs, reason: str):
        if self.fallback == "error":
            raise InputError(f"the megakernel cannot serve this decode step: {reason}. Serve with "
                             "fallback='eager' to run such steps through the model's own forward")
        self.stats.fallback_steps += 1
        self.stats.last_fallback = reason
        return self._eager(original, args, kwargs)

    # ------------------------------------------------------------------------------------- prefill
    def _prefill_fits(self, call, ids) -> bool:
        """A fresh prompt whose only output generate needs is the last position's logits, no padding."""
        rows, length = ids.shape
        if call.get("logits_to_keep") != 1 or rows != self.decoder.batch or length > self.decoder.capacity:
            return False
        positions = call.get("position_ids")
        if positions is not None and not torch.equal(positions.cpu().expand(rows, length),
                                                     torch.arange(length).expand(rows, length)):
            return False
        mask = call.get("attention_mask")
        return mask is None or (torch.is_tensor(mask) and mask.ndim == 2 and bool(mask.bool().all()))

    @torch.no_grad()
    def _prefill(self, call, cache, ids):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        self._inside = True
        try:
            logits = self.decoder.prefill(ids)
        finally:
            self._inside = False
        length = ids.shape[1]
        k_cache, v_cache = self.decoder.kv_cache()
        dtype = _model_dtype(self.model)
        for layer in range(k_cache.shape[0]):
            cache.update(k_cache[layer, :, :, :length].to(device=ids.device, dtype=dtype, copy=True),
                         v_cache[layer, :, :, :length].to(device=ids.device, dtype=dtype, copy=True), layer)
        self.sync.remember(cache.layers[0].keys, length)
        self.stats.prefills += 1
        return _output(CausalLMOutputWithPast(logits=logits[:, None, :].to(ids.device), past_key_values=cache), call)

    # ------------------------------------------------------------------------------------- decode
    @torch.no_grad()
    def _decode(self, call, cache, ids, step: "_Step"):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        rows, position = ids.shape[0], step.position
        self._check_step(step, rows)
        keys, values = _layer_tensors(cache)
        if not self.sync.is_current(keys[0], position):
            self.sync.load(keys, values, position)
        logits = self.decoder.step(step.tokens, position)[:rows].to(device=ids.device, dtype=torch.float32,
                                                                     copy=True)
        new_keys, new_values = self.sync.step_kv(position, rows)
        _store_step(cache, new_keys, new_values, position)
        self.sync.remember(cache.layers[0].keys, position + 1)
        self.stats.decode_steps += 1
        return _output(CausalLMOutputWithPast(logits=logits[:, None, :], past_key_values=cache), call)

    def _check_step(self, step: "_Step", rows: int) -> None:
        decoder, position = self.decoder, step.position
        if rows > decoder.batch:
            raise _Misfit(f"{rows} sequences are more than the decoder's bucket (batch {decoder.batch})")
        if position >= decoder.capacity:
            raise _Misfit(f"position {position} is outside the decoder's KV capacity [0, {decoder.capacity}): "
                          "bake a bucket with a larger capacity")
        if bool((step.positions != position).any()):
            raise _Misfit(f"position_ids {step.positions.tolist()} differ from the cache length {position} "
                          "(a padded batch?): the megakernel decodes every sequence at the cache's position")
        if not step.mask_ok:
            raise _Misfit("the attention mask hides some of positions 0..p (padding, or a window the plan does "
                          "not have): the megakernel attends to every cached position, or to its sliding window")


@dataclass
class _Step:
    """What a one-token call carries, read with one device-to-host copy."""

    tokens: torch.Tensor  # [B] on the host
    position: int  # the cache's length: the slot this token is written to
    positions: torch.Tensor  # position_ids on the host (empty when not given)
    mask_ok: bool  # every attention mask given lets the token see exactly 0..position (or its window)


def _read_step(call, cache, ids, decoder) -> _Step:
    device = ids.device
    length = torch.as_tensor(cache.get_seq_length(), device=device).reshape(1)
    positions = call.get("position_ids")
    positions = positions.reshape(-1) if torch.is_tensor(positions) else ids.new_empty(0)
    masks = call.get("attention_mask")
    masks = [(key, m) for key, m in (masks.items() if isinstance(masks, dict) else [(None, masks)])
             if torch.is_tensor(m)]
    checks = [prefix_mask_ok(mask, length[0], mask_window(decoder, key)).reshape(1) for key, mask in masks]
    parts = [ids.reshape(-1), length, positions, *checks]
    host = torch.cat([part.to(device=device, dtype=torch.long) for part in parts]).cpu()
    tokens, position, given, oks = host.split([ids.numel(), 1, positions.numel(), len(checks)])
    return _Step(tokens, int(position), given, bool(oks.all()))


def serve_decode_steps(model, decoder, *, fallback: str = "error") -> DecodeStepServer:
    """A :class:`DecodeStepServer` for ``model`` and ``decoder``; ``with serve_decode_steps(...):`` attaches it."""
    return DecodeStepServer(model, decoder, fallback=fallback)


def check_pair(model, decoder) -> None:
    """``decoder`` must have been baked for ``model``'s architecture (same config hash)."""
    from ..presets import config_hash

    config = getattr(model, "config", None)
    bound = getattr(decoder, "model", None)
    if config is None or not hasattr(decoder, "step") or not hasattr(decoder, "kv_cache"):
        raise InputError("serve_decode_steps needs a Hugging Face causal LM and a MegakernelDecoder (or "
                         "megabake.integrations.bake_decoder(model, ...))")
    if bound is not None and bound is not model and config_hash(bound.config) != config_hash(config):
        raise InputError("the decoder was baked for a model with another config (config hash "
                         f"{config_hash(bound.config)[:12]} vs {config_hash(config)[:12]}): bake it for this model")


def _arguments(original, args, kwargs) -> dict:
    """The call's arguments by name (variadic keyword arguments merged in)."""
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    named = dict(bound.arguments)
    for name, parameter in inspect.signature(original).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    return named


def _is_cached_token_call(call, cache, ids) -> bool:
    """A call of token ids with a cache whose outputs are only logits and the cache."""
    if cache is None or not hasattr(cache, "layers") or not torch.is_tensor(ids) or ids.ndim != 2:
        return False
    if call.get("inputs_embeds") is not None or call.get("labels") is not None or call.get("use_cache") is False:
        return False
    return not any(call.get(flag) for flag in _NOT_DECODE_FLAGS)


def _layer_tensors(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def _store_step(cache, new_keys, new_values, position: int) -> None:
    """Write one token's K/V at ``position`` into every layer of the HF cache (module doc)."""
    from transformers.cache_utils import StaticLayer

    layers = cache.layers
    if all(type(layer) is StaticLayer for layer in layers):
        write_static_step([layer.keys for layer in layers], [layer.values for layer in layers],
                          [layer.cumulative_length for layer in layers], new_keys, new_values, position)
        return
    for index, layer in enumerate(layers):
        dtype = layer.keys.dtype
        cache.update(new_keys[index][:, :, None].to(dtype=dtype, copy=True),
                     new_values[index][:, :, None].to(dtype=dtype, copy=True), index)


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _output(output, call):
    return output if call.get("return_dict", True) is not False else output.to_tuple()
