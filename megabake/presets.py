"""Built-in model presets: configs of real decoder architectures, built offline with random weights.

Contract: ``get_preset(name)`` returns a :class:`Preset`; ``preset.build_model()`` returns an eval-mode
``transformers`` causal LM with weights drawn from a fixed seed (same seed -> bit-identical weights, drawn or
read back from ``MEGABAKE_PRESET_CACHE``: :mod:`megabake.preset_cache`), so
every part of MegaBake runs without network access. ``PRESETS`` lists them; ``DEFAULT_PRESET`` is a tiny
Llama that bakes in seconds on a CPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PRESET = "tiny-llama"
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Preset:
    """A named architecture config; ``model_id`` is what reports and package paths call it."""

    name: str
    model_id: str
    architecture: str
    config: dict[str, Any] = field(hash=False)
    description: str = ""
    experimental: str = ""  # the MEGABAKE_EXPERIMENTAL_LAYOUTS name it needs until its kernel is GPU-verified

    def make_config(self):
        import transformers

        config_cls = getattr(transformers, self.architecture).config_class
        return config_cls(**self.config)

    def config_hash(self) -> str:
        return config_hash(self.make_config())

    def build_model(self, seed: int = DEFAULT_SEED, dtype=None, cache_dir=None):
        """Instantiate the model with random weights from ``seed`` (CPU, eval mode). ``cache_dir`` (default: the
        folder ``MEGABAKE_PRESET_CACHE`` names, if any) keeps the drawn weights on disk so the next build of the
        same preset and seed reads them instead of drawing them again (:mod:`megabake.preset_cache`: the same
        bits)."""
        import torch
        import transformers

        from .preset_cache import cached_preset_model, preset_cache_dir

        config = self.make_config()
        model_cls = getattr(transformers, self.architecture)

        def draw():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                drawn = model_cls(config)
                _randomize_norm_weights(drawn, seed)
            return drawn

        model = cached_preset_model(self.name, seed, config, model_cls, draw, cache_dir or preset_cache_dir())
        model = model.eval()
        if dtype is not None:
            model = model.to(dtype)
        return model


def _randomize_norm_weights(model, seed: int) -> None:
    """HF initialises norm weights to exactly 1.0; perturb them so a kernel that ignores them fails."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))


def config_hash(config) -> str:
    """sha256 of the config's canonical JSON (diff-relevant fields only, no bookkeeping keys)."""
    data = config.to_diff_dict() if hasattr(config, "to_diff_dict") else dict(config)
    for volatile in ("transformers_version", "_name_or_path", "_commit_hash", "torch_dtype", "dtype"):
        data.pop(volatile, None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


_LLAMA_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False)
_PHI3 = dict(num_hidden_layers=2, intermediate_size=512, num_attention_heads=4, rms_norm_eps=1e-5, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)  # the tiny Phi presets' shared fields
_GEMMA3 = dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=512,
               max_position_embeddings=32768, attention_bias=False, tie_word_embeddings=True,
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
# Granite = Llama + four scalars (ibm-granite/granite-3.1-2b-instruct's values; the tiny preset shares them)
_GRANITE = dict(_LLAMA_COMMON, embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
                logits_scaling=8.0, pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)


