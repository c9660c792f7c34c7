"""Model sources: what ``megabake bake --model`` accepts, loaded as an fp32 eval-mode HF causal LM.

Contract: ``load_source(spec, revision, seed) -> ModelSource`` accepts

* a built-in preset name (random weights from ``seed``; revision ``random-seed<seed>``);
* a Hub repo id, with or without an org (``HuggingFaceTB/SmolLM-135M``, ``gpt2``), at ``revision``
  resolved to a 40-hex commit sha;
* a local model folder (the output of ``save_pretrained``: ``config.json`` + ``*.safetensors`` or
  ``*.bin``);
* a ``.gguf`` file (dequantized by transformers; needs the ``gguf`` package), rebuilt as a plain
  (non-quantized) model of its architecture so it casts like any other; its metadata is parsed once per load
  (``shared_gguf_readers``), not once for the architecture, once for the config and once for the weights.

Local inputs have no commit: they are pinned by ``content_digest`` (sha256 over the weight files' names and
bytes), whose first 16 hex digits form the revision ``sha256-<16 hex>`` used in the package path; the report
records the full digest and the path (``ModelSource.local``). ``load_local(info, path=None)`` loads such a
model again and refuses it when its digest no longer matches. Every failure is a :class:`MegaBakeError`
naming the input and the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import MegaBakeError, network_errors

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
LOCAL_REVISION_PREFIX = "sha256-"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelSource:
    model: torch.nn.Module
    model_id: str
    revision: str
    weights: str  # random | pretrained
    seed: int | None
    preset: str | None
    local: dict | None = None  # {"kind": "folder"|"gguf", "path", "sha256"} for local inputs
    tokenizer_source: dict | None = None  # how to load the tokenizer again (folder / gguf file)


def load_source(spec: str, revision: str | None, seed: int) -> ModelSource:
    """Resolve ``spec`` (module doc) and load its model in fp32."""
    from .presets import get_preset, is_preset

    if is_preset(spec):
        if revision not in (None, "", f"random-seed{seed}"):
            raise MegaBakeError(f"--revision does not apply to the built-in preset {spec!r} (random weights "
                                f"from --seed); drop it or bake a Hub model id")
        preset = get_preset(spec)
        return ModelSource(preset.build_model(seed=seed), preset.model_id, f"random-seed{seed}", "random", seed,
                           spec)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf") or path.is_file():
        _no_revision_for_local(spec, revision)
        return load_gguf(path)
    if path.is_dir() or spec.startswith((".", "/", "~")):
        _no_revision_for_local(spec, revision)
        return load_folder(path)
    return load_hub(spec, revision)


def _no_revision_for_local(spec: str, revision: str | None) -> None:
    if revision:
        raise MegaBakeError(f"--revision does not apply to the local input {spec} (it is pinned by the sha256 of "
                            "its weight files); drop --revision")


# ------------------------------------------------------------------------------------------- Hub


def load_hub(model: str, revision: str | None) -> ModelSource:
    from .package.layout import MODEL_ID_RE
    from .presets import PRESETS

    if not MODEL_ID_RE.match(model):
        raise MegaBakeError(f"{model!r} is neither a built-in preset ({', '.join(sorted(PRESETS))}), a local model "
                            "folder or .gguf file that exists, nor a Hub repo id such as gpt2 or ORG/NAME")
    sha = resolve_hub_revision(model, revision or "main")
    from transformers import AutoModelForCausalLM

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(model, revision=sha, dtype=torch.float32).eval()
    except network_errors() as exc:
        raise MegaBakeError(f"could not load the weights of {model}@{sha[:12]}: {exc}. Check the network, or bake "
                            "offline from a cached snapshot (HF_HUB_OFFLINE=1 and --revision <its commit sha>)") from exc
    return ModelSource(hf_model, model, sha, "pretrained", None, None,
                       tokenizer_source={"kind": "hub", "id": model, "revision": sha})


def resolve_hub_revision(model: str, wanted: str) -> str:
    """The commit sha of ``model`` at ``wanted`` (branch, tag or sha), asked of the Hub; offline
    (``HF_HUB_OFFLINE=1``), a full commit sha is taken as given (the snapshot must be in the HF cache)."""
    import re

    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if constants.HF_HUB_OFFLINE:
        if re.fullmatch(r"[0-9a-f]{40}", wanted):
            return wanted
        raise MegaBakeError(f"HF_HUB_OFFLINE is set, so {model}@{wanted} cannot be resolved: pass --revision "
                            "with the full 40-character commit sha of a snapshot in your HF cache")
    try:
        return HfApi().model_info(model, revision=wanted).sha
    except RevisionNotFoundError:
        raise MegaBakeError(f"revision {wanted!r} does not exist in the Hub repo {model}; pass a branch, tag or "
                            "commit sha that exists (see the repo's 'Files and versions')") from None
    except RepositoryNotFoundError:
        raise MegaBakeError(f"the Hub repo {model} does not exist or needs a token: check the id, or log in "
                            "with `hf auth login` / set HF_TOKEN for gated models") from None
    except (HfHubHTTPError,) + network_errors() as exc:
        raise MegaBakeError(f"could not reach the Hub to resolve {model}@{wanted}: {exc}. Retry with network "
                            "access, bake a built-in preset, or bake offline from a cached snapshot "
                            "(HF_HUB_OFFLINE=1 and --revision <its commit sha>)") from exc


# ----------------------------------------------------------------------------------------- local


def content_digest(files: list[Path]) -> str:
    """sha256 over each weight file's name and bytes, in name order (1 MiB reads)."""
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda f: f.name):
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def local_revision(sha256: str) -> str:
    return f"{LOCAL_REVISION_PREFIX}{sha256[:16]}"


