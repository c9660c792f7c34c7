"""Builders shared by compiler tests: preset -> captured step -> IR -> plan -> generated module."""

from __future__ import annotations

from megabake.compiler import CompiledStep, compile_step
from megabake.presets import get_preset


Compiled = CompiledStep  # the tests' name for one bucket's step at every stage


def compile_model(model, *, batch: int = 1, capacity: int = 32, ctas: int = 132, threads: int = 256,
                  tuning=None) -> Compiled:
    """``tuning=None``: the default GEMV tiling (the streaming ring); ``DEFAULT_TUNING``: the plain tiling."""
    return compile_step(model, batch=batch, capacity=capacity, ctas=ctas, threads=threads, tuning=tuning)


def compile_preset(name: str, *, layers: int | None = None, **kwargs) -> Compiled:
    preset = get_preset(name)
    if layers is None:
        return compile_model(preset.build_model(), **kwargs)
    import dataclasses

    config = dict(preset.config, num_hidden_layers=layers)
    small = dataclasses.replace(preset, config=config)
    return compile_model(small.build_model(), **kwargs)
