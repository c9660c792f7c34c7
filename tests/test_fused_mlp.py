"""The ``fused_mlp`` build (session 43 candidate, ``megabake.codegen.fused_mlp``): where it applies, its geometry,
what it emits, and a CuTe DSL compile for sm_90a (no GPU). Its numerics run on the GPU: tests/test_fused_mlp_gpu.py."""

from __future__ import annotations

import re

import pytest

from megabake.codegen import generate
from megabake.codegen.fused_mlp import FUSED_MLP_BUFFERS, fused_mlp_refusal, mlp_geometry, mlp_smem_bytes
from megabake.plan.tuning import HOPPER_SMEM_PER_BLOCK
from megabake.runtime.compile import argument_buffers, compile_check, extra_buffers, load_module
from tests.compiler_fixtures import compile_preset

# presets whose CTA's W_down columns fit shared memory: 8-, 4- and 16-byte copies of a row's columns
FITTING = {"smollm-135m": (12, 64), "qwen2.5-0.5b": (38, 32), "qwen3-0.6b": (24, 128)}
CAPACITY = {"smollm-135m": 2048, "qwen2.5-0.5b": 4096, "qwen3-0.6b": 4096}


def _plan(preset: str, capacity: int = 4096, layers: int = 1):
    return compile_preset(preset, layers=layers, vocab=512, capacity=capacity).plan


@pytest.fixture(scope="module")
def smollm():
    return compile_preset("smollm-135m", layers=2, vocab=512, capacity=2048)


@pytest.mark.parametrize("preset", sorted(FITTING))
def test_every_activation_has_one_cta_and_a_ctas_columns_fit_shared_memory(preset):
    plan = _plan(preset, CAPACITY[preset])
    assert fused_mlp_refusal(plan, fused_o=True) is None
    geometry = mlp_geometry(plan)
    assert (geometry.per_cta, geometry.load_bits) == FITTING[preset]
    assert geometry.chunks * geometry.per_cta == plan.dims.intermediate  # blocks tile the width exactly
    assert geometry.chunks <= plan.ctas < plan.dims.intermediate / (geometry.per_cta - 2)  # the least even block
    assert (geometry.per_cta * 16) % geometry.load_bits == 0  # a row's columns are whole copies
    assert geometry.down_bytes == plan.dims.hidden * geometry.per_cta * 2
    assert plan.smem_bytes < mlp_smem_bytes(plan) <= HOPPER_SMEM_PER_BLOCK


def test_the_partial_limit_keeps_the_int64_sum_from_wrapping():
    """The kernel flags partials at or over MLP_FIXED_LIMIT; the geometry refuses more than MAX_PARTIALS of them per
    row: their fixed-point sum stays inside int64."""
    pytest.importorskip("cutlass")
    from megabake.codegen.bodies import mlp
    from megabake.codegen.fused_mlp import MAX_PARTIALS

    assert MAX_PARTIALS == mlp.MLP_MAX_PARTIALS
    assert MAX_PARTIALS * mlp.MLP_FIXED_LIMIT * mlp.MLP_FIXED_ONE <= 2 ** 63


def test_refusals_name_the_cause():
    plan = _plan("smollm-135m", 2048)
    assert "needs fused_o=True" in fused_mlp_refusal(plan, fused_o=False)
    with pytest.raises(ValueError, match=r"fused_mlp runs the gate/up and down projections in one interval, but it "
                                         r"needs fused_o=True .*: build without it"):
        generate(plan, fused_o=False, fused_mlp=True)
    llama = _plan("llama-3.2-1b")
    with pytest.raises(ValueError, match=r"W_down columns \(2048 x 64 bf16, 262144 bytes\) a CTA needs \d+ bytes of "
                                         r"shared memory, over the 232448"):
        generate(llama, fused_mlp=True)
    assert fused_mlp_refusal(plan, fused_o=True) is None
    batched = compile_preset("smollm-135m", layers=1, vocab=512, capacity=2048, batch=2).plan
    with pytest.raises(ValueError, match="needs fused_o=True"):
        generate(batched, fused_mlp=True)


def _calls(kernel: str) -> list[str]:
    return [line.strip().split("(")[0] for line in kernel.splitlines() if line.strip().startswith(("bodies.", "cute.arch"))]


