"""Runtime: bind a plan + generated module to a model's weights and run decode steps.

Contract: :class:`MegakernelDecoder` owns the packed weights, the KV cache (``[L, B, KVH, C, D]``) and the
workspace of one bucket. ``step(token_ids, position) -> logits [B, V]`` (fp32, a view of a static buffer)
runs one decode step: on an SM90 GPU as exactly one cooperative launch of the compiled megakernel, replayed
from a CUDA graph; on the CPU (``backend="reference"``) through the plan's reference executor.
``prefill(prompt_ids)`` runs the HF model eagerly and copies its KV cache into the decoder's;
``greedy_tokens(token_ids, position, n)`` runs n greedy steps in one host round trip (one CUDA graph: the
kernel, argmax, next input and position stay on the GPU). ``step`` checks its inputs in plain Python and
replays one of two step graphs whose first node copies the pinned input row (a synchronized call costs
~13 us over the kernel on the H200).
``generate(prompt_ids, max_new_tokens, ...)`` does prefill then megakernel decode (``megabake.generation``:
greedy or sampled, EOS / stop strings, streaming). Inputs outside the
bucket (position >= capacity, token id >= vocab, batch > bucket) raise :class:`InputError`.
``MegakernelDecoder.from_package(path, device=...)`` checks the package's toolchain (same CuTe DSL major.minor)
before anything is loaded, rebuilds the model named by ``report.json`` (preset with its seed, a Hub repo at the
pinned revision, or the local weights it was baked from) and binds it; on a GPU it loads the package's
precompiled kernel (``megakernel.sm_90a.o``, no JIT) when the toolchain matches exactly, else compiles
``module.py`` (``compile_path`` / ``compile_fallback`` say which and why).
"""

from __future__ import annotations

import json
import logging
import operator
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DeviceError, InputError, MegaBakeError
from ..plan import ATTN_WINDOW, ROPE_TABLE, Plan, kv_splits
from ..plan.packing import pack_weights, plan_inv_freqs, rotary_tables, torch_dtype
from ..plan.reference import ReferenceExecutor
from ..rope import cast_model, exact_rotary_buffers, restore_rotary_buffers


LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuInfo:
    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block_optin: int

    @property
    def gpu_class(self) -> str:
        from ..package.layout import gpu_class_of

        return gpu_class_of(self.capability, self.sm_count)


def gpu_info(device=None) -> GpuInfo | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
    optin = getattr(props, "shared_memory_per_block_optin", 227 * 1024)
    return GpuInfo(props.name, (props.major, props.minor), props.multi_processor_count, int(optin))


def require_hopper(device=None) -> GpuInfo:
    info = gpu_info(device)
    if info is None:
        raise DeviceError("no CUDA GPU is visible; MegaBake megakernels run on Hopper (SM90) GPUs such as the "
                          "H100/H200. On a CPU use backend='reference' (device='cpu') to run the plan's "
                          "reference executor.")
    if info.capability != (9, 0):
        raise DeviceError(f"{info.name} has compute capability {info.capability[0]}.{info.capability[1]}; "
                          "MegaBake megakernels need SM90 (Hopper: H100/H200). Use device='cpu' for the "
                          "reference executor.")
    return info


def check_admission(plan: Plan, info: GpuInfo) -> None:
    """Every CTA of the cooperative grid must be co-resident: one CTA per SM, smem within the opt-in limit."""
    smem = plan.smem_bytes
    if plan.ctas > info.sm_count:
        raise DeviceError(f"the plan launches {plan.ctas} cooperative CTAs but {info.name} has {info.sm_count} SMs; "
                          f"re-bake on this GPU (its GPU class is {info.gpu_class})")
    if smem > info.smem_per_block_optin:
        raise DeviceError(f"the kernel needs {smem} bytes of shared memory per CTA, over this GPU's limit of "
                          f"{info.smem_per_block_optin}; bake with a smaller batch")
    if plan.threads > 1024:
        raise DeviceError(f"{plan.threads} threads per CTA exceeds 1024")


STAGING_ROWS = 3  # two step graphs alternate rows 0 and 1; row 2 feeds direct uploads
DIRECT_ROW = 2


