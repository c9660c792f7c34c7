"""Timing and baselines, pure parts on the CPU: schedule, sample collection (fake clock), floor arithmetic,
baseline choice, assembly; baselines trace with fullgraph=True and agree with eager; GPU paths refuse."""

import pytest
import torch

from megabake.errors import DeviceError
from megabake.presets import get_preset
from megabake.verification.baselines import BASELINES, DEFAULT_BASELINES, build_baseline, eager_reference_logits
from megabake.verification.commands import KNOWN_BASELINES
from megabake.verification.numerics import rel_l2, teacher_tokens
from megabake.verification.timing import (
    Candidate,
    Samples,
    TimingSettings,
    alternating_schedule,
    assemble_timings,
    collect,
    floor_ms,
    measure_pipelined,
    measure_sync_call,
    pick_baseline,
    run_timings,
)


class FakeClock:
    """Seconds that advance only when a fake call (2 ms) or a fake sync (1 ms) runs."""

    def __init__(self):
        self.now = 0.0
        self.log = []

    def __call__(self):
        return self.now

    def call(self, name):
        def run(i):
            self.log.append((name, i))
            self.now += 2e-3
        return run

    def sync(self):
        self.now += 1e-3


def test_alternating_schedule_rotates_and_balances():
    assert alternating_schedule(["a", "b"], 4) == [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a")]
    rounds = alternating_schedule(["a", "b", "c"], 6)
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    for position in range(3):  # every candidate takes every slot equally often
        assert sorted(r[position] for r in rounds) == ["a", "a", "b", "b", "c", "c"]
    assert alternating_schedule([], 3) == []


def test_sync_and_pipelined_arithmetic_with_fake_clock():
    clock = FakeClock()
    assert measure_sync_call(clock.call("x"), range(10), clock.sync, clock) == pytest.approx(3.0)  # call + sync
    assert measure_pipelined(clock.call("x"), range(10), clock.sync, clock) == pytest.approx(2.1)  # one sync / 10


def test_collect_warms_up_then_alternates_rounds():
    clock = FakeClock()
    candidates = [Candidate("megabake", "megabake", clock.call("m")), Candidate("base", "baseline", clock.call("b")),
                  Candidate("broken", "baseline", None, error="RuntimeError: no")]
    settings = TimingSettings(samples=4, inner=3, warmup=5)
    results = collect(candidates, settings, clock.sync, clock=clock)
    assert set(results) == {"megabake", "base"}
    for samples in results.values():
        assert len(samples.sync_call) == len(samples.pipelined) == 4 and samples.gpu_event == []
        assert samples.sync_call == pytest.approx([3.0] * 4)
    timed = clock.log[10:]  # after 5 warm-up calls each
    assert [name for name, _ in clock.log[:10]] == ["m"] * 5 + ["b"] * 5
    firsts = [timed[k * 12][0] for k in range(4)]  # each candidate block = 3 sync + 3 pipelined calls
    assert firsts == ["m", "b", "m", "b"]
    assert {i for _, i in timed} == {0, 1, 2}


def test_floor_arithmetic():
    # SmolLM-135M: ~270 MB of bf16 weights at 4.28 TB/s copy bandwidth -> ~0.063 ms (shared/GPU.md)
    assert floor_ms(270_000_000, 4280.0) == pytest.approx(0.0631, abs=1e-4)
    assert floor_ms(2_471_000_000, 4280.0) == pytest.approx(0.5773, abs=1e-3)
    with pytest.raises(ValueError):
        floor_ms(1, 0.0)


def _samples(value, n=40, spread=0.01):
    return [value * (1 + spread * ((i % 5) - 2)) for i in range(n)]


def test_pick_baseline_is_fastest_timed_baseline():
    candidates = [Candidate("megabake", "megabake", None), Candidate("slow", "baseline", None),
                  Candidate("fast", "baseline", None), Candidate("failed", "baseline", None, error="x")]
    results = {"megabake": Samples(_samples(0.5)), "slow": Samples(_samples(2.0)), "fast": Samples(_samples(1.5))}
    assert pick_baseline(candidates, results) == "fast"
    assert pick_baseline(candidates[:1], results) is None


def test_assemble_timings_object():
    candidates = [Candidate("megabake", "megabake", None, graph_replays=True),
                  Candidate("inductor-graph", "baseline", None, graph_replays=True, rel_l2_vs_eager=0.001),
                  Candidate("inductor-reduce-overhead", "baseline", None, error="BackendCompilerFailed: x")]
    results = {"megabake": Samples(_samples(0.5), _samples(0.45), _samples(0.4)),
               "inductor-graph": Samples(_samples(1.5), _samples(1.4), _samples(1.3))}
    timings = assemble_timings(candidates, results, weight_bytes=270_000_000, bandwidth_GBps=4280.0,
                               settings=TimingSettings())
    assert timings["unit"] == "ms" and timings["baseline"] == "inductor-graph"
    assert timings["speedup"]["median"] == pytest.approx(3.0)
    assert timings["speedup"]["measure"] == "sync_call"
    lo, hi = timings["speedup"]["ci95"]
    assert lo <= 3.0 <= hi
    mk = timings["candidates"]["megabake"]
    assert mk["sync_call"]["samples"] == results["megabake"].sync_call and len(mk["gpu_event"]["samples"]) == 40
    assert timings["candidates"]["inductor-reduce-overhead"]["sync_call"] is None
    assert "graph_replays" not in timings["candidates"]["inductor-reduce-overhead"]
    assert timings["floor_ms"] == pytest.approx(0.0631, abs=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_run_timings_without_cuda_raises_clearly():
    model = get_preset("tiny-llama").build_model()
    from megabake.verification.doubles import EagerDecoder

    with pytest.raises(DeviceError, match="CUDA GPU"):
        run_timings(EagerDecoder(model, capacity=32))


# ----------------------------------------------------------------------------------- baselines on CPU


@pytest.fixture(scope="module")
def tiny():
    model = get_preset("tiny-llama").build_model()  # fp32: a step and a prefill agree to rounding
    ids = teacher_tokens(1, 12, model.config.vocab_size, seed=0)
    return model, ids


def test_known_baselines_match_registry():
    assert set(KNOWN_BASELINES) == set(BASELINES)
    assert set(DEFAULT_BASELINES) == {"inductor-reduce-overhead", "inductor-graph"}


@pytest.mark.parametrize("name,kwargs", [("eager", None),
                                         ("inductor-reduce-overhead", {"fullgraph": True, "backend": "eager"})])
def test_baseline_steps_agree_with_eager_at_repeated_positions(tiny, name, kwargs):
    torch._dynamo.reset()
    model, ids = tiny
    prompt = ids[:, :8]
    step = build_baseline(name, model, prompt, 16, compile_kwargs=kwargs)
    for position in (8, 9, 10, 8, 9):  # repeating a position rewrites the same KV slot
        token = ids[:, position]
        ref = eager_reference_logits(model, ids[:, :position], token, position, 16)
        with torch.no_grad():
            got = step.call(token, torch.tensor([position]))
        assert rel_l2(got.float(), ref) < 1e-5, (name, position)


def test_graph_captured_baseline_needs_cuda(tiny):
    model, ids = tiny
    with pytest.raises(DeviceError, match="CUDA"):
        build_baseline("inductor-graph", model, ids[:, :8], 16)


def test_unknown_baseline(tiny):
    with pytest.raises(ValueError, match="known"):
        build_baseline("tensorrt", tiny[0], tiny[1][:, :8], 16)


def test_graph_check_from_profiler_names():
    from megabake.verification.timing import graph_check_from_names

    replayed = graph_check_from_names(["cudaMemcpyAsync", "cudaGraphLaunch", "cudaStreamSynchronize"])
    assert replayed.replays is True and replayed.launches == 0
    eager = graph_check_from_names(["aten::mm", "cudaLaunchKernel", "cudaLaunchKernel"])
    assert eager.replays is False and eager.launches == 2
    blind = graph_check_from_names(["aten::mm", "aten::add"])  # CUPTI unavailable: unknown, not False
    assert blind.replays is None and blind.launches is None


def test_graph_check_counts_replays_without_the_profiler(monkeypatch):
    """The timing harness's graph check spies on ``torch.cuda.CUDAGraph.replay`` (no CUPTI, which would stay
    attached and slow the timed calls after it) and puts the method back afterwards."""
    import torch.profiler

    from megabake.verification.timing import check_graph

    replayed = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replayed.append(self))
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.profiler, "profile", None)  # the default check must not profile

    graphed = check_graph(lambda i: torch.cuda.CUDAGraph.replay("graph"))
    assert graphed.replays is True and graphed.launches is None and replayed == ["graph"]
    assert check_graph(lambda i: None).replays is False
    assert torch.cuda.CUDAGraph.replay is original
    with pytest.raises(RuntimeError, match="boom"):
        check_graph(lambda i: (_ for _ in ()).throw(RuntimeError("boom")))
    assert torch.cuda.CUDAGraph.replay is original  # restored on an error too


