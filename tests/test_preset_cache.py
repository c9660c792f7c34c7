"""The preset weight cache (``megabake.preset_cache``, ``MEGABAKE_PRESET_CACHE``): a cached build of every
architecture family's tiny preset is the drawn model bit for bit (names, dtypes, values, non-persistent buffers,
tied weights still one tensor, the same logits), a second build reads the file instead of drawing, a bad file is
drawn again and replaced, and the size cap holds."""

from __future__ import annotations

import logging

import pytest
import torch

import megabake.presets
from megabake import preset_cache
from megabake.presets import get_preset
from megabake.registry.models import FAMILIES


@pytest.fixture(autouse=True)
def _no_cache_from_the_environment(monkeypatch):
    """A drawn reference is drawn here, whatever ``MEGABAKE_PRESET_CACHE`` the shell sets (gpu_session.sh does)."""
    monkeypatch.delenv(preset_cache.PRESET_CACHE_ENV, raising=False)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(preset_cache._named_tensors(model))


def _assert_same_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Same tensors and sharing, then the same logits (a forward may re-register rotary buffers, as long RoPE
    does: compare the structure first)."""
    got_tensors, want_tensors = _tensors(got), _tensors(want)
    assert list(got_tensors) == list(want_tensors)
    for name, tensor in want_tensors.items():
        assert got_tensors[name].dtype == tensor.dtype and torch.equal(got_tensors[name], tensor), name
    assert preset_cache._sharing(list(got_tensors.items()))[1] == preset_cache._sharing(list(want_tensors.items()))[1]
    tokens = torch.randint(0, want.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(got(tokens).logits, want(tokens).logits)


TINY_PRESETS = {family.tiny_preset().name: family.tiny_preset() for family in FAMILIES}


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_a_cached_build_is_the_drawn_model(name, tmp_path, monkeypatch):
    preset = TINY_PRESETS[name]
    missed = preset.build_model(seed=5, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and files[0].name.startswith(f"{name}-seed5-")

    def no_draw(*args):
        raise AssertionError("drawn again")

    with monkeypatch.context() as patch:
        patch.setattr(megabake.presets, "_randomize_norm_weights", no_draw)  # a hit reads the file
        hit = preset.build_model(seed=5, cache_dir=tmp_path)
    _assert_same_model(missed, preset.build_model(seed=5))
    _assert_same_model(hit, preset.build_model(seed=5))
    assert not hit.training


def test_tied_weights_stay_one_tensor(tmp_path):
    preset = TINY_PRESETS["family-gemma"]
    assert preset.make_config().tie_word_embeddings
    preset.build_model(cache_dir=tmp_path)
    hit = preset.build_model(cache_dir=tmp_path)
    assert hit.get_output_embeddings().weight is hit.get_input_embeddings().weight


def test_the_environment_turns_it_on_and_other_seeds_get_their_own_file(tmp_path, monkeypatch):
    preset = get_preset("tiny-llama")
    monkeypatch.delenv(preset_cache.PRESET_CACHE_ENV, raising=False)
    preset.build_model()
    assert preset_cache.preset_cache_dir() is None and not list(tmp_path.iterdir())
    monkeypatch.setenv(preset_cache.PRESET_CACHE_ENV, str(tmp_path / "cache"))
    first, second = preset.build_model(seed=0), preset.build_model(seed=1)
    assert len(list((tmp_path / "cache").glob("tiny-llama-seed*.safetensors"))) == 2
    assert not torch.equal(first.lm_head.weight, second.lm_head.weight)
    hit = preset.build_model(seed=1)
    monkeypatch.delenv(preset_cache.PRESET_CACHE_ENV)
    _assert_same_model(hit, preset.build_model(seed=1))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other-model"])
def test_a_bad_file_is_drawn_again_and_replaced(damage, tmp_path, caplog):
    preset = get_preset("tiny-llama")
    drawn = preset.build_model(cache_dir=tmp_path)
    path = next(tmp_path.glob("*.safetensors"))
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a safetensors file")
    else:  # another preset's weights under this one's name
        TINY_PRESETS["family-qwen3"].build_model(cache_dir=tmp_path / "other")
        path.write_bytes(next((tmp_path / "other").glob("*.safetensors")).read_bytes())
    with caplog.at_level(logging.WARNING, logger="megabake.preset_cache"):
        rebuilt = preset.build_model(cache_dir=tmp_path)
    assert "drawing the weights again" in caplog.text
    _assert_same_model(rebuilt, drawn)
    _assert_same_model(preset.build_model(cache_dir=tmp_path), preset.build_model())  # replaced by a good file
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_size_cap_evicts_the_least_recently_used_and_skips_what_cannot_fit(tmp_path, monkeypatch):
    preset = get_preset("tiny-llama")
    preset.build_model(seed=0, cache_dir=tmp_path)
    one = next(tmp_path.glob("*.safetensors")).stat().st_size
    monkeypatch.setenv(preset_cache.PRESET_CACHE_GB_ENV, str(1.5 * one / 2**30))  # room for one file
    preset.build_model(seed=1, cache_dir=tmp_path)
    assert [f.name.split("-seed")[1][0] for f in tmp_path.glob("*.safetensors")] == ["1"]
    monkeypatch.setenv(preset_cache.PRESET_CACHE_GB_ENV, str(0.5 * one / 2**30))  # room for none
    preset.build_model(seed=2, cache_dir=tmp_path)
    assert not list(tmp_path.glob("*seed2*"))


def test_a_killed_write_leaves_no_entry_and_its_temporary_file_goes_once_stale(tmp_path):
    import os
    import time

    preset = get_preset("tiny-llama")
    killed, fresh = tmp_path / ".tiny-llama-seed0-x.safetensors.abc.tmp", tmp_path / ".other.safetensors.def.tmp"
    for path in (killed, fresh):
        path.write_bytes(b"half a file")
    old = time.time() - preset_cache.STALE_WRITE_SECONDS - 5
    os.utime(killed, (old, old))
    preset.build_model(cache_dir=tmp_path)
    assert not killed.exists() and fresh.exists()  # another process may still be writing the fresh one
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