def host_token_ids(token_ids) -> list[int]:
    """Token ids (an int, a sequence of ints, or an integer tensor of one id per sequence) as host ints.
    A CUDA tensor is copied to the host (one sync): its ids must be checked before the kernel gathers rows."""
    if isinstance(token_ids, bool):
        raise InputError("token ids must be integers, got a bool")
    if isinstance(token_ids, int):
        return [token_ids]
    if torch.is_tensor(token_ids):
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise InputError(f"token ids must be an integer tensor, got dtype {token_ids.dtype}")
        return [int(t) for t in token_ids.reshape(-1).tolist()]
    try:
        values = list(token_ids)
    except TypeError:
        raise InputError(f"token ids must be an int, a sequence of ints or an integer tensor, got "
                         f"{type(token_ids).__name__}") from None
    ints = []
    for value in values:
        if torch.is_tensor(value) and value.numel() == 1 and not value.is_floating_point():
            value = int(value)
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise InputError(f"token ids must be integers, got {type(value).__name__} {value!r}")
        ints.append(int(value.__index__()))
    return ints


def host_position(position) -> int:
    """A step's position as a host int: a Python or numpy integer, or a one-element integer tensor (anything
    ``operator.index`` takes, as token ids are), never a bool, a float or a string."""
    if not (isinstance(position, bool) or torch.is_tensor(position) and (
            position.numel() != 1 or position.dtype == torch.bool or position.is_floating_point())):
        try:
            return operator.index(position)
        except TypeError:
            pass
    raise InputError(f"position must be an int, got {type(position).__name__} {position!r}")


def _module_flag(module_source: str, name: str) -> bool:
    """Whether module.py sets header constant ``name`` to something other than False / 0 (absent: False)."""
    match = re.search(rf"^{name} = (\S+)", module_source, re.MULTILINE)
    return match is not None and match.group(1) not in ("False", "0")


