"""Plan: typed IR -> stages (barrier intervals) x tiles x CTAs, buffers and packed-weight layout.

Contract: ``build_plan(ir, ctas=..., threads=...)`` returns a :class:`Plan`, pure data (dataclasses of
ints, floats and strings) whose canonical JSON (``plan.to_json()``) is hashed into ``plan.hash``. The plan
recognises the decoder by dataflow (``megabake.plan.recognise``): one embedding, then blocks of
``RMSNorm -> {q,k,v} Linear -> RoPE -> KVAppend -> DecodeAttention -> o Linear -> Add -> RMSNorm ->
{gate,up} Linear -> GatedAct -> down Linear -> Add``, then RMSNorm + LM head. Identical blocks become one
runtime layer loop over packed weights ``[L, rows, cols]``. Anything else raises :class:`PlanError`.

The stages, their weights, packing and biases come from the stage table (``megabake.plan.stages``). Per step
the kernel runs: prologue (embedding) | per layer: norm+QKV, attention (RoPE + KV append + decode attention),
O-proj + residual, norm+gate/up, act+down + residual | epilogue (norm + LM head), with one grid barrier
between consecutive stages. RMSNorm of one row is recomputed by every CTA that needs it instead of costing a
barrier. Linear biases become per-stage fp32 buffers (``STAGE_BIAS``, zeros for a projection without one)
that the GEMV adds as it writes; a plan without biases has no such buffers, and its kernel is the same as
before biases existed. Qwen3's per-head q/k RMSNorm (before RoPE) is recognised through the norm and packed
as ``qk_norms`` for the attention stage. A projection's scalar output scale (``Linear.scale``: Granite's
residual_multiplier) is folded into its stage's packed weight and bias (``PackedWeight.scale``), the LM head's
(Granite's logits / logits_scaling) into the final norm's; the kernel never sees them.

Layout of the package: ``model`` (the data classes), ``recognise`` (IR -> blocks), ``stages`` (the stage
table), ``attention`` (split-KV tiling), ``memory`` (shared memory), ``tuning`` (GEMV tilings and the default
choice), ``packing`` / ``rotary`` / ``reference`` (weights, RoPE tables and the CPU executor of a plan).

Layouts (``megabake.plan.stages.LAYOUTS``): ``pre_norm`` (Llama and most families) and ``sandwich`` (Gemma 2:
RMSNorm before and after attention and the MLP, the residual adds of the normalised outputs folded into the next
stage's staging; verified on the H200 in session 8). A layout added later and not yet verified on a GPU is baked
only when ``MEGABAKE_EXPERIMENTAL_LAYOUTS`` names it (:func:`check_layout_enabled`).
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import PlanError
from ..ir import Embedding, IRGraph, Linear, RMSNorm, RotaryTable
from .attention import (ATTN_COUNT, ATTN_PART, SPLIT_KV_MIN_CHUNK, SPLIT_KV_UNROLL,  # noqa: F401
                        SplitStep, attention_tiling, check_attention_preload, chunk_quantum, kv_splits,
                        slices_at, split_chunks, split_kv_buffers, split_schedule)
from .memory import STAGING_BYTES, check_shared_memory, smem_bytes, smem_floats, staging_dtype  # noqa: F401
from .model import (PLAN_VERSION, WARP, Buffer, LayerBinding, ModelDims, PackedWeight, Plan,  # noqa: F401
                    Rotary, Stage, Tiling, plan_from_dict)
from .recognise import POWER_OF_TWO_HEAD_DIMS, Block, model_dims, recognise_decoder
from .stages import (ATTN_WINDOW, GATED_BLOCK, GATED_LAYOUTS, GATED_PLAIN_BLOCK, GEMV_STAGES,  # noqa: F401
                     HEAD_NORMS, LAYER_GEMVS, LAYER_NORM_ROLES, LAYOUTS, ROPE_TABLE, STAGE_BIAS, STAGE_TABLE,
                     WORKSPACES, Layout, StageSpec)
from .tuning import (DEFAULT_TUNING, HOPPER_SMEM_PER_BLOCK, PIPELINE_MAX_THREADS,  # noqa: F401
                     PIPELINE_MAX_VECTORS, RING_VECTOR_BYTES, STREAMING_DEFAULT, GemvTuning, check_pipeline,
                     check_ring, default_tuning, ring_bytes, ring_shape, streaming_tuning)
from .tuning import MMA_MAX_BATCH, MMA_ROWS, mma_bytes, mma_partials_bytes, mma_split, mma_unroll

_check_shared_memory = check_shared_memory  # the name older tests and scripts import
_smem_bytes = smem_bytes


def build_plan(ir: IRGraph, *, ctas: int = 132, threads: int = 256, weight_dtype: str = "bfloat16",
               rotary_scaling: float = 1.0, inv_freq_buffer: str = "",
               tuning: dict[str, GemvTuning] | None = None, attention_preload: bool = False,
               split_kv: bool | None = None, rotary_tables: list[tuple[str, float]] | None = None,
               long_rope: dict | None = None, staging: str | None = None, down_input: str | None = None) -> Plan:
    """Turn recognised IR into a plan for a grid of ``ctas`` CTAs of ``threads`` threads.

    ``rotary_tables`` (``recover_rotary_tables``: (inv_freq fqn, scaling) per RotaryTable op) is needed when the
    model rotates with several tables (Gemma 3's per-layer-type RoPE); one table is ``inv_freq_buffer`` and
    ``rotary_scaling``. ``long_rope`` (``CapturedStep.long_rope``: inv_freq fqn -> (long inv_freq, switch
    position)) marks the tables of a long-RoPE model whose bucket passes its original range: their ``Rotary``
    records the long frequencies and the first position that rotates with them.

    ``split_kv`` (default: on unless ``attention_preload``) splits decode attention's cached keys across CTAs
    (flash decoding, ``bodies.split_kv_attention``); off, one CTA reads a (batch, head)'s whole cache (the
    layout attention preload needs).

    ``tuning=None`` picks :func:`default_tuning` (the streaming ring that fits this bucket); a dict overrides
    the GEMV tiling of named stages (``GEMV_STAGES``) and the rest keep the plain ``DEFAULT_TUNING``.
    ``attention_preload`` loads each lane group's first cached K/V rows before the barrier that precedes
    attention (the attention stage's ``tiling.preload``; one (batch, head) tile per CTA at most).

    ``staging`` ("float32" | "bfloat16") is the dtype of the GEMV input rows each CTA stages on chip. Default: bf16
    for a batched bucket the tensor-core GEMV runs by default (:func:`_tensor_cores_by_default`: 2-8 sequences,
    bf16 weights, a verified activation; faster than fp32 staging on the H200 in session 14), else fp32 where it
    fits in shared memory, else bf16 (``memory.staging_dtype``; bf16 staging passed `pytest -m gpu` in session 12).
    """
    if threads % WARP or not 64 <= threads <= 1024:
        raise PlanError(f"threads per CTA must be a multiple of 32 in [64, 1024], got {threads}")
    unknown = sorted(set(tuning or {}) - set(GEMV_STAGES))
    if unknown:
        raise PlanError(f"tuning names unknown GEMV stage(s) {unknown}; known: {list(GEMV_STAGES)}")
    if split_kv is None:
        split_kv = not attention_preload
    decoder = recognise_decoder(ir)
    embed, blocks, final_norm, lm_head = decoder.embed, decoder.blocks, decoder.final_norm, decoder.lm_head
    layout = LAYOUTS[decoder.layout]
    check_layout_enabled(layout.name)
    dims = model_dims(embed, blocks, final_norm, lm_head, decoder.softcap)
    if dims.whole_qk_norm:
        check_layout_enabled("whole_qk_norm", EXPERIMENTAL_FEATURES["whole_qk_norm"])
    batch, capacity = ir.batch, ir.capacity
    wants_mma = any(t.mma for t in (tuning or {}).values())
    by_default = tuning is None and not attention_preload and _tensor_cores_by_default(
        dims, batch, capacity, weight_dtype, ctas, threads, split_kv)
    if staging is None and (wants_mma or by_default):
        staging = "bfloat16"
    staging = _staging(dims, batch, capacity, threads, split_kv, staging, attention_preload)
    if tuning is None:
        tuning = (_mma_default(dims, batch, staging, weight_dtype, ctas, threads)
                  or _with_gated_write(default_tuning(threads, smem_bytes(dims, batch, capacity, threads, split_kv,
                                                                          staging)), dims.act))
        wants_mma = any(t.mma for t in tuning.values())
    tuning = {**DEFAULT_TUNING, **tuning}
    _check_options(dims, tuning, threads, lm_head, split_kv, attention_preload, batch, ctas)
    if wants_mma:
        _check_mma(dims, tuning, batch, staging, weight_dtype)
    _check_gated(tuning)
    gated_block = 0  # gate/up rows per interleaved block of a gated gate/up GEMV; 0: it does not apply the activation
    if tuning["norm_gate_up"].mma or tuning["norm_gate_up"].gated:  # it applies the activation as it writes (the
        layout = GATED_LAYOUTS[layout.name]  # tensor cores' 8-row tiles pair GATED_BLOCK gate and up rows, the
        gated_block = GATED_BLOCK if tuning["norm_gate_up"].mma else GATED_PLAIN_BLOCK  # plain +gated tiles 1 + 1
    windows = [block.ops["attention"].window for block in blocks]
    _check_windows(windows, split_kv)
    rope_tables, layer_tables = _rope_tables(ir, blocks, rotary_tables, dims.head_dim)
    if len(rope_tables) == 1:  # several tables computed, one used (Gemma 3 with only local layers)
        inv_freq_buffer, rotary_scaling = rope_tables[0].inv_freq_buffer, rope_tables[0].attention_scaling
        rope_tables = []
    down_input = _down_input(dims, batch, capacity, threads, split_kv, staging, tuning, layout, down_input)
    global_down = down_input == "global"
    check_shared_memory(dims, batch, capacity, threads, split_kv, staging, global_down)
    scratch = smem_bytes(dims, batch, capacity, threads, split_kv, staging, global_down)
    ring = check_ring(tuning, threads, scratch)
    tied = lm_head.weight == embed.table
    biased = _biased_stages(blocks)
    head_norms = _has_head_norms(blocks)
    stages = _stages(layout, dims, batch, tuning, attention_tiling(dims, batch, ctas, threads, split_kv), biased,
                     head_norms, attention_preload, (ctas, threads // WARP))
    ring += _mma_partials(stages, threads, scratch + ring)
    return Plan(
        version=PLAN_VERSION, dims=dims, batch=batch, capacity=capacity, ctas=ctas, threads=threads,
        smem_bytes=scratch + ring, weight_dtype=weight_dtype,
        buffers=_buffers(layout, dims, batch, capacity, weight_dtype, tied, max(1, len(rope_tables)))
        + ([Buffer(DOWN_INPUT, "workspace", "bfloat16", [batch, dims.intermediate])] if global_down else [])
        + _bias_buffers(dims, biased)
        + _head_norm_buffers(dims, head_norms) + split_kv_buffers(dims, batch, stages) + _window_buffers(dims, windows)
        + _rope_table_buffers(dims, rope_tables),
        packed=_packing(layout, blocks, embed, final_norm, lm_head, tied, gated_block)
        + _bias_packing(layout, blocks, biased, gated_block)
        + _head_norm_packing(blocks, head_norms),
        stages=stages, layers=[_bind_layer(layout, block, window, table)
                               for block, window, table in zip(blocks, windows, layer_tables)],
        rotary=_with_long_rope(Rotary(inv_freq_buffer=inv_freq_buffer, attention_scaling=rotary_scaling,
                                      head_dim=dims.head_dim, ops=[op.id for op in ir.of_kind(RotaryTable)]),
                               long_rope, capacity),
        globals={"embed": _provenance([embed]), "final_norm": _provenance([final_norm]),
                 "lm_head": _provenance([lm_head])},
        tied_lm_head=tied, layout=layout.name,
        rope_tables=[_with_long_rope(rotary, long_rope, capacity) for rotary in rope_tables],
        staging_dtype=staging, down_input=down_input,
    )


DOWN_INPUT = "act"  # bf16 [batch, intermediate]: the gated activation a down_input="global" plan's down GEMV reads


def _down_input(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool, staging: str,
                tuning: dict[str, GemvTuning], layout: Layout, requested: str | None) -> str:
    """Where the down projection reads its input rows (``build_plan``'s ``down_input``): "smem" (staged, as every
    other GEMV) or "global" (the gate/up GEMV writes act(gate) * up in bf16 to the ``DOWN_INPUT`` buffer, which
    the tensor-core down GEMV reads through L2). None picks "global" only where the staged rows alone overflow
    shared memory (batch 8 of gemma-2b and Mistral-7B: 8 x 16384 / 14336 bf16) and leaving them out fits."""
    if requested not in (None, "smem", "global"):
        raise PlanError(f"down_input must be 'smem' or 'global', got {requested!r}")
    if requested == "smem":
        return "smem"
    if requested is None:
        staged = smem_bytes(dims, batch, capacity, threads, split_kv, staging)
        unstaged = smem_bytes(dims, batch, capacity, threads, split_kv, staging, global_down=True)
        if staged <= HOPPER_SMEM_PER_BLOCK or unstaged > HOPPER_SMEM_PER_BLOCK:
            return "smem"
    why = _global_down_refusal(staging, tuning, layout)
    if why:
        if requested is None:  # check_shared_memory names the batch and capacity that fit
            return "smem"
        raise PlanError(f"down_input='global' {why}")
    check_layout_enabled("global_down_input", EXPERIMENTAL_FEATURES["global_down_input"],
                         holder=f"this bucket (batch {batch}) needs" if requested is None else "this bake asks for")
    return "global"


def _global_down_refusal(staging: str, tuning: dict[str, GemvTuning], layout: Layout) -> str | None:
    """Why the down GEMV cannot read its input from global memory in this plan, or None."""
    if staging != "bfloat16" or not (tuning["down_residual"].mma and tuning["norm_gate_up"].mma):
        return ("needs the tensor-core GEMV (tiling +mma, bf16 staging) on the gate/up and down stages: the gate/up "
                "GEMV writes the activation in bf16 for the down GEMV to read")
    down = next(spec for spec in layout.stages if spec.name == "down_residual")
    if down.vector.kind != "copy" or down.vector.source != "gate_up":
        return f"needs a layout whose down projection stages the gated activation as is (this one: {layout.name})"
    return None


def _staging(dims: ModelDims, batch: int, capacity: int, threads: int, split_kv: bool, staging: str | None,
             attention_preload: bool) -> str:
    """The GEMV input rows' dtype in shared memory (``build_plan``'s ``staging``), checked."""
    chosen = staging or staging_dtype(dims, batch, capacity, threads, split_kv)
    if chosen not in STAGING_BYTES:
        raise PlanError(f"staging dtype {chosen!r} is not one of {sorted(STAGING_BYTES)}")
    if chosen == "bfloat16":
        if attention_preload:
            raise PlanError("attention preload keeps this step's key and value in the fp32 staging rows; it cannot "
                            "be combined with bf16 staging (a bucket whose fp32 rows do not fit): bake without "
                            "--attention-preload")
        need = smem_bytes(dims, batch, capacity, threads, split_kv, "float32")
        check_layout_enabled("bf16_staging", f"{EXPERIMENTAL_FEATURES['bf16_staging']}: batch {batch} x "
                             f"{smem_floats(dims, batch, capacity, threads, split_kv)['vec_width']}-wide fp32 rows "
                             f"need {need} bytes per CTA (a smaller --batch keeps fp32 staging)")
    return chosen


EXPERIMENTAL_LAYOUTS_ENV = "MEGABAKE_EXPERIMENTAL_LAYOUTS"
GPU_VERIFIED_LAYOUTS = ("pre_norm", "sandwich", "post_norm")  # layouts whose kernels passed `pytest -m gpu` on an H200


# kernel features (beyond layouts) that passed `pytest -m gpu` on a Hopper GPU (an H200; global_down_input on an
# H100 in session 41, mma_wide on an H100 in session 42, the H200 not being lent: same sm_90a code and shared memory
# per CTA; fused_split on an H100 and with fused_mlp on the H200 in session 45; loader_warp on an H100 in session 55:
# the GPU tests of Qwen3-0.6B and Qwen2.5-0.5B, the only presets it changes, and in session 56 the 13 Qwen3-0.6B tests
# on its "attention"-gated default; the whole suite passed with it on, on an H100 in session 58; kv_fence on an H100
# in session 58: its bit-identity GPU test (4 plans) and 13 SmolLM-135M / Phi-3-mini GPU tests with it on, the whole
# suite with it off; the same bits as the plain loop; group_fold on an H100 in session 60: the whole suite with it on,
# its own test (4 plans, fp32 order of the merge) once its tolerance allowed one flipped bf16 rounding; split_cap on
# an H100 in session 64: with it on, the 15 GPU tests whose ids name qwen2.5-0.5b, the only preset whose modules it
# changes (codegen.split_cap_fits_group), all passed, and the Qwen2.5-0.5B b1 benchmark's numerics at 4000 passed;
# the whole suite on it as the default, on an H100 in session 65: 140 of 151 passed, none failed, 11 not reached)
GPU_VERIFIED_FEATURES = ("rope_tables", "whole_qk_norm", "bf16_staging", "mma_gemv", "gated_gemv",
                         "global_down_input", "mma_wide", "fused_split", "fused_mlp", "spare_warp", "bulk_down",
                         "loader_warp", "kv_fence", "group_fold", "split_cap")
EXPERIMENTAL_FEATURES = {"rope_tables": "per-layer rotary tables (Gemma 3: one RoPE base per layer type)",
                         "whole_qk_norm": "q/k RMSNorm over the whole projection (OLMo-2)",
                         "bf16_staging": "GEMV inputs staged in bf16 shared memory because fp32 rows do not fit",
                         "mma_gemv": "the tensor-core GEMV (mma.sync on bf16-staged inputs, tiling +mma)",
                         "gated_gemv": "the activation in the plain gate/up GEMV's write (tiling +gated; passed on "
                                       "the H200 in session 15)",
                         "global_down_input": "the tensor-core down projection reading its bf16 input rows from "
                                              "global memory, not shared memory (session 40: batch 8 of models whose "
                                              "MLP is too wide to stage; passed on an H100 in session 41)",
                         "mma_wide": "split-KV attention items of heads of 256 dims on the tensor cores (session 41: "
                                     "Gemma; codegen.default_mma_wide turns it on where the plan deals such items; "
                                     "passed on an H100 in session 42)",
                         "fused_split": "with fused_o, split steps' O projection in attention's interval too (session "
                                        "44: codegen.generate(fused_split=None) turns it on where fused_o is on; "
                                        "the whole GPU suite passed with it on, on an H100 in session 45, and "
                                        "with fused_mlp on the H200)",
                         "fused_mlp": "with fused_o, a layer's gate/up and down projections in one interval (session "
                                      "43: codegen.fused_mlp.default_fused_mlp turns it on where a CTA's W_down "
                                      "columns copy at least 64 bits wide; the whole GPU suite passed with it on, "
                                      "on the H200 in session 45)",
                         "spare_warp": "warp 0, whose thread 0 polls each grid barrier, issues no copies between the "
                                       "arrival and the wait (session 48: codegen.generate(spare_loads=None, "
                                       "spare_ring=None) turns both on where they apply; the same bits, -1% to -3% "
                                       "GPU ms on an H100; the whole GPU suite passed with it on, on an H100 in "
                                       "session 49)",
                         "loader_warp": "a ninth warp per CTA streams the weights in consumption order across grid "
                                        "barriers, paced by the consumers' arrivals (sessions 51-53: "
                                        "codegen.loader.default_loader_warp turns it on where a layer streams at "
                                        "least 16 MB and it applies; the same bits as the fused default; every "
                                        "GPU test of the two presets it changes passed with it on, on an H100 in "
                                        "session 55)",
                         "kv_fence": "each split-KV lane-group iteration's K/V rows issued together behind a warp "
                                     "fence (session 57: codegen.default_kv_fence turns it on where attention is "
                                     "split and the K/V pipeline is off; the same bits as the plain loop; H100 GPU "
                                     "ms in session 58: Qwen2.5-0.5B @4000 0.637 -> 0.621, SmolLM-135M @2000 0.419 "
                                     "-> 0.412, Phi-3-mini @4000 3.113 -> 3.065)",
                         "group_fold": "a fused_split build's O blocks merge up to 16 active split-KV splits of "
                                       "their KV group, so its items do not merge them first (session 59: "
                                       "codegen.default_group_fold; H100 GPU ms: Qwen3-0.6B @4000 0.903 -> 0.874, "
                                       "@1000 0.766 -> 0.740, Llama-3.2-1B @4000 1.027 -> 1.004; the whole GPU "
                                       "suite passed with it on, on an H100 in session 60)",
                         "split_cap": "where a plan deals more than 16 split-KV splits a KV group of 7+ query "
                                      "heads that fits one tensor-core item (batch 1 among the presets: "
                                      "Qwen2.5-0.5B), the default deals for the tensor cores with fused_o kept on, "
                                      "over at most 16 splits that the O blocks merge (session 62: "
                                      "codegen.default_mma_schedule / default_split_cap; H100 GPU ms, Qwen2.5-0.5B "
                                      "b1: @1000 0.600 -> 0.587, @4000 0.654 -> 0.627, @16 level; SmolLM-135M's "
                                      "3-head groups lost 2% at 1000, session 63; the 15 Qwen2.5-0.5B GPU tests "
                                      "passed with it on, on an H100 in session 64)",
                         "bulk_down": "with fused_mlp, a CTA's W_down columns by cp.async.bulk from a packed copy the "
                                      "runtime derives (session 48: codegen.generate(bulk_down=None) turns it on where "
                                      "fused_mlp is; the same bits; the whole GPU suite passed with it on, on an "
                                      "H100 in session 49)"}


def feature_enabled(name: str) -> bool:
    """Whether a layout or kernel feature is baked: it has passed `pytest -m gpu` (``GPU_VERIFIED_LAYOUTS`` /
    ``GPU_VERIFIED_FEATURES``) or ``MEGABAKE_EXPERIMENTAL_LAYOUTS`` names it (comma- or space-separated)."""
    if name in GPU_VERIFIED_LAYOUTS or name in GPU_VERIFIED_FEATURES:
        return True
    return name in os.environ.get(EXPERIMENTAL_LAYOUTS_ENV, "").replace(",", " ").split()


def check_layout_enabled(name: str, what: str | None = None, holder: str = "this model has") -> None:
    """A layout (or, with ``what`` describing it, a kernel feature such as ``rope_tables``) whose kernel has not
    yet run on a GPU is baked only when ``MEGABAKE_EXPERIMENTAL_LAYOUTS`` names it (comma- or space-separated).
    Every layout in ``LAYOUTS`` has passed, and every feature in ``GPU_VERIFIED_FEATURES``. ``holder`` opens the
    refusal ("this bake asks for" where the feature is an option, not the model's)."""
    if feature_enabled(name):
        return
    subject = f"{what} ({name!r})" if what else f"the {name!r} decoder layout"
    raise PlanError(f"{holder} {subject}, whose kernel matches eager fp32 on the CPU (reference executor) and "
                    "compiles for sm_90a but has not run on a GPU yet; to bake it anyway set "
                    f"{EXPERIMENTAL_LAYOUTS_ENV}={name} (a bake on a Hopper GPU and `megabake verify` still check "
                    "its numerics against PyTorch)")


def _check_options(dims: ModelDims, tuning: dict[str, GemvTuning], threads: int, lm_head: Linear, split_kv: bool,
                   attention_preload: bool, batch: int, ctas: int) -> None:
    check_pipeline(tuning, threads)
    if tuning["norm_lm_head"].preload:
        raise PlanError("GEMV preload is not supported for the LM head stage (no barrier precedes it inside the "
                        "layer loop); use preload=False for norm_lm_head")
    if lm_head.bias is not None:
        raise PlanError(f"{lm_head.hf_module} (the LM head) has a bias; an LM-head bias is not supported yet")
    for k in (dims.hidden, dims.q_rows, dims.intermediate):
        if k % 8:
            raise PlanError(f"a GEMV reduction length of {k} is not a multiple of 8 (16-byte bf16 vectors)")
    if split_kv and attention_preload:
        raise PlanError("attention preload applies to the unsplit attention: pass split_kv=False with it")
    if dims.whole_qk_norm and not split_kv:
        raise PlanError("q/k norms over the whole projection (OLMo-2) are baked into the split-KV attention only; "
                        "bake without --attention-preload (and without split_kv=False)")
    if dims.rotary_dim and (dims.rotary_dim % 2 or not split_kv):
        raise PlanError(f"partial rotary (rotary_dim {dims.rotary_dim} of head_dim {dims.head_dim}) is baked into "
                        "the split-KV attention only, with an even rotary_dim; bake without --attention-preload "
                        "(and without split_kv=False)")
    if not split_kv and dims.head_dim not in POWER_OF_TWO_HEAD_DIMS:
        raise PlanError(f"head_dim {dims.head_dim} is baked into the split-KV attention only (the unsplit attention "
                        f"needs head_dim in {', '.join(map(str, POWER_OF_TWO_HEAD_DIMS))}); bake without "
                        "--attention-preload (and without split_kv=False)")
    if attention_preload:
        check_attention_preload(dims, batch, ctas)


def _check_mma(dims: ModelDims, tuning: dict[str, GemvTuning], batch: int, staging: str, weight_dtype: str) -> None:
    """The tensor-core GEMV (``+mma``) multiplies bf16 weights by bf16-staged rows of at most 8 sequences."""
    check_layout_enabled("mma_gemv", EXPERIMENTAL_FEATURES["mma_gemv"], holder="this bake asks for")
    refusal = _mma_refusal(batch, staging, weight_dtype)
    if refusal:
        raise PlanError(refusal)
    if dims.final_softcap and tuning["norm_lm_head"].mma:
        raise PlanError("the tensor-core GEMV (+mma) does not soft-cap the LM head's logits (Gemma 2): give "
                        "norm_lm_head a plain tiling (build_plan's tuning; `--tiling` applies to every stage)")


# activations the plain (register or cp.async ring) gate/up GEMV applies in its write by default (+gated): H200,
# session 15, batch 1, ring tiling: -2.3% SmolLM-135M (0.433 -> 0.423 ms), -2.8% Llama-3.2-1B (0.865 -> 0.841 ms)
# GPU time per step, logits bit-identical to the separate activation (same sums, same activation formula)
GATED_DEFAULT_ACTIVATIONS = ("silu", "gelu_tanh")


def _with_gated_write(tuning: dict[str, GemvTuning], act: str) -> dict[str, GemvTuning]:
    """``tuning`` with the gated write (+gated) on its gate/up stage where that tiling allows it, the model's
    activation is in ``GATED_DEFAULT_ACTIVATIONS`` and the feature has passed on a GPU (``gated_gemv`` in
    ``GPU_VERIFIED_FEATURES``, session 15); ``tuning`` unchanged otherwise."""
    if act not in GATED_DEFAULT_ACTIVATIONS or "gated_gemv" not in GPU_VERIFIED_FEATURES:
        return tuning
    try:
        gate_up = dataclasses.replace(tuning["norm_gate_up"], gated=True)
    except PlanError:  # +mma, +pipeline, a register preload or an odd rows-per-tile: no gated write
        return tuning
    return {**tuning, "norm_gate_up": gate_up}


def _check_gated(tuning: dict[str, GemvTuning]) -> None:
    """``+gated`` (the plain GEMV's gated write) is the gate/up stage's."""
    others = [name for name, t in tuning.items() if t.gated and name != "norm_gate_up"]
    if others:
        raise PlanError(f"+gated applies the MLP's activation in the gate/up GEMV; stage(s) {others} have no "
                        "activation to apply: give them a tiling without +gated")
    if tuning["norm_gate_up"].gated:
        check_layout_enabled("gated_gemv", EXPERIMENTAL_FEATURES["gated_gemv"], holder="this bake asks for")


def _mma_refusal(batch: int, staging: str, weight_dtype: str) -> str | None:
    """Why the tensor-core GEMV cannot run this bucket, or None."""
    if staging != "bfloat16":
        return (f"the tensor-core GEMV (+mma) reads its inputs as bf16; this plan stages them in {staging}: "
                "bake without a staging override (+mma picks bf16)")
    if batch > MMA_MAX_BATCH:
        return (f"the tensor-core GEMV (+mma) holds at most {MMA_MAX_BATCH} sequences per MMA; batch {batch} "
                "needs the plain tiling")
    if weight_dtype != "bfloat16":
        return f"the tensor-core GEMV (+mma) multiplies bf16 weights; these are {weight_dtype}"
    return None


# activations whose gated write in the tensor-core gate/up GEMV passed on the H200 (session 13: SiLU, Llama-3.2-1B
# b8; session 14: Gemma's tanh GELU, tiny-gemma b2 at long context); exact GELU has not run on a GPU
MMA_DEFAULT_ACTIVATIONS = ("silu", "gelu_tanh")


# the smallest batch whose default is bf16 staging + the tensor cores even where fp32 rows fit (session 14, H200,
# Llama-3.2-1B batch 4: 1.020 ms GPU per step against 1.462 fp32-staged); batch 1 keeps fp32 staging (not measured)
MMA_MIN_DEFAULT_BATCH = 2


def _tensor_cores_by_default(dims: ModelDims, batch: int, capacity: int, weight_dtype: str, ctas: int, threads: int,
                             split_kv: bool) -> bool:
    """A batched bucket (at least ``MMA_MIN_DEFAULT_BATCH`` sequences) that the tensor-core GEMV runs by default
    once staged in bf16 (:func:`_mma_default`, its partial sums fitting in shared memory): its default stages bf16
    rows (what eager bf16 PyTorch feeds its GEMVs) even where fp32 rows fit."""
    if batch < MMA_MIN_DEFAULT_BATCH:
        return False
    chosen = _mma_default(dims, batch, "bfloat16", weight_dtype, ctas, threads)
    return chosen is not None and (smem_bytes(dims, batch, capacity, threads, split_kv, "bfloat16")
                                   + mma_partials_bytes(threads) <= HOPPER_SMEM_PER_BLOCK)


def _mma_default(dims: ModelDims, batch: int, staging: str, weight_dtype: str, ctas: int,
                 threads: int) -> dict | None:
    """The default tiling of a bf16-staged bucket the tensor-core GEMV can run (:func:`_mma_refusal`; at most
    ``MMA_MAX_BATCH`` sequences) of a model whose activation is in ``MMA_DEFAULT_ACTIVATIONS``, once it has passed
    on a GPU (``mma_gemv`` in ``GPU_VERIFIED_FEATURES``, session 13): ``8x8+mma`` on every GEMV stage whose K it
    can split (the LM head of a soft-capped model keeps the plain tiling); None otherwise."""
    if ("mma_gemv" not in GPU_VERIFIED_FEATURES or _mma_refusal(batch, staging, weight_dtype)
            or dims.act not in MMA_DEFAULT_ACTIVATIONS):
        return None
    mma = GemvTuning(MMA_ROWS, 8, mma=True)
    chosen = {}
    for name in GEMV_STAGES:
        gemv = next(spec.gemv for spec in STAGE_TABLE if spec.name == name and spec.gemv)
        try:
            mma_split(getattr(dims, gemv.rows), getattr(dims, gemv.cols), ctas, threads // WARP)
        except PlanError:  # K not a multiple of the MMA step
            continue
        if not (name == "norm_lm_head" and dims.final_softcap):
            chosen[name] = mma
    return chosen or None


def _mma_partials(stages: list[Stage], threads: int, other_bytes: int) -> int:
    """Shared-memory bytes of the split tensor-core GEMV's partial sums, checked against what the rest leaves."""
    extra = mma_bytes([s.tiling for s in stages], threads)
    if other_bytes + extra > HOPPER_SMEM_PER_BLOCK:
        raise PlanError(f"the tensor-core GEMV's partial sums need {extra} bytes of shared memory per CTA next to the "
                        f"kernel's {other_bytes}, over Hopper's {HOPPER_SMEM_PER_BLOCK}: use a smaller --batch or "
                        "--capacity, or bake without +mma")
    return extra


def _provenance(ops) -> dict[str, list[str]]:
    return {
        "ops": [op.id for op in ops],
        "fx_nodes": [n for op in ops for n in op.fx_nodes],
        "hf_modules": sorted({op.hf_module for op in ops if op.hf_module}),
    }


def _layer_roles(spec: StageSpec) -> list[str]:
    return list(spec.optional_roles) + list(spec.roles)


def _check_windows(windows: list[int], split_kv: bool) -> None:
    if any(windows) and not split_kv:
        raise PlanError(f"sliding-window attention (window {max(windows)}) is baked into the split-KV attention "
                        "only; bake without --attention-preload (and without split_kv=False)")


def _rope_tables(ir: IRGraph, blocks: list[Block], recovered: list[tuple[str, float]] | None,
                 head_dim: int) -> tuple[list[Rotary], list[int]]:
    """The rotary tables the layers use (Gemma 3: one per layer type) and each layer's index among them:
    ([], zeros) for a model with one table; one Rotary when several are computed but one is used."""
    tables = ir.of_kind(RotaryTable)
    if len(tables) <= 1:
        return [], [0] * len(blocks)
    if recovered is None or len(recovered) != len(tables):
        raise PlanError(f"this model computes {len(tables)} rotary tables; pass "
                        "rotary_tables=megabake.plan.rotary.recover_rotary_tables(captured, ir) (compile_step does)")
    by_id = {table.id: (table, source) for table, source in zip(tables, recovered)}
    used: list[str] = []
    for block in blocks:
        q_table, k_table = block.ops["q_rope"].table, block.ops["k_rope"].table
        if q_table != k_table:
            raise PlanError(f"layer {block.index} rotates q and k with different tables ({q_table}, {k_table})")
        if q_table not in used:
            used.append(q_table)
    used.sort(key=lambda op_id: tables.index(by_id[op_id][0]))
    if len(used) > 1:
        check_layout_enabled("rope_tables", EXPERIMENTAL_FEATURES["rope_tables"])
    rotaries = [Rotary(inv_freq_buffer=by_id[op_id][1][0], attention_scaling=by_id[op_id][1][1], head_dim=head_dim,
                       ops=[op_id]) for op_id in used]
    return rotaries, [used.index(block.ops["q_rope"].table) for block in blocks]


def _with_long_rope(rotary: Rotary, long_rope: dict | None, capacity: int) -> Rotary:
    """``rotary`` with its long-RoPE switch (``long_inv_freq`` from row ``long_from`` on) when ``long_rope`` names
    its buffer and the bucket reaches the switch; unchanged otherwise."""
    inv_freq, switch = (long_rope or {}).get(rotary.inv_freq_buffer, (None, 0))
    if inv_freq is None or not 0 < switch < capacity:
        return rotary
    return dataclasses.replace(rotary, long_inv_freq=[float(v) for v in inv_freq], long_from=int(switch))


def _rope_table_buffers(dims: ModelDims, rope_tables: list[Rotary]) -> list[Buffer]:
    return [Buffer(ROPE_TABLE, "table", "int32", [dims.layers])] if len(rope_tables) > 1 else []


def _window_buffers(dims: ModelDims, windows: list[int]) -> list[Buffer]:
    """``attn_window`` [layers] int32 when some layer attends over a sliding window (values:
    :meth:`Plan.attn_window_table`); none otherwise, so such plans and kernels are unchanged."""
    return [Buffer(ATTN_WINDOW, "table", "int32", [dims.layers])] if any(windows) else []


def _bind_layer(layout: Layout, block: Block, window: int = 0, rope_table: int = 0) -> LayerBinding:
    ops = block.ops
    layer_specs = [spec for spec in layout.stages if spec.per_layer]
    by_stage = {spec.name: [ops[r] for r in _layer_roles(spec) if r in ops] for spec in layer_specs}
    params = {role: op.weight for spec in layer_specs for role in _layer_roles(spec)
              if (op := ops.get(role)) is not None and isinstance(op, (RMSNorm, Linear))}
    return LayerBinding(
        index=block.index, params=params,
        ops={s: [op.id for op in v] for s, v in by_stage.items()},
        fx_nodes={s: [n for op in v for n in op.fx_nodes] for s, v in by_stage.items()},
        hf_modules={s: sorted({op.hf_module for op in v if op.hf_module}) for s, v in by_stage.items()},
        window=window, rope_table=rope_table,
    )


def _stage_tiling(spec: StageSpec, dims: ModelDims, batch: int, tuning: dict[str, GemvTuning],
                  attention: Tiling, grid: tuple[int, int]) -> Tiling:
    if spec.gemv is not None:
        rows, chosen = getattr(dims, spec.gemv.rows), tuning[spec.name]
        if chosen.mma:  # tensor cores: the plan picks the warps per tile and the loads that divide their K slice
            cols = getattr(dims, spec.gemv.cols)
            split = mma_split(rows, cols, *grid)
            return Tiling("rows", rows, MMA_ROWS, -(-rows // MMA_ROWS), mma_unroll(cols, split, chosen.unroll),
                          mma=split)
        return Tiling("rows", rows, chosen.per_tile, -(-rows // chosen.per_tile), chosen.unroll, chosen.spread,
                      chosen.preload, chosen.pipeline, chosen.stages, gated=chosen.gated)
    if spec.kind == "attention":
        return attention
    elements = batch * dims.hidden  # the embedding gather: elements over CTAs
    return Tiling("chunks", elements, 256, -(-elements // 256))


def _stages(layout: Layout, dims: ModelDims, batch: int, tuning: dict[str, GemvTuning], attention: Tiling,
            biased: list[str], head_norms: bool, attention_preload: bool, grid: tuple[int, int]) -> list[Stage]:
    """The layout's stages with their tilings; ``grid`` = (CTAs, warps per CTA)."""
    stages = []
    for index, spec in enumerate(layout.stages):
        tiling = _stage_tiling(spec, dims, batch, tuning, attention, grid)
        if spec.kind == "attention":
            tiling.preload = attention_preload
        reads, roles = list(spec.reads), list(spec.roles)
        if spec.name in biased:
            reads.append(STAGE_BIAS[spec.name])
        if spec.optional_roles and head_norms:
            reads += spec.optional_reads
            roles = list(spec.optional_roles) + roles
        stages.append(Stage(index, spec.name, spec.scope, spec.kind, reads, list(spec.writes), tiling, roles,
                            barrier_after=spec.barrier_after))
    return stages


def _buffers(layout: Layout, dims: ModelDims, batch: int, capacity: int, wdt: str, tied: bool,
             rope_tables: int = 1) -> list[Buffer]:
    L, H = dims.layers, dims.hidden
    buffers = [Buffer("embed", "weight", wdt, [dims.vocab, H])]
    rope_shape = [capacity, dims.head_dim] if rope_tables == 1 else [rope_tables, capacity, dims.head_dim]
    buffers += [Buffer(spec.gemv.weight, "weight", wdt, [L, getattr(dims, spec.gemv.rows), getattr(dims, spec.gemv.cols)])
                for spec in layout.layer_gemvs]
    buffers += [Buffer("norms", "weight", "float32", [L, len(layout.norm_roles), H]),
                Buffer("final_norm", "weight", "float32", [H])]
    if not tied:
        buffers.append(Buffer("lm_head", "weight", wdt, [dims.vocab, H]))
    buffers += [
        Buffer("rope_cos", "table", "float32", rope_shape),
        Buffer("rope_sin", "table", "float32", rope_shape),
        Buffer("k_cache", "state", wdt, [L, batch, dims.n_kv_heads, capacity, dims.head_dim]),
        Buffer("v_cache", "state", wdt, [L, batch, dims.n_kv_heads, capacity, dims.head_dim]),
        Buffer("tokens", "input", "int32", [batch]),
        Buffer("position", "input", "int32", [1]),
    ]
    buffers += [Buffer(name, "workspace", "float32", [batch, getattr(dims, width)])
                for name, width in layout.workspaces.items()]
    buffers += [Buffer("logits", "output", "float32", [batch, dims.vocab]), Buffer("barrier", "sync", "int64", [1])]
    return buffers


def _packing(layout: Layout, blocks: list[Block], embed: Embedding, final_norm: RMSNorm, lm_head: Linear,
             tied: bool, gated_block: int) -> list[PackedWeight]:
    def per_layer(roles):
        return [[_weight_source(block.ops[role]) for role in roles] for block in blocks]

    packs = [PackedWeight("embed", False, [[(embed.table, 0)]])]
    packs += [PackedWeight(spec.gemv.weight, True, per_layer(spec.gemv.roles), _interleave(spec, gated_block),
                           _output_scale(spec, blocks))
              for spec in layout.layer_gemvs]
    # the LM head's output scale (Granite's logits / logits_scaling) folds into the fp32 final norm: the head may be
    # the tied embedding, and its input row is rmsnorm(x) * final_norm, linear in the norm weight
    packs += [PackedWeight("norms", True, per_layer(layout.norm_roles)),
              PackedWeight("final_norm", False, [[(final_norm.weight, 0)]], scale=lm_head.scale)]
    if not tied:
        packs.append(PackedWeight("lm_head", False, [[(lm_head.weight, 0)]]))
    return packs


def _weight_source(op) -> tuple:
    """A packed-weight source: ``(fqn, 0)`` the whole parameter, or ``(fqn, start, stop)`` those rows of a fused
    one (Phi-3's qkv_proj / gate_up_proj, ``Linear.weight_rows``)."""
    rows = getattr(op, "weight_rows", None)
    return (op.weight, *rows) if rows else (op.weight, 0)


def _output_scale(spec: StageSpec, blocks: list[Block]) -> float:
    """The scale of a GEMV stage's projection outputs (``Linear.scale``; Granite's residual_multiplier on o and
    down), folded into its packed weight and bias: one for all its projections in every layer."""
    scales = {block.ops[role].scale for block in blocks for role in spec.gemv.roles}
    if len(scales) > 1:
        raise PlanError(f"the projections {'/'.join(spec.gemv.roles)} scale their outputs by {sorted(scales)} (in "
                        f"different layers or projections); a scale folds into their packed weight {spec.gemv.weight} "
                        "only when it is the same for all of them in every layer")
    return scales.pop()


def _biased_stages(blocks: list[Block]) -> list[str]:
    """GEMV stages in which some layer's projection has a bias."""
    return [spec.name for spec in LAYER_GEMVS if spec.gemv.bias
            and any(block.ops[role].bias is not None for block in blocks for role in spec.gemv.roles)]


def _bias_buffers(dims: ModelDims, biased: list[str]) -> list[Buffer]:
    return [Buffer(spec.gemv.bias, "weight", "float32", [dims.layers, getattr(dims, spec.gemv.rows)])
            for spec in LAYER_GEMVS if spec.name in biased]


def _interleave(spec: StageSpec, gated_block: int) -> int:
    """A gated GEMV's packed rows alternate blocks of ``gated_block`` gate and up rows (``stages.gated_act_layout``)."""
    return gated_block if spec.gemv.gated else 0


def _bias_packing(layout: Layout, blocks: list[Block], biased: list[str], gated_block: int) -> list[PackedWeight]:
    def part(lin):
        if lin.bias is None:
            return ("", lin.out_features)
        rows = getattr(lin, "weight_rows", None)
        return (lin.bias, *rows) if rows else (lin.bias, 0)

    return [PackedWeight(spec.gemv.bias, True, [[part(block.ops[role]) for role in spec.gemv.roles] for block in blocks],
                         _interleave(spec, gated_block), _output_scale(spec, blocks))
            for spec in layout.layer_gemvs if spec.name in biased]


def _has_head_norms(blocks: list[Block]) -> bool:
    present = {"q_norm" in block.ops for block in blocks}
    if len(present) > 1:
        raise PlanError("only some layers have per-head q/k norms; layers must be identical")
    return present == {True}


def _head_norm_buffers(dims: ModelDims, head_norms: bool) -> list[Buffer]:
    if not head_norms:
        return []
    shape = [dims.layers, dims.q_rows + dims.kv_rows] if dims.whole_qk_norm else [dims.layers, 2, dims.head_dim]
    return [Buffer(HEAD_NORMS, "weight", "float32", shape)]


def _head_norm_packing(blocks: list[Block], head_norms: bool) -> list[PackedWeight]:
    """Per head (Qwen3): one row each for q and k; whole projection (OLMo-2): q's then k's weights, in a row."""
    if not head_norms:
        return []
    return [PackedWeight(HEAD_NORMS, True, [[(block.ops["q_norm"].weight, 0), (block.ops["k_norm"].weight, 0)]
                                            for block in blocks])]