def test_weight_bytes_fallback():
    from megabake.verification.doubles import EagerDecoder
    from megabake.verification.timing import weight_bytes_of

    model = get_preset("tiny-llama").build_model(dtype=torch.bfloat16)
    decoder = EagerDecoder(model, capacity=16)
    expected = sum(p.numel() for p in model.parameters()) * 2
    assert weight_bytes_of(decoder) == expected
    del decoder.weight_bytes
    assert weight_bytes_of(decoder) == expected


def test_candidate_errors_are_logged_when_they_happen(caplog):
    from megabake.verification.timing import Candidate, _log_errors

    broken = Candidate("inductor-graph", "baseline", None, error="AcceleratorError: illegal memory access")
    fine = Candidate("megabake", "megabake", lambda i: None)
    with caplog.at_level("WARNING"):
        _log_errors([fine, broken], "build")
        _log_errors([fine, broken], "first call")  # logged once, not again
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["build: inductor-graph failed: AcceleratorError: illegal memory access"]


def test_recheck_voids_a_candidate_whose_output_moved():
    from megabake.verification.timing import _recheck

    reference = torch.ones(1, 8)
    steady = Candidate("steady", "baseline", lambda i: torch.ones(1, 8), rel_l2_vs_eager=0.0)
    moved = Candidate("moved", "baseline", lambda i: torch.full((1, 8), 3.0), rel_l2_vs_eager=0.0)
    _recheck(steady, reference)
    _recheck(moved, reference)
    assert steady.error is None
    assert "output changed while timed" in moved.error and "2 after timing" in moved.error
    results = {"steady": Samples(_samples(2.0)), "moved": Samples(_samples(1.0))}
    assert pick_baseline([steady, moved], results) == "steady"  # a voided candidate is never the baseline


