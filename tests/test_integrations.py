"""CPU tests of megabake.integrations: the transformers-generate drop-in and the torch.compile backend.

The decoders run the plan's reference executor (the CPU form of the megakernel), fp32, tiny Llama preset.
Seed 2 and these prompts give greedy continuations that change token mid-way, so a wrong position or KV cache
shows up in the ids, not only in the logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import megabake
from megabake.errors import InputError, MegaBakeError, UnsupportedGraphError
from megabake.integrations import bake_decoder, make_backend, serve_decode_steps
from megabake.presets import get_preset
from tests.compiler_fixtures import FUSED_MMA_TOLERANCE

CAPACITY = 64
NEW = 8
PROMPT1 = torch.tensor([[900, 17, 250, 3]])
PROMPT2 = torch.tensor([[900, 17, 250, 3], [1, 2, 3, 4]])


def _model():
    return get_preset("tiny-llama").build_model(seed=2)


def _static(model):
    return StaticCache(config=model.config, max_cache_len=CAPACITY)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def decoder1(model):
    return bake_decoder(model, batch=1, capacity=CAPACITY)


@pytest.fixture(scope="module")
def decoder2(model):
    return bake_decoder(model, batch=2, capacity=CAPACITY)


@pytest.fixture(scope="module")
def want1(decoder1):
    return decoder1.generate(PROMPT1, max_new_tokens=NEW)


@pytest.fixture(scope="module")
def want2(decoder2):
    return decoder2.generate(PROMPT2, max_new_tokens=NEW)


def _eager_cache(model, ids):
    cache = _static(model)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return cache


def _fp32_tolerance(decoder):
    """Relative L2 of served logits (max abs of K/V) from eager fp32: fp32 rounding, or the bf16 query and
    probabilities of batch 1's fused short-context steps where their KV groups run on the tensor cores
    (``decoder.fused_mma``, the default since session 36: ~5e-4 on these random weights)."""
    return FUSED_MMA_TOLERANCE if decoder.fused_mma else 1e-5


def _max_cache_diff(a, b):
    return max(float((x.keys - y.keys).abs().max()) + float((x.values - y.values).abs().max())
               for x, y in zip(a.layers, b.layers))


# ------------------------------------------------------------------------------------------- bake


def test_bake_decoder_leaves_the_model_untouched_and_shares_its_weights():
    model = _model()
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    config = model.generation_config.to_dict()
    decoder = bake_decoder(model, batch=1, capacity=32)
    assert {name: p for name, p in model.named_parameters()} == params  # the same Parameter objects
    assert all(model.get_buffer(name) is b for name, b in buffers.items())
    assert model.generation_config.to_dict() == config  # capture's static-cache config went to a copy
    assert decoder.model is not model and decoder.backend == "reference" and decoder.capacity == 32
    twin = decoder.model.get_parameter("model.layers.0.mlp.up_proj.weight")
    assert twin.data_ptr() == params["model.layers.0.mlp.up_proj.weight"].data_ptr()  # no weight copy


# ------------------------------------------------------------------------------------------- drop-in


@pytest.mark.parametrize("cache", ["static-cache", "cache_implementation", "dynamic"])
def test_dropin_generate_is_token_for_token_the_decoders_generate(model, decoder1, want1, cache):
    assert len(set(want1[0, PROMPT1.shape[1]:].tolist())) > 1  # the continuation changes token
    given = {"static-cache": {"past_key_values": _static(model)},
             "cache_implementation": {"cache_implementation": "static"}, "dynamic": {}}[cache]
    with serve_decode_steps(model, decoder1) as server:
        got = model.generate(PROMPT1, max_new_tokens=NEW, do_sample=False, **given)
    assert torch.equal(got, want1)
    assert (server.stats.decode_steps, server.stats.prefills, server.stats.eager_calls) == (NEW - 1, 1, 0)
    assert "forward" not in model.__dict__  # detached: the class's forward again


def test_dropin_logits_are_eager_hfs_and_the_hf_cache_stays_exact(model, decoder1):
    cache = _static(model)
    with serve_decode_steps(model, decoder1):
        served = model.generate(PROMPT1, max_new_tokens=NEW, do_sample=False, past_key_values=cache,
                                output_logits=True, return_dict_in_generate=True)
    eager = model.generate(PROMPT1, max_new_tokens=NEW, do_sample=False, past_key_values=_static(model),
                           output_logits=True, return_dict_in_generate=True)
    assert torch.equal(served.sequences, eager.sequences)
    for got, want in zip(served.logits, eager.logits):
        assert float((got - want).norm() / want.norm()) < _fp32_tolerance(decoder1)
    assert int(cache.get_seq_length()) == PROMPT1.shape[1] + NEW - 1
    assert _max_cache_diff(cache, _eager_cache(model, served.sequences[:, :-1])) < _fp32_tolerance(decoder1)


def test_dropin_batch_two_bucket(model, decoder2, want2):
    with serve_decode_steps(model, decoder2) as server:
        got = model.generate(PROMPT2, max_new_tokens=NEW, do_sample=False, past_key_values=_static(model))
    assert torch.equal(got, want2)
    assert server.stats.decode_steps == NEW - 1


def test_dropin_reloads_the_decoder_after_a_write_it_did_not_make(model, decoder1):
    """A call the server runs eagerly (two new tokens continuing the cache) writes HF's cache without the
    decoder: its version counter moves, so the next megakernel step reloads the decoder's cache first."""
    cache = _static(model)
    with torch.no_grad(), serve_decode_steps(model, decoder1) as server:
        t1 = model(PROMPT1, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        t2 = model(t1, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        pair = torch.cat([t2, torch.tensor([[77]])], 1)
        t3 = model(pair, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        served = model(t3, past_key_values=cache, use_cache=True).logits[:, -1]
    sequence = torch.cat([PROMPT1, t1, pair, t3], 1)
    with torch.no_grad():
        reference = model(sequence, past_key_values=_static(model), use_cache=True).logits[:, -1]
    assert (server.stats.prefills, server.stats.decode_steps, server.stats.eager_calls) == (1, 2, 1)
    assert server.cache_loads == 1
    assert float((served - reference).norm() / reference.norm()) < _fp32_tolerance(decoder1)
    assert int(cache.get_seq_length()) == sequence.shape[1]


def test_dropin_refuses_a_padded_batch_or_runs_it_eagerly_when_asked(model, decoder2):
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with serve_decode_steps(model, decoder2), pytest.raises(InputError, match="padded batch"):
        model.generate(PROMPT2, attention_mask=mask, max_new_tokens=3, do_sample=False,
                       past_key_values=_static(model))
    with serve_decode_steps(model, decoder2, fallback="eager") as server:
        got = model.generate(PROMPT2, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             past_key_values=_static(model))
    want = model.generate(PROMPT2, attention_mask=mask, max_new_tokens=3, do_sample=False,
                          past_key_values=_static(model))
    assert torch.equal(got, want)
    assert server.stats.fallback_steps == 2 and server.stats.decode_steps == 0
    assert "padded batch" in server.stats.last_fallback


def test_dropin_bad_inputs_raise_input_error(model, decoder1):
    with pytest.raises(InputError, match="fallback='bogus'"):
        serve_decode_steps(model, decoder1, fallback="bogus")
    other = get_preset("tiny-llama").make_config()
    other.num_hidden_layers = 3
    import transformers

    with pytest.raises(InputError, match="another config"):
        serve_decode_steps(transformers.LlamaForCausalLM(other), decoder1)
    with serve_decode_steps(model, decoder1), pytest.raises(InputError, match="already served"):
        serve_decode_steps(model, decoder1).attach()
    assert "forward" not in model.__dict__


# ------------------------------------------------------------------------------------------- backend


def _greedy_loop(compiled, model, prompt, new=NEW, cache=None):
    """Prefill + one-token decode calls through ``compiled``, greedy, on a static cache."""
    cache = cache if cache is not None else _static(model)
    ids = [prompt]
    with torch.no_grad():
        token = compiled(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(new - 1):
            ids.append(token)
            token = compiled(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return torch.cat([*ids, token], 1), cache


def _paths(backend):
    return [(record.kind, record.path) for record in backend.report]


def test_backend_decode_calls_run_the_megakernel_with_generates_tokens(want1):
    model = _model()
    backend = megabake.make_backend(other="eager")
    got, cache = _greedy_loop(torch.compile(model, backend=backend, fullgraph=True), model, PROMPT1)
    assert torch.equal(got, want1)
    decode = [r for r in backend.report if r.kind == "decode"]
    assert ("prefill", "eager") in _paths(backend) and {r.path for r in decode} == {"megakernel"}
    # the bake's torch.export makes Dynamo re-trace once: the decode calls may span two graphs
    assert sum(r.megakernel_calls for r in decode) == NEW - 1 and sum(r.fallback_calls for r in decode) == 0
    assert decode[-1].bucket == f"batch 1, capacity {CAPACITY}, reference"
    assert len(backend.decoders()) == 1
    tolerance = _fp32_tolerance(backend.decoders()[0])
    assert _max_cache_diff(cache, _eager_cache(model, got[:, :-1])) < tolerance  # HF's cache written as the graph would


def test_backend_under_hf_generate_prefill_inductor_decode_megakernel_batch_two(want2):
    model = _model()
    backend = make_backend()
    backend.prepare(model, batch=2, cache_length=CAPACITY)  # bake before compiling: no re-trace
    model.compile(backend=backend, fullgraph=True)
    got = model.generate(PROMPT2, max_new_tokens=NEW, do_sample=False, past_key_values=_static(model))
    assert torch.equal(got, want2)
    assert _paths(backend) == [("prefill", "inductor"), ("decode", "megakernel")]
    prefill, decode = backend.report
    assert (prefill.calls, decode.calls, decode.megakernel_calls) == (1, NEW - 1, NEW - 1)
    assert "not a one-token decode step" in prefill.reason
    again = model.generate(PROMPT2, max_new_tokens=NEW, do_sample=False, past_key_values=_static(model))
    assert torch.equal(again, want2) and len(backend.report) == 2 and decode.megakernel_calls == 2 * (NEW - 1)
    assert "graph 1: decode -> megakernel" in backend.summary()


def _unbakeable_model():
    """A Mish activation in layer 0: no IR op computes it (GELU, which this used, is baked since Gemma)."""
    model = _model()
    model.model.layers[0].mlp.act_fn = torch.nn.Mish()
    return model


def test_backend_strict_mode_refuses_with_the_unsupported_node():
    model = _unbakeable_model()
    compiled = torch.compile(model, backend=make_backend(fallback="error", other="eager"), fullgraph=True)
    with pytest.raises(UnsupportedGraphError) as info:
        _greedy_loop(compiled, model, PROMPT1, new=2)
    assert "mish" in str(info.value) and "model.layers.0.mlp.act_fn" in str(info.value)


def test_backend_falls_back_for_a_model_it_cannot_bake():
    model = _unbakeable_model()
    backend = make_backend(fallback="eager", other="eager")
    got, _ = _greedy_loop(torch.compile(model, backend=backend, fullgraph=True), model, PROMPT1)
    want = model.generate(PROMPT1, max_new_tokens=NEW, do_sample=False, past_key_values=_static(model))
    assert torch.equal(got, want)
    decode = backend.report[1]
    assert (decode.kind, decode.path) == ("decode", "eager") and "mish" in decode.reason
    assert decode.fallback_calls == decode.calls and decode.megakernel_calls == 0


def test_backend_first_call_check_catches_a_graph_that_is_not_the_models_step():
    model = _model()

    def doubled(ids, cache):
        return model(ids, past_key_values=cache, use_cache=True).logits * 2.0

    backend = make_backend(fallback="eager", other="eager")
    compiled = torch.compile(doubled, backend=backend, fullgraph=True)
    cache, reference = _static(model), _static(model)
    with torch.no_grad():
        compiled(PROMPT1, cache)
        model(PROMPT1, past_key_values=reference, use_cache=True)
        got = compiled(torch.tensor([[5]]), cache)
        want = model(torch.tensor([[5]]), past_key_values=reference, use_cache=True).logits * 2.0
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    decode = [r for r in backend.report if r.kind == "decode"][-1]
    assert decode.path == "eager" and "disagrees with the graph run as traced" in decode.reason
    strict = torch.compile(doubled, backend=make_backend(fallback="error", other="eager"), fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(MegaBakeError, match="disagrees"):
        cache = _static(model)
        strict(PROMPT1, cache)
        strict(torch.tensor([[5]]), cache)


def test_backend_calls_outside_the_bucket_fall_back_or_raise():
    model = _model()
    backend = make_backend(capacity=32, fallback="eager", other="eager")
    prompt = torch.arange(1, 31)[None]  # 30 positions: steps at 30, 31 fit capacity 32, then 32, 33 do not
    got, _ = _greedy_loop(torch.compile(model, backend=backend, fullgraph=True), model, prompt, new=5)
    want = model.generate(prompt, max_new_tokens=5, do_sample=False, past_key_values=_static(model))
    assert torch.equal(got, want)
    decode = [r for r in backend.report if r.kind == "decode"]
    assert sum(r.megakernel_calls for r in decode) == 2 and sum(r.fallback_calls for r in decode) == 2
    assert "outside the baked KV capacity [0, 32)" in decode[-1].last_fallback
    torch._dynamo.reset()
    strict = torch.compile(model, backend=make_backend(capacity=32, fallback="error", other="eager"), fullgraph=True)
    with pytest.raises(InputError, match="outside the baked KV capacity"):
        _greedy_loop(strict, model, prompt, new=5)


def test_backend_leaves_a_dynamic_cache_to_the_fallback():
    model = _model()
    backend = make_backend(fallback="eager", other="eager")
    got, _ = _greedy_loop(torch.compile(model, backend=backend, fullgraph=True), model, PROMPT1, new=3,
                          cache=DynamicCache(config=model.config))
    want = model.generate(PROMPT1, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    decode = [r for r in backend.report if r.kind == "decode"]
    assert decode and all(r.path == "eager" and "DynamicCache" in r.reason for r in decode)


def test_make_backend_bad_inputs_raise_input_error():
    assert megabake.make_backend is make_backend
    with pytest.raises(InputError, match="fallback='bogus'"):
        make_backend(fallback="bogus")
    with pytest.raises(InputError, match="other='gpu'"):
        make_backend(other="gpu")
    with pytest.raises(InputError, match="capacity must be an int >= 2"):
        make_backend(capacity=1)
    with pytest.raises(InputError, match="model must be the Hugging Face model"):
        make_backend(model="tiny-llama")
    with pytest.raises(InputError, match="batch must be an int >= 1"):
        make_backend().prepare(_model(), batch=0)


@pytest.mark.slow
def test_backend_on_real_bf16_weights_gives_generates_tokens():
    """SmolLM2-135M-Instruct in bf16: returning the megakernel's logits rounded to the graph's bf16 made
    near-ties (the H200 run of 2026-12-01 diverged at token 17 of the haiku prompt); fp32 logits keep greedy
    ids equal to ``decoder.generate``'s."""
    import copy

    from megabake.rope import cast_model
    from tests.real_weights import chat_ids, smollm2_fp32

    model, tokenizer = smollm2_fp32()
    ids = chat_ids(tokenizer, "Write a haiku about the sea.")
    decoder = bake_decoder(cast_model(copy.deepcopy(model), dtype=torch.bfloat16), batch=1, capacity=128)
    own = decoder.generate(ids, max_new_tokens=32)[0].tolist()
    compiled = cast_model(copy.deepcopy(model), dtype=torch.bfloat16).eval()
    backend = make_backend(other="eager")
    backend.prepare(compiled, batch=1, cache_length=128)
    compiled.compile(backend=backend, fullgraph=True)
    with torch.no_grad():
        got = compiled.generate(ids, max_new_tokens=32, do_sample=False, disable_compile=True,
                                past_key_values=StaticCache(config=compiled.config, max_cache_len=128))[0].tolist()
    assert got[:len(own)] == own
    assert [(r.kind, r.path) for r in backend.report] == [("prefill", "eager"), ("decode", "megakernel")]


# ------------------------------------------------------------------------------- sliding windows
def _windowed_model():
    """tiny-mistral with a 16-position window: a 4 + 30 token answer decodes mostly past it."""
    import dataclasses

    preset = get_preset("tiny-mistral")
    return dataclasses.replace(preset, config=dict(preset.config, sliding_window=16)).build_model(seed=2)


@pytest.fixture(scope="module")
def windowed_want():
    model = _windowed_model()
    return model.generate(PROMPT1, max_new_tokens=30, do_sample=False,
                          past_key_values=StaticCache(config=model.config, max_cache_len=CAPACITY))


def test_backend_serves_a_sliding_window_model_on_a_full_length_cache(windowed_want):
    """Past the window HF's decode graph takes a 4-D mask hiding the positions before it: the backend accepts
    exactly the plan's window (it used to fall back there, calling it padding) and every decode call runs on
    the megakernel, token for token HF's greedy answer."""
    from megabake.capture import full_length_static_cache

    model = _windowed_model()
    backend = make_backend(other="eager", fallback="error")
    model.compile(backend=backend, fullgraph=True)
    got = model.generate(PROMPT1, max_new_tokens=30, do_sample=False,
                         past_key_values=full_length_static_cache(model.config, CAPACITY))
    assert torch.equal(got, windowed_want)
    decode = [r for r in backend.report if r.kind == "decode"]
    assert {r.path for r in decode} == {"megakernel"} and sum(r.megakernel_calls for r in decode) == 29
    assert sum(r.fallback_calls for r in decode) == 0


def test_backend_names_the_full_length_cache_when_given_transformers_window_rings(windowed_want):
    model = _windowed_model()
    backend = make_backend(other="eager", fallback="eager")
    model.compile(backend=backend, fullgraph=True)
    got = model.generate(PROMPT1, max_new_tokens=30, do_sample=False,
                         past_key_values=StaticCache(config=model.config, max_cache_len=CAPACITY))
    assert torch.equal(got, windowed_want)  # served by the fallback, correctly
    reasons = " ".join(r.reason for r in backend.report if r.kind == "decode")
    assert "StaticSlidingWindowLayer" in reasons and "full_length_static_cache(model.config, capacity)" in reasons


def test_prefix_mask_accepts_exactly_the_plans_window():
    from megabake.integrations.kv import prefix_mask_ok

    position, window = 40, 16
    slots = torch.arange(CAPACITY)
    windowed = ((slots <= position) & (slots > position - window))[None, None, None]
    assert bool(prefix_mask_ok(windowed, position, window)) and not bool(prefix_mask_ok(windowed, position))
    assert not bool(prefix_mask_ok(windowed, position, window + 1))
    holed = windowed.clone()
    holed[..., position - 3] = False  # padding inside the window
    assert not bool(prefix_mask_ok(holed, position, window))
    additive = torch.where(windowed, 0.0, float("-inf"))
    assert bool(prefix_mask_ok(additive, torch.tensor(position), window))


def test_dropin_serves_a_sliding_window_model_past_its_window(windowed_want):
    from megabake.capture import full_length_static_cache

    model = _windowed_model()
    decoder = bake_decoder(model, batch=1, capacity=CAPACITY)
    with serve_decode_steps(model, decoder) as server:
        got = model.generate(PROMPT1, max_new_tokens=30, do_sample=False,
                             past_key_values=full_length_static_cache(model.config, CAPACITY))
    assert torch.equal(got, windowed_want)
    assert (server.stats.decode_steps, server.stats.fallback_steps) == (29, 0), server.stats.last_fallback


def test_dropin_serves_mixed_windows_through_the_mask_mapping():
    """Gemma 2 (local layers windowed, global ones not): generate passes transformers' mask mapping; the drop-in
    checks the "sliding_attention" mask against the plan's window and the "full_attention" one against every
    position, so all decode steps past the window run on the megakernel (the backend's graph takes the mapping
    as two inputs and goes to its fallback)."""
    import dataclasses

    from megabake.capture import full_length_static_cache

    preset = get_preset("tiny-gemma2")
    windowed = dataclasses.replace(preset, config=dict(preset.config, sliding_window=16))
    reference = windowed.build_model(seed=2)
    want = reference.generate(PROMPT1, max_new_tokens=30, do_sample=False,
                              past_key_values=full_length_static_cache(reference.config, CAPACITY))
    model = windowed.build_model(seed=2)
    decoder = bake_decoder(model, batch=1, capacity=CAPACITY)
    assert decoder.plan.windows == [16, 0]
    with serve_decode_steps(model, decoder) as server:
        got = model.generate(PROMPT1, max_new_tokens=30, do_sample=False,
                             past_key_values=full_length_static_cache(model.config, CAPACITY))
    assert torch.equal(got, want)
    assert (server.stats.decode_steps, server.stats.fallback_steps) == (29, 0), server.stats.last_fallback


def test_first_call_tolerance_follows_the_plans_input_rounding():
    """The drop-in's first-call check: tight for the fp32 reference executor with fp32 GEMV inputs, looser where
    the plan rounds them to bf16 as the kernel does (batched tensor-core buckets, session 14) or rounds fused
    steps' attention (batch 1's fused KV groups on the tensor cores, session 36), loosest for kernels."""
    from types import SimpleNamespace

    from megabake.integrations.backend import _first_call_tolerance

    def decoder(backend, staging, fused_mma=False):
        return SimpleNamespace(backend=backend, plan=SimpleNamespace(staging_dtype=staging), fused_mma=fused_mma)

    assert _first_call_tolerance(decoder("reference", "float32"), torch.float32) == 1e-3
    assert _first_call_tolerance(decoder("reference", "float32", fused_mma=True), torch.float32) == 2e-2
    assert _first_call_tolerance(decoder("reference", "bfloat16"), torch.float32) == 2e-2
    assert _first_call_tolerance(decoder("cuda", "float32"), torch.float32) == 0.1
    assert _first_call_tolerance(decoder("reference", "float32"), torch.bfloat16) == 0.1
