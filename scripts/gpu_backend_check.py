"""Quick H200 check of megabake.make_backend() against decoder.generate (tiny-llama preset, bf16, batch 1).

Usage (on the H200 after ``source .cute/activate.sh``): ``python3 scripts/gpu_backend_check.py``. Prints whether the
torch.compile backend's greedy tokens equal the megakernel's own ``generate`` and the backend's summary.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from transformers import StaticCache

    from megabake.integrations import bake_decoder, make_backend
    from megabake.presets import get_preset
    from megabake.rope import cast_model

    model = cast_model(get_preset("tiny-llama").build_model(seed=0), device="cuda", dtype=torch.bfloat16).eval()
    prompt = torch.randint(1, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3)).cuda()
    decoder = bake_decoder(model, batch=1, capacity=64)
    own = decoder.generate(prompt, max_new_tokens=24)[0].tolist()
    backend = make_backend(other="eager")
    backend.prepare(model, batch=1, cache_length=64)
    model.compile(backend=backend, fullgraph=True)
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=24, do_sample=False, disable_compile=True,
                             past_key_values=StaticCache(config=model.config, max_cache_len=64))[0].tolist()
    print("backend tokens equal decoder.generate:", got[:len(own)] == own)
    print(backend.summary())


if __name__ == "__main__":
    main()