def test_first_call_that_disagrees_with_eager_is_failed_and_never_the_baseline():
    """Seen on the H200: a hand-captured graph replaying over a freed KV cache gave stable logits at rel-L2
    0.57 vs eager; the re-check (output moved?) cannot see that, the first-call agreement check must."""
    from megabake.verification.timing import AGREEMENT_LIMIT, _first_call

    reference = torch.linspace(-1.0, 1.0, 8).reshape(1, 8)
    close = Candidate("close", "baseline", lambda i: reference * 1.01)
    wrong = Candidate("wrong", "baseline", lambda i: reference.flip(-1))
    nan = Candidate("nan", "baseline", lambda i: torch.full((1, 8), float("nan")))
    for candidate in (close, wrong, nan):
        _first_call(candidate, reference)
    assert close.error is None and close.rel_l2_vs_eager < AGREEMENT_LIMIT
    assert "disagrees with eager bf16 (rel-L2 2 > 0.1)" in wrong.error
    assert "disagrees with eager bf16" in nan.error
    results = {"close": Samples(_samples(2.0)), "wrong": Samples(_samples(1.0))}
    assert pick_baseline([close, wrong], results) == "close"


def test_agreement_limit_follows_eager_drift_at_long_context():
    """Random-weight Llama-1B at position 4000: eager bf16 is ~0.8 rel-L2 from fp32, so a correct candidate
    can be ~1 away from eager; the limit scales with the measured drift and never drops below 0.1."""
    from megabake.verification.timing import AGREEMENT_LIMIT, _first_call, agreement_limit

    assert agreement_limit(None) == AGREEMENT_LIMIT == agreement_limit(0.01)
    assert agreement_limit(0.8) == pytest.approx(2.0)
    assert agreement_limit(float("nan")) == AGREEMENT_LIMIT
    reference = torch.linspace(-1.0, 1.0, 8).reshape(1, 8)
    drifted = Candidate("drifted", "baseline", lambda i: reference + 0.5)  # rel-L2 ~0.77 to eager
    _first_call(drifted, reference, agreement_limit(0.8))
    assert drifted.error is None
    _first_call(drifted, reference, agreement_limit(0.05))
    assert "disagrees with eager bf16" in drifted.error


