"""GPU checks of `megabake verify` (Hopper/SM90 only; skipped elsewhere). On the H200, from the repo root:

    source .cute/activate.sh && python3 -m pytest -m gpu -q tests/test_verify_gpu.py

Covers: the environment record; numerics with a stand-in decoder on the GPU; both baselines really replay
a CUDA graph and agree with eager; the whole timing harness (warm-up, alternating rounds, GPU events, copy
bandwidth, floor) with a stand-in; and the real thing: bake the tiny preset, `verify_package`, status verified.
"""


import pytest
import torch

from megabake.presets import get_preset


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _sm90(), reason="needs a Hopper (SM90) GPU")]


@pytest.fixture(scope="module")
def tiny():
    return get_preset("tiny-llama").build_model(dtype=torch.bfloat16).to("cuda")


def test_environment_record():
    from megabake.package import validate
    from megabake.verification import environment, toolchain
    from tests.fixtures_packages import make_report

    env = environment()
    assert env["gpu_class"].startswith("sm90a-")
    assert env["sm_count"] == torch.cuda.get_device_properties(0).multi_processor_count
    assert env["compute_capability"] == "9.0"
    validate("report", dict(make_report(status="unverified", megabake_ms=None), environment=env, toolchain=toolchain()))


def test_numerics_with_stand_in_on_gpu(tiny):
    from megabake.verification import run_numerics
    from megabake.verification.doubles import EagerDecoder

    exact = run_numerics(EagerDecoder(tiny, capacity=128), prefill=16, steps=64)
    assert exact["pass"], exact["failures"]
    itself = run_numerics(EagerDecoder(tiny, capacity=128, exact=False), prefill=16, steps="max", slack=1.0)
    assert itself["pass"] and itself["steps"] == 112, itself["failures"]


@pytest.mark.parametrize("name", ["inductor-reduce-overhead", "inductor-graph", "inductor-default-graph"])
def test_baselines_replay_a_graph_and_agree_with_eager(tiny, name):
    from megabake.verification.baselines import build_baseline, eager_reference_logits
    from megabake.verification.numerics import rel_l2, teacher_tokens
    from megabake.verification.timing import check_graph

    torch._dynamo.reset()
    ids = teacher_tokens(1, 24, tiny.config.vocab_size, seed=0).cuda()
    step = build_baseline(name, tiny, ids[:, :16], 128)
    positions = [torch.tensor([p], device="cuda") for p in range(16, 24)]
    with torch.no_grad():
        for _ in range(4):  # cudagraph trees record on a later call than the first
            for k, p in enumerate(positions):
                step.call(ids[:, 16 + k], p)
        got = step.call(ids[:, 16], positions[0]).float().clone()
    ref = eager_reference_logits(tiny, ids[:, :16], ids[:, 16], 16, 128)
    assert rel_l2(got.cpu(), ref.cpu()) < 5e-2  # bf16 logits of two implementations
    with torch.no_grad():  # as the timing harness calls it: with grad on, Dynamo recompiles (no graph)
        check = check_graph(lambda i: step.call(ids[:, 16], positions[0]))
        profiled = check_graph(lambda i: step.call(ids[:, 16], positions[0]), count_launches=True)
    assert check.replays, f"{name} did not replay a CUDA graph"
    assert profiled.replays is True  # CUPTI sees the graph launch the spy counted (profiled last: it stays attached)


