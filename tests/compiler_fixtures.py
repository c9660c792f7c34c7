"""Builders shared by compiler tests: preset -> captured step -> IR -> plan -> generated module."""

from __future__ import annotations

from megabake.compiler import CompiledStep, compile_step
from megabake.presets import get_preset


Compiled = CompiledStep  # the tests' name for one bucket's step at every stage


def compile_model(model, *, batch: int = 1, capacity: int = 32, ctas: int = 132, threads: int = 256,
                  tuning=None, staging: str | None = None, down_input: str | None = None) -> Compiled:
    """``tuning=None``: the default GEMV tiling (the streaming ring); ``DEFAULT_TUNING``: the plain tiling.
    ``staging=None``: the plan's default (bf16 rows for the tensor cores at batch 2-8, else fp32 where they fit)."""
    return compile_step(model, batch=batch, capacity=capacity, ctas=ctas, threads=threads, tuning=tuning,
                        staging=staging, down_input=down_input)


def compile_preset(name: str, *, layers: int | None = None, vocab: int | None = None, **kwargs) -> Compiled:
    """A preset's model (``layers`` and ``vocab`` cut it down) through ``compile_model``. Cut the vocabulary of
    real shapes in compile tests: only the LM head's row count depends on it, and every captured model leaves
    its size in the process (torch.export: ~1 GB per 1 GB model, not freed by gc, session 9), which OOM-killed
    the CPU suite on a 23 GB machine."""
    preset = get_preset(name)
    if layers is None and vocab is None:
        return compile_model(preset.build_model(), **kwargs)
    import dataclasses

    config = dict(preset.config)
    if layers is not None:
        config["num_hidden_layers"] = layers
    if vocab is not None:
        config["vocab_size"] = vocab
        for key, inside in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
            if isinstance(config.get(key), int) and config[key] >= vocab:
                config[key] = inside
    small = dataclasses.replace(preset, config=config)
    return compile_model(small.build_model(), **kwargs)


def assert_matches_eager(model, executor, steps: int, tol: float = 1e-5, cache_atol: float = 1e-5) -> list[float]:
    """Advance ``steps`` decode steps (seeded random tokens) through the HF model (static cache) and the plan's
    reference executor: logits rel-L2 below ``tol`` at every step, the same K cache at the end. The per-step
    errors."""
    import torch

    from megabake.capture import full_length_static_cache

    plan = executor.plan
    cache = full_length_static_cache(model.config, plan.capacity)
    tokens = torch.randint(1, plan.dims.vocab, (steps,), generator=torch.Generator().manual_seed(3))
    errors = []
    with torch.no_grad():
        for pos in range(steps):
            want = model(tokens[pos:pos + 1][None], past_key_values=cache, use_cache=True,
                         cache_position=torch.tensor([pos])).logits[0, -1]
            got = executor.step(tokens[pos:pos + 1], pos)[0]
            errors.append(float((got - want).norm() / want.norm()))
            assert errors[-1] < tol, f"step {pos}: rel-L2 {errors[-1]:.2e}"
    keys = torch.stack([layer.keys for layer in cache.layers])
    assert torch.allclose(executor.buffers["k_cache"], keys, atol=cache_atol)
    return errors


def body_calls(source: str, body: str) -> list[dict[str, str]]:
    """The keyword arguments (name -> source text) of every ``bodies.<body>(...)`` call in a generated kernel, in
    source order."""
    import ast

    kernel = source.split("\n# ====")[0]
    calls = []
    nodes = sorted(ast.walk(ast.parse(kernel)), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
    for node in nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == body \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "bodies":
            assert not node.args, f"bodies.{body} called with positional arguments"
            calls.append({k.arg: ast.unparse(k.value) for k in node.keywords})
    return calls


# Relative L2 from fp32 that a batch-1 build's fused short-context steps may add where their KV groups run on the
# tensor cores (``decoder.fused_mma``: bf16 query and probabilities; ~5e-4 to 1.6e-3 on random weights).
FUSED_MMA_TOLERANCE = 5e-3


def assert_prefill_then_decode_matches_full_forward(compiled, prompt: int, total: int, seed: int) -> None:
    """Reference-backend decoder: prefill ``prompt`` random tokens, then decode up to ``total``; each step's logits
    against the eager model's full-sequence forward (prefill rel-L2 < 1e-5, steps < 1e-4, or
    :data:`FUSED_MMA_TOLERANCE` where the module's fused short-context steps score whole KV groups on the tensor
    cores: ``decoder.fused_mma``, bf16 query and probabilities)."""
    import torch

    from megabake.runtime import MegakernelDecoder

    model = compiled.model
    decoder = MegakernelDecoder(compiled.plan, compiled.generated.source, model, backend="reference")
    ids = torch.randint(1, compiled.plan.dims.vocab, (1, total), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[0].float()
    last = decoder.prefill(ids[:, :prompt])
    assert float((last[0] - full[prompt - 1]).norm() / full[prompt - 1].norm()) < 1e-5
    step_tolerance = FUSED_MMA_TOLERANCE if decoder.fused_mma else 1e-4
    for pos in range(prompt, total):
        got = decoder.step(ids[:, pos], pos)[0]
        assert float((got - full[pos]).norm() / full[pos].norm()) < step_tolerance, pos
