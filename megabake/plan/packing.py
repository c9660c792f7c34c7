"""Packed-weight layout executor: model parameters -> the plan's weight buffers and rotary tables.

Contract: ``pack_weights(plan, lookup, dtype=..., device=...)`` returns ``{buffer name: tensor}`` for every
weight buffer of the plan, built only from the plan's :class:`PackedWeight` sources (HF parameter fqns,
concatenated along rows, stacked per layer; ``(fqn, start, stop)`` takes rows of a fused parameter; ``("", n)``
sources are n zero rows; ``interleave`` reorders a layer's rows by :func:`interleave_halves`; ``scale``, when not 1,
multiplies every value in fp32 before the one cast to the buffer's dtype). Norm weights are packed in fp32 with the
plan's weight offset folded in (Gemma's ``1 + w``, before any scale); biases are packed in fp32.
``rotary_tables(plan, inv_freq)`` evaluates cos/sin for every cache slot: row p from ``inv_freq`` (the model's
buffer, :func:`plan_inv_freqs`), or, for a long-RoPE table past its original range, from the plan's
``long_inv_freq`` where ``p >= long_from`` (transformers' switch to the long factors at that position).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import Plan

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32,
           "int64": torch.int64}


NORM_BUFFERS = ("norms", "final_norm", "qk_norms")  # fp32, with the plan's weight offset folded in


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def pack_weights(plan: Plan, lookup: Callable[[str], torch.Tensor], *, dtype: torch.dtype | None = None,
                 device=None) -> dict[str, torch.Tensor]:
    packed: dict[str, torch.Tensor] = {}
    for spec in plan.packed:
        buf = plan.buffer(spec.buffer)
        is_norm = spec.buffer in NORM_BUFFERS
        target = torch.float32 if buf.dtype == "float32" else (dtype or torch_dtype(buf.dtype))
        work = target if spec.scale == 1.0 else torch.float32  # a folded scale multiplies in fp32, then one cast
        layers = []
        for sources in spec.sources:
            parts = [_source_rows(lookup, source).detach().to(device=device, dtype=work) if source[0] else
                     torch.zeros(source[1], dtype=work, device=device) for source in sources]
            if is_norm:
                parts = [p + plan.dims.norm_offset for p in parts]
            if spec.scale != 1.0:
                parts = [(p * spec.scale).to(target) for p in parts]
            stacked = is_norm and len(parts) > 1 and len(buf.shape) == (3 if spec.per_layer else 2)
            rows = torch.stack(parts) if stacked else torch.cat(parts, dim=0)
            layers.append(interleave_halves(rows, spec.interleave) if spec.interleave else rows)
        tensor = torch.stack(layers) if spec.per_layer else layers[0]
        if list(tensor.shape) != buf.shape:
            raise ValueError(f"packed {spec.buffer} has shape {list(tensor.shape)}, plan says {buf.shape}")
        packed[spec.buffer] = tensor.contiguous()
    return packed


def interleave_halves(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Rows [first half | second half] reordered as ``block`` rows of the first, ``block`` of the second, ...
    (a gated GEMV's packed gate | up: each 8-row tensor-core tile holds 4 gate rows and the 4 matching up rows)."""
    half = rows.shape[0] // 2
    if rows.shape[0] % (2 * block):
        raise ValueError(f"cannot interleave {rows.shape[0]} rows in blocks of {block} from each half")
    return rows.view(2, half // block, block, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def _source_rows(lookup: Callable[[str], torch.Tensor], source) -> torch.Tensor:
    """A source's tensor: the whole parameter ``(fqn, 0)`` or its rows ``(fqn, start, stop)``."""
    tensor = lookup(source[0])
    return tensor[source[1]:source[2]] if len(source) == 3 else tensor


def rotary_tables(plan: Plan, inv_freq, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [capacity, head_dim] in fp32: halves duplicated, times the attention scaling. ``inv_freq``: one
    tensor, or one per table of ``plan.rotaries`` (:func:`plan_inv_freqs`); a plan with several tables
    (``has_rope_tables``) gets [tables, capacity, head_dim]. With partial rotary the features past
    ``dims.rotated`` get cos 1 and sin 0 (they pass through the kernel's rotation unchanged). A long-RoPE table
    (``rotary.long_inv_freq``) takes rows ``p >= rotary.long_from`` from the long frequencies."""
    freqs_per_table = inv_freq if isinstance(inv_freq, (list, tuple)) else [inv_freq]
    positions = torch.arange(plan.capacity, dtype=torch.float32, device=device)
    passed = plan.dims.head_dim - plan.dims.rotated
    cos, sin = [], []
    for table, rotary in zip(freqs_per_table, plan.rotaries):
        table = table.to(device=device, dtype=torch.float32)
        if rotary.long_inv_freq:
            long = torch.tensor(rotary.long_inv_freq, dtype=torch.float32, device=device)
            if long.shape != table.shape:
                raise ValueError(f"rotary table {rotary.inv_freq_buffer} has {table.numel()} frequencies and "
                                 f"{long.numel()} long-RoPE frequencies; they must match")
            per_row = torch.where((positions >= rotary.long_from)[:, None], long[None, :], table[None, :])
            freqs = positions[:, None] * per_row
        else:
            freqs = positions[:, None] * table[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        if emb.shape[-1] != plan.dims.rotated:
            raise ValueError(f"rotary table {rotary.inv_freq_buffer} has {table.numel()} frequencies; the plan "
                             f"rotates {plan.dims.rotated} features (rotary_dim / 2 frequencies expected)")
        ones, zeros = emb.new_ones(plan.capacity, passed), emb.new_zeros(plan.capacity, passed)
        cos.append(torch.cat([emb.cos() * rotary.attention_scaling, ones], dim=-1))
        sin.append(torch.cat([emb.sin() * rotary.attention_scaling, zeros], dim=-1))
    if plan.has_rope_tables:
        return torch.stack(cos).contiguous(), torch.stack(sin).contiguous()
    return cos[0].contiguous(), sin[0].contiguous()


def plan_inv_freqs(plan: Plan, model) -> list[torch.Tensor]:
    """The exact fp32 inverse frequencies of each of the plan's rotary tables, from ``model``'s buffers. For a
    long-RoPE rotary module (transformers' ``longrope``) the short factors the step was exported with are its
    ``original_inv_freq``: its ``inv_freq`` holds the long ones after any forward past the original range."""
    from ..rope import exact_inv_freq

    return [exact_inv_freq(model, _short_factors_buffer(model, rotary.inv_freq_buffer)) for rotary in plan.rotaries]


def _short_factors_buffer(model, fqn: str) -> str:
    """``fqn``, or its ``original_inv_freq`` sibling when ``fqn`` is the ``inv_freq`` of a long-RoPE module."""
    owner_name, _, leaf = fqn.rpartition(".")
    try:
        owner = model.get_submodule(owner_name) if owner_name else model
    except AttributeError:
        return fqn
    if leaf != "inv_freq" or getattr(owner, "rope_type", None) != "longrope" \
            or "original_inv_freq" not in owner._buffers:
        return fqn
    return f"{owner_name}.original_inv_freq" if owner_name else "original_inv_freq"
