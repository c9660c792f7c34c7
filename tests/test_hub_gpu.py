"""On a Hopper GPU: load_from_hub detects this GPU's class, picks its package among others, and runs it."""

from __future__ import annotations

import pytest
import torch

from megabake.hub import load_from_hub, publish


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a Hopper GPU")]

REPO = "my-org/tiny-llama-megabake"
TOKEN = "hf_fake_token"


def test_load_from_hub_picks_this_gpu_class_and_runs(hub_server, tmp_path):
    from megabake.baking import bake
    from megabake.runtime import gpu_info

    info = gpu_info()
    if info.capability != (9, 0):
        pytest.skip(f"{info.name} is not a Hopper GPU")
    decoy_class = "sm90a-114sm" if info.sm_count != 114 else "sm90a-132sm"
    paths = [bake("tiny-llama", out=tmp_path / "packages", gpu_class=g, run_on_gpu=False).path
             for g in (info.gpu_class, decoy_class)]
    publish(paths, REPO, endpoint=hub_server.url, token=TOKEN, allow_unverified=True, allow_random_weights=True)
    common = dict(endpoint=hub_server.url, token=TOKEN, cache_dir=tmp_path / "cache", allow_unverified=True,
                  trust_remote_code=True)
    gpu = load_from_hub(REPO, "main", device="cuda", **common)
    assert gpu.report["gpu_class"] == info.gpu_class
    cpu = load_from_hub(REPO, "main", device="cpu", gpu_class=info.gpu_class, **common)
    for position, token in enumerate([5, 17, 301]):
        got = gpu.step(torch.tensor([token], device="cuda"), position).float().cpu()
        want = cpu.step(torch.tensor([token]), position).float()
        assert torch.isfinite(got).all()
        assert float((got - want).norm() / want.norm()) < 5e-2
