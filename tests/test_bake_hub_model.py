"""Baking a Hub model id at a revision (served by the local Hub server): the revision resolves to a commit sha
that names the package and is recorded in the report; weights are the pretrained ones, not random."""

from __future__ import annotations

import pytest
import torch

from megabake.baking import bake
from megabake.errors import MegaBakeError
from megabake.package import read_package
from megabake.presets import get_preset


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _upload_tiny_model(hub_server, tmp_path, repo: str) -> tuple[str, torch.nn.Module]:
    model = get_preset("tiny-llama").build_model(seed=7)
    model.save_pretrained(tmp_path / "src")
    files = {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir() if p.is_file()}
    return hub_server.commit_files(repo, files, message="upload tiny llama"), model


def test_bake_hub_model_pins_the_resolved_revision(hub_env, hub_cache, tmp_path):
    sha, model = _upload_tiny_model(hub_env, tmp_path, "acme/tiny-llama")
    result = bake("acme/tiny-llama", revision="main", out=tmp_path / "packages", run_on_gpu=False)
    report = result.report
    assert report["model"]["id"] == "acme/tiny-llama"
    assert report["model"]["revision"] == sha and len(sha) == 40
    assert report["model"]["weights"] == "pretrained" and report["model"]["preset"] is None
    assert result.path == tmp_path / "packages" / "acme--tiny-llama" / sha / f"decode-b1-c128-sm90a-132sm-p{result.plan_hash[:8]}"
    assert report["reference_check"]["ok"] and report["kernel"]["compile_check"]["ok"]
    assert any(hub_cache.rglob("model.safetensors")), "weights must come through the HF cache"
    read_package(result.path)

    # The package binds the same pretrained weights when rebuilt from its report (pinned sha).
    from megabake.runtime import MegakernelDecoder

    decoder = MegakernelDecoder.from_package(result.path, device="cpu")
    original = model.model.embed_tokens.weight
    assert torch.equal(decoder.model.get_parameter("model.embed_tokens.weight"), original)


def test_bake_unknown_hub_revision_is_a_clear_error(hub_env, hub_cache, tmp_path):
    _upload_tiny_model(hub_env, tmp_path, "acme/tiny-llama")
    with pytest.raises(MegaBakeError, match="revision 'no-such-branch' does not exist in the Hub repo"):
        bake("acme/tiny-llama", revision="no-such-branch", out=tmp_path / "packages", run_on_gpu=False)
    with pytest.raises(MegaBakeError, match="does not exist or needs a token"):
        bake("acme/missing", out=tmp_path / "packages", run_on_gpu=False)
    assert not (tmp_path / "packages").exists()


def test_preset_with_revision_is_refused(tmp_path):
    with pytest.raises(MegaBakeError, match="--revision does not apply"):
        bake("tiny-llama", revision="main", out=tmp_path, run_on_gpu=False)


def test_unreachable_hub_is_a_clear_error(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(MegaBakeError, match=r"could not reach the Hub to resolve acme/tiny-llama@main.*HF_HUB_OFFLINE"):
        bake("acme/tiny-llama", out=tmp_path / "packages", run_on_gpu=False)
    assert not (tmp_path / "packages").exists()


def test_offline_bake_from_the_cache_needs_a_commit_sha(hub_env, hub_cache, tmp_path, monkeypatch):
    from huggingface_hub import constants

    sha, _ = _upload_tiny_model(hub_env, tmp_path, "acme/tiny-llama")
    bake("acme/tiny-llama", revision="main", out=tmp_path / "online", run_on_gpu=False)  # fills the cache
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # and prove no request is made
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MegaBakeError, match="full 40-character commit sha"):
        bake("acme/tiny-llama", revision="main", out=tmp_path / "offline", run_on_gpu=False)
    result = bake("acme/tiny-llama", revision=sha, out=tmp_path / "offline", run_on_gpu=False)
    assert result.report["model"]["revision"] == sha and result.report["reference_check"]["ok"]
