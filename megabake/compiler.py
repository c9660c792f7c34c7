"""Compile one decode step: capture -> IR -> rotary tables -> plan -> codegen, in one place.

Contract: ``compile_step(model, batch=, capacity=, ctas=, threads=, tuning=, attention_preload=, split_kv=,
strict=, clock=, staging=) -> CompiledStep`` runs the whole chain on a Hugging Face causal LM for one bucket. The
bake (``megabake.baking``), the in-memory bake (``megabake.integrations.bake_decoder``), the GPU scripts and the
tests all use it, so the chain is spelled once. ``CompiledStep.replan(tuning=, attention_preload=, split_kv=,
staging=)`` builds another plan and module from the same capture and IR (tilings, autotune candidates); ``plan_for`` builds only
the plan (with the same rotary tables and long-RoPE switch as the first). ``clock(label)`` returns a context
manager around each phase (the bake's progress lines); the default does nothing. A long-RoPE bucket past the
model's original range gets the capture's ``long_rope`` (the long factors and the switch position) into the
plan's ``Rotary``. Errors are the phases' own: ``UnsupportedGraphError`` (IR), ``PlanError`` (plan).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

from .capture import CapturedStep, capture_decode_step
from .codegen import GeneratedModule, generate
from .ir import IRGraph, lower
from .plan import Plan, build_plan
from .plan.rotary import recover_rotary_tables


@dataclass(frozen=True)
class CompiledStep:
    """One bucket's decode step at every stage of the pipeline."""

    model: object
    captured: CapturedStep
    ir: IRGraph
    plan: Plan
    generated: GeneratedModule
    ctas: int
    threads: int
    inv_freq_buffer: str
    rotary_scaling: float
    rotary_tables: list[tuple[str, float]] | None = None  # several tables (Gemma 3), else None

    def plan_for(self, tuning=None, attention_preload: bool = False, split_kv: bool | None = None,
                 staging: str | None = None) -> Plan:
        return build_plan(self.ir, ctas=self.ctas, threads=self.threads, inv_freq_buffer=self.inv_freq_buffer,
                          rotary_scaling=self.rotary_scaling, tuning=tuning, attention_preload=attention_preload,
                          split_kv=split_kv, rotary_tables=self.rotary_tables, long_rope=self.captured.long_rope,
                          staging=staging)

    def replan(self, **plan_options) -> "CompiledStep":
        plan = self.plan_for(**plan_options)
        return replace(self, plan=plan, generated=generate(plan))


def _no_clock(label: str):
    return contextlib.nullcontext()


def compile_step(model, *, batch: int = 1, capacity: int = 128, ctas: int = 132, threads: int = 256,
                 tuning=None, attention_preload: bool = False, split_kv: bool | None = None, strict: bool = True,
                 clock: Callable[[str], contextlib.AbstractContextManager] = _no_clock,
                 staging: str | None = None, down_input: str | None = None) -> CompiledStep:
    """The whole chain for one bucket (module doc). ``tuning=None`` is the default GEMV tiling; ``staging`` and
    ``down_input``: :func:`megabake.plan.build_plan`'s (None: the plan's default)."""
    with clock("capture decode step (torch.export, static KV cache)"):
        captured = capture_decode_step(model, batch=batch, capacity=capacity)
    with clock("lower to IR"):
        ir = lower(captured, strict=strict)
    tables = recover_rotary_tables(captured, ir)
    (inv_freq, scaling), several = tables[0], tables if len(tables) > 1 else None
    with clock("plan stages, tiles, buffers"):
        plan = build_plan(ir, ctas=ctas, threads=threads, inv_freq_buffer=inv_freq, rotary_scaling=scaling,
                          tuning=tuning, attention_preload=attention_preload, split_kv=split_kv,
                          rotary_tables=several, long_rope=captured.long_rope, staging=staging,
                          down_input=down_input)
    with clock("generate module.py"):
        generated = generate(plan)
    return CompiledStep(model, captured, ir, plan, generated, ctas, threads, inv_freq, scaling, several)
