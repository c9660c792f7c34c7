"""Real trained weights on the H200 (SmolLM2-135M-Instruct GGUF, tests/real_weights.py): long prompts.

Issue 11's check: after a long prompt (prefilled by HF eager, bf16) the megakernel's decode steps stay as
close to fp32 as eager bf16 (worst and median rel-L2, top-1 vs fp32), in a capacity-2048 bucket; a 40-token
prompt keeps the 30 steps within the first split-KV chunk, where the default build fuses attention and the O
projection (groups on the tensor cores), and 128 / 1900 run the split steps.
Run: ``source .cute/activate.sh && MEGABAKE_SMOLLM2_GGUF=/tmp/big/model.gguf python3 -m pytest -m gpu -q
tests/test_real_weights_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.compiler_fixtures import compile_model
from tests.real_weights import CHAT_PROMPTS, chat_ids, smollm2_fp32

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def long_decoder():
    from megabake.runtime import MegakernelDecoder, gpu_info

    model, tokenizer = smollm2_fp32()
    compiled = compile_model(copy.deepcopy(model), capacity=2048, ctas=gpu_info().sm_count)
    decoder = MegakernelDecoder(compiled.plan, compiled.generated.source, copy.deepcopy(model), device="cuda")
    yield decoder, model, tokenizer
    del decoder
    torch.cuda.empty_cache()


@pytest.mark.parametrize("prefill", [40, 128, 1900])  # 40: fused attention+O steps (contexts <= 128)
def test_long_prompt_numerics_on_real_weights(long_decoder, prefill):
    from megabake.verification import run_numerics

    decoder, _, _ = long_decoder
    numerics = run_numerics(decoder, prefill=prefill, steps=30, seed=prefill)
    summary = numerics["summary"]
    print(prefill, {k: summary[k] for k in ("max_rel_l2_vs_fp32", "max_rel_l2_bf16_vs_fp32", "median_rel_l2_vs_fp32",
                                            "median_rel_l2_bf16_vs_fp32", "top1_vs_fp32", "bf16_top1_vs_fp32")})
    assert numerics["pass"], numerics["failures"]
    assert summary["top1_vs_fp32"] >= summary["bf16_top1_vs_fp32"]


def test_greedy_chat_text_matches_fp32(long_decoder):
    """Greedy answers to chat prompts: the megakernel's tokens equal HF fp32's for a long common prefix."""
    decoder, model, tokenizer = long_decoder
    fp32 = copy.deepcopy(model).cuda()
    for prompt in CHAT_PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        ours = decoder.generate(ids, max_new_tokens=24)[0, ids.shape[1]:].tolist()
        ref = fp32.generate(ids.cuda(), max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        common = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        print(prompt, common, len(ref), repr(tokenizer.decode(ours[:len(ref)])))
        assert common >= min(16, len(ref)), (prompt, tokenizer.decode(ours), tokenizer.decode(ref))