def test_eager_drift_vs_fp32_measures_bf16_against_exact_fp32():
    from megabake.presets import get_preset
    from megabake.verification.baselines import eager_reference_logits
    from megabake.verification.timing import TimingInputs, TimingSettings, eager_drift_vs_fp32

    model = get_preset("tiny-llama").build_model().to(torch.bfloat16)

    class Decoder:
        batch, capacity, device = 1, 32, torch.device("cpu")
        vocab_size = model.config.vocab_size

    settings = TimingSettings(samples=1, inner=2, warmup=0, prefill=8, seed=0)
    inputs = TimingInputs.make(Decoder(), settings)
    reference = eager_reference_logits(model, inputs.prompt, inputs.tokens[0], inputs.positions[0], 32)
    drift = eager_drift_vs_fp32(model, inputs, 32, reference)
    assert 1e-4 < drift < 0.1  # bf16 rounding, not a different computation
    assert model.dtype == torch.bfloat16  # the fp32 copy left the model alone


def test_megakernel_candidate_steps_on_host_ints_equal_to_the_shared_device_tokens():
    """The megakernel's step copies a CUDA tensor of ids to the host to check them (a sync per call that the
    graphed baselines never pay): its candidate gets the same ids as host ints, prepared once."""
    from megabake.verification.timing import TimingInputs, TimingSettings, megakernel_candidate

    class Decoder:
        batch, capacity, device, vocab_size = 2, 64, torch.device("cpu"), 500

        def __init__(self):
            self.calls = []

        def reset(self):
            pass

        def prefill(self, prompt):
            self.prompt = prompt

        def step(self, tokens, position):
            self.calls.append((tokens, position))

    decoder = Decoder()
    settings = TimingSettings(samples=1, inner=3, warmup=0, prefill=8, seed=0)
    inputs = TimingInputs.make(decoder, settings)
    candidate = megakernel_candidate(decoder, inputs)
    for i in range(settings.inner):
        candidate.call(i)
    assert [type(tokens) for tokens, _ in decoder.calls] == [list] * 3
    assert [tokens for tokens, _ in decoder.calls] == [t.tolist() for t in inputs.tokens]
    assert [position for _, position in decoder.calls] == inputs.positions == [8, 9, 10]
    assert all(len(tokens) == 2 and all(type(t) is int for t in tokens) for tokens, _ in decoder.calls)


def test_decode_ids_give_one_layout_and_one_compile():
    from torch._dynamo.testing import CompileCounter

    from megabake.verification.baselines import decode_ids

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(lambda ids: ids * 2, backend=counter, fullgraph=True)
    grid = torch.arange(24).reshape(1, 24)
    for ids in (grid[:, 3], grid[:, 5:6], torch.tensor([7]), grid[:, 4].contiguous()):
        shaped = decode_ids(ids)
        assert shaped.shape == (1, 1) and shaped.stride() == (1, 1)
        compiled(shaped)
    assert counter.frame_count == 1
    wide = torch.arange(12).reshape(3, 4)
    assert decode_ids(wide[:, 1]).flatten().tolist() == [1, 5, 9]


def test_block_cross_check_runs_each_candidate_back_to_back():
    from megabake.verification.timing import measure_blocks

    clock = FakeClock()
    settings = TimingSettings(samples=2, inner=3, block_calls=5)
    candidates = [Candidate("megabake", "megabake", clock.call("mk")), Candidate("bl", "baseline", clock.call("bl")),
                  Candidate("broken", "baseline", clock.call("x"), error="boom")]
    results = {"megabake": Samples(), "bl": Samples()}
    measure_blocks(candidates, settings, clock.sync, results, clock=clock)
    assert [name for name, _ in clock.log] == ["mk"] * 5 + ["bl"] * 5  # alone, in a row; a failed one skipped
    assert [i for _, i in clock.log[:5]] == [0, 1, 2, 0, 1]  # cycles over the shared schedule
    assert results["bl"].sync_call_block == pytest.approx([3.0] * 5)  # 2 ms call + 1 ms sync, per call
    assert results["bl"].host_call_block == pytest.approx([2.0] * 5)  # until the call returned, before the sync


