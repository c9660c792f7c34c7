"""Where a ``generate(plan, loader_warp=True)`` build applies, and its geometry (a candidate since session 51).

Contract: pure functions of a :class:`~megabake.plan.Plan`; no code is written here. A loader build adds a ninth
warp per CTA that streams the weights of the streamed GEMV stages (the QKV projection, the fused MLP's gate/up rows,
the LM head) through rings of ``SLOT_BYTES`` slots in the order the consumer warps read them (by default the QKV rows
in a ring of their own, so the next layer's land during attention), and copies the W_O block and the W_down columns
into buffers of their own, across grid barriers (``bodies/loader.py``). It builds on
the fused default (``fused_o``, ``fused_split``, ``fused_mlp`` with ``bulk_down``; batch 1): every weight byte a
step reads is then in one of those five streams. :func:`loader_refusal` names what is missing otherwise.

Session 50's probe (``scripts/gpu_stream_probe.py``, H100) ran this schedule 11-16% faster than the fill after
each arrival on Qwen3-0.6B and Qwen2.5-0.5B, with at most one or two 16 KB tiles in flight per SM. Session 51
(H100, one shared ring, ``loader_qkv_ring=False``): the fused default's bits; GPU ms at 16 Qwen3-0.6B 0.669 -> 0.700,
Qwen2.5-0.5B 0.549 -> 0.548, SmolLM-135M 0.345 -> 0.363, the next layer's QKV rows waiting for ring slots (docs/PERF.md,
"Session 51"). Session 52 (H100): the QKV ring gives the same bits and is no faster alone, because the next layer's
copies are in flight at the QKV barrier's release. Paced by the consumers' arrivals (``LOADER_GATES``), the
loader beats the default at 16: Qwen3-0.6B 0.681 -> 0.622 ms with ``("qkv",)``, one unit in flight and
``drain``; Qwen2.5-0.5B 0.556 -> 0.513 with ``("qkv",)``. It is 4% slower on Qwen3-0.6B at 4000. The
``"attention"`` gate is meant for that. Session 53 (H100): it lost at 4000 (0.983 ms against 0.920) in that order, so
a split step's copies now go in the order they are read (not timed yet); :func:`default_loader_warp` builds the paced
loader by default where the ``loader_warp`` feature is enabled (docs/PERF.md, "Session 53").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..plan import Plan, feature_enabled
from ..plan.memory import smem_bytes
from ..plan.tuning import HOPPER_SMEM_PER_BLOCK
from .fused import fused_geometry
from .fused_mlp import mlp_geometry

SLOT_BYTES = 16384  # = bodies.loader.SLOT_BYTES
MAX_SLOTS = 8  # ring slots at most (3 streamed as fast as 12 in the probe, session 50 call 5)
MIN_SLOTS = 3  # the W_O block and W_down have buffers of their own, so a unit never waits on a later one
# the loader's pacing unless generate is told otherwise (sessions 52-53, H100, GPU ms; docs/PERF.md "Session 52"):
# the "qkv" gate, one unit in flight per stream and the drain. Qwen3-0.6B 0.670 -> 0.617 at 16, 0.920 -> 0.933 at
# 4000; Qwen2.5-0.5B 0.551 -> 0.516 at 16. Session 51's unpaced loader (two units, no gate, no drain) lost there.
DEFAULT_GATES = ("qkv",)
# ... plus the split-step "attention" gate where the K/V cache a layer reads at the bucket's capacity is at least this
# share of the layer's weight bytes (session 55, H100, GPU ms, DEFAULT_GATES -> + "attention"): Qwen3-0.6B at capacity
# 4096 (16.8 MB of K/V a layer, 0.53 of its 31.5 MB of weights) 0.625 -> 0.626 at 16, 0.948 -> 0.922 at 4000 (no
# loader: 0.678 / 0.926); Qwen2.5-0.5B (2.1 MB, 0.07) 0.517 -> 0.522 at 16, 0.631 -> 0.683 at 4000. Where attention
# streams much K/V, the weights' copies wait for it to end; where it streams little, they must not.
ATTENTION_GATE_MIN_KV_SHARE = 0.25
DEFAULT_INFLIGHT = 1  # units requested and not landed, per CTA, in the layers' streams (probe: 2 saturates DRAM)
DEFAULT_DRAIN = True
# generate(plan) builds the loader where it applies and a layer streams at least this many weight bytes (the loader
# warp's own costs, named barriers and the consumers' gate arrivals, are per layer): H100 GPU ms at 16, sessions
# 52-53: SmolLM-135M (7 MB a layer) 0.342 -> 0.359 (slower), Qwen2.5-0.5B (30 MB) 0.551 -> 0.513, Qwen3-0.6B (32 MB)
# 0.670 -> 0.617
DEFAULT_MIN_LAYER_BYTES = 16 << 20
# loader_warpgroup: the loader warp in a warpgroup of its own (384 threads), which lowers its register budget with
# setmaxnreg so the consumer warpgroups can raise theirs (without it, ptxas gives 288 threads 168 registers each:
# 65536 over three whole warpgroups; the default build's 256 threads get 255). 2 x 128 x 232 + 128 x 40 <= 65536.
WARPGROUP = 128
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
LOADER_BARRIER_BYTES = 8  # one mbarrier
STREAMED_STAGES = ("norm_qkv", "norm_gate_up", "norm_lm_head")
# loader_gates (session 52): the consumers' grid arrivals the loader warp waits for before it issues more copies, so
# that fewer of them are in flight when a barrier's release fence runs (it waits for the SM's copies in flight:
# session 50). "qkv": the next layer's QKV rows, the W_down columns and the gate/up rows wait for the arrival after
# this layer's QKV GEMV (else they stream during that GEMV, as its slots free). "attention": in a split step only
# (long contexts, where attention streams the K/V cache), those copies wait for attention's arrival instead, as the
# default build's ring fill does, and go in the order they are read: the gate/up rows, W_down, the next layer's QKV
# rows (session 53: in the fused steps' order, the gate/up rows came last and the MLP waited for them). "mlp": the
# next layer's W_O block and the LM head's rows wait for the arrival after this layer's MLP. "items" (session 61, a
# candidate in place of "attention"): a split step's copies wait, in the same order, only until this CTA's split-KV
# items are done, so they can land while split_o_block waits for the KV group's other items (session 59: the
# "attention" gate held Qwen3-0.6B's gate/up interval at 4000 at 139 us against 88 at 16); the price is copies in
# flight at the O stage's release, and it is the larger: H100, session 62, GPU ms, "attention" -> "items",
# Qwen3-0.6B @4000 0.882 -> 0.915 (gate/up 218 -> 184 us on CTA 0, attention 352 -> 373, down 79 -> 99), @1000
# 0.752 -> 0.759, Qwen2.5-0.5B @4000 0.656 -> 0.669, the same bits; so it stays an opt-in build. Value: the stage
# whose barrier is meant ("split_kv_items": no stage; the consumers arrive right after their items,
# codegen._fused_split_stages).
LOADER_GATES = {"qkv": "norm_qkv", "items": "split_kv_items", "attention": "o_residual", "mlp": "down_residual"}
ITEMS_GATE = LOADER_GATES["items"]


@dataclass(frozen=True)
class Stream:
    """One streamed GEMV stage: each CTA owns ``per_cta`` consecutive rows of
    its ``rows`` x ``cols`` weight view, streamed as ``units`` units of ``unit_rows`` rows, dealt to the warps in
    groups of ``group`` rows; ``inflight`` units at most requested and not landed (0: the ring bounds it)."""

    stage: str
    rows: int
    cols: int
    group: int
    per_cta: int
    unit_rows: int
    units: int
    inflight: int


@dataclass(frozen=True)
class LoaderGeometry:
    """The streams in consumption order (per layer: QKV, gate/up; then the LM head), the ring's ``slots`` and the
    bytes of shared memory a loader build needs (``smem_bytes``)."""

    streams: tuple[Stream, ...]
    slots: int
    smem_bytes: int
    warpgroup: bool = False  # the loader warp's warpgroup of its own, with setmaxnreg (generate's loader_warpgroup)
    qkv_slots: int = 0  # the QKV rows' ring of their own (one slot per unit), or 0: they share the ring
    gates: tuple[str, ...] = ()  # LOADER_GATES the loader waits at (generate's loader_gates)
    drain: bool = False  # the loader waits for the W_O block and the W_down columns to land before going on

    def gate_index(self, stage: str) -> int | None:
        """The slot of ``s_gate`` the consumers arrive on after ``stage``'s grid arrival, or None: no gate there."""
        names = [LOADER_GATES[g] for g in self.gates]
        return names.index(stage) if stage in names else None

    @property
    def extra_threads(self) -> int:
        """Threads beyond the consumers': the loader warp, or its whole warpgroup."""
        return WARPGROUP if self.warpgroup else 32

    def stream(self, stage: str) -> Stream:
        return next(s for s in self.streams if s.stage == stage)

    def ring_slots(self, stage: str) -> int:
        """The slots of the ring ``stage``'s rows go through (a stream's ``inflight`` must stay below them: a loader
        waiting for a unit more than a lap back would wait for a phase it has not armed yet)."""
        return self.qkv_slots if stage == "norm_qkv" and self.qkv_slots else self.slots

    @property
    def layer_units(self) -> int:
        """Units a layer streams through the shared ring (the QKV rows' too, where they have no ring of their own)."""
        return self.stream("norm_gate_up").units + (0 if self.qkv_slots else self.stream("norm_qkv").units)


