"""Timing of the megakernel decoder against the strongest CUDA-graphed Inductor baseline.

Contract: ``run_timings(decoder, *, samples=40, baselines=DEFAULT_BASELINES, ...)`` returns the report's
``timings`` object (docs/FORMATS.md); it needs a CUDA GPU and raises :class:`DeviceError` without one.
Method: every candidate (the megakernel and each baseline of ``baselines.py``) runs on the same weights,
bucket, token ids and positions (``inner`` calls at positions ``prefill, prefill+1, ...``). Each candidate's
first call is compared with eager bf16 (``rel_l2_vs_eager``; above ``agreement_limit``, 0.1 or 2.5x eager
bf16's own rel-L2 to an exact fp32 copy at that call when larger, the candidate computes something else and is
marked failed; ``timings.agreement`` records the drift and the limit); all warm up; a graph check then counts
the CUDA-graph replays of one call (``graph_replays``; no profiler: see ``check_graph``). Then ``samples`` rounds run every candidate
once each, in an order that rotates every round (``alternating_schedule``: AB, BA, AB, ...); a round
measures, per candidate, ``inner`` synchronized complete calls (host + GPU, clock read after
``synchronize``), ``inner`` pipelined calls with one sync, and the GPU-event time of ``inner`` calls queued
behind a spin kernel (so host launch gaps do not count). Each sample is a per-call mean in ms. Summaries:
median + seeded bootstrap 95% interval, raw samples kept. The baseline is the baseline candidate with the
lowest synchronized median; the speedup is the paired ratio baseline/megakernel of synchronized calls.
Then each candidate runs ``block_calls`` synchronized calls back to back (``sync_call_block``, a cross-check:
a median more than 15% away from the alternating rounds' becomes a ``warnings`` entry; ``host_call_block``: the
same calls' time until the call returned, the host's part). After timing, call 0
runs again: a candidate whose logits moved is marked failed (its times are void).
The weight-streaming floor is ``weight_bytes`` / device copy bandwidth measured in the same run (read +
write bytes of a device-to-device copy).
The pure parts (schedule, sample collection with an injected sync/clock, floor, assembly) run on a CPU.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import DeviceError
from .stats import paired_ratio, summarize

MIN_SAMPLES = 40
GHZ_GUESS = 2.0  # spin-kernel cycles per ns, to hold the stream (only needs the right order of magnitude)


@dataclass(frozen=True)
class TimingSettings:
    samples: int = MIN_SAMPLES
    inner: int = 20  # calls per sample
    warmup: int = 30  # calls per candidate before the first round
    prefill: int = 16
    seed: int = 0
    block_calls: int = 100  # back-to-back synchronized calls per candidate in the cross-check block


@dataclass
class Candidate:
    """One thing to time: ``call(i)`` runs decode call i of the shared (token, position) schedule."""

    name: str
    kind: str  # "megabake" | "baseline"
    call: Callable[[int], object] | None
    graph_replays: bool | None = None
    launches: int | None = None  # kernel launches seen outside graphs in one profiled call
    rel_l2_vs_eager: float | None = None  # first call's logits vs eager bf16 at the same state
    error: str | None = None
    error_logged: bool = False


@dataclass
class Samples:
    sync_call: list[float] = field(default_factory=list)
    pipelined: list[float] = field(default_factory=list)
    gpu_event: list[float] = field(default_factory=list)
    sync_call_block: list[float] = field(default_factory=list)  # one call each, back to back (cross-check)
    host_call_block: list[float] = field(default_factory=list)  # the same calls until call(i) returned


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("timing needs a CUDA GPU (a Hopper/SM90 one for the megakernel); none is visible "
                          "to torch on this machine. Run `megabake verify` on an H100/H200.")


# -------------------------------------------------------------------------------------- schedule


def alternating_schedule(names: Sequence[str], rounds: int) -> list[tuple[str, ...]]:
    """Order of candidates in each round: the list rotated by one every round (AB, BA, AB, ...)."""
    names = list(names)
    if not names:
        return []
    return [tuple(names[r % len(names):] + names[:r % len(names)]) for r in range(rounds)]


# ------------------------------------------------------------------------------- measurement core


def measure_sync_call(call, indices, sync, clock=time.perf_counter) -> float:
    """Mean ms of complete calls, each followed by ``sync()`` before the clock is read."""
    total = 0.0
    sync()
    for i in indices:
        start = clock()
        call(i)
        sync()
        total += clock() - start
    return total * 1e3 / len(indices)


def measure_pipelined(call, indices, sync, clock=time.perf_counter) -> float:
    """Mean ms per call of back-to-back calls with a single ``sync()`` at the end."""
    sync()
    start = clock()
    for i in indices:
        call(i)
    sync()
    return (clock() - start) * 1e3 / len(indices)


def measure_gpu_events(call, indices, hold_ms: float) -> float:
    """Mean GPU ms per call between CUDA events, the calls queued behind a ``hold_ms`` spin kernel."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(hold_ms * 1e6 * GHZ_GUESS))
    start.record()
    for i in indices:
        call(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / len(indices)


def warm_up(candidates: Sequence[Candidate], settings: TimingSettings, sync) -> None:
    """``settings.warmup`` calls of every live candidate (compiles, autotunes, records CUDA graphs)."""
    for candidate in candidates:
        if candidate.call is not None and candidate.error is None:
            for k in range(settings.warmup):
                candidate.call(k % settings.inner)
    sync()


def measure_rounds(candidates: Sequence[Candidate], settings: TimingSettings, sync, *, gpu_events: bool = False,
                   clock=time.perf_counter) -> dict[str, Samples]:
    """``settings.samples`` alternating rounds over the live candidates; raw samples by candidate name."""
    live = {c.name: c for c in candidates if c.call is not None and c.error is None}
    indices = list(range(settings.inner))
    results = {name: Samples() for name in live}
    for order in alternating_schedule(list(live), settings.samples):
        for name in order:
            call, out = live[name].call, results[name]
            out.sync_call.append(measure_sync_call(call, indices, sync, clock))
            out.pipelined.append(measure_pipelined(call, indices, sync, clock))
            if gpu_events:
                hold = 0.5 + 2.0 * out.pipelined[-1] * len(indices)
                out.gpu_event.append(measure_gpu_events(call, indices, hold))
    return results


def measure_blocks(candidates: Sequence[Candidate], settings: TimingSettings, sync, results: dict[str, Samples],
                   clock=time.perf_counter) -> None:
    """Cross-check of the alternating rounds: each candidate alone, ``block_calls`` synchronized calls in a
    row (one sample per call, cycling over the ``inner`` schedule), into ``results[name].sync_call_block``, and
    each call's time until ``call(i)`` returned (before the sync: the host's part) into ``host_call_block``."""
    for candidate in candidates:
        if candidate.call is None or candidate.error is not None or candidate.name not in results:
            continue
        out, host = results[candidate.name].sync_call_block, results[candidate.name].host_call_block
        sync()
        for k in range(settings.block_calls):
            start = clock()
            candidate.call(k % settings.inner)
            returned = clock()
            sync()
            out.append((clock() - start) * 1e3)
            host.append((returned - start) * 1e3)


BLOCK_DISAGREEMENT = 0.15  # |block median / alternating median - 1| above this is reported as a warning


def consistency_warnings(candidates: Sequence[Candidate], results: dict[str, Samples]) -> list[str]:
    """Candidates whose back-to-back block median disagrees with their alternating-rounds median."""
    from .stats import median

    warnings = []
    for candidate in candidates:
        samples = results.get(candidate.name)
        if not samples or not samples.sync_call or not samples.sync_call_block:
            continue
        rounds, block = median(samples.sync_call), median(samples.sync_call_block)
        if abs(block / rounds - 1) > BLOCK_DISAGREEMENT:
            warnings.append(f"{candidate.name}: {rounds:.4g} ms per synchronized call in alternating rounds but "
                            f"{block:.4g} ms back to back ({block / rounds - 1:+.0%}); the timing environment was "
                            "not steady, compare the raw samples before quoting the speedup")
    return warnings


def collect(candidates: Sequence[Candidate], settings: TimingSettings, sync, *, gpu_events: bool = False,
            clock=time.perf_counter) -> dict[str, Samples]:
    """Warm up, then measure the rounds (``warm_up`` + ``measure_rounds``)."""
    warm_up(candidates, settings, sync)
    return measure_rounds(candidates, settings, sync, gpu_events=gpu_events, clock=clock)


# ------------------------------------------------------------------------------ floor, bandwidth


def floor_ms(weight_bytes: int, bandwidth_GBps: float) -> float:
    """Time to stream the weights once at the device copy bandwidth, in ms."""
    if bandwidth_GBps <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_GBps}")
    return weight_bytes / (bandwidth_GBps * 1e9) * 1e3