def test_hand_captured_graph_survives_graph_trees_built_in_verify_order(tiny):
    """CUDA-graph trees clear cuBLAS workspaces while recording; a hand-captured graph using cuBLAS must be
    captured after them (``build_order``) or its replay faults (seen on Llama-1B: illegal address)."""
    from megabake.verification.baselines import build_baseline, build_order, eager_reference_logits
    from megabake.verification.numerics import rel_l2, teacher_tokens

    torch._dynamo.reset()
    ids = teacher_tokens(1, 24, tiny.config.vocab_size, seed=0).cuda()
    built = {}
    for name in build_order(["inductor-graph", "inductor-reduce-overhead"]):
        options = {"fullgraph": True} if name == "inductor-graph" else None  # default mode: cuBLAS matmuls
        built[name] = build_baseline(name, tiny, ids[:, :16], 128, compile_kwargs=options)
    position = torch.tensor([16], device="cuda")
    with torch.no_grad():
        for _ in range(3):
            built["inductor-reduce-overhead"].call(ids[:, 16], position)
        got = built["inductor-graph"].call(ids[:, 16], position).float().clone()
        torch.cuda.synchronize()
    ref = eager_reference_logits(tiny, ids[:, :16], ids[:, 16], 16, 128)
    assert rel_l2(got.cpu(), ref.cpu()) < 5e-2


def test_hand_captured_graph_keeps_its_kv_cache_alive(tiny):
    """The graph replays raw addresses of its StaticCache; if the cache were collected after capture, the
    next allocations would overwrite it under the graph (seen on SmolLM: stable logits at rel-L2 0.57)."""
    import gc

    from megabake.verification.baselines import build_baseline, eager_reference_logits
    from megabake.verification.numerics import rel_l2, teacher_tokens

    torch._dynamo.reset()
    ids = teacher_tokens(1, 24, tiny.config.vocab_size, seed=0).cuda()
    ref = eager_reference_logits(tiny, ids[:, :16], ids[:, 16], 16, 128)
    step = build_baseline("inductor-graph", tiny, ids[:, :16], 128, compile_kwargs={"fullgraph": True})
    gc.collect()
    # Reuse whatever the allocator has free, in every block size from 1 KiB to 16 MiB, filled with NaN.
    churn = [torch.full((1 << k,), float("nan"), device="cuda") for k in range(8, 23) for _ in range(8)]
    with torch.no_grad():
        got = step.call(ids[:, 16], torch.tensor([16], device="cuda")).float().clone()
    del churn
    assert rel_l2(got.cpu(), ref.cpu()) < 5e-2


def test_timing_harness_with_stand_in(tiny):
    from megabake.verification.doubles import EagerDecoder
    from megabake.verification.report import assemble_report, summary_lines, validated
    from megabake.verification.timing import run_timings
    from tests.fixtures_packages import make_report

    torch._dynamo.reset()
    decoder = EagerDecoder(tiny, capacity=128, exact=False)
    timings = run_timings(decoder, samples=40, inner=5, warmup=10)
    cands = timings["candidates"]
    assert set(cands) == {"megabake", "inductor-reduce-overhead", "inductor-graph"}, cands
    for name, cand in cands.items():
        assert cand.get("error") is None, (name, cand.get("error"))
        for measure in ("sync_call", "pipelined", "gpu_event"):
            assert len(cand[measure]["samples"]) == 40 and cand[measure]["median"] > 0
    assert cands["inductor-graph"]["graph_replays"] and cands["inductor-reduce-overhead"]["graph_replays"]
    assert cands["megabake"]["graph_replays"] is False  # the stand-in is eager
    assert timings["baseline"] in ("inductor-graph", "inductor-reduce-overhead")
    assert timings["copy_bandwidth_GBps"] > 1000 and timings["floor_ms"] > 0
    report = validated(assemble_report(make_report(status="unverified", megabake_ms=None),
                                       numerics=None, timings=timings, environment=None))
    print("\n".join(summary_lines(report)))


def test_verify_baked_tiny_package(tmp_path):
    from megabake.baking import bake
    from megabake.verification import verify_package
    from megabake.verification.report import summary_lines

    torch._dynamo.reset()
    path = bake("tiny-llama", capacity=128, out=tmp_path).path
    report = verify_package(path, steps=64, samples=40)
    print("\n".join(summary_lines(report)))
    assert report["numerics"]["pass"], report["numerics"]["failures"]
    mk = report["timings"]["candidates"]["megabake"]
    assert mk.get("error") is None and mk["graph_replays"] is True
    assert report["status"] == "verified", report["status_reasons"]
