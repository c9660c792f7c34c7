"""Text generation over any decoder with the MegaBake interface (``prefill``, ``step``, ``batch``, ``capacity``).

Contract: ``generate(decoder, prompt_ids, max_new_tokens=..., eos_token_id=..., stop_strings=..., do_sample=...,
temperature=..., top_k=..., top_p=..., seed=..., streamer=..., tokenizer=...) -> Generation`` runs one eager
prefill, then one decode step per new token (one megakernel launch each on a GPU). Settings not given come
from the model's ``generation_config`` (``eos_token_id``, ``do_sample``, ``temperature``, ``top_k``,
``top_p``), as ``transformers``' own ``generate`` does. Greedy (``do_sample=False``) picks the argmax;
sampling applies temperature, then top-k, then top-p (nucleus), from a ``torch.Generator`` seeded by
``seed`` (same seed, same tokens). Generation stops after ``max_new_tokens``, when every sequence has produced
an end-of-sequence token (later tokens of a finished sequence are that token), or when the decoded new text of
every sequence contains a stop string (needs ``tokenizer``). ``streamer`` receives the prompt, then each new
token, then ``end()`` (the ``transformers.TextStreamer`` protocol: tokens appear as they are made).
Greedy decoding on a decoder with ``greedy_tokens`` (the megakernel) runs ``sync_every`` steps per host round
trip (argmax and position stay on the GPU; tokens reach the streamer in groups of ``sync_every``); the
tokens are the same as one step at a time (``sync_every=1``).
Every bad setting raises :class:`InputError` naming it. Timing: ``Generation.ms_per_token`` is decode time per
step over the whole answer; ``steady_ms_per_token`` leaves out the first host round trip, which captures the
megakernel's CUDA graphs on first use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .errors import InputError


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 16
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def check(self) -> "GenerationSettings":
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise InputError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        return self


@dataclass
class Generation:
    """``tokens`` [B, P + n] (prompt then the n <= max_new_tokens new tokens); why it stopped; timings."""

    tokens: torch.Tensor
    prompt_length: int
    stopped_by: str  # max_new_tokens | eos | stop_string
    prefill_s: float
    decode_s: float
    step_times_s: list[float] = field(default_factory=list)
    first_round_trip_steps: int = 0  # decode steps of the first host round trip (it captures the CUDA graphs)

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_length:]

    @property
    def ms_per_token(self) -> float | None:
        """Decode time per step over the whole answer, one-time costs of the first round trip included."""
        steps = len(self.step_times_s)
        return 1e3 * self.decode_s / steps if steps else None

    @property
    def steady_ms_per_token(self) -> float | None:
        """Decode time per step after the first host round trip, whose one-time set-up (the megakernel's CUDA
        graphs are captured on first use) would dominate a short answer; None without later steps."""
        first = self.first_round_trip_steps
        later = len(self.step_times_s) - first
        if first < 1 or later < 1:
            return None
        return 1e3 * (self.decode_s - sum(self.step_times_s[:first])) / later


def settings_for(model, **given) -> GenerationSettings:
    """``given`` (None entries dropped) over the model's ``generation_config`` over the defaults."""
    config = getattr(model, "generation_config", None)
    from_config = {}
    if config is not None:
        eos = getattr(config, "eos_token_id", None)
        from_config["eos_token_ids"] = _as_ids(eos)
        for name in ("do_sample", "temperature", "top_k", "top_p"):
            value = getattr(config, name, None)
            if value is not None:
                from_config[name] = value
    chosen = {k: v for k, v in given.items() if v is not None}
    if "eos_token_id" in chosen:
        chosen["eos_token_ids"] = _as_ids(chosen.pop("eos_token_id"))
    if "stop_strings" in chosen:
        stops = chosen["stop_strings"]
        chosen["stop_strings"] = (stops,) if isinstance(stops, str) else tuple(stops)
    return GenerationSettings(**{**from_config, **chosen}).check()


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def next_tokens(logits: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of ``logits`` [B, V] (fp32, any device) on the CPU: argmax, or a sample."""
    logits = logits.detach().float().cpu()
    if not settings.do_sample:
        return logits.argmax(-1)
    scores = logits / settings.temperature
    if settings.top_k:
        kth = scores.topk(min(settings.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= settings.top_p  # keep the smallest set reaching top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(decoder, prompt_ids, *, tokenizer=None, streamer=None, sync_every: int = 8, **given) -> Generation:
    """Prefill then decode step by step (module doc)."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise InputError(f"sync_every must be a positive int (greedy tokens per host round trip), got {sync_every!r}")
    settings = settings_for(getattr(decoder, "model", None), **given)
    prompt = torch.as_tensor(prompt_ids)
    prompt = prompt[None] if prompt.ndim == 1 else prompt
    length = prompt.shape[1]
    if length + settings.max_new_tokens > decoder.capacity + 1:
        raise InputError(f"prompt of {length} + {settings.max_new_tokens} new tokens exceeds the KV capacity "
                         f"{decoder.capacity}: lower max_new_tokens or bake a bucket with a larger --capacity")
    if settings.stop_strings and tokenizer is None:
        raise InputError("stop_strings need a tokenizer to decode the new text: pass tokenizer=...")
    generator = torch.Generator().manual_seed(settings.seed) if settings.seed is not None else None
    if streamer is not None:
        streamer.put(prompt.cpu())
    started = time.perf_counter()
    logits = decoder.prefill(prompt)
    prefill_s = time.perf_counter() - started
    tokens, step_times, round_trips = [], [], []
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool)
    stopped_by = "max_new_tokens"
    upcoming = _next_token_source(decoder, settings, generator, sync_every)
    decode_started = time.perf_counter()
    token = next_tokens(logits, settings, generator)
    while True:
        if tokens and settings.eos_token_ids:
            token = torch.where(finished, torch.full_like(token, settings.eos_token_ids[0]), token)
        tokens.append(token)
        if streamer is not None:
            streamer.put(token)
        finished |= _is_eos(token, settings.eos_token_ids)
        if bool(finished.all()):
            stopped_by = "eos"
            break
        if settings.stop_strings and _hit_stop(tokenizer, torch.stack(tokens, 1), settings.stop_strings):
            stopped_by = "stop_string"
            break
        if len(tokens) == settings.max_new_tokens:
            break
        token = upcoming(token, length + len(tokens) - 1, settings.max_new_tokens - len(tokens), step_times,
                         round_trips)
    decode_s = time.perf_counter() - decode_started
    if streamer is not None:
        streamer.end()
    out = torch.cat([prompt.cpu(), torch.stack(tokens, dim=1)], dim=1)
    return Generation(out, length, stopped_by, prefill_s, decode_s, step_times, (round_trips or [0])[0])