def test_the_module_drops_one_barrier_per_layer_and_reads_the_accumulator(smollm):
    """Against the fused_o build: per layer one grid_wait less, no down GEMV and no copy of the
    activations; the embedding goes to o_mid; every residual-input staging (the layers' QKV norm, the final norm)
    reads o_mid + the accumulator row of the layer before; the gate/up GEMV streams only this CTA's row pairs
    (its warps, ``mwarp``) into ``s_act``, then the CTA meets and adds its down partials into row layer + 1."""
    plan = smollm.plan
    default = generate(plan, fused_split=False, fused_mlp=False).source  # fused_o alone
    # bulk_down and spare_ring (the defaults since session 49) move the W_down copy and warp 0's fills: test_spare_warp
    source = generate(plan, fused_mlp=True, fused_split=False, bulk_down=False, spare_ring=False).source
    module = load_module(source)
    assert module.ARGUMENTS[-1:] == list(FUSED_MLP_BUFFERS)
    buffers = {b.name: b for b in extra_buffers(module)}
    assert buffers["mlp_acc"].dtype == "int64" and buffers["mlp_acc"].shape == [plan.dims.layers + 1,
                                                                                plan.dims.hidden + 4]
    assert buffers["o_mid"].dtype == "float32"
    assert [b.name for b in argument_buffers(plan, module)][-1] == "mlp_acc"
    assert (module.MLP_PER_CTA, module.MLP_CHUNKS, module.MLP_LOAD_BITS, module.MLP_TILES) == (12, 128, 64, 12)
    # a CTA without a block deals its warps past the last tile: gemv_rows_streamed's steps are 0 for all 8 warps
    tiles, warps = module.MLP_TILES, module.WARPS
    assert all((tiles - (warp + 1 * tiles) + warps - 1) // warps == 0 for warp in range(warps))
    assert module.VEC_WIDTH == plan.dims.hidden  # no intermediate row is staged
    assert module.SMEM_BYTES == mlp_smem_bytes(plan)
    kernel, default_kernel = source.split("# ====")[0], default.split("# ====")[0]
    loop, default_loop = kernel.split("for layer in range")[1], default_kernel.split("for layer in range")[1]
    loop_body = loop.split("# ---- stage 6")[0]
    assert loop_body.count("bodies.grid_wait(") == default_loop.split("# ---- stage 6")[0].count("bodies.grid_wait(") - 1
    barriers = re.search(r"(\d+) grid barriers per step \((\d+) where", source).groups()
    default_barriers = re.search(r"(\d+) grid barriers per step \((\d+) where", default).groups()
    assert [int(b) + plan.dims.layers for b in barriers] == [int(b) for b in default_barriers]
    assert "bodies.copy_to_smem(" not in kernel and "weight=w_down[layer, None, None], ring" not in kernel
    assert "embed=embed, tokens=tokens, x=o_mid," in kernel
    assert kernel.count("bodies.rmsnorm_from_acc_to_smem(") == 2
    assert "acc=mlp_acc[layer, None], x=x, weight=norms[layer, 0, None]" in kernel
    assert "acc=mlp_acc[LAYERS, None], x=x, weight=final_norm" in kernel
    assert "acc=mlp_acc[layer + 1, None]" in kernel
    up = [call for call in _calls(loop_body)]
    at = up.index("bodies.mlp_down_partial")
    assert up[at - 3:at + 2] == ["bodies.rmsnorm_partials_to_smem", "bodies.gemv_rows_streamed",
                                 "cute.arch.sync_threads", "bodies.mlp_down_partial", "bodies.grid_arrive"]
    gate_up = [chunk for chunk in kernel.split("bodies.gemv_rows_streamed(")[1:] if "w_gate_up" in chunk[:120]][0]
    assert "gwarp=mwarp" in gate_up and "total_warps=WARPS" in gate_up and "out=s_act" in gate_up
    # the ring fill and the W_down columns' copy before the barrier that precedes the MLP, on both paths
    fill = loop_body.index("gwarp=mwarp, lane=lane, active=1")
    assert loop_body.index("if fo == 0:") < fill < loop_body.index("bodies.mlp_down_load(") \
        < loop_body.index("# ---- stage 4")
    assert "bodies.prefetch_rows(\n            weight=w_gate_up" not in loop_body


@pytest.mark.parametrize("preset", sorted(FITTING))
def test_the_default_fuses_where_the_w_down_copies_are_64_bits_or_wider(preset):
    """``fused_mlp=None`` (``default_fused_mlp``, GPU-verified since session 45): on where fused_o is and a CTA's
    W_down columns copy at least 64 bits wide (SmolLM-135M 64, Qwen3-0.6B 128), off where they copy 32
    (Qwen2.5-0.5B: slower in session 44) and where fused_o is off."""
    from megabake.codegen.fused_mlp import DEFAULT_MIN_LOAD_BITS, default_fused_mlp
    from megabake.plan import GPU_VERIFIED_FEATURES

    plan = _plan(preset, CAPACITY[preset])
    wide = FITTING[preset][1] >= DEFAULT_MIN_LOAD_BITS
    assert "fused_mlp" in GPU_VERIFIED_FEATURES
    assert default_fused_mlp(plan, fused_o=True) is wide and not default_fused_mlp(plan, fused_o=False)
    # fused_mlp's W_down copies by cp.async.bulk (bulk_down, since session 49); without the loader warp, which
    # streams the fused MLP wherever it is built (tests/test_loader_warp.py)
    default = generate(plan, loader_warp=False).source
    assert ("bodies.mlp_down_bulk(" in default) is wide and "bodies.mlp_down_load(" not in default
    assert default == generate(plan, fused_mlp=wide, loader_warp=False).source
    assert "bodies.mlp_down_bulk(" not in generate(plan, fused_o=False).source


@pytest.mark.parametrize("preset,capacity", [("smollm-135m", 2048), ("qwen2.5-0.5b", 4096)])
def test_a_fused_mlp_build_compiles_for_sm90a(preset, capacity, tmp_path):
    """8-byte (SmolLM-135M) and 4-byte (Qwen2.5-0.5B) cp.async copies of the W_down columns; the partials are
    truncated to s64 and reduced with relaxed gpu-scope ``red.add.u64``; the staging converts them back."""
    plan = compile_preset(preset, layers=1, vocab=512, capacity=capacity).plan
    source = generate(plan, fused_mlp=True, bulk_down=False).source  # cp.async of the columns (bulk: test_spare_warp)
    result = compile_check(plan, load_module(source), dump_dir=str(tmp_path))
    assert result.ok, result.error
    ptx = max(tmp_path.glob("*.ptx"), key=lambda p: p.stat().st_mtime).read_text()
    bits = FITTING[preset][1]
    assert f"cp.async.ca.shared.global" in ptx and f", {bits // 8}, {bits // 8};" in ptx
    assert "cvt.rzi.s64.f32" in ptx and "red.relaxed.gpu.global.add.u64" in ptx and "cvt.rn.f32.s64" in ptx