def loader_record(loader: LoaderGeometry) -> dict:
    """The loader's pacing as a package records it (``GeneratedModule.codegen["loader_warp"]``): the gates, the
    drain, the warpgroup, the QKV ring's slots, the ring's slots and each stream's units in flight (0: the ring
    bounds them). JSON types only; two loader builds of one plan with equal records and generate's other choices
    left to their defaults (as a bake leaves them) emit the same module."""
    return {"gates": list(loader.gates), "drain": loader.drain, "warpgroup": loader.warpgroup,
            "slots": loader.slots, "qkv_slots": loader.qkv_slots,
            "inflight": {s.stage: s.inflight for s in loader.streams}}


def _stream(stage: str, rows: int, cols: int, group: int, per_cta: int, inflight: int) -> Stream | None:
    unit_rows = SLOT_BYTES // (cols * 2) // group * group
    if unit_rows < group:
        return None
    return Stream(stage, rows, cols, group, per_cta, unit_rows, -(-per_cta // unit_rows), inflight)


def _spread(stage: str, rows: int, cols: int, ctas: int, inflight: int) -> Stream | None:
    """A stage whose rows are dealt over the whole grid: CTA ``c`` owns rows ``c * per_cta ..``."""
    per_cta = -(-rows // ctas)
    return _stream(stage, rows, cols, 1, per_cta, inflight)


def loader_geometry(plan: Plan, inflight: int = DEFAULT_INFLIGHT, qkv_ring: bool = True,
                    gates: int = 0) -> LoaderGeometry | None:
    """The loader build's streams and rings, or None where a row does not fit a slot or the rings do not fit. With
    ``qkv_ring`` the QKV rows have a ring of their own, a slot per unit: the next layer's rows can land during
    attention, while the gate/up rows hold the shared ring (session 51: sharing it, Qwen3-0.6B's QKV interval took
    195 us instead of 108). ``gates``: the mbarriers of ``loader_gates`` the build adds."""
    d = plan.dims
    mlp = mlp_geometry(plan)
    if mlp is None:
        return None
    up_rows = 2 * mlp.per_cta
    streams = (_spread("norm_qkv", d.qkv_rows, d.hidden, plan.ctas, inflight),
               _stream("norm_gate_up", up_rows, d.hidden, 2, up_rows, inflight),
               _spread("norm_lm_head", d.vocab, d.hidden, plan.ctas, 0))
    if any(s is None for s in streams):
        return None
    fused = fused_geometry(plan)
    staged = smem_bytes(plan.dims, plan.batch, plan.capacity, plan.threads, True, plan.staging_dtype,
                        global_down=True)
    qkv_slots = streams[0].units if qkv_ring else 0
    if qkv_slots and streams[0].inflight >= qkv_slots:  # a ring this small bounds its units in flight itself
        streams = (replace(streams[0], inflight=0),) + streams[1:]
    fixed = (staged + _aligned(fused.block_bytes, 128) + _aligned(mlp.down_bytes, 128) + 2 * 128  # slot alignment
             + LOADER_BARRIER_BYTES * (2 * (MAX_SLOTS + qkv_slots) + 4 + gates) + 64 + qkv_slots * SLOT_BYTES)
    slots = min(MAX_SLOTS, (HOPPER_SMEM_PER_BLOCK - fixed) // SLOT_BYTES)
    if slots < MIN_SLOTS:
        return None
    return LoaderGeometry(streams, slots, fixed + slots * SLOT_BYTES, qkv_slots=qkv_slots)


def _aligned(nbytes: int, to: int) -> int:
    return (nbytes + to - 1) // to * to


def layer_weight_bytes(plan: Plan) -> int:
    """The bf16 weight bytes one decoder layer's GEMVs read (QKV, O, gate/up, down)."""
    d = plan.dims
    return 2 * d.hidden * (d.qkv_rows + d.q_rows + d.gate_up_rows + d.intermediate)


def layer_kv_bytes(plan: Plan) -> int:
    """The bf16 K/V cache bytes one decoder layer's attention reads at the bucket's capacity (its widest window)."""
    keys = max(min(window or plan.capacity, plan.capacity) for window in plan.windows)
    return 2 * 2 * plan.batch * plan.dims.kv_rows * keys


def default_loader_gates(plan: Plan) -> tuple[str, ...]:
    """The gates ``generate(plan, loader_warp=True)`` paces the loader with where none are given: ``DEFAULT_GATES``,
    plus "attention" where :func:`layer_kv_bytes` is at least ``ATTENTION_GATE_MIN_KV_SHARE`` of
    :func:`layer_weight_bytes` (Qwen3-0.6B at capacity 4096, not Qwen2.5-0.5B with its 2 K/V heads of 64)."""
    if layer_kv_bytes(plan) >= ATTENTION_GATE_MIN_KV_SHARE * layer_weight_bytes(plan):
        return DEFAULT_GATES + ("attention",)
    return DEFAULT_GATES


def default_loader_warp(plan: Plan, **choices) -> bool:
    """Whether ``generate(plan, loader_warp=None)`` builds the loader warp: where the ``loader_warp`` feature is
    enabled (:func:`megabake.plan.feature_enabled`: in ``GPU_VERIFIED_FEATURES`` since session 55, so by default),
    :func:`loader_refusal` finds nothing with ``choices`` (the build's
    other options, fused_mlp and bulk_down on) and a layer streams at least :data:`DEFAULT_MIN_LAYER_BYTES`. Where
    the plan's own default leaves fused_mlp off (Qwen2.5-0.5B), the loader build's logits are the fused_mlp build's
    (fp32 order, not the same bits as the plain default)."""
    return (feature_enabled("loader_warp") and loader_refusal(plan, **choices) is None
            and layer_weight_bytes(plan) >= DEFAULT_MIN_LAYER_BYTES)


def loader_refusal(plan: Plan, *, fused_o: bool, fused_split: bool, fused_mlp: bool, bulk_down: bool,
                   fused_kv_smem: bool, early_down: str | None, barrier: str, qkv_ring: bool = True) -> str | None:
    """Why ``loader_warp`` cannot build this plan with these choices, or None where it can."""
    if not (fused_o and fused_split and fused_mlp and bulk_down):
        return ("it streams the fused default's weights: it needs fused_o, fused_split, fused_mlp and bulk_down "
                "(batch 1; fused_mlp=True, bulk_down=True where the plan's default leaves them off)")
    if fused_kv_smem:
        return "fused_kv_smem keeps K/V rows after the W_O block in the ring's shared memory"
    if early_down:
        return "the loader warp issues the W_down copies itself (early_down moves the consumers' copies)"
    if barrier != "split":
        return f"it needs the split grid barrier (barrier={barrier!r})"
    tilings = {s.name: s.tiling for s in plan.stages if s.name in STREAMED_STAGES}
    odd = [name for name in STREAMED_STAGES if name not in tilings or tilings[name].kind != "rows"
           or not tilings[name].stages or tilings[name].mma]
    if odd:
        return (f"stage(s) {', '.join(odd)} are not streamed through the cp.async ring tiling, which the loader's "
                "streams replace")
    if plan.bias_of("norm_gate_up"):
        return "the gate/up projection has a bias"
    if plan.dims.final_softcap:
        return "the final soft-capping rewrites the LM head's rows in the register tiling's warp order"
    if plan.dims.hidden * 2 > SLOT_BYTES:
        return f"a weight row of {plan.dims.hidden} bf16 does not fit a {SLOT_BYTES}-byte ring slot"
    if loader_geometry(plan, qkv_ring=qkv_ring, gates=len(LOADER_GATES)) is None:
        return (f"at least {MIN_SLOTS} ring slots of {SLOT_BYTES} bytes, the W_O block and the W_down columns do not "
                f"fit the {HOPPER_SMEM_PER_BLOCK} bytes of shared memory of a Hopper CTA")
    return None