def _local_id(path: Path) -> str:
    import re

    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem if path.is_file() else path.resolve().name).strip("-.")
    return f"local/{stem or 'model'}"


def folder_weight_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin"))


def load_folder(folder: Path) -> ModelSource:
    if not folder.is_dir():
        raise MegaBakeError(f"{folder} is not a folder: pass a model folder written by save_pretrained "
                            "(config.json + *.safetensors), a .gguf file, a preset or a Hub id")
    if not (folder / "config.json").is_file():
        raise MegaBakeError(f"{folder} has no config.json: it is not a Hugging Face model folder (write one with "
                            "model.save_pretrained(folder))")
    files = folder_weight_files(folder)
    if not files:
        raise MegaBakeError(f"{folder} has a config.json but no weight files (*.safetensors or *.bin): save the "
                            "weights with model.save_pretrained(folder)")
    from transformers import AutoModelForCausalLM

    digest = content_digest(files)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise MegaBakeError(f"transformers could not load the model folder {folder}: {exc}") from exc
    local = {"kind": "folder", "path": str(folder.resolve()), "sha256": digest}
    return ModelSource(model, _local_id(folder), local_revision(digest), "pretrained", None, None, local=local,
                       tokenizer_source={"kind": "folder", "path": str(folder.resolve())})


def load_gguf(path: Path) -> ModelSource:
    if not path.is_file():
        raise MegaBakeError(f"the GGUF file {path} does not exist")
    _require_gguf()
    with shared_gguf_readers():
        architecture = gguf_architecture(path)
        if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise MegaBakeError(f"{path.name} holds a {architecture!r} model; MegaBake bakes GGUF files of "
                                f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} architectures")
        digest = content_digest([path])
        model = dequantized_gguf_model(path)
    local = {"kind": "gguf", "path": str(path.resolve()), "sha256": digest}
    return ModelSource(model, _local_id(path), local_revision(digest), "pretrained", None, None, local=local,
                       tokenizer_source={"kind": "gguf", "path": str(path.resolve())})


@contextlib.contextmanager
def shared_gguf_readers():
    """Within this block every ``gguf.GGUFReader(path)`` of one file is the same reader. transformers builds a
    new one for the config, another for the weights and another for the tokenizer, and each parses every metadata
    field: SmolLM2-135M's 49k-token vocabulary and merges take ~8 s per parse on a CPU core (``load_gguf``
    40.4 -> 24.6 s with one reader instead of three, the same weights bit for bit). A reader is not changed after it is built (parsed fields, memory-mapped tensors), so sharing it
    changes nothing else. Likewise ``gguf.get_tensor_name_map(arch, layers)``: transformers' weight loading
    rebuilds that map once per module of the model (~11 ms each, ~4.5 s of SmolLM2-135M's load); it is only read
    after it is built, so one per (arch, layers) is shared. The ``gguf`` module's names are swapped back on exit;
    not for concurrent threads. Without the ``gguf`` package it does nothing (no GGUF file can be read then
    anyway)."""
    import functools
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        yield
        return
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def shared_reader(path, mode: str = "r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (a whole metadata parse: inside ``shared_gguf_readers`` the
    config and weights loads then reuse it)."""
    _require_gguf()
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, OSError) as exc:
        raise MegaBakeError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def dequantized_gguf_model(path: Path):
    """The GGUF's weights dequantized to fp32 in a plain model of its architecture (no quantization flag:
    transformers marks GGUF-loaded models as quantized, which refuses ``.to(dtype)``)."""
    _require_gguf()
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = str(path.parent), path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    plain_config = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise MegaBakeError(f"the weights of {path.name} do not fit its own config (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
    return model.eval()


def _require_gguf() -> None:
    import functools
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise MegaBakeError("reading a .gguf file needs the gguf package: pip install 'megabake[gguf]' "
                            "(or: pip install gguf accelerate)")


def load_local(info: dict, path: str | os.PathLike | None = None) -> torch.nn.Module:
    """Load the local model a report's ``model.local`` names (or the copy at ``path``), digest-checked."""
    where = Path(path or info["path"]).expanduser()
    if not where.exists():
        raise MegaBakeError(f"the package was baked from the local {info['kind']} {info['path']}, which is not on "
                            "this machine: pass its copy (MegakernelDecoder.from_package(..., model_path=PATH) or "
                            "megabake.load_from_hub(..., model_path=PATH))")
    files = [where] if info["kind"] == "gguf" else folder_weight_files(where)
    digest = content_digest(files)
    if digest != info["sha256"]:
        raise MegaBakeError(f"the weights at {where} (sha256 {digest[:16]}) are not the ones the package was baked "
                            f"from (sha256 {info['sha256'][:16]}): the file changed; re-bake it")
    source = load_gguf(where) if info["kind"] == "gguf" else load_folder(where)
    return source.model
