"""Where a ``generate(plan, fused_mlp=True)`` build applies, and its geometry (a candidate since session 43).

Contract: pure functions of a :class:`~megabake.plan.Plan`; no code is written here. A fused-MLP build runs a
layer's gate/up and down projections in one barrier interval (one grid barrier less per layer, at every
context): CTA ``c < chunks`` owns the activations [c * per_cta, (c + 1) * per_cta) of the intermediate width. It
streams their (gate, up) row pairs through its warps' cp.async rings (the gated write puts the activations in
shared memory), then multiplies them with its columns of W_down (copied into shared memory before the barrier)
and adds the partial output rows into an int64 fixed-point accumulator (``bodies/mlp.py``: exact and
order-free, so deterministic). The next stage's staging reads o_mid + accumulator. It builds on ``fused_o``
(its ``o_mid`` residual, batch 1, pre-norm, the split barrier); :func:`fused_mlp_refusal` names what is missing.
Session 43 (H100): its GPU tests pass; GPU ms at 16 -2.8% SmolLM-135M, -0.9% Qwen3-0.6B, +7.2% Qwen2.5-0.5B; the
atomics move 128 x hidden x 8 bytes per layer, about what the removed barrier cost (docs/PERF.md, "Session 43").
Session 45: the default where a CTA's W_down columns copy at least 64 bits wide (:func:`default_fused_mlp`), after
the whole GPU suite passed with it on, on the H200.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, feature_enabled
from ..plan.memory import smem_bytes, smem_floats
from ..plan.stages import spec_of
from ..plan.tuning import HOPPER_SMEM_PER_BLOCK

FUSED_MLP_BUFFERS = ("mlp_acc",)  # int64 [layers + 1, hidden + 4]: fixed-point sums of the MLPs' outputs
# bulk_down: each CTA's W_down columns packed contiguous, [layers, chunks, hidden x per_cta] bf16, derived from w_down
# by the runtime (DERIVED_BUFFERS in module.py, runtime.compile.block_columns,
# MegakernelDecoder.refresh_derived_buffers)
BULK_DOWN_BUFFERS = ("w_down_cta",)
BULK_MAX_COPY_BYTES = 4096  # the largest cp.async.bulk a lane issues (scripts/gpu_copy_probe.py's size)
ACC_PAD = 4  # columns past ``hidden`` in an accumulator row: the flag word, then padding to whole 4-vectors
MAX_PARTIALS = 256  # = bodies.mlp.MLP_MAX_PARTIALS: the int64 sum of this many limited partials cannot wrap
DEFAULT_MIN_LOAD_BITS = 64  # the default fuses where a CTA's W_down columns copy at least this wide (session 45)


@dataclass(frozen=True)
class MlpGeometry:
    """How a fused-MLP build deals the intermediate width: ``chunks`` CTAs own ``per_cta`` activations each
    (``per_cta`` divides the width; the other CTAs idle in the MLP); each copies its [hidden, per_cta] bf16
    columns of W_down (``down_bytes``) with ``load_bits``-wide cp.async copies."""

    per_cta: int
    chunks: int
    load_bits: int
    down_bytes: int

    def tiles(self, per_tile: int) -> int:
        """The gate/up GEMV's tiles of ``per_tile`` packed rows in one CTA's block (its 2 x ``per_cta`` rows)."""
        return -(-2 * self.per_cta // per_tile)


def mlp_geometry(plan: Plan) -> MlpGeometry | None:
    """The smallest even ``per_cta`` dividing the intermediate width that leaves no more chunks than CTAs, or
    None where there is none."""
    inter, hidden = plan.dims.intermediate, plan.dims.hidden
    least = max(2, -(-inter // plan.ctas))
    per_cta = next((a for a in range(least, inter + 1) if inter % a == 0 and a % 2 == 0), None)
    if per_cta is None:
        return None
    bits = next(b for b in (128, 64, 32) if (per_cta * 16) % b == 0)
    return MlpGeometry(per_cta, inter // per_cta, bits, hidden * per_cta * 2)


def bulk_copy_bytes(geometry: MlpGeometry) -> int:
    """bulk_down: the bytes of each ``cp.async.bulk`` of a CTA's packed W_down columns: the largest multiple of 16
    that divides ``down_bytes`` and is at most :data:`BULK_MAX_COPY_BYTES` (16 always divides it: ``per_cta`` is
    even and hidden a multiple of 8, which plan.build_plan checks)."""
    return max(b for b in range(16, BULK_MAX_COPY_BYTES + 1, 16) if geometry.down_bytes % b == 0)


def mlp_smem_bytes(plan: Plan, bulk_down: bool = False) -> int:
    """The shared memory of a fused-MLP build: the plan's, less the intermediate width of the staged input rows
    (no stage stages the down projection's input: ``smem_bytes(..., global_down=True)``, as ``VEC_WIDTH`` then
    says), plus the CTA's W_down columns (16-byte aligned), plus with ``bulk_down`` the mbarrier its bulk copies
    complete on."""
    geometry = mlp_geometry(plan)
    args = (plan.dims, plan.batch, plan.capacity, plan.threads, True, plan.staging_dtype)
    staged = smem_bytes(*args, global_down=plan.down_input == "global")
    return (plan.smem_bytes - staged + smem_bytes(*args, global_down=True) + (geometry.down_bytes + 15) // 16 * 16 + 16
            + (16 if bulk_down else 0))


def _layer_stage(plan: Plan, name: str):
    return next((s for s in plan.stages if s.scope == "layer" and s.name == name), None)


def fused_mlp_refusal(plan: Plan, *, fused_o: bool) -> str | None:
    """Why ``fused_mlp`` cannot build this plan (with ``fused_o`` as chosen), or None where it can."""
    if not fused_o:
        return "it needs fused_o=True (its o_mid residual; batch 1, pre-norm, the split barrier)"
    up, down = _layer_stage(plan, "norm_gate_up"), _layer_stage(plan, "down_residual")
    layer = [s.name for s in plan.stages if s.scope == "layer"]
    if up is None or down is None or layer.index("down_residual") != layer.index("norm_gate_up") + 1:
        return "the layer's gate/up and down projections are not consecutive stages"
    if layer[-1] != "down_residual":
        return "the down projection is not the layer's last stage"
    up_gemv = spec_of(up, plan).gemv
    if not up_gemv.gated or up.tiling.mma or not up.tiling.stages or not up.tiling.preload \
            or up.tiling.per_tile % 2:
        return ("the gate/up GEMV is not the prefilled cp.async ring with the gated write in tiles of whole "
                "(gate, up) pairs (the bake's default tiling is)")
    if plan.bias_of("norm_gate_up"):
        return "the gate/up projection has a bias"
    residual_readers = [s for s in plan.stages if s.scope != "prologue" and spec_of(s, plan).gemv is not None
                        and spec_of(s, plan).vector.source == "x" and s.name != "norm_gate_up"]
    odd = [s.name for s in residual_readers if spec_of(s, plan).vector.kind != "rmsnorm"]
    if odd:
        return f"stage(s) {', '.join(odd)} read the residual x without an RMSNorm (the accumulator's staging is one)"
    if plan.down_input == "global":
        return "the down projection reads its input from global memory (down_input='global')"
    geometry = mlp_geometry(plan)
    if geometry is None:
        return f"the intermediate width {plan.dims.intermediate} has no even divisor that deals it over the CTAs"
    if geometry.chunks > MAX_PARTIALS:
        return f"{geometry.chunks} CTAs' partials per output row could overflow the int64 sum (at most {MAX_PARTIALS})"
    att = smem_floats(plan.dims, plan.batch, plan.capacity, plan.threads, True)["att"]
    if geometry.per_cta > att:
        return f"{geometry.per_cta} activations per CTA do not fit the attention scratch ({att} floats)"
    if mlp_smem_bytes(plan) > HOPPER_SMEM_PER_BLOCK:
        return (f"with a CTA's W_down columns ({plan.dims.hidden} x {geometry.per_cta} bf16, {geometry.down_bytes} "
                f"bytes) a CTA needs {mlp_smem_bytes(plan)} bytes of shared memory, over the "
                f"{HOPPER_SMEM_PER_BLOCK} a Hopper CTA can have")
    return None


def default_fused_mlp(plan: Plan, *, fused_o: bool) -> bool:
    """Whether ``generate(plan, fused_mlp=None)`` fuses the MLP: where the ``fused_mlp`` feature is enabled
    (``plan.feature_enabled``: GPU-verified since session 45), the build can (:func:`fused_mlp_refusal` finds
    nothing) and a CTA's W_down columns copy in cp.async copies of at least :data:`DEFAULT_MIN_LOAD_BITS` bits.
    Session 44 (H100, GPU ms with
    fused_split): SmolLM-135M (64-bit copies) 0.353 -> 0.342 at 16, 0.431 -> 0.423 at 2000; Qwen3-0.6B (128-bit)
    0.950 -> 0.948 at 4000; Qwen2.5-0.5B (38 columns a CTA: 32-bit copies) 0.666 -> 0.706 at 4000, so it stays
    off there. Session 45 (H200, with fused_split): SmolLM-135M 0.334 -> 0.327 at 16, 0.410 -> 0.404 at 2000,
    Qwen3-0.6B 0.618 -> 0.610 at 16. Session 46 (docs/PERF.md): the copy width is a proxy that happens to pick
    these presets; what costs is the bytes copied before the barrier (~0.38 us per MB over the grid, at every
    width), and Qwen2.5-0.5B copies the most while its MLP saves the least."""
    if not feature_enabled("fused_mlp") or fused_mlp_refusal(plan, fused_o=fused_o) is not None:
        return False
    return mlp_geometry(plan).load_bits >= DEFAULT_MIN_LOAD_BITS
