"""Baselines the megakernel is timed against: the same HF decode step through torch.compile / CUDA graphs.

Contract: ``build_baseline(name, model, prompt_ids, capacity, *, compile_kwargs=None)`` returns a
:class:`BaselineStep` whose ``call(token_ids [B], position [1] long tensor) -> logits [B, V]`` runs one
decode step of ``model`` (its own weights, no copy) over its own transformers ``StaticCache`` of
``capacity`` slots, already prefilled eagerly with ``prompt_ids``. The returned logits may live in a static
buffer (clone to keep). Names (``BASELINES``):

* ``inductor-reduce-overhead``: ``torch.compile(step, fullgraph=True, mode="reduce-overhead")`` (Inductor
  with its CUDA-graph trees);
* ``inductor-graph``: ``torch.compile(step, fullgraph=True, mode="max-autotune-no-cudagraphs")`` captured
  by hand in one ``torch.cuda.CUDAGraph`` with static input buffers; a call copies the token ids and the
  position into those buffers and replays the graph (CUDA only);
* ``inductor-default-graph``: the same hand-captured graph of ``torch.compile(step, fullgraph=True)`` (Inductor's
  default mode: no kernel autotuning, cuBLAS matmuls). Opt-in (``--baselines``): max-autotune times its kernel
  choices while it compiles, and its graph moved between runs (OLMo-2-1B at KV 4096 on the H200: 1.63-1.66 ms in
  session 21, 4.54 ms in session 24), so a run can time both and be judged against the faster;
* ``eager``: the uncompiled step (not a default; a sanity point).

Long-RoPE models (Phi-3-128k, Phi-4-mini) choose their frequency factors with a data-dependent branch that
``fullgraph=True`` cannot trace: within the original range (``capacity <= original_max_position_embeddings``)
the branch always picks the short factors, so the baselines pin them (``rope_type`` "default", ``inv_freq`` =
``original_inv_freq``, what transformers' own update sets there; the model computes the same logits, and stays
pinned). A bucket past that range is refused with the reason (``BaselineError``).

``compile_kwargs`` replaces the compile options (tests use ``{"backend": "eager"}`` to check on a CPU that
the step traces with ``fullgraph=True``). ``eager_reference_logits`` gives the eager bf16 logits of the first
timed call, against which every candidate's first call is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import DeviceError, MegaBakeError
from ..rope import long_rope_rotaries, use_short_factors
from .reference import ReferenceDecoder, model_device

DEFAULT_BASELINES = ("inductor-reduce-overhead", "inductor-graph")
WARMUP_BEFORE_CAPTURE = 3


class BaselineError(MegaBakeError):
    """A baseline that cannot be built for this model and bucket (the message says why)."""


@dataclass
class BaselineStep:
    """``call`` must run under ``torch.no_grad()`` (as the timing harness does): the compiled graphs were
    traced without grad, and a call with grad enabled recompiles and does not replay them."""

    name: str
    call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    description: str
    keep_alive: tuple = ()  # what a captured graph reads by address (its KV cache, compiled module)


def decode_ids(ids: torch.Tensor) -> torch.Tensor:
    """Token ids [B] or [B, 1] as a [B, 1] tensor with strides (1, 1), whatever view they came from.

    Dynamo guards on strides (also of size-1 dims): a column sliced from [B, T] and a fresh tensor would
    compile twice, and a recompile re-records CUDA-graph trees, which clears cuBLAS workspaces under any
    hand-captured graph. One layout for every call keeps one compiled graph."""
    ids = ids.reshape(-1, 1).contiguous()
    return ids.as_strided(ids.shape, (1, 1))


def _prefilled(model, prompt_ids: torch.Tensor, capacity: int) -> ReferenceDecoder:
    runner = ReferenceDecoder(model, capacity=capacity)
    runner.prefill(prompt_ids)
    return runner


def build_eager(model, prompt_ids, capacity, compile_kwargs=None) -> BaselineStep:
    module = _prefilled(model, prompt_ids, capacity).module
    return BaselineStep("eager", lambda ids, pos: module(decode_ids(ids), pos), "eager HF forward, StaticCache")


def build_reduce_overhead(model, prompt_ids, capacity, compile_kwargs=None) -> BaselineStep:
    """Compiled and recorded here: CUDA-graph trees clear cuBLAS workspaces while they warm up and record,
    which frees the workspace a hand-captured graph (``inductor-graph``) replays with. Recording before any
    hand capture (``build_order``) keeps that graph valid."""
    module = _prefilled(model, prompt_ids, capacity).module
    options = compile_kwargs or {"fullgraph": True, "mode": "reduce-overhead"}
    compiled = torch.compile(module, **options)

    def call(ids, pos):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(decode_ids(ids), pos)

    ids = prompt_ids[:, -1].to(model_device(model))
    pos = torch.tensor([prompt_ids.shape[1]], dtype=torch.long, device=ids.device)
    for _ in range(WARMUP_BEFORE_CAPTURE):  # compile, warm up, record the graph tree
        call(ids, pos)
    return BaselineStep("inductor-reduce-overhead", call, f"torch.compile({options})")


AUTOTUNED_GRAPH_OPTIONS = {"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}
DEFAULT_MODE_GRAPH_OPTIONS = {"fullgraph": True}


def build_graph_captured(model, prompt_ids, capacity, compile_kwargs=None) -> BaselineStep:
    return _hand_captured("inductor-graph", model, prompt_ids, capacity, compile_kwargs or AUTOTUNED_GRAPH_OPTIONS)


def build_default_mode_graph(model, prompt_ids, capacity, compile_kwargs=None) -> BaselineStep:
    return _hand_captured("inductor-default-graph", model, prompt_ids, capacity,
                          compile_kwargs or DEFAULT_MODE_GRAPH_OPTIONS)


def _hand_captured(name: str, model, prompt_ids, capacity: int, options: dict) -> BaselineStep:
    """``torch.compile(runner.module, **options)`` warmed up on a side stream, then captured in one CUDAGraph."""
    if model_device(model).type != "cuda":
        raise DeviceError(f"the {name} baseline captures a CUDA graph: the model must be on a CUDA GPU")
    runner = _prefilled(model, prompt_ids, capacity)
    compiled = torch.compile(runner.module, **options)
    device = model_device(model)
    static_ids = decode_ids(prompt_ids[:, -1].to(device)).clone()
    static_pos = torch.tensor([prompt_ids.shape[1]], dtype=torch.long, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Autotuning benchmarks candidate kernels; run them in a subprocess so a faulting candidate cannot leave a
    # sticky CUDA error in this process (and crash the megakernel's timing afterwards).
    with torch.no_grad(), torch.cuda.stream(side), _autotune_in_subprocess():
        for _ in range(WARMUP_BEFORE_CAPTURE):
            compiled(static_ids, static_pos)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = compiled(static_ids, static_pos)

    def call(ids, pos):
        static_ids.copy_(decode_ids(ids))
        static_pos.copy_(pos)
        graph.replay()
        return static_out

    # The graph holds raw addresses of the StaticCache: if ``runner`` were collected, its KV cache would go
    # back to the allocator and any later allocation would overwrite it under the replaying graph (seen on
    # the H200: logits rel-L2 0.57 vs eager after one eager step, stable, so the re-check did not catch it).
    return BaselineStep(name, call, f"torch.compile({options}) in one hand-captured CUDAGraph",
                        keep_alive=(runner, compiled))


def _autotune_in_subprocess():
    import torch._inductor.config as inductor_config

    return inductor_config.patch(autotune_in_subproc=True)


BASELINES = {
    "inductor-reduce-overhead": build_reduce_overhead,
    "inductor-graph": build_graph_captured,
    "inductor-default-graph": build_default_mode_graph,
    "eager": build_eager,
}
HAND_CAPTURED = ("inductor-graph", "inductor-default-graph")


def build_order(names) -> list[str]:
    """Hand-captured graphs last: see :func:`build_reduce_overhead`."""
    return sorted(names, key=lambda name: name in HAND_CAPTURED)


def build_baseline(name: str, model, prompt_ids, capacity: int, *, compile_kwargs=None) -> BaselineStep:
    try:
        builder = BASELINES[name]
    except KeyError:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}") from None
    if builder is not build_eager:
        pin_short_rope_factors(model, capacity)
    with torch.no_grad():
        return builder(model, prompt_ids, capacity, compile_kwargs)


def pin_short_rope_factors(model, capacity: int) -> None:
    """Make a long-RoPE model's rotaries plain RoPE over their short factors (see the module doc)."""
    for name, rotary in long_rope_rotaries(model):
        original = (getattr(rotary.config, "rope_parameters", None) or {}).get("original_max_position_embeddings")
        if original is None or capacity > int(original):
            raise BaselineError(
                f"{type(model).__name__}: long-RoPE ({name or 'rotary'}) switches to its long frequency factors past "
                f"position {original} by a data-dependent branch that torch.compile(fullgraph=True) cannot trace, and "
                f"KV capacity {capacity} passes it. fix: time the baselines at a bucket of at most {original} slots")
        use_short_factors(rotary)


@torch.no_grad()
def eager_reference_logits(model, prompt_ids, token_ids, position: int, capacity: int) -> torch.Tensor:
    """Eager logits [B, V] (fp32) of one step at ``position`` after prefilling ``prompt_ids``."""
    return _prefilled(model, prompt_ids, capacity).step(token_ids, position)