def _next_token_source(decoder, settings: GenerationSettings, generator, sync_every: int):
    """``upcoming(token, position, remaining, step_times, round_trips) -> next token``: one decode step per call,
    or, for greedy decoding on a decoder with ``greedy_tokens``, up to ``sync_every`` steps per host round trip
    (argmax and position stay on the GPU; the same tokens, since each step's input is the previous argmax).
    Each step's time goes to ``step_times``, each host round trip's step count to ``round_trips``."""
    pending: list[torch.Tensor] = []

    def one_step(token, position, remaining, step_times, round_trips):
        started = time.perf_counter()
        logits = decoder.step(token, position)
        chosen = next_tokens(logits, settings, generator)
        step_times.append(time.perf_counter() - started)
        round_trips.append(1)
        return chosen

    def chunked(token, position, remaining, step_times, round_trips):
        if not pending:
            count = min(sync_every, remaining)
            started = time.perf_counter()
            pending.extend(decoder.greedy_tokens(token, position, count).unbind(1))
            step_times.extend([(time.perf_counter() - started) / count] * count)
            round_trips.append(count)
        return pending.pop(0)

    greedy_on_device = not settings.do_sample and sync_every > 1 and hasattr(decoder, "greedy_tokens")
    return chunked if greedy_on_device else one_step


def _is_eos(token: torch.Tensor, eos_ids: tuple[int, ...]) -> torch.Tensor:
    if not eos_ids:
        return torch.zeros_like(token, dtype=torch.bool)
    return torch.isin(token, torch.tensor(eos_ids))


def _hit_stop(tokenizer, new_tokens: torch.Tensor, stops: tuple[str, ...]) -> bool:
    texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=False)
    return all(any(stop in text for stop in stops) for text in texts)
