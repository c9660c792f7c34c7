"""An on-disk cache of the random weights a built-in preset draws, so a second build of the same preset skips the
draw (a single-threaded RNG: gemma-2b's 2.5B fp32 weights took 60 s on the H100 machine's CPU, once per device
call that benched or tuned it).

Contract: ``cached_preset_model(name, seed, config, model_cls, draw, cache_dir)`` returns the model ``draw()``
builds, bit for bit: the same parameter and buffer names, dtypes and values (non-persistent buffers such as
rotary tables included) and the same sharing (tied weights stay one tensor). With ``cache_dir`` None it is just
``draw()``. Otherwise a hit rebuilds the module tree on the meta device and fills it from
``<cache_dir>/<preset>-seed<seed>-<key>.safetensors``, the key hashing the config and the torch and transformers
versions (their init code draws the weights); a miss draws, then writes the file atomically (a temporary file
renamed into place: an interrupted write leaves no entry). A file that does not fit the model (corrupt,
truncated, other names or shapes) is logged, removed and drawn again. ``MEGABAKE_PRESET_CACHE_GB`` (default
24) caps the folder: the least recently used files go first, and a model larger than the cap is not cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

PRESET_CACHE_ENV = "MEGABAKE_PRESET_CACHE"  # a folder: set it to cache preset weights there (off when unset)
PRESET_CACHE_GB_ENV = "MEGABAKE_PRESET_CACHE_GB"
DEFAULT_CACHE_GB = 24.0
_ALIASES_KEY = "megabake_aliases"  # safetensors metadata: {alias name: stored name} for shared tensors

log = logging.getLogger(__name__)


def preset_cache_dir() -> Path | None:
    """The folder ``MEGABAKE_PRESET_CACHE`` names, or None (no caching)."""
    value = os.environ.get(PRESET_CACHE_ENV, "").strip()
    return Path(value).expanduser() if value else None


def cache_file(cache_dir: Path, name: str, seed: int, config) -> Path:
    """Where the weights of preset ``name`` drawn from ``seed`` live: keyed by the config (its JSON) and the
    torch and transformers versions whose init code drew them."""
    import transformers

    text = json.dumps({"config": config.to_json_string(use_diff=False), "torch": torch.__version__,
                       "transformers": transformers.__version__}, sort_keys=True)
    return cache_dir / f"{name}-seed{seed}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.safetensors"


def cached_preset_model(name: str, seed: int, config, model_cls, draw: Callable[[], torch.nn.Module],
                        cache_dir: Path | None) -> torch.nn.Module:
    """``draw()``'s model, from the cache where it holds it (module doc)."""
    if cache_dir is None:
        return draw()
    path = cache_file(cache_dir, name, seed, config)
    if path.exists():
        try:
            model = _load(path, config, model_cls)
            os.utime(path)  # least recently used goes first
            return model
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is drawn again, never trusted
            log.warning("preset cache: %s does not fit %s (%s: %s); drawing the weights again", path, name,
                        type(exc).__name__, exc)
            path.unlink(missing_ok=True)
    model = draw()
    try:
        _store(path, model)
    except OSError as exc:
        log.warning("preset cache: could not write %s (%s); the weights were drawn and are used", path, exc)
    return model


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (non-persistent ones too) by name, shared ones under each of their names."""
    return (list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False)))


def _sharing(named: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(first name -> tensor, alias name -> first name) by tensor identity."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_by_id: dict[int, str] = {}
    for name, tensor in named:
        first = first_by_id.setdefault(id(tensor), name)
        if first == name:
            stored[name] = tensor
        else:
            aliases[name] = first
    return stored, aliases


def _store(path: Path, model: torch.nn.Module) -> None:
    from safetensors.torch import save_file

    stored, aliases = _sharing(_named_tensors(model))
    size = sum(t.numel() * t.element_size() for t in stored.values())
    cap = float(os.environ.get(PRESET_CACHE_GB_ENV, DEFAULT_CACHE_GB)) * 2**30
    if size > cap:
        log.info("preset cache: %s is %.1f GB, over the %.1f GB cap (%s): not cached", path.name, size / 2**30,
                 cap / 2**30, PRESET_CACHE_GB_ENV)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _evict(path.parent, cap - size)
    tensors = {name: t.detach().contiguous() for name, t in stored.items()}
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata={_ALIASES_KEY: json.dumps(aliases)})
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)


STALE_WRITE_SECONDS = 3600  # a temporary file this old is a write that was killed (a device call's time limit)


def _evict(folder: Path, room: float) -> None:
    """Remove the least recently used cache files until the rest take at most ``room`` bytes, and temporary files
    of writes that were killed."""
    now = time.time()
    for stale in folder.glob(".*.tmp"):
        if now - stale.stat().st_mtime > STALE_WRITE_SECONDS:
            stale.unlink(missing_ok=True)
    files = sorted(folder.glob("*.safetensors"), key=lambda f: f.stat().st_mtime, reverse=True)
    total = 0
    for file in files:
        total += file.stat().st_size
        if total > room:
            file.unlink(missing_ok=True)


def _load(path: Path, config, model_cls) -> torch.nn.Module:
    """The module tree built on the meta device, moved to empty CPU storage, filled from ``path`` and re-tied as
    the file records; refused (ValueError) where the names, shapes, dtypes or sharing differ."""
    from safetensors import safe_open

    with torch.device("meta"):
        model = model_cls(config)
    want_stored, want_aliases = _sharing(_named_tensors(model))  # the sharing the module tree sets up
    model = model.to_empty(device="cpu")
    with safe_open(str(path), framework="pt") as file:
        aliases = json.loads(file.metadata()[_ALIASES_KEY])
        if set(file.keys()) != set(want_stored) or aliases != want_aliases:
            raise ValueError("other tensor names or sharing than the model's")
        named = dict(_named_tensors(model))
        with torch.no_grad():
            for name in want_stored:
                tensor, target = file.get_tensor(name), named[name]
                if tensor.shape != target.shape or tensor.dtype != target.dtype:
                    raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} in the file, "
                                     f"{tuple(target.shape)} {target.dtype} in the model")
                target.copy_(tensor)
    for alias, first in aliases.items():  # to_empty may give each module its own tensor: share them again
        _retie(model, alias, named[first])
    if _sharing(_named_tensors(model))[1] != aliases:
        raise ValueError("the tied tensors could not be shared again")
    return model


def _retie(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = tensor
    else:
        owner._buffers[leaf] = tensor
