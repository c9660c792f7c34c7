"""Every family's generated module.py through CuTe DSL to sm_90a on the CPU (no GPU): one table of shapes.

Real shapes are cut to a few layers (the layer loop makes depth irrelevant to code generation; Gemma 3 keeps six
so one global layer follows five local ones) and a vocabulary of at most 4096 rows (only the LM head's row
count depends on it): every captured model leaves its size in the pytest process (torch.export, session 9), and
the full vocabularies OOM-killed the suite on a 23 GB machine. Each case also states what its plan must hold, so
a shape that silently plans as something simpler fails here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest

from megabake.plan import Plan
from megabake.presets import get_preset
from tests.compiler_fixtures import compile_preset


def _streams_gemvs_through_the_ring(copies_per_k_step: int) -> Callable[[str], bool]:
    """The five GEMVs of a layer (default tiling: the cp.async ring) issue >= ``copies_per_k_step`` x 2 rows per
    tile 16-byte weight copies per K step; where the loader warp is built (``codegen.loader.default_loader_warp``,
    its own warpgroup: setmaxnreg), it streams them by ``cp.async.bulk`` row copies onto mbarriers instead."""
    def holds(ptx: str) -> bool:
        if "setmaxnreg" in ptx:
            return ptx.count("cp.async.bulk.shared::cluster.global") >= 3 and "mbarrier.try_wait" in ptx
        return ptx.count("cp.async.cg.shared.global") >= 5 * 2 * copies_per_k_step and "cp.async.wait_group" in ptx
    return holds


def _granite_folds(plan: Plan) -> bool:
    """Granite's four multipliers are plan data (Llama's kernel): embedding and softmax scales, the packed o/down
    weights' scale and 1 / logits_scaling on the final norm."""
    scales = {packed.buffer: packed.scale for packed in plan.packed if packed.scale != 1.0}
    return plan.dims.embed_scale == 12.0 and plan.dims.attn_scale == 0.015625 and plan.tied_lm_head \
        and scales == {"w_o": 0.22, "w_down": 0.22, "final_norm": 0.125}


@dataclass(frozen=True)
class Shape:
    preset: str
    capacity: int = 128
    layers: int | None = 2  # None: the preset's own depth
    plan_holds: Callable[[Plan], bool] = field(default=lambda plan: True)
    ptx_holds: Callable[[str], bool] = field(default=lambda ptx: True)
    why: str = ""

    def __str__(self) -> str:
        return f"{self.preset}-c{self.capacity}"