class MegakernelDecoder:
    """A baked decode step bound to weights, a KV cache and (on GPU) a compiled, graph-captured kernel."""

    def __init__(self, plan: Plan, module_source: str, model, *, device=None, backend: str | None = None,
                 package_dir: Path | None = None, report: dict | None = None, use_graph: bool = True):
        self.plan = plan
        self.module_source = module_source
        # split-KV items of 2-8 query heads on the tensor cores (module.py's header constant, written by codegen):
        # the reference backend mirrors their bf16 rounding, and GPU checks build their reference with it
        # (True, or a load-mode number of a candidate build: codegen's MMA_TWO_BUFFERS, MMA_EARLY_KV, MMA_EARLY_L1)
        self.mma_attention = _module_flag(module_source, "MMA_ATTENTION")
        self.fused_mma = _module_flag(module_source, "FUSED_MMA")  # fused steps' groups on the tensor cores
        self.mma_wide = "\nMMA_WIDE = True\n" in module_source  # heads of 256 on the tensor cores too
        # an mma_schedule build deals whole KV groups over shorter chunks (module.py's MMA_SLICES, the slice counts
        # whose items run on the tensor cores); 0: the default dealing
        slices = re.search(r"^MMA_SLICES = (\d+)$", module_source, re.MULTILINE)
        self.mma_slices = int(slices.group(1)) if slices else 0
        # a split_cap build deals split-KV attention over fewer splits than the plan's (module.py's KV_SPLITS)
        dealt = re.search(r"^KV_SPLITS = (\d+)", module_source, re.MULTILINE)
        self.dealt_splits = int(dealt.group(1)) if dealt and int(dealt.group(1)) != kv_splits(plan) else 0
        self.package_dir = Path(package_dir) if package_dir else None
        self.report = report or {}
        device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.device = device
        self.backend = backend or ("cuda" if device.type == "cuda" else "reference")
        self.batch, self.capacity = plan.batch, plan.capacity
        self.vocab_size = plan.dims.vocab
        self.launches_per_step = 1
        self._graph = None
        self._greedy_graphs: dict = {}
        self._greedy_ids = None
        self._use_graph = use_graph
        # One source of RoPE frequencies (megabake.rope): the kernel's tables, the prefill that writes the
        # prompt's keys and every reference use the exact fp32 inverse frequencies, whatever the weights' dtype.
        self.inv_freq_fp32 = plan_inv_freqs(plan, model)  # one tensor per rotary table
        if self.backend == "cuda":
            self.gpu = require_hopper(device)
            check_admission(plan, self.gpu)
            self.model = cast_model(model, device=device, dtype=torch.bfloat16)
            self._bind_cuda()
        elif self.backend == "reference":
            restore_rotary_buffers(model, exact_rotary_buffers(model))  # a bf16 model's rounded buffers
            self.model = model
            dtype = next(model.parameters()).dtype
            weights = pack_weights(plan, model.get_parameter, dtype=dtype)
            cos, sin = rotary_tables(plan, self.inv_freq_fp32)
            self._reference = ReferenceExecutor(plan, weights, cos, sin, mma_attention=self.mma_attention,
                                                fused_mma=self.fused_mma, mma_wide=self.mma_wide,
                                                mma_slices=self.mma_slices, dealt_splits=self.dealt_splits)
            self.buffers = self._reference.buffers
        else:
            raise InputError(f"unknown backend {backend!r}: use 'cuda' or 'reference'")

    # ------------------------------------------------------------------------------------- binding
    def _bind_cuda(self) -> None:
        plan, device = self.plan, self.device
        weights = pack_weights(plan, self.model.get_parameter, dtype=torch.bfloat16, device=device)
        cos, sin = rotary_tables(plan, self.inv_freq_fp32, device=device)
        self.buffers: dict[str, torch.Tensor] = dict(weights)
        self.buffers["rope_cos"], self.buffers["rope_sin"] = cos, sin
        if plan.has_windows:
            self.buffers[ATTN_WINDOW] = torch.tensor(plan.attn_window_table(), dtype=torch.int32, device=device)
        if plan.has_rope_tables:
            self.buffers[ROPE_TABLE] = torch.tensor([layer.rope_table for layer in plan.layers], dtype=torch.int32,
                                                    device=device)
        # tokens and position share one int32 buffer so a step uploads them with a single copy, no kernel
        self._inputs = torch.zeros(plan.batch + 1, dtype=torch.int32, device=device)
        self.buffers["tokens"], self.buffers["position"] = self._inputs[:plan.batch], self._inputs[plan.batch:]
        # pinned staging rows for tokens + position: rows 0/1 alternate between two captured step graphs (each
        # copies its row, then launches), row 2 feeds direct uploads; an event per row guards its reuse
        self._staging = torch.zeros(STAGING_ROWS, plan.batch + 1, dtype=torch.int32, pin_memory=True)
        self._staging_view = self._staging.numpy()  # numpy item writes cost ~100 ns, torch's ~1 us
        self._staged = [torch.cuda.Event() for _ in range(STAGING_ROWS)]
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._next_row = 0
        self._greedy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._greedy_ids: torch.Tensor | None = None
        from .compile import extra_buffers, load_module

        self.module = load_module(self.module_source)
        for buf in plan.buffers + extra_buffers(self.module):
            if buf.name not in self.buffers:
                shape = list(buf.shape)
                if buf.name == "barrier":  # timeline / watchdog builds store clocks or arrivals after the counter
                    shape[0] += getattr(self.module, "TIMELINE_SLOTS", 0) + getattr(self.module, "WATCH_SLOTS", 0)
                self.buffers[buf.name] = torch.zeros(shape, dtype=torch_dtype(buf.dtype), device=device)
        self.refresh_derived_buffers()
        self.weight_bytes = plan.weight_bytes()
        self._compile()

    def refresh_derived_buffers(self) -> None:
        """Rebuild the buffers the module derives from weights (``DERIVED_BUFFERS``: a ``bulk_down`` build reads
        W_down from ``w_down_cta``, a per-CTA packing of ``w_down``). Call it after writing a weight buffer in place,
        or the kernel keeps reading the packed copy made at construction."""
        from .compile import block_columns

        for name, (source, per_block) in getattr(self.module, "DERIVED_BUFFERS", {}).items():
            self.buffers[name].copy_(block_columns(self.buffers[source], per_block))

    def _kernel_tensors(self) -> list[torch.Tensor]:
        return [self.buffers.get(name, self.buffers["embed"]) for name in self.module.ARGUMENTS]

    def _compile(self) -> None:
        """The package's precompiled kernel when it fits this toolchain and these tensors, else a JIT compile of
        module.py. ``compile_path``: "precompiled" | "jit"; ``compile_fallback``: why not precompiled."""
        import cuda.bindings.driver as cuda
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack

        from .compile import load_precompiled, tensor_alignments

        self._torch_args = self._kernel_tensors()
        aligns = tensor_alignments(self._torch_args)
        self._cute_args = [from_dlpack(t, assumed_align=a) for t, a in zip(self._torch_args, aligns)]
        self.compile_path, self.compile_fallback = "jit", None
        if self.package_dir is not None:
            loaded = load_precompiled(self.package_dir, module_source=self.module_source, tensors=self._torch_args)
            if loaded.function is not None:
                self._compiled, self.compile_path = loaded.function, "precompiled"
                return
            self.compile_fallback = loaded.reason
            LOG.info("precompiled kernel not used (%s); compiling module.py", loaded.reason)
        stream = cuda.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        self._compiled = cute.compile(self.module.launch, *self._cute_args, stream)

    def _launch(self) -> None:
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        self._compiled(*self._cute_args, stream)

    def _capture_graph(self) -> None:
        """Two step graphs, one per pinned staging row: copy that row to the device inputs, then the kernel."""
        self._launch()  # warm: module load, first-launch setup
        torch.cuda.synchronize(self.device)
        graphs = []
        for row in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._inputs.copy_(self._staging[row], non_blocking=True)
                self._launch()
            graphs.append(graph)
        self._graphs, self._graph = graphs, graphs[0]

    # ------------------------------------------------------------------------------------- inputs
    def _check_inputs(self, token_ids, position) -> list[int]:
        """Token ids as host ints (padded to the bucket's batch), checked in plain Python: torch ops on small
        host tensors cost microseconds each, and checking a CUDA tensor in place would add kernels. The usual call
        (a list of host ints in range, an int position in range) passes on plain comparisons alone: every
        microsecond here is before the launch (session 61, one CPU core: 4.4 -> 1.4 us at batch 1); anything else
        takes the checks that name what is wrong."""
        if (type(token_ids) is list and type(position) is int and 0 < len(token_ids) <= self.batch
                and 0 <= position < self.capacity
                and all(type(token) is int and 0 <= token < self.vocab_size for token in token_ids)):
            return token_ids + [0] * (self.batch - len(token_ids))
        tokens = host_token_ids(token_ids)
        if len(tokens) > self.batch:
            raise InputError(f"batch of {len(tokens)} sequences is larger than the baked bucket (batch "
                             f"{self.batch}); bake a bucket with --batch {len(tokens)}")
        if not tokens:
            raise InputError("no token ids given")
        for token in tokens:
            if not 0 <= token < self.vocab_size:
                raise InputError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        self._check_position(position)
        return tokens + [0] * (self.batch - len(tokens))

    def _check_position(self, position, count: int = 1) -> int:
        position = host_position(position)
        if position < 0:
            raise InputError(f"position {position} is negative: a step's position is the number of tokens already "
                             f"in the KV cache, from 0")
        if position + count - 1 >= self.capacity:
            raise InputError(f"position {position + count - 1} is outside the KV capacity [0, {self.capacity}): the "
                             f"cache is full; bake a bucket with a larger --capacity")
        return position

    def _stage(self, row: int, tokens: list[int], position: int) -> None:
        """Write tokens + position into pinned staging row ``row`` once its previous copy has run."""
        self._staged[row].synchronize()  # that copy was enqueued two steps ago: done unless the host runs ahead
        self._staging_view[row] = tokens + [position]  # one numpy write (two cost twice as much at batch 1)

    def _upload(self, tokens: list[int], position: int) -> None:
        """One asynchronous host-to-device copy of tokens + position (the direct-upload staging row)."""
        self._stage(DIRECT_ROW, tokens, position)
        self._inputs.copy_(self._staging[DIRECT_ROW], non_blocking=True)
        self._staged[DIRECT_ROW].record()

    # ------------------------------------------------------------------------------------- steps
    def step(self, token_ids, position: int) -> torch.Tensor:
        """One decode step at ``position`` (same for every sequence). Returns fp32 logits [B, V]."""
        tokens = self._check_inputs(token_ids, position)
        if self.backend == "reference":
            return self._reference.step(torch.tensor(tokens), int(position))
        if self._use_graph and self._graph is None:
            self._capture_graph_safely()
        if self._graph is not None:  # one graph launch: the input copy is the graph's first node
            row, self._next_row = self._next_row, 1 - self._next_row
            self._stage(row, tokens, int(position))
            self._graphs[row].replay()
            self._staged[row].record()
            return self.buffers["logits"]
        self._upload(tokens, int(position))
        self._launch()
        return self.buffers["logits"]

    @torch.no_grad()
    def greedy_tokens(self, token_ids, position: int, count: int) -> torch.Tensor:
        """``count`` greedy decode steps in one host round trip. Step k runs at ``position + k`` on the previous
        step's argmax (the first on ``token_ids``); returns the ``count`` argmax tokens [B, count] (int64, CPU).

        On a GPU the steps are one CUDA graph (per ``count``): megakernel, argmax, next input and position
        stay on the device. Same tokens as ``step`` + host argmax, ``count`` times."""
        tokens = self._check_inputs(token_ids, position)
        if not isinstance(count, int) or count < 1:
            raise InputError(f"count must be a positive int, got {count!r}")
        self._check_position(position, count)
        if self.backend == "cuda" and self._use_graph and self._graph is None:
            self._capture_graph_safely()
        if self._graph is None:  # the reference executor, or no CUDA graphs here: one step at a time
            out = []
            current = tokens
            for k in range(count):
                current = self.step(current, int(position) + k).argmax(-1).tolist()
                out.append(current)
            return torch.tensor(out, dtype=torch.long).T.contiguous()
        graph = self._greedy_graphs.get(count) or self._capture_greedy_graph(count)
        self._upload(tokens, int(position))
        graph.replay()
        return self._greedy_ids[:count].T.cpu()

    def _capture_greedy_graph(self, count: int):
        if self._greedy_ids is None or self._greedy_ids.shape[0] < count:
            self._greedy_graphs.clear()  # they write the buffer being replaced
            self._greedy_ids = torch.zeros(max(count, 64), self.batch, dtype=torch.long, device=self.device)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # capture records, it does not run: the KV cache is untouched
            for k in range(count):
                self._launch()
                torch.argmax(self.buffers["logits"], dim=-1, out=self._greedy_ids[k])
                self._inputs[:self.batch].copy_(self._greedy_ids[k])
                self._inputs[self.batch:].add_(1)
        self._greedy_graphs[count] = graph
        return graph

    def _capture_graph_safely(self) -> None:
        # Capture replays the kernel once, which would advance the cache: snapshot and restore it.
        saved = {k: self.buffers[k].clone() for k in ("k_cache", "v_cache")}
        try:
            self._capture_graph()
        except Exception as exc:  # graph capture unsupported: fall back to direct launches, say why
            self._use_graph = False
            self.graph_error = f"{type(exc).__name__}: {exc}"
        for key, value in saved.items():
            self.buffers[key].copy_(value)

    def reference_executor(self):
        """The plan's CPU reference executor on this (cuda) decoder's own packed weights and rotary tables, mirroring
        the module's split-KV dealing (``mma_slices``) and tensor-core roundings (``mma_attention``, ``fused_mma``,
        ``mma_wide``): what a GPU check compares with."""
        from ..plan.reference import reference_executor_from_buffers

        return reference_executor_from_buffers(self.plan, self.buffers, mma_attention=self.mma_attention,
                                               fused_mma=self.fused_mma, mma_wide=self.mma_wide,
                                               mma_slices=self.mma_slices, dealt_splits=self.dealt_splits)

    def stage_timeline(self) -> list[tuple[str, float]]:
        """(stage, microseconds as seen by CTA 0) of the last step; needs a ``generate(timeline=True)`` module
        (``timeline="phases"``: one entry per phase of each stage, ``<stage>.<phase>``)."""
        from ..codegen import timeline_labels

        slots = getattr(getattr(self, "module", None), "TIMELINE_SLOTS", 0)
        if not slots:
            raise MegaBakeError("this decoder's module has no timeline: build it with "
                                "megabake.codegen.generate(plan, timeline=True)")
        stride = getattr(self.module, "TIMELINE_STRIDE", slots)  # a per-CTA build: CTA 0's row comes first
        clocks = self.buffers["barrier"][1:1 + stride].cpu().tolist()
        labels = getattr(self.module, "TIMELINE_LABELS", None) or timeline_labels(
            self.plan, phases=getattr(self.module, "TIMELINE_PHASES", False))
        return [(label, (clocks[k + 1] - clocks[k]) / 1000.0) for k, label in enumerate(labels)]

    def cta_timelines(self) -> tuple[list[str], list[list[float]]]:
        """Every CTA's phase clocks of the last step of a ``generate(plan, timeline="phases-per-cta")`` module:
        the interval labels (as :meth:`stage_timeline`'s) and, per CTA, microseconds from the earliest CTA's kernel
        start to its own start (entry 0) and to the end of each interval (entry k: ``labels[k - 1]``). A CTA's
        clock is stored once all its warps are through the phase, so the end of a phase before a ``barrier``
        interval is the CTA's arrival at that grid barrier and the end of the ``barrier`` interval its release."""
        from ..codegen import timeline_labels

        stride = getattr(getattr(self, "module", None), "TIMELINE_STRIDE", 0)
        if not stride:
            raise MegaBakeError("this decoder's module has no per-CTA timeline: build it with "
                                "megabake.codegen.generate(plan, timeline=\"phases-per-cta\")")
        rows = self.buffers["barrier"][1:1 + stride * self.plan.ctas].view(self.plan.ctas, stride).cpu()
        rows = ((rows - rows[:, 0].min()).double() / 1000.0).tolist()
        return list(getattr(self.module, "TIMELINE_LABELS", None) or timeline_labels(self.plan, phases=True)), rows

    def barrier_watch(self) -> list[tuple[int, int]]:
        """Per CTA of a ``generate(plan, watchdog=True)`` build: (grid barriers arrived at since the decoder was
        built, ordinal of the first one it stopped waiting at or 0). All zeros in the second column: no hang."""
        slots = getattr(getattr(self, "module", None), "WATCH_SLOTS", 0)
        if not slots:
            raise MegaBakeError("this decoder's module has no barrier watchdog: build it with "
                                "megabake.codegen.generate(plan, watchdog=True)")
        values = self.buffers["barrier"][1:1 + slots].cpu().tolist()
        return [(int(values[2 * c]), int(values[2 * c + 1])) for c in range(slots // 2)]

    def reset(self) -> None:
        """Zero the KV cache (a new sequence)."""
        self.buffers["k_cache"].zero_()
        self.buffers["v_cache"].zero_()

    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers["k_cache"], self.buffers["v_cache"]

    def fp32_reference_model(self):
        """A deep fp32 copy of the bound model with exact (fp32) RoPE frequencies: the numerics reference.

        Casting to bf16 rounds HF's ``inv_freq`` buffer; upcasting a bf16 copy would keep that rounding.
        """
        import copy

        return cast_model(copy.deepcopy(self.model), dtype=torch.float32)

    @torch.no_grad()
    def prefill(self, prompt_ids) -> torch.Tensor:
        """Eager HF forward over the prompt; its KV cache becomes the decoder's. Returns last logits [B, V]."""
        from ..capture import full_length_static_cache

        prompt = torch.as_tensor(prompt_ids)
        if prompt.ndim == 1:
            prompt = prompt[None]
        length = prompt.shape[1]
        if length < 1:
            raise InputError("the prompt is empty: prefill needs at least one token")
        bad = prompt[(prompt < 0) | (prompt >= self.vocab_size)]
        if bad.numel():
            raise InputError(f"prompt token id {int(bad[0])} is outside the vocabulary [0, {self.vocab_size})")
        self._check_inputs(prompt[:, -1], length - 1)  # batch and capacity
        if prompt.shape[0] != self.batch:
            raise InputError(f"prefill needs exactly {self.batch} sequences (the bucket's batch), got {prompt.shape[0]}")
        device = next(self.model.parameters()).device
        cache = full_length_static_cache(self.model.config, self.capacity)
        out = self.model(prompt.to(device), past_key_values=cache, use_cache=True,
                         cache_position=torch.arange(length, device=device))
        self.reset()
        k_cache, v_cache = self.kv_cache()
        for i, layer in enumerate(cache.layers):
            k_cache[i].copy_(layer.keys.to(k_cache.dtype))
            v_cache[i].copy_(layer.values.to(v_cache.dtype))
        return out.logits[:, -1].float()

    def generate(self, prompt_ids, max_new_tokens: int = 16, *, return_details: bool = False, **settings):
        """Eager prefill, then one megakernel launch per new token (``megabake.generation.generate``): greedy
        or sampled (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``), stopping at
        ``eos_token_id`` / ``stop_strings`` (with ``tokenizer``) as the model's ``generation_config`` says,
        tokens streamed to ``streamer``. Returns ids [B, P + n]; ``return_details=True`` gives the
        :class:`~megabake.generation.Generation` (why it stopped, prefill and per-step times)."""
        from ..generation import generate

        result = generate(self, prompt_ids, max_new_tokens=max_new_tokens, **settings)
        return result if return_details else result.tokens

    # ------------------------------------------------------------------------------------- package
    @classmethod
    def from_package(cls, package_dir, *, device=None, model=None, model_path=None,
                     use_graph: bool = True) -> "MegakernelDecoder":
        """Bind a package folder. The model is rebuilt from the report (preset + seed, Hub repo @ revision, or
        the local folder / .gguf it was baked from, or its copy at ``model_path``; local weights must still
        match the report's sha256) unless ``model`` is given (its config must match)."""
        package_dir = Path(package_dir)
        try:
            plan = Plan.from_json((package_dir / "plan.json").read_text())
            report = json.loads((package_dir / "report.json").read_text())
            source = (package_dir / "module.py").read_text()
        except FileNotFoundError as exc:
            raise MegaBakeError(f"{package_dir} is not a MegaBake package: missing {Path(exc.filename).name}") from exc
        device = torch.device(device) if device is not None else None
        if (device.type == "cuda") if device is not None else torch.cuda.is_available():
            from ..package.toolchain import check_compatible

            check_compatible(report.get("toolchain") or {}, precompiled=False)  # before any model load
        if model is None:
            model = load_model_for_report(report, model_path=model_path)
        else:
            check_model_matches(report, model)
        return cls(plan, source, model, device=device, package_dir=package_dir, report=report, use_graph=use_graph)


def load_model_for_report(report: dict, model_path=None):
    """Rebuild the model a package was baked from: a preset with its seed, a Hub repo at its revision, or the
    local folder / .gguf file (at ``model_path`` if it moved), refused when its weights' digest changed."""
    from ..presets import get_preset, is_preset

    info = report["model"]
    if info.get("local"):
        from ..sources import load_local

        model = load_local(info["local"], model_path)
    elif info.get("preset") and is_preset(info["preset"]):
        model = get_preset(info["preset"]).build_model(seed=info.get("seed") or 0)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(info["id"], revision=info["revision"], dtype=torch.float32)
        model.eval()
    check_model_matches(report, model)
    return model


def check_model_matches(report: dict, model) -> None:
    """The model's config hash must be the one the package was baked from."""
    from ..presets import config_hash

    expected = report["model"].get("config_hash")
    actual = config_hash(model.config)
    if expected and actual != expected:
        raise MegaBakeError(f"model config hash {actual[:12]} does not match the package's "
                            f"{expected[:12]}: the package was baked for a different model revision")
