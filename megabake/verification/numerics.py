"""Numerics of a decoder across advancing decode calls, against eager bf16 and an fp32 reference.

Contract: ``run_numerics(decoder, *, prefill=16, steps=64, seed=0, slack=1.25, top1_min=0.99)`` returns
the report's ``numerics`` object (docs/FORMATS.md). Procedure: one seeded random token sequence (ids in
``[1, vocab)``, never zeros); the decoder, eager bf16 and fp32 (both ``ReferenceDecoder`` on the decoder's
weights) each prefill the first ``prefill`` tokens, then take ``steps`` decode steps fed the same next
token (teacher forcing) at positions ``prefill, prefill+1, ...``. Per step: relative L2 and max-abs error
of the logits against fp32 and against eager bf16, KL(fp32 || decoder), top-1 agreement with eager bf16
(the decoder's top-1 token is one of eager bf16's top-1 tokens: bf16 logits tie), finiteness. At the end
the KV caches are compared over the written positions, and positions past them must still be zero.

Pass rule (``judge``), judged over the whole run by robust statistics against eager bf16's, never by
one step: the decoder's worst (max) and median rel-L2 to fp32 over the steps are each at most ``slack`` x
eager bf16's worst and median rel-L2 to fp32 (a race or a wrong step shows as a worst far above eager's
worst; a systematic error as a median above eager's median), while one step where eager bf16 happens to land
unusually close to fp32 does not fail a run that is closer to fp32 on average and in the worst case; the
KV cache's rel-L2 is at most ``slack`` x eager's; top-1 agreement with eager bf16 >= ``top1_min`` over the
*decisive* steps (the fp32 reference's top-1/top-2 gap exceeds twice eager bf16's max-abs error, so bf16
precision can resolve the top-1 at all: random-weight models have near-flat logits where eager bf16's own
rounding flips the argmax); and the decoder does not pick the fp32 top-1 significantly less often than eager
bf16 does (unless it picks it at >= top1_min of the steps): over the *discordant* steps, where exactly one of the
two picks fp32's top-1, a one-sided exact sign test (McNemar's) must not reject "each is as likely to be the
one that hits" at ``TOP1_SIGNIFICANCE``. A single near-tie step that eager bf16's rounding happens to resolve
the fp32 way (p = 0.5) is noise; five misses against no hits (p = 1/32) is a real deficit. Per-step numbers
stay in the report. No NaN or Inf in any logits or the KV cache. Each failure names the metric and, for
per-step failures, the step and the position.
``steps="max"`` (or None) decodes up to the bucket's capacity.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..errors import InputError
from .reference import ReferenceDecoder, reference_models

ABS_TOL = 1e-6  # errors this small pass whatever the bf16 level (an exact decoder vs an exact reference)
TOP1_SIGNIFICANCE = 0.05  # the sign test's level for "picks fp32's top-1 less often than eager bf16"


@dataclass(frozen=True)
class NumericsConfig:
    prefill: int = 16
    steps: int = 64
    seed: int = 0
    slack: float = 1.25
    top1_min: float = 0.99


@dataclass(frozen=True)
class StepMetrics:
    """One decode step's logits compared (field names are the report's ``per_step`` keys)."""

    step: int
    position: int
    rel_l2_vs_fp32: float
    rel_l2_bf16_vs_fp32: float
    rel_l2_vs_bf16: float
    max_abs_vs_fp32: float
    max_abs_vs_bf16: float
    kl_vs_fp32: float
    top1_agree_bf16: bool
    finite: bool
    top1_rows_agree: int = 1  # rows (batch) whose top-1 matches eager bf16
    rows: int = 1
    top1_agree_fp32: bool = True  # the decoder's top-1 is the fp32 reference's
    bf16_top1_agree_fp32: bool = True  # eager bf16's top-1 is the fp32 reference's
    fp32_top1_margin: float = math.inf  # fp32 logit gap between its top-1 and top-2
    decisive: bool = True  # margin > 2 x eager bf16's max-abs error: bf16 precision can resolve the top-1

    def report(self) -> dict:
        data = asdict(self)
        del data["top1_rows_agree"], data["rows"]
        return {k: _json_float(v) for k, v in data.items()}


@dataclass(frozen=True)
class KVMetrics:
    rel_l2: float  # decoder vs fp32 over written positions
    max_abs: float
    rel_l2_bf16: float  # eager bf16 vs fp32, the level to match
    finite: bool
    untouched_zero: bool  # positions past the last written one are still zero


@dataclass
class NumericsResult:
    config: NumericsConfig
    per_step: list[StepMetrics]
    kv: KVMetrics | None
    failures: list[str] = field(default_factory=list)

    @property
    def top1_agreement(self) -> float:
        rows = sum(m.rows for m in self.per_step)
        return sum(m.top1_rows_agree for m in self.per_step) / rows if rows else 0.0

    def top1_stats(self) -> dict:
        return top1_stats(self.per_step)

    def to_dict(self) -> dict:
        cfg = self.config
        summary = {
            "top1_agreement": self.top1_agreement,
            **{k: _json_float(v) for k, v in error_stats(self.per_step).items()},
            "kv_cache_rel_l2": _json_float(self.kv.rel_l2) if self.kv else None,
            "kv_cache_max_abs": _json_float(self.kv.max_abs) if self.kv else None,
            **self.top1_stats(),
        }
        return {
            "prefill": cfg.prefill, "steps": cfg.steps, "slack": cfg.slack, "top1_min": cfg.top1_min,
            "pass": not self.failures,
            "per_step": [m.report() for m in self.per_step],
            "summary": summary,
            "failures": list(self.failures),
        }


def _json_float(value):
    """JSON has no NaN/Inf: map them to None (the ``finite`` flags say why)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ------------------------------------------------------------------------------------------ metrics


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max())


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(softmax(ref) || softmax(logits)), mean over rows, in float64."""
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def top1_agreeing_rows(logits: torch.Tensor, bf16: torch.Tensor) -> int:
    """Rows whose top-1 token is also a top-1 of eager bf16 (bf16 logits tie often: any tied max counts)."""
    picked = bf16.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    return int((picked >= bf16.max(-1).values).sum())


def _decisive(bf16: torch.Tensor, fp32: torch.Tensor) -> tuple[float, bool]:
    """fp32's smallest top-1/top-2 gap over rows, and whether it exceeds 2x eager bf16's max-abs error.

    Random-weight models have near-flat logits: where the reference's top two logits are closer than eager
    bf16's own error, "agreement with eager bf16" measures bf16's rounding, not the kernel.
    """
    top2 = fp32.double().topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    return margin, margin > 2.0 * max_abs(bf16, fp32)


def sign_test_p(misses: int, hits: int) -> float:
    """One-sided exact sign test: P(at least ``misses`` of ``misses + hits`` fair coin flips land "miss")."""
    trials = misses + hits
    return sum(math.comb(trials, k) for k in range(misses, trials + 1)) / 2.0 ** trials


def top1_stats(per_step: list["StepMetrics"]) -> dict:
    decisive = [m for m in per_step if m.decisive]
    count = len(per_step) or 1
    only_bf16 = sum(m.bf16_top1_agree_fp32 and not m.top1_agree_fp32 for m in per_step)
    only_ours = sum(m.top1_agree_fp32 and not m.bf16_top1_agree_fp32 for m in per_step)
    return {
        "top1_agreement_decisive": (sum(m.top1_agree_bf16 for m in decisive) / len(decisive)) if decisive else 1.0,
        "decisive_steps": len(decisive),
        "top1_vs_fp32": sum(m.top1_agree_fp32 for m in per_step) / count,
        "bf16_top1_vs_fp32": sum(m.bf16_top1_agree_fp32 for m in per_step) / count,
        "top1_vs_fp32_sign_test_p": sign_test_p(only_bf16, only_ours),
    }


def top1_vs_fp32_deficit(stats: dict, top1_min: float) -> bool:
    """Whether the decoder picks fp32's top-1 significantly less often than eager bf16 (module doc); a summary
    written before the sign test (no ``top1_vs_fp32_sign_test_p``) is judged by the plain count, as it was then."""
    return (stats["top1_vs_fp32"] < min(top1_min, stats["bf16_top1_vs_fp32"])
            and stats.get("top1_vs_fp32_sign_test_p", 0.0) < TOP1_SIGNIFICANCE)


def compare_logits(step: int, position: int, logits, bf16, fp32) -> StepMetrics:
    """All per-step metrics of ``logits`` [B, V] against the eager bf16 and fp32 logits."""
    logits, bf16, fp32 = logits.detach().cpu().float(), bf16.detach().cpu().float(), fp32.detach().cpu().float()
    finite = bool(torch.isfinite(logits).all())
    agree = top1_agreeing_rows(logits, bf16) if finite else 0
    margin, decisive = _decisive(bf16, fp32)
    return StepMetrics(
        top1_agree_fp32=finite and top1_agreeing_rows(logits, fp32) == logits.shape[0],
        bf16_top1_agree_fp32=top1_agreeing_rows(bf16, fp32) == bf16.shape[0],
        fp32_top1_margin=margin, decisive=decisive,
        step=step, position=position,
        rel_l2_vs_fp32=rel_l2(logits, fp32), rel_l2_bf16_vs_fp32=rel_l2(bf16, fp32),
        rel_l2_vs_bf16=rel_l2(logits, bf16), max_abs_vs_fp32=max_abs(logits, fp32),
        max_abs_vs_bf16=max_abs(logits, bf16), kl_vs_fp32=kl_divergence(fp32, logits),
        top1_agree_bf16=agree == logits.shape[0], finite=finite,
        top1_rows_agree=agree, rows=int(logits.shape[0]),
    )


def compare_kv(cache, bf16_cache, fp32_cache, written: int) -> KVMetrics:
    """Compare keys and values ``[L, B, KVH, C, D]`` over positions ``[0, written)``."""
    parts = []
    for got, ref16, ref32 in zip(cache, bf16_cache, fp32_cache):
        got = got.detach().cpu().float()
        parts.append((got[..., :written, :], ref16.detach().cpu().float()[..., :written, :],
                      ref32.detach().cpu().float()[..., :written, :], got[..., written:, :]))
    got = torch.cat([p[0].flatten() for p in parts])
    ref16 = torch.cat([p[1].flatten() for p in parts])
    ref32 = torch.cat([p[2].flatten() for p in parts])
    rest = torch.cat([p[3].flatten() for p in parts])
    finite = bool(torch.isfinite(got).all()) and bool(torch.isfinite(rest).all())
    return KVMetrics(rel_l2=rel_l2(got, ref32), max_abs=max_abs(got, ref32), rel_l2_bf16=rel_l2(ref16, ref32),
                     finite=finite, untouched_zero=bool((rest == 0).all()))


# --------------------------------------------------------------------------------------- pass rule


def _within(err: float, level: float, slack: float) -> bool:
    return math.isfinite(err) and err <= slack * level + ABS_TOL


def error_stats(per_step: list[StepMetrics]) -> dict:
    """Worst and median rel-L2 to fp32 over the steps, of the decoder and of eager bf16 (the pass rule's inputs)."""
    ours = [m.rel_l2_vs_fp32 for m in per_step]
    eager = [m.rel_l2_bf16_vs_fp32 for m in per_step]
    if not per_step:
        return {"max_rel_l2_vs_fp32": 0.0, "median_rel_l2_vs_fp32": 0.0,
                "max_rel_l2_bf16_vs_fp32": 0.0, "median_rel_l2_bf16_vs_fp32": 0.0}
    return {"max_rel_l2_vs_fp32": max(ours), "median_rel_l2_vs_fp32": _median(ours),
            "max_rel_l2_bf16_vs_fp32": max(eager), "median_rel_l2_bf16_vs_fp32": _median(eager)}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def judge(per_step: list[StepMetrics], kv: KVMetrics | None, *, slack: float, top1_min: float) -> list[str]:
    """The failures of the pass rule (module doc); empty means pass."""
    failures = [f"step {m.step} (position {m.position}): finite: logits hold NaN or Inf"
                for m in per_step if not m.finite]
    if not failures:
        stats = error_stats(per_step)
        for which in ("max", "median"):
            ours, eager = stats[f"{which}_rel_l2_vs_fp32"], stats[f"{which}_rel_l2_bf16_vs_fp32"]
            if not _within(ours, eager, slack):
                worst = max(per_step, key=lambda m: m.rel_l2_vs_fp32)
                failures.append(f"{which} rel_l2_vs_fp32 {ours:.3g} > {slack} x eager bf16's {which} {eager:.3g} "
                                f"over {len(per_step)} steps (worst: step {worst.step}, position {worst.position})")
    stats = top1_stats(per_step)
    agreement = stats["top1_agreement_decisive"]
    if agreement < top1_min:
        steps = [f"{m.step}" for m in per_step if m.decisive and not m.top1_agree_bf16]
        failures.append(f"top1_agreement {agreement:.4f} < {top1_min} over the {stats['decisive_steps']} steps "
                        f"where bf16 can resolve the top-1 (steps {', '.join(steps[:16])}"
                        f"{' ...' if len(steps) > 16 else ''} disagree with eager bf16)")
    if top1_vs_fp32_deficit(stats, top1_min):
        failures.append(f"top1_vs_fp32 {stats['top1_vs_fp32']:.4f} is below eager bf16's "
                        f"{stats['bf16_top1_vs_fp32']:.4f}: the decoder picks the fp32 reference's top-1 less often "
                        f"(sign test over the steps where only one of them picks it: p = "
                        f"{stats['top1_vs_fp32_sign_test_p']:.3g} < {TOP1_SIGNIFICANCE})")
    if kv is not None:
        if not kv.finite:
            failures.append("kv_cache: holds NaN or Inf")
        elif not _within(kv.rel_l2, kv.rel_l2_bf16, slack):
            failures.append(f"kv_cache_rel_l2 {kv.rel_l2:.3g} > {slack} x eager bf16 {kv.rel_l2_bf16:.3g}")
        if not kv.untouched_zero:
            failures.append("kv_cache: positions past the last decoded one were written (expected zeros)")
    return failures


# ------------------------------------------------------------------------------------------- runner


def resolve_steps(steps, prefill: int, capacity: int) -> int:
    """Decode steps to run: an int, or "max"/None for all positions left after the prefill."""
    if prefill < 1:
        raise InputError(f"prefill must be >= 1 token, got {prefill}")
    room = capacity - prefill
    if steps is None or steps == "max":
        steps = room
    steps = int(steps)
    if steps < 1 or steps > room:
        raise InputError(f"{steps} decode steps after a {prefill}-token prefill do not fit the KV capacity "
                         f"{capacity}: use --steps between 1 and {room} (or --steps max)")
    return steps


def teacher_tokens(batch: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Seeded random token ids [batch, length] in [1, vocab_size): never zeros, never a pad-only run."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (batch, length), generator=gen, dtype=torch.long)


def run_numerics(decoder, *, prefill: int = 16, steps=64, seed: int = 0, slack: float = 1.25,
                 top1_min: float = 0.99) -> dict:
    """Teacher-forced comparison of ``decoder`` with eager bf16 and fp32 (module doc); the report object."""
    return numerics_result(decoder, prefill=prefill, steps=steps, seed=seed, slack=slack,
                           top1_min=top1_min).to_dict()


@torch.no_grad()
def numerics_result(decoder, *, prefill: int = 16, steps=64, seed: int = 0, slack: float = 1.25,
                    top1_min: float = 0.99) -> NumericsResult:
    steps = resolve_steps(steps, prefill, decoder.capacity)
    config = NumericsConfig(prefill=prefill, steps=steps, seed=seed, slack=slack, top1_min=top1_min)
    tokens = teacher_tokens(decoder.batch, prefill + steps, decoder.vocab_size, seed).to(decoder.device)
    bf16_model, fp32_model = reference_models(decoder.model)
    if hasattr(decoder, "fp32_reference_model"):  # exact fp32 RoPE frequencies (bf16 casts round them)
        fp32_model = decoder.fp32_reference_model().eval()
    bf16 = ReferenceDecoder(bf16_model, capacity=decoder.capacity)
    fp32 = ReferenceDecoder(fp32_model, capacity=decoder.capacity, fp32=True)
    decoder.reset()
    for runner in (decoder, bf16, fp32):
        runner.prefill(tokens[:, :prefill])
    per_step = []
    for i in range(steps):
        position = prefill + i
        token = tokens[:, position]
        logits = decoder.step(token, position).float().clone()
        per_step.append(compare_logits(i, position, logits, bf16.step(token, position), fp32.step(token, position)))
    kv = compare_kv(decoder.kv_cache(), bf16.kv_cache(), fp32.kv_cache(), written=prefill + steps)
    return NumericsResult(config, per_step, kv, judge(per_step, kv, slack=slack, top1_min=top1_min))