SHAPES = [
    *[Shape(name, ptx_holds=_streams_gemvs_through_the_ring(3), why="Llama-family real shapes")
      for name in ("smollm-135m", "llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "smollm-1.7b")],
    *[Shape(name, plan_holds=lambda p: p.dims.n_kv_heads == 1 and p.dims.act == "gelu_tanh",
            ptx_holds=_streams_gemvs_through_the_ring(1),
            why="head_dim 256, 8 query heads on one KV head, a 16384-wide GeGLU: room for a 2-stage ring")
      for name in ("tiny-gemma", "gemma-2b")],
    *[Shape(name, plan_holds=lambda p: p.layout == "sandwich", why="Gemma 2: sandwich norms, soft-capping")
      for name in ("tiny-gemma2", "gemma-2-2b")],
    Shape("tiny-gemma3", capacity=160, layers=None, plan_holds=lambda p: p.has_rope_tables and p.has_windows),
    Shape("gemma-3-270m", capacity=1024, layers=6, plan_holds=lambda p: p.has_rope_tables and p.has_windows,
          why="4/1 heads x 256, window 512 < 1024, a rotary table per layer type"),
    Shape("tiny-mistral", capacity=320, layers=None, plan_holds=lambda p: p.has_windows),
    Shape("mistral-7b", capacity=8192, plan_holds=lambda p: p.has_windows, why="window 4096 < 8192"),
    *[Shape(name, capacity=capacity, plan_holds=lambda p: p.dims.head_dim == 96 and p.has_windows,
            why="head_dim 96: 12-lane rows in 16-lane groups; past the window (96, 2047)")
      for name, capacity in (("tiny-phi3", 160), ("phi-3-mini", 4096))],
    Shape("tiny-phi4", capacity=320, plan_holds=lambda p: p.dims.rotary_dim == 48 and p.rotary.long_from == 128,
          why="partial rotary; past the original long-RoPE range (the switch is table data: same kernel)"),
    Shape("phi-4-mini", capacity=4096, plan_holds=lambda p: p.dims.rotary_dim == 96 and p.rotary.long_from == 0,
          why="24/8 heads x 128, 96 rotated features, bucket 4096 = its original long-RoPE range"),
    *[Shape(name, capacity=1024, plan_holds=lambda p: p.layout == "post_norm" and p.dims.whole_qk_norm,
            why="OLMo-2: norms after attention and MLP, q/k norms over the whole projection")
      for name in ("tiny-olmo2", "olmo-2-1b")],
    *[Shape(name, plan_holds=_granite_folds, ptx_holds=_streams_gemvs_through_the_ring(3),
            why="Granite: Llama with its multipliers folded into the plan (32/8 heads x 64, vocab 49155)")
      for name in ("tiny-granite", "granite-3.1-2b")],
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_module_compiles_for_sm90a(shape: Shape, tmp_path):
    pytest.importorskip("cutlass")
    from megabake.runtime.compile import compile_check, load_module

    vocab = min(4096, get_preset(shape.preset).config["vocab_size"])
    compiled = compile_preset(shape.preset, layers=shape.layers, vocab=vocab, capacity=shape.capacity)
    assert shape.plan_holds(compiled.plan), f"{shape}: the plan does not hold what this shape needs ({shape.why})"
    result = compile_check(compiled.plan, load_module(compiled.generated.source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    assert shape.ptx_holds(next(tmp_path.glob("*.ptx")).read_text()), shape.why


@pytest.mark.parametrize("build", [{"pass_chunks": True}, {"long_slices": False}, {"kv_pipeline": True},
                                   {"kv_fence": True}, {"fold_merge": False}, {"mma_attention": False},
                                   {"mma_attention": True, "mma_schedule": True}, {"mma_two_buffers": True},
                                   {"group_fold": True}, {"early_kv": True}, {"early_kv": "l1"}],
                         ids=["pass-chunks", "short-slices", "kv-pipeline", "kv-fence", "no-fold-merge",
                              "lane-attention", "mma-schedule", "mma-two-buffers", "group-fold", "early-kv",
                              "early-kv-l1"])
def test_split_kv_candidate_builds_compile_for_sm90a(build, tmp_path):
    """The split-KV build options a GPU session times against the default (``gpu_tune.py --builds pass-chunks
    short-slices kv-pipeline no-fold-merge``) compile too, on a shape where they deal differently (SmolLM-135M: 3
    query heads per KV head). The default folds the merge (``FOLD_SPLITS = 16``, 8 before session 60's group_fold);
    ``fold_merge=False`` merges in
    attention again, as before session 24. The default (since session 33) scores and sums the 3-head items on the
    tensor cores: its PTX holds the 8 + 4 MMAs of a 16-key step (64 dims) on top of the lane-group loop's
    (``mma_attention=False``, the default before), twice since session 36 (the fused attention+O steps score their
    whole groups the same way; the lane-group build fuses nothing); ``mma_schedule`` also deals for them
    (``MMA_SLICES``). ``kv_fence`` (session 57, the default since session 58) issues each lane-group iteration's
    K/V rows behind a warp fence: one ``bar.warp.sync`` more in the PTX of the loop than ``kv_fence=False``'s
    (SmolLM-135M's one-head slices run it at long contexts), and it refuses to build with ``kv_pipeline``, which
    loads those rows one iteration ahead instead. ``mma_two_buffers`` (session 58) runs two 16-key steps per loop
    iteration from two K/V buffers: 12 MMAs more in the split-KV items' body (fused steps keep one buffer), and it
    needs ``mma_attention``. ``group_fold`` (session 59) lets the fused_split O blocks merge up to 16 splits of their
    group (``FOLD_SPLITS = 16``, also in ``split_o_block``'s call; the default since session 60); it needs
    fused_split. ``early_kv`` (session 59) issues a warp's first 16-key step of K/V before its item's query is
    roped: ``MMA_ATTENTION = 3`` and ``FUSED_MMA = 3``, the same MMAs as the default; it needs mma_attention and
    excludes mma_two_buffers;
    ``early_kv="l1"`` prefetches that step's lines into L1 instead (``= 4``: ``prefetch.global.L1`` in the PTX)."""
    pytest.importorskip("cutlass")
    from megabake.codegen import generate
    from megabake.runtime.compile import compile_check, load_module

    compiled = compile_preset("smollm-135m", layers=2, vocab=4096, capacity=2048)
    source = generate(compiled.plan, **build).source
    expected = {"pass_chunks": "CHUNK_QUANTUM = 32", "long_slices": "LONG_SLICES = False",
                "kv_pipeline": "KV_PIPELINE = True", "kv_fence": "KV_PIPELINE = 2", "fold_merge": None,
                "mma_attention": "MMA_ATTENTION = True" if build.get("mma_attention") else None,
                "mma_two_buffers": "MMA_ATTENTION = 2", "group_fold": "FOLD_SPLITS = 16",
                "early_kv": "MMA_ATTENTION = 3" if build.get("early_kv") is True else "MMA_ATTENTION = 4",
                }[next(iter(build))]
    default = generate(compiled.plan).source
    assert "\nFOLD_SPLITS = 16\n" in default and "\nMMA_ATTENTION = True\n" in default
    if expected:
        assert f"\n{expected}\n" in source
    elif build == {"fold_merge": False}:
        assert "FOLD_SPLITS" not in source
    else:
        assert "MMA_ATTENTION" not in source
    result = compile_check(compiled.plan, load_module(source), dump_dir=str(tmp_path / "build"))
    assert result.ok, result.error
    if build == {"kv_fence": True}:
        assert "\nKV_PIPELINE = 2\n" in default  # the default since session 58 (codegen.default_kv_fence)
        default = generate(compiled.plan, kv_fence=False).source
        with pytest.raises(ValueError, match="kv_fence .* kv_pipeline"):
            generate(compiled.plan, kv_fence=True, kv_pipeline=True)
        default_result = compile_check(compiled.plan, load_module(default), dump_dir=str(tmp_path / "default"))
        assert default_result.ok, default_result.error
        fences = [next((tmp_path / name).glob("*.ptx")).read_text().count("bar.warp.sync")
                  for name in ("build", "default")]
        assert fences[0] == fences[1] + 1, fences  # one lane-group loop, traced once (Constexpr paths)
    if build == {"group_fold": True}:
        assert source == default  # the default since session 60 (codegen.default_group_fold)
        unfolded = generate(compiled.plan, group_fold=False).source
        assert "\nFOLD_SPLITS = 8\n" in unfolded
        assert "fold=16," in source and "fold=8," in unfolded  # split_o_block's merge, in the kernel body
        with pytest.raises(ValueError, match="group_fold .* needs fold_merge and fused_split"):
            generate(compiled.plan, group_fold=True, fused_split=False)
    if build == {"early_kv": "l1"}:
        assert "\nFUSED_MMA = 4\n" in source
        assert "prefetch.global.L1 " in next((tmp_path / "build").glob("*.ptx")).read_text()
    if build == {"early_kv": True}:
        assert "\nFUSED_MMA = 3\n" in source and "\nFUSED_MMA = True\n" in default
        with pytest.raises(ValueError, match="early_kv .* needs mma_attention"):
            generate(compiled.plan, early_kv=True, mma_attention=False)
        with pytest.raises(ValueError, match="early_kv and mma_two_buffers"):
            generate(compiled.plan, early_kv=True, mma_two_buffers=True)
    if build == {"mma_two_buffers": True}:
        with pytest.raises(ValueError, match="mma_two_buffers .* needs mma_attention"):
            generate(compiled.plan, mma_two_buffers=True, mma_attention=False)
    if build in ({"mma_attention": False}, {"mma_two_buffers": True}, {"early_kv": True}, {"early_kv": "l1"}):
        default_result = compile_check(compiled.plan, load_module(default), dump_dir=str(tmp_path / "default"))
        assert default_result.ok, default_result.error
        mmas = [next((tmp_path / name).glob("*.ptx")).read_text().count("mma.sync") for name in ("build", "default")]
        if build == {"mma_two_buffers": True}:  # the split-KV loop's second 16-key step (fused steps: one buffer)
            assert mmas[0] == mmas[1] + 12, mmas
        elif "early_kv" in build:  # the same steps: only where the first one's loads are issued moved
            assert mmas[0] == mmas[1], mmas
        else:
            assert mmas[1] == mmas[0] + 24, mmas  # 12 in the split-KV items, 12 in the fused steps' whole groups


def test_the_kernel_and_the_plan_agree_on_which_items_go_to_the_tensor_cores():
    """``bodies.mma_attention_fits`` (copied into module.py, which cannot import MegaBake) is the plan's rule."""
    pytest.importorskip("cutlass")
    from megabake.codegen.bodies import mma_attention_fits as kernel_fits
    from megabake.plan.attention import mma_attention_fits as plan_fits

    for heads in range(0, 12):
        for head_dim in (32, 64, 80, 96, 128, 256):
            assert kernel_fits(heads, head_dim) == plan_fits(heads, head_dim), (heads, head_dim)
    assert plan_fits(7, 64) and plan_fits(2, 128) and not plan_fits(1, 64) and not plan_fits(8, 256)
