"""``generate(plan, short_attention=N)`` (a candidate since session 28): below N positions every CTA computes every
head's attention as the O projection's staging and the grid barrier after attention is skipped. CPU: where the
branches sit, that the rest of the kernel is the default's, the sm_90a compile of each attention variant the body
handles, bad inputs. GPU: ``test_short_attention_gives_the_default_logits_on_both_sides_of_its_threshold`` in
tests/test_gpu_decode.py."""

from __future__ import annotations

import pytest

from megabake.codegen import generate, short_attention_error, stage_phases
from megabake.plan import build_plan
from megabake.plan.rotary import recover_rotary
from tests.compiler_fixtures import compile_preset

SHORT = "if pos < SHORT_ATTENTION:"
LONG = "if pos >= SHORT_ATTENTION:  # longer contexts: split-KV attention and the grid barrier after it"


@pytest.fixture(scope="module")
def tiny():
    return compile_preset("tiny-llama")


def _kernel(source: str) -> list[str]:
    return source.split("\n# ====")[0].splitlines()


def test_short_attention_skips_split_attention_and_its_barrier_below_the_threshold(tiny):
    default = _kernel(generate(tiny.plan).source)
    lines = _kernel(generate(tiny.plan, short_attention=64).source)
    assert "SHORT_ATTENTION = 64  # below this position: attention in every CTA's O staging, no grid barrier after " \
           "attention" in lines
    layers = tiny.plan.dims.layers
    long_at = [i for i, line in enumerate(lines) if line.strip() == LONG]
    assert len(long_at) == 1  # inside the layer loop: once per layer at run time
    guarded = []  # the lines under the long-context branch: split-KV attention, its arrival and wait
    indent = len(lines[long_at[0]]) - len(lines[long_at[0]].lstrip())
    for line in lines[long_at[0] + 1:]:
        if len(line) - len(line.lstrip()) <= indent:
            break
        guarded.append(line.strip())
    assert guarded[0].startswith("bodies.split_kv_attention(")
    assert [g for g in guarded if g.startswith("bodies.grid_")] == [
        "bodies.grid_arrive(barrier=barrier, next_target=bar_next, tidx=tidx, ctas=CTAS)",
        "bodies.grid_wait(barrier=barrier, next_target=bar_next, tidx=tidx, ctas=CTAS)"]
    short_at = next(i for i, line in enumerate(lines) if line.strip() == SHORT)
    assert short_at > long_at[0]
    assert lines[short_at + 1].strip().startswith("bodies.short_attention_to_smem(")
    staged_else = next(i for i in range(short_at, len(lines)) if lines[i].strip() == "else:")
    assert lines[staged_else + 1].strip().startswith(("bodies.merge_splits_to_smem(", "bodies.copy_to_smem("))
    # the O GEMV follows the if / else at the stage's own indent
    after = next(i for i in range(staged_else + 1, len(lines)) if "bodies.gemv_rows" in lines[i])
    assert len(lines[after]) - len(lines[after].lstrip()) == len(lines[short_at]) - len(lines[short_at].lstrip())
    # everything else is the default kernel: drop the two branches' wrappers and the short call
    short_call = _call_lines(lines, short_at + 1)
    stripped = [line.strip() for i, line in enumerate(lines)
                if i not in short_call and line.strip() not in (LONG, SHORT, "else:")
                and not line.startswith("SHORT_ATTENTION = ")]
    # (calls under a branch wrap their arguments at other places: compare without line breaks and spaces)
    assert "".join(stripped).replace(" ", "") == "".join(line.strip() for line in default).replace(" ", "")
    assert layers >= 2


def _call_lines(lines: list[str], start: int) -> set[int]:
    """Indices of the call starting at ``start`` (its continuation lines are indented further)."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and len(lines[end]) - len(lines[end].lstrip()) > indent:
        end += 1
    return set(range(start, end))


def test_short_attention_keeps_a_phases_timeline_s_slots(tiny):
    """A phases build stores the attention stage's clocks in the short branch too (the phases last 0 ns there),
    so gpu_tune reads the same labels from both kinds of steps."""
    plain = generate(tiny.plan, timeline="phases").source
    short = generate(tiny.plan, timeline="phases", short_attention=64).source
    attention = next(s for s in tiny.plan.stages if s.kind == "attention")
    assert stage_phases(tiny.plan, attention) == ["split_kv_attention", "barrier"]
    slots = [line.strip() for line in _kernel(plain) if "barrier[" in line and "globaltimer" in line]
    short_slots = [line.strip() for line in _kernel(short) if "barrier[" in line and "globaltimer" in line]
    # each of the attention stage's two clocks is stored in both branches
    assert len(short_slots) == len(slots) + len(stage_phases(tiny.plan, attention))
    assert sorted(set(short_slots)) == sorted(set(slots))


@pytest.mark.parametrize("preset,layers,batch", [("tiny-llama", None, 1), ("qwen3-0.6b", 2, 1),
                                                 ("tiny-olmo2", None, 1), ("tiny-phi3", None, 1),
                                                 ("tiny-mistral", None, 2)])
def test_short_attention_compiles_for_sm90a(preset, layers, batch, tiny):
    """tiny-llama (GQA 2 heads per group), Qwen3 (per-head q/k norms, head_dim 128), tiny-olmo2 (whole-projection
    q/k norms), tiny-phi3 (head_dim 96: spare lanes in a lane group), tiny-mistral at batch 2 (a sliding window,
    bf16 staging); tiny-llama also as a per-CTA timeline."""
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check, load_module

    extra = {"capacity": 1024} if preset == "tiny-mistral" else {}  # past its 96-position window
    compiled = tiny if preset == "tiny-llama" else compile_preset(preset, layers=layers, batch=batch,
                                                                  vocab=512 if layers else None, **extra)
    if batch > 1:
        assert compiled.plan.staging_dtype == "bfloat16" and compiled.plan.has_windows
    source = generate(compiled.plan, short_attention=64).source
    assert "def short_attention_to_smem(" in source and "def _short_rope_slice(" in source
    result = compile_check(compiled.plan, load_module(source))
    assert result.ok, result.error
    if preset == "tiny-llama":
        per_cta = generate(compiled.plan, short_attention=64, timeline="phases-per-cta").source
        assert compile_check(compiled.plan, load_module(per_cta)).ok


def test_short_attention_refuses_what_it_cannot_build(tiny):
    for bad in (-1, True, "64", 6.4):
        with pytest.raises(ValueError, match="short_attention="):
            generate(tiny.plan, short_attention=bad)
    assert short_attention_error(tiny.plan, 0) is None and short_attention_error(tiny.plan, 128) is None
    assert "def short_attention_to_smem(" not in generate(tiny.plan).source  # off by default
    inv_freq, scaling = recover_rotary(tiny.captured, tiny.ir)
    unsplit = build_plan(tiny.ir, inv_freq_buffer=inv_freq, rotary_scaling=scaling, attention_preload=True)
    with pytest.raises(ValueError, match="attention is not split"):
        generate(unsplit, short_attention=64)
    assert generate(unsplit).source  # the same plan builds without it
