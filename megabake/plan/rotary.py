"""Rotary table recovery: evaluate the captured rotary region and express it as plan data.

Contract: ``recover_rotary(captured, ir)`` runs the exported cos/sin region (a function of positions only)
for every cache slot, checks it equals ``cos/sin(p * inv_freq) * s`` with the model's ``inv_freq`` buffer,
and returns ``(inv_freq buffer fqn, s)``; ``recover_rotary_tables`` does so for each table of a model with
several (Gemma 3: one region, one table per layer type). A region not of that form raises :class:`PlanError`.
``exact_inv_freq`` (re-exported from :mod:`megabake.rope`, the one source of RoPE frequencies) gives that
buffer in fp32 as HF computed it, even after ``model.to(bf16)`` rounded it. A long-RoPE model's region is
exported over its short factors (``megabake.capture``); the long ones a bucket past the original range switches
to are not in the region but in ``CapturedStep.long_rope``, which ``build_plan`` puts into the plan's ``Rotary``.
"""

from __future__ import annotations

import torch

from ..capture import CapturedStep
from ..errors import PlanError
from ..ir import IRGraph, RotaryTable
from ..rope import exact_inv_freq

# exact_inv_freq is re-exported from the one source, megabake.rope
__all__ = ["exact_inv_freq", "recover_rotary", "recover_rotary_tables"]


def recover_rotary(captured: CapturedStep, ir: IRGraph) -> tuple[str, float]:
    """The model's one rotary table as (inv_freq fqn, scaling); a model with several is refused here (use
    :func:`recover_rotary_tables`)."""
    tables = ir.of_kind(RotaryTable)
    if len(tables) != 1:
        raise PlanError(f"expected one rotary cos/sin region, found {len(tables)}")
    return _recover(captured, tables[0])


def recover_rotary_tables(captured: CapturedStep, ir: IRGraph) -> list[tuple[str, float]]:
    """(inv_freq fqn, scaling) of every RotaryTable op, in IR order (Gemma 3: one per layer type)."""
    tables = ir.of_kind(RotaryTable)
    if not tables:
        raise PlanError("expected a rotary cos/sin region, found none")
    return [_recover(captured, table) for table in tables]


def _recover(captured: CapturedStep, table: RotaryTable) -> tuple[str, float]:
    region = getattr(captured.program.graph_module, table.submodule)
    inv_freq = captured.buffer_tensor(table.inv_freq).detach().float()
    positions = torch.arange(captured.capacity, device=inv_freq.device)[None, :]
    inputs = [captured.buffer_tensor(name).detach().float() if name else positions
              for name in (table.region_inputs or [table.inv_freq, ""])]
    with torch.no_grad():
        outputs = region(*inputs)
    cos, sin = outputs[2 * table.slot][0].float(), outputs[2 * table.slot + 1][0].float()
    scale = float(cos[0, 0])
    freqs = positions[0, :, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    if cos.shape != emb.shape or not (
        torch.allclose(cos, emb.cos() * scale, atol=1e-4, rtol=1e-4)
        and torch.allclose(sin, emb.sin() * scale, atol=1e-4, rtol=1e-4)
    ):
        raise PlanError(f"the rotary region {table.submodule} ({table.hf_module or 'rotary_emb'}) is not "
                        "cos/sin(position * inv_freq) with duplicated halves; this RoPE variant is not supported")
    return captured.other_buffers[table.inv_freq].removeprefix("model."), scale
