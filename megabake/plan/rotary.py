"""Rotary table recovery: evaluate the captured rotary region and express it as plan data.

Contract: ``recover_rotary(captured, ir)`` runs the exported cos/sin region (a function of positions only)
for every cache slot, checks it equals ``cos/sin(p * inv_freq) * s`` with the model's ``inv_freq`` buffer,
and returns ``(inv_freq buffer fqn, s)``. A region that is not of that form raises :class:`PlanError`.
``exact_inv_freq`` (re-exported from :mod:`megabake.rope`, the one source of RoPE frequencies) gives that
buffer in fp32 as HF computed it, even after ``model.to(bf16)`` rounded it.
"""

from __future__ import annotations

import torch

from ..capture import CapturedStep
from ..errors import PlanError
from ..ir import IRGraph, RotaryTable
from ..rope import exact_inv_freq

__all__ = ["exact_inv_freq", "recover_rotary"]  # exact_inv_freq re-exported from the one source, megabake.rope


def recover_rotary(captured: CapturedStep, ir: IRGraph) -> tuple[str, float]:
    tables = ir.of_kind(RotaryTable)
    if len(tables) != 1:
        raise PlanError(f"expected one rotary cos/sin region, found {len(tables)}")
    table = tables[0]
    region = getattr(captured.program.graph_module, table.submodule)
    inv_freq = captured.buffer_tensor(table.inv_freq).detach().float()
    positions = torch.arange(captured.capacity, device=inv_freq.device)[None, :]
    with torch.no_grad():
        cos, sin = region(inv_freq, positions)
    cos, sin = cos[0].float(), sin[0].float()
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