def test_block_disagreement_becomes_a_report_warning():
    from megabake.package import validate
    from megabake.verification.report import summary_lines
    from tests.fixtures_packages import make_report

    candidates = [Candidate("megabake", "megabake", None), Candidate("inductor-graph", "baseline", None)]
    results = {"megabake": Samples(_samples(1.0), sync_call_block=_samples(1.05)),
               "inductor-graph": Samples(_samples(1.75), sync_call_block=_samples(1.26))}
    timings = assemble_timings(candidates, results, weight_bytes=1, bandwidth_GBps=4280.0, settings=TimingSettings())
    assert len(timings["warnings"]) == 1 and timings["warnings"][0].startswith("inductor-graph: 1.75 ms")
    assert "-28%" in timings["warnings"][0]
    assert timings["candidates"]["inductor-graph"]["sync_call_block"]["median"] == pytest.approx(1.26)
    report = validate("report", dict(make_report(status="unverified", megabake_ms=None), timings=timings))
    assert any(line.startswith("  warning: inductor-graph") for line in summary_lines(report))


@pytest.mark.parametrize("preset_name", ["qwen2.5-0.5b", "qwen3-0.6b", "phi-4-mini"])
def test_baseline_step_traces_whole_for_every_architecture_we_bake(preset_name):
    """The Inductor baselines compile the HF step with fullgraph=True: a graph break in Qwen2's biases or
    Qwen3's q/k norms would surface only on the GPU, at benchmark time. One layer, a small vocabulary."""
    import dataclasses

    torch._dynamo.reset()
    preset = get_preset(preset_name)
    small = dataclasses.replace(preset, config=dict(preset.config, num_hidden_layers=1, vocab_size=1024,
                                                    pad_token_id=None))
    model = small.build_model()
    ids = teacher_tokens(1, 10, 1024, seed=0)
    step = build_baseline("inductor-reduce-overhead", model, ids[:, :8], 16,
                          compile_kwargs={"fullgraph": True, "backend": "eager"})
    for position in (8, 9):
        ref = eager_reference_logits(model, ids[:, :position], ids[:, position], position, 16)
        with torch.no_grad():
            got = step.call(ids[:, position], torch.tensor([position]))
        assert rel_l2(got.float(), ref) < 1e-5, position


def test_long_rope_baseline_pins_the_short_factors_within_the_range_and_refuses_past_it():
    """Phi-4-mini's long-RoPE branch on the largest position cannot be traced whole (H200, session 11: the
    inductor-graph baseline of phi-4-mini failed with 'Data-dependent branching'). Within the original range
    the baseline pins the short factors and matches the unpinned eager model; past it, a clear refusal."""
    import copy
    import dataclasses

    from megabake.verification.baselines import BaselineError

    torch._dynamo.reset()
    preset = get_preset("tiny-phi4")  # original range 128
    small = dataclasses.replace(preset, config=dict(preset.config, num_hidden_layers=1))
    model = small.build_model()
    unpinned = copy.deepcopy(model)
    ids = teacher_tokens(1, 12, model.config.vocab_size, seed=0)
    with pytest.raises(BaselineError, match="long-RoPE .* passes it. fix: .* at most 128 slots"):
        build_baseline("inductor-reduce-overhead", model, ids[:, :8], 256,
                       compile_kwargs={"fullgraph": True, "backend": "eager"})
    step = build_baseline("inductor-reduce-overhead", model, ids[:, :8], 128,
                          compile_kwargs={"fullgraph": True, "backend": "eager"})
    for position in (8, 9, 10):
        ref = eager_reference_logits(unpinned, ids[:, :position], ids[:, position], position, 128)
        with torch.no_grad():
            got = step.call(ids[:, position], torch.tensor([position]))
        assert rel_l2(got.float(), ref) < 1e-5, position