def measure_copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10, trials: int = 5) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written (median of trials)."""
    import torch

    from .stats import median

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        rates.append(2 * nbytes * reps / (start.elapsed_time(end) * 1e-3) / 1e9)
    del src, dst
    torch.cuda.empty_cache()
    return median(rates)


# ------------------------------------------------------------------------------------ graph check


@dataclass(frozen=True)
class GraphCheck:
    replays: bool | None  # None: unknown (a profile that saw no CUDA runtime calls: CUPTI unavailable)
    launches: int | None  # kernel launches outside a graph; None: not counted (check_graph's count_launches)


def check_graph(call, *, count_launches: bool = False) -> GraphCheck:
    """Does one call replay a CUDA graph? Counted by a spy on ``torch.cuda.CUDAGraph.replay`` (what CUDA-graph
    trees, hand-captured graphs and the megakernel's step graphs all call), without CUPTI: ``torch.profiler``
    leaves CUPTI attached after it ends (Kineto skips ``cuptiFinalize`` unless ``TEARDOWN_CUPTI=1``,
    pytorch/pytorch#144455), which slows every later CUDA call of the process, so a profiled check before the
    timing rounds would tax the synchronized calls it is there to measure. ``count_launches=True`` profiles the
    call instead (graph launches and kernel launches outside graphs as CUPTI sees them): only once nothing is
    timed after it in the process."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if not count_launches:
        with counting_graph_replays() as replays:
            call(0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return GraphCheck(replays=replays[0] > 0, launches=None)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call(0)
        torch.cuda.synchronize()
    return graph_check_from_names([event.name for event in prof.events()])  # replays as CUPTI saw them


@contextmanager
def counting_graph_replays():
    """Within the block, ``torch.cuda.CUDAGraph.replay`` calls are counted into the yielded one-element list
    (the method is restored on exit)."""
    import torch

    original = torch.cuda.CUDAGraph.replay
    count = [0]

    def replay(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    torch.cuda.CUDAGraph.replay = replay
    try:
        yield count
    finally:
        torch.cuda.CUDAGraph.replay = original


def graph_check_from_names(names: Sequence[str]) -> GraphCheck:
    """Read a profiled call's event names: graph launches, and kernel launches outside graphs."""
    if not any(n.startswith(("cuda", "cu")) for n in names):
        return GraphCheck(replays=None, launches=None)
    graph = sum("GraphLaunch" in n for n in names)
    kernels = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
                  for n in names)
    return GraphCheck(replays=graph > 0, launches=kernels)


# -------------------------------------------------------------------------------------- assembly


def _candidate_dict(candidate: Candidate, samples: Samples | None, seed: int) -> dict:
    data = {"kind": candidate.kind}
    if candidate.graph_replays is not None:  # the schema wants a boolean: unknown is left out
        data["graph_replays"] = candidate.graph_replays
    for metric in ("sync_call", "pipelined", "gpu_event", "sync_call_block", "host_call_block"):
        values = getattr(samples, metric) if samples else []
        data[metric] = summarize(values, seed=seed).to_dict() if values else None
    data["launches_outside_graph"] = candidate.launches
    data["rel_l2_vs_eager"] = candidate.rel_l2_vs_eager
    data["error"] = candidate.error
    return data


def pick_baseline(candidates: Sequence[Candidate], results: dict[str, Samples]) -> str | None:
    """The timed baseline with the lowest median synchronized call, or None if none was timed."""
    from .stats import median

    timed = [c.name for c in candidates if c.kind == "baseline" and c.error is None and results.get(c.name)
             and results[c.name].sync_call]
    return min(timed, key=lambda name: median(results[name].sync_call), default=None)


def assemble_timings(candidates: Sequence[Candidate], results: dict[str, Samples], *, weight_bytes: int,
                     bandwidth_GBps: float | None, settings: TimingSettings) -> dict:
    """The report's ``timings`` object from raw samples (pure)."""
    megabake = next((c for c in candidates if c.kind == "megabake"), None)
    baseline = pick_baseline(candidates, results)
    speedup = None
    if (megabake is not None and megabake.error is None and baseline and results.get(megabake.name)
            and results[megabake.name].sync_call):
        speedup = paired_ratio(results[baseline].sync_call, results[megabake.name].sync_call,
                               seed=settings.seed).to_dict()
        speedup["measure"] = "sync_call"
    return {
        "unit": "ms",
        "candidates": {c.name: _candidate_dict(c, results.get(c.name), settings.seed) for c in candidates},
        "warnings": consistency_warnings(candidates, results),
        "baseline": baseline,
        "speedup": speedup,
        "floor_ms": floor_ms(weight_bytes, bandwidth_GBps) if bandwidth_GBps else None,
        "weight_bytes": int(weight_bytes),
        "copy_bandwidth_GBps": bandwidth_GBps,
        "method": {"samples": settings.samples, "calls_per_sample": settings.inner, "prefill": settings.prefill,
                   "warmup_calls": settings.warmup, "order": "alternating", "ci": "bootstrap95-median",
                   "bootstrap_seed": settings.seed},
    }


# --------------------------------------------------------------------------------------- runner


@dataclass
class TimingInputs:
    """Token ids and positions shared by every candidate, on the device; ``host_tokens`` holds the same ids as
    host ints, the form the megakernel's ``step`` takes without a device round trip (given a CUDA tensor it
    copies the ids to the host to check them: one sync per call, which the graphed baselines, fed device
    tensors, never pay)."""

    prompt: object  # LongTensor [B, P]
    tokens: list  # inner x LongTensor [B]
    positions: list[int]
    position_tensors: list  # inner x LongTensor [1]
    host_tokens: list[list[int]] = field(default_factory=list)  # inner x [B] ints

    @classmethod
    def make(cls, decoder, settings: TimingSettings) -> "TimingInputs":
        import torch

        from .numerics import teacher_tokens

        room = decoder.capacity - settings.prefill
        if room < 1:
            raise ValueError(f"prefill {settings.prefill} leaves no room in KV capacity {decoder.capacity}")
        ids = teacher_tokens(decoder.batch, settings.prefill + settings.inner, decoder.vocab_size,
                             settings.seed + 1).to(decoder.device)
        positions = [settings.prefill + (i % room) for i in range(settings.inner)]
        return cls(prompt=ids[:, :settings.prefill],
                   tokens=[ids[:, settings.prefill + i].contiguous() for i in range(settings.inner)],
                   positions=positions,
                   position_tensors=[torch.tensor([p], dtype=torch.long, device=decoder.device) for p in positions],
                   host_tokens=ids[:, settings.prefill:].T.tolist())


def megakernel_candidate(decoder, inputs: TimingInputs) -> Candidate:
    decoder.reset()
    decoder.prefill(inputs.prompt)
    return Candidate("megabake", "megabake", lambda i: decoder.step(inputs.host_tokens[i], inputs.positions[i]))


def baseline_candidate(name: str, model, inputs: TimingInputs, capacity: int) -> Candidate:
    from .baselines import build_baseline

    try:
        step = build_baseline(name, model, inputs.prompt, capacity)
    except Exception as exc:  # a baseline that cannot be built is recorded, not fatal
        return Candidate(name, "baseline", None, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    return Candidate(name, "baseline", lambda i: step.call(inputs.tokens[i], inputs.position_tensors[i]))


def _live(candidates: Sequence[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.error is None and c.call is not None]


AGREEMENT_LIMIT = 0.1  # two bf16 implementations of one step differ by ~1-3e-2 rel-L2 (measured, H200)
DRIFT_FACTOR = 2.5  # two implementations each as far from fp32 as eager bf16 differ by up to ~2x that drift


def agreement_limit(eager_drift: float | None) -> float:
    """Largest first-call rel-L2 to eager bf16 a correct candidate may show: ``AGREEMENT_LIMIT``, or
    ``DRIFT_FACTOR`` x eager bf16's own rel-L2 to fp32 at that call when larger. At long context eager bf16
    drifts far from fp32 (random-weight Llama-1B: ~0.3 at position 1000, ~0.8 at 4000), so a fixed limit
    would fail every correct candidate there."""
    if eager_drift is None or not eager_drift == eager_drift:  # unknown or NaN
        return AGREEMENT_LIMIT
    return max(AGREEMENT_LIMIT, DRIFT_FACTOR * eager_drift)


def eager_drift_vs_fp32(model, inputs: "TimingInputs", capacity: int, reference) -> float:
    """rel-L2 of eager bf16's first-call logits (``reference``) to an exact fp32 copy's at the same state."""
    import copy

    import torch

    from ..rope import cast_model
    from .numerics import rel_l2
    from .reference import ReferenceDecoder

    fp32 = cast_model(copy.deepcopy(model), dtype=torch.float32).eval()
    try:
        runner = ReferenceDecoder(fp32, capacity=capacity, fp32=True)
        runner.prefill(inputs.prompt)
        exact = runner.step(inputs.tokens[0], inputs.positions[0])
        return rel_l2(reference.cpu(), exact.cpu())
    finally:
        del fp32
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _first_call(candidate: Candidate, reference, limit: float = AGREEMENT_LIMIT) -> None:
    """First call (compiles a baseline) compared with eager bf16 at the same state; errors are recorded."""
    import torch

    from .numerics import rel_l2

    try:
        with torch.no_grad():
            logits = candidate.call(0).float().clone()
        if logits.is_cuda:
            torch.cuda.synchronize()  # a fault is blamed on the candidate that caused it
        candidate.rel_l2_vs_eager = rel_l2(logits.cpu(), reference.cpu())
    except Exception as exc:
        candidate.error = f"{type(exc).__name__}: {str(exc)[:400]}"
        return
    if not candidate.rel_l2_vs_eager <= limit:  # NaN fails too
        candidate.error = (f"first call disagrees with eager bf16 (rel-L2 {candidate.rel_l2_vs_eager:.3g} > "
                           f"{limit:.3g}): it computes something else, so its times are not compared")


RECHECK_TOLERANCE = 1e-2


def _recheck(candidate: Candidate, reference) -> None:
    """Call 0 again after timing (same token and position, so the same logits): a candidate whose output
    moved was corrupted while timed (e.g. a CUDA graph replaying over freed memory); its times are void."""
    import torch

    from .numerics import rel_l2

    if candidate.rel_l2_vs_eager is None:
        return
    try:
        with torch.no_grad():
            again = rel_l2(candidate.call(0).float().cpu(), reference.cpu())
    except Exception as exc:
        candidate.error = f"re-check after timing: {type(exc).__name__}: {str(exc)[:400]}"
        return
    if abs(again - candidate.rel_l2_vs_eager) > RECHECK_TOLERANCE:
        candidate.error = (f"output changed while timed: rel-L2 vs eager {candidate.rel_l2_vs_eager:.3g} at the "
                           f"first call, {again:.3g} after timing; its times are not trusted")


def _graph_check(candidate: Candidate) -> None:
    """After warm-up (CUDA-graph trees record late): does a call replay a graph? Errors are recorded."""
    try:
        check = check_graph(candidate.call)
        candidate.graph_replays, candidate.launches = check.replays, check.launches
    except Exception as exc:
        candidate.error = f"graph check: {type(exc).__name__}: {str(exc)[:400]}"


def run_timings(decoder, *, samples: int = MIN_SAMPLES, baselines=None, prefill: int = 16, inner: int = 20,
                warmup: int = 30, seed: int = 0) -> dict:
    """Time the decoder and the baselines (module doc); returns the report's ``timings`` object."""
    import torch

    from .baselines import DEFAULT_BASELINES, build_order, eager_reference_logits

    require_cuda()
    settings = TimingSettings(samples=samples, inner=inner, warmup=warmup, prefill=prefill, seed=seed)
    inputs = TimingInputs.make(decoder, settings)
    reference = eager_reference_logits(decoder.model, inputs.prompt, inputs.tokens[0], inputs.positions[0],
                                       decoder.capacity)
    drift = eager_drift_vs_fp32(decoder.model, inputs, decoder.capacity, reference)
    limit = agreement_limit(drift)
    names = list(DEFAULT_BASELINES if baselines is None else baselines)
    built = {name: _logged_build(name, decoder.model, inputs, decoder.capacity) for name in build_order(names)}
    candidates = [megakernel_candidate(decoder, inputs)] + [built[name] for name in names]
    _log_errors(candidates, "build")
    with torch.no_grad():
        for candidate in _live(candidates):
            _first_call(candidate, reference, limit)
        _log_errors(candidates, "first call")
        warm_up(_live(candidates), settings, torch.cuda.synchronize)
        for candidate in _live(candidates):
            _graph_check(candidate)
        results = measure_rounds(_live(candidates), settings, torch.cuda.synchronize, gpu_events=True)
        measure_blocks(_live(candidates), settings, torch.cuda.synchronize, results)
        for candidate in _live(candidates):
            _recheck(candidate, reference)
        _log_errors(candidates, "re-check after timing")
    bandwidth = measure_copy_bandwidth()
    timings = assemble_timings(candidates, results, weight_bytes=weight_bytes_of(decoder),
                               bandwidth_GBps=bandwidth, settings=settings)
    timings["agreement"] = {"eager_bf16_vs_fp32": drift, "limit": limit, "position": inputs.positions[0]}
    return timings


def _logged_build(name: str, model, inputs: "TimingInputs", capacity: int) -> Candidate:
    """``baseline_candidate`` with its build logged (a max-autotune compile takes a minute or more)."""
    log = logging.getLogger(__name__)
    log.info("build baseline %s ...", name)
    started = time.perf_counter()
    candidate = baseline_candidate(name, model, inputs, capacity)
    log.info("build baseline %s: %s in %.1f s", name, "failed" if candidate.error else "done",
             time.perf_counter() - started)
    return candidate


def _log_errors(candidates: Sequence[Candidate], stage: str) -> None:
    """Log candidate errors as they happen: a later crash (a sticky CUDA error) must not hide the first one."""
    for candidate in candidates:
        if candidate.error and not candidate.error_logged:
            logging.getLogger(__name__).warning("%s: %s failed: %s", stage, candidate.name, candidate.error)
            candidate.error_logged = True


def weight_bytes_of(decoder) -> int:
    """``decoder.weight_bytes``, else the bytes of its model's parameters (tied weights counted once)."""
    found = getattr(decoder, "weight_bytes", None)
    if found:
        return int(found)
    return sum(p.numel() * p.element_size() for p in decoder.model.parameters())
