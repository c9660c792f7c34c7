"""Builders shared by compiler tests: preset -> captured step -> IR -> plan -> generated module."""

from __future__ import annotations

from dataclasses import dataclass

from megabake.capture import CapturedStep, capture_decode_step
from megabake.codegen import GeneratedModule, generate
from megabake.ir import IRGraph, lower
from megabake.plan import Plan, build_plan
from megabake.plan.rotary import recover_rotary
from megabake.presets import get_preset


@dataclass
class Compiled:
    model: object
    captured: CapturedStep
    ir: IRGraph
    plan: Plan
    generated: GeneratedModule


def compile_model(model, *, batch: int = 1, capacity: int = 32, ctas: int = 132, threads: int = 256,
                  tuning=None) -> Compiled:
    """``tuning=None``: the default GEMV tiling (the streaming ring); ``DEFAULT_TUNING``: the plain tiling."""
    captured = capture_decode_step(model, batch=batch, capacity=capacity)
    ir = lower(captured)
    inv_freq, scaling = recover_rotary(captured, ir)
    plan = build_plan(ir, ctas=ctas, threads=threads, inv_freq_buffer=inv_freq, rotary_scaling=scaling,
                      tuning=tuning)
    return Compiled(model, captured, ir, plan, generate(plan))


def compile_preset(name: str, *, layers: int | None = None, **kwargs) -> Compiled:
    preset = get_preset(name)
    if layers is None:
        return compile_model(preset.build_model(), **kwargs)
    import dataclasses

    config = dict(preset.config, num_hidden_layers=layers)
    small = dataclasses.replace(preset, config=config)
    return compile_model(small.build_model(), **kwargs)