def _long_rope(head_dim: int, partial: float, original: int, positions: int) -> dict:
    """transformers' ``longrope`` parameters with one short and one long factor per rotated frequency (a smooth
    placeholder ramp: random-weight presets need the shape, not the published values)."""
    pairs = int(head_dim * partial) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "original_max_position_embeddings": original, "factor": positions / original,
            "short_factor": [round(1.0 + 2.0 * i / pairs, 4) for i in range(pairs)],
            "long_factor": [round(1.0 + 40.0 * (i / pairs) ** 2, 4) for i in range(pairs)]}


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="tiny-llama",
            model_id="megabake/tiny-llama",
            architecture="LlamaForCausalLM",
            description="2-layer Llama (hidden 256, 4/2 heads, head_dim 64): the offline default, bakes in seconds",
            config=dict(
                _LLAMA_COMMON,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                vocab_size=1024,
                max_position_embeddings=2048,
                rope_theta=10000.0,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="smollm-135m",
            model_id="HuggingFaceTB/SmolLM-135M",
            architecture="LlamaForCausalLM",
            description="SmolLM-135M shape: hidden 576, 30 layers, 9/3 heads, intermediate 1536, vocab 49152, tied",
            config=dict(
                _LLAMA_COMMON,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                head_dim=64,
                vocab_size=49152,
                max_position_embeddings=2048,
                rope_theta=10000.0,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="llama-3.2-1b",
            model_id="meta-llama/Llama-3.2-1B",
            architecture="LlamaForCausalLM",
            description="Llama-3.2-1B shape: hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocab 128256, llama3 RoPE",
            config=dict(
                _LLAMA_COMMON,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                vocab_size=128256,
                max_position_embeddings=131072,
                rope_theta=500000.0,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=32.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                ),
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="smollm-1.7b",
            model_id="HuggingFaceTB/SmolLM-1.7B",
            architecture="LlamaForCausalLM",
            description="SmolLM-1.7B shape: hidden 2048, 24 layers, 32/32 heads x 64, intermediate 8192, vocab 49152, "
                        "tied (a larger Llama without GQA)",
            config=dict(
                _LLAMA_COMMON,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=24,
                num_attention_heads=32,
                num_key_value_heads=32,
                head_dim=64,
                vocab_size=49152,
                max_position_embeddings=2048,
                rope_theta=10000.0,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="qwen2.5-0.5b",
            model_id="Qwen/Qwen2.5-0.5B",
            architecture="Qwen2ForCausalLM",
            description="Qwen2.5-0.5B shape: hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 151936, "
                        "q/k/v biases, tied",
            config=dict(
                hidden_act="silu",
                rms_norm_eps=1e-6,
                hidden_size=896,
                intermediate_size=4864,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                vocab_size=151936,
                max_position_embeddings=32768,
                rope_theta=1000000.0,
                use_sliding_window=False,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="qwen3-0.6b",
            model_id="Qwen/Qwen3-0.6B",
            architecture="Qwen3ForCausalLM",
            description="Qwen3-0.6B shape: hidden 1024, 28 layers, 16/8 heads x 128, intermediate 3072, vocab 151936, "
                        "per-head q/k RMSNorm, tied",
            config=dict(
                hidden_act="silu",
                rms_norm_eps=1e-6,
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=151936,
                max_position_embeddings=40960,
                rope_theta=1000000.0,
                attention_bias=False,
                use_sliding_window=False,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="tiny-gemma",
            model_id="megabake/tiny-gemma",
            architecture="GemmaForCausalLM",
            description="2-layer Gemma (hidden 256, 4/1 heads x 64, GeGLU tanh, scaled embedding, 1 + w norms): "
                        "the Gemma family on a CPU in seconds",
            config=dict(
                hidden_activation="gelu_pytorch_tanh",
                rms_norm_eps=1e-6,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=64,
                vocab_size=1024,
                max_position_embeddings=2048,
                rope_theta=10000.0,
                attention_bias=False,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="gemma-2b",
            model_id="google/gemma-2b",
            architecture="GemmaForCausalLM",
            description="gemma-2b shape: hidden 2048, 18 layers, 8/1 heads x 256, intermediate 16384 (GeGLU tanh), "
                        "vocab 256000, scaled embedding, 1 + w norms, tied",
            config=dict(
                hidden_activation="gelu_pytorch_tanh",
                rms_norm_eps=1e-6,
                hidden_size=2048,
                intermediate_size=16384,
                num_hidden_layers=18,
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=256,
                vocab_size=256000,
                max_position_embeddings=8192,
                rope_theta=10000.0,
                attention_bias=False,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="tiny-mistral",
            model_id="megabake/tiny-mistral",
            architecture="MistralForCausalLM",
            description="2-layer Mistral (hidden 256, 4/2 heads x 64) with a 96-token sliding window: smaller than "
                        "the default 128-slot bucket, so every bake of it runs sliding-window attention",
            config=dict(
                _LLAMA_COMMON,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                vocab_size=1024,
                max_position_embeddings=4096,
                sliding_window=96,
                rope_theta=10000.0,
                tie_word_embeddings=False,
            ),
        ),
        Preset(
            name="mistral-7b",
            model_id="mistralai/Mistral-7B-v0.1",
            architecture="MistralForCausalLM",
            description="Mistral-7B-v0.1 shape: hidden 4096, 32 layers, 32/8 heads x 128, intermediate 14336, vocab "
                        "32000, sliding window 4096 (a bucket above 4096 positions attends over the window)",
            config=dict(
                _LLAMA_COMMON,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=32000,
                max_position_embeddings=32768,
                sliding_window=4096,
                rope_theta=10000.0,
                tie_word_embeddings=False,
            ),
        ),
        Preset(
            name="tiny-phi3",
            model_id="megabake/tiny-phi3",
            architecture="Phi3ForCausalLM",
            description="2-layer Phi-3 (hidden 384, 4/2 heads x 96 as Phi-3-mini's, fused qkv and gate-up "
                        "projections, sliding window 96)",
            config=dict(_PHI3, hidden_size=384, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096,
                        original_max_position_embeddings=4096, sliding_window=96, tie_word_embeddings=False),
        ),
        Preset(
            name="phi-3-mini",
            model_id="microsoft/Phi-3-mini-4k-instruct",
            architecture="Phi3ForCausalLM",
            description="Phi-3-mini-4k shape: hidden 3072, 32 layers, 32/32 heads x 96, fused qkv and gate-up "
                        "projections, intermediate 8192, vocab 32064, sliding window 2047, 4096 positions",
            config=dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
                        original_max_position_embeddings=4096, sliding_window=2047, rms_norm_eps=1e-5,
                        pad_token_id=32000, bos_token_id=1, eos_token_id=32000, tie_word_embeddings=False),
        ),
        Preset(
            name="tiny-phi4",
            model_id="megabake/tiny-phi4",
            architecture="Phi3ForCausalLM",
            description="2-layer Phi-4-mini-like decoder (hidden 256, 4/2 heads x 64): partial rotary (48 of 64 "
                        "features) and long-RoPE factors (original range 128 positions: buckets past it switch "
                        "to the long factors from position 128 on)",
            config=dict(_PHI3, hidden_size=256, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192,
                        original_max_position_embeddings=128, tie_word_embeddings=True,
                        rope_parameters=_long_rope(head_dim=64, partial=0.75, original=128, positions=8192)),
        ),
        Preset(
            name="phi-4-mini",
            model_id="microsoft/Phi-4-mini-instruct",
            architecture="Phi3ForCausalLM",
            description="Phi-4-mini shape: hidden 3072, 32 layers, 24/8 heads x 128, partial rotary (96 of 128), "
                        "long-RoPE (original range 4096; factor values are a placeholder ramp), intermediate "
                        "8192, vocab 200064, tied",
            config=dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
                        num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
                        original_max_position_embeddings=4096, sliding_window=262144, rms_norm_eps=1e-5,
                        pad_token_id=199999, bos_token_id=199999, eos_token_id=199999, tie_word_embeddings=True,
                        rope_parameters=_long_rope(head_dim=128, partial=0.75, original=4096, positions=131072)),
        ),
        Preset(
            name="tiny-olmo2",
            model_id="megabake/tiny-olmo2",
            architecture="Olmo2ForCausalLM",
            description="2-layer OLMo-2 (hidden 256, 2/2 heads x 128: one query head per KV head, as OLMo-2-1B): "
                        "norms after attention and the MLP only, q/k RMSNorm over the whole projection",
            config=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-6,
                        rope_theta=500000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=False),
        ),
        Preset(
            name="olmo-2-1b",
            model_id="allenai/OLMo-2-0425-1B",
            architecture="Olmo2ForCausalLM",
            description="OLMo-2-1B shape: hidden 2048, 16 layers, 16/16 heads x 128, intermediate 8192, vocab 100352, "
                        "post-norms, whole-projection q/k norms",
            config=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                        num_key_value_heads=16, vocab_size=100352, max_position_embeddings=4096, rms_norm_eps=1e-6,
                        rope_theta=500000.0, pad_token_id=100277, bos_token_id=None, eos_token_id=100257,
                        tie_word_embeddings=False),
        ),
        Preset(
            name="tiny-gemma2",
            model_id="megabake/tiny-gemma2",
            architecture="Gemma2ForCausalLM",
            description="2-layer Gemma 2 (hidden 256, 4/2 heads x 64): norms before and after attention and MLP, "
                        "final logit soft-capping, GeGLU tanh, scaled embedding",
            config=dict(
                hidden_activation="gelu_pytorch_tanh",
                rms_norm_eps=1e-6,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                vocab_size=1024,
                max_position_embeddings=4096,
                sliding_window=4096,
                query_pre_attn_scalar=64,
                final_logit_softcapping=3.0,
                rope_theta=10000.0,
                attention_bias=False,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="tiny-gemma3",
            model_id="megabake/tiny-gemma3",
            architecture="Gemma3ForCausalLM",
            description="6-layer Gemma 3 text (hidden 256, 4/2 heads x 64): 5 local layers (sliding window 48, RoPE "
                        "base 10k) and 1 global (base 1M), q/k norms, pre/post norms",
            config=dict(
                _GEMMA3,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=6,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                vocab_size=1024,
                query_pre_attn_scalar=64,
                sliding_window=48,
            ),
        ),
        Preset(
            name="gemma-3-270m",
            model_id="google/gemma-3-270m",
            architecture="Gemma3ForCausalLM",
            description="gemma-3-270m shape: hidden 640, 18 layers (5 local : 1 global), 4/1 heads x 256, "
                        "intermediate 2048, vocab 262144, sliding window 512, RoPE base 10k local / 1M global, tied",
            config=dict(_GEMMA3, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, vocab_size=262144),
        ),
        Preset(
            name="gemma-3-1b",
            model_id="google/gemma-3-1b-pt",
            architecture="Gemma3ForCausalLM",
            description="gemma-3-1b shape: hidden 1152, 26 layers (5 local : 1 global), 4/1 heads x 256, "
                        "intermediate 6912, vocab 262144, sliding window 512, RoPE base 10k local / 1M global, tied",
            config=dict(_GEMMA3, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, vocab_size=262144),
        ),
        Preset(
            name="gemma-2-2b",
            model_id="google/gemma-2-2b",
            architecture="Gemma2ForCausalLM",
            description="gemma-2-2b shape: hidden 2304, 26 layers, 8/4 heads x 256, intermediate 9216 (GeGLU tanh), "
                        "vocab 256000, pre/post norms, final logit soft-capping 30, sliding window 4096 on every other "
                        "layer, tied",
            config=dict(
                hidden_activation="gelu_pytorch_tanh",
                rms_norm_eps=1e-6,
                hidden_size=2304,
                intermediate_size=9216,
                num_hidden_layers=26,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                vocab_size=256000,
                max_position_embeddings=8192,
                sliding_window=4096,
                query_pre_attn_scalar=256,
                final_logit_softcapping=30.0,
                attn_logit_softcapping=50.0,
                rope_theta=10000.0,
                attention_bias=False,
                tie_word_embeddings=True,
            ),
        ),
        Preset(
            name="tiny-granite",
            model_id="megabake/tiny-granite",
            architecture="GraniteForCausalLM",
            description="2-layer Granite (hidden 256, 4/2 heads x 64): Llama with an embedding multiplier (12), "
                        "attention multiplier 1/64 as the softmax scale, residual multiplier 0.22 on the o and down "
                        "outputs and logits divided by 8, tied",
            config=dict(_GRANITE, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, rope_theta=10000.0),
        ),
        Preset(
            name="granite-3.1-2b",
            model_id="ibm-granite/granite-3.1-2b-instruct",
            architecture="GraniteForCausalLM",
            description="granite-3.1-2b shape: hidden 2048, 40 layers, 32/8 heads x 64, intermediate 8192, vocab "
                        "49155, RoPE base 5M, 131072 positions, multipliers (embedding 12, attention 1/64, residual "
                        "0.22, logits / 8), tied",
            config=dict(_GRANITE, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
                        max_position_embeddings=131072, rope_theta=5000000.0),
        ),
    ]
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(
            f"unknown preset {name!r}; built-in presets are: {', '.join(sorted(PRESETS))}. "
            "To bake a Hub model instead, pass its repo id (e.g. HuggingFaceTB/SmolLM-135M) and --revision."
        ) from None


def is_preset(name: str) -> bool:
    return name in PRESETS
