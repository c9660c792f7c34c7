"""Rotary table recovery: evaluate the captured rotary region and express it as plan data.

Contract: ``recover_rotary(captured, ir)`` runs the exported cos/sin region (a function of positions only)
for every cache slot, checks it equals ``cos/sin(p * inv_freq) * s`` with the model's ``inv_freq`` buffer,
and returns ``(inv_freq buffer fqn, s)``. A region that is not of that form raises :class:`PlanError`.
``exact_inv_freq(model, fqn)`` returns that buffer in fp32 as HF computed it, even after ``model.to(bf16)``
rounded the buffer: it recomputes the frequencies from the rotary module's config and keeps them only when
they round to the buffer (otherwise the buffer itself is used).
"""

from __future__ import annotations

import torch

from ..capture import CapturedStep
from ..errors import PlanError
from ..ir import IRGraph, RotaryTable


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


def exact_inv_freq(model, fqn: str) -> torch.Tensor:
    """The fp32 inverse frequencies behind ``model``'s inv_freq buffer ``fqn`` (see module doc), on the CPU."""
    buffer = model.get_buffer(fqn).detach()
    if buffer.dtype == torch.float32:
        return buffer.cpu().clone()
    owner = model.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else model
    recomputed = _recompute_inv_freq(owner)
    if recomputed is not None and recomputed.shape == buffer.shape and torch.equal(
            recomputed.to(buffer.dtype), buffer.cpu()):
        return recomputed
    return buffer.float().cpu().clone()


def _recompute_inv_freq(rotary_module) -> torch.Tensor | None:
    config = getattr(rotary_module, "config", None)
    rope_type = getattr(rotary_module, "rope_type", None)
    if config is None or rope_type is None:
        return None
    try:
        if rope_type == "default":
            init = rotary_module.compute_default_rope_parameters
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, _ = init(config, "cpu")
    except Exception:  # an init we cannot call the standard way: fall back to the buffer
        return None
    return inv_freq.detach().float().cpu()
