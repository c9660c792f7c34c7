"""The ``megabake run`` click command: generate with a decode package, the text streamed to stdout.

Contract: ``megabake run PACKAGE|REPO (--prompt TEXT [--chat] | --prompt-ids 1,2,3) [--max-new-tokens N] ...``
(``run_command``, registered in ``megabake/cli.py``)

* loads PACKAGE, a local package folder (``MegakernelDecoder.from_package``, digests checked first), or the
  best package of the Hub repo REPO at ``--revision`` (``megabake.hub.load_from_hub``: batch 1, the smallest
  KV capacity >= ``--capacity``, this GPU's class);
* runs on ``--device`` (default: the megakernel on a Hopper GPU, else the plan's CPU reference executor);
  stderr says which backend;
* tokenizes ``--prompt`` with the model's own tokenizer: the Hub model at the package's pinned revision, or
  the local folder / .gguf file it was baked from (at ``--model-path`` if it moved). ``--chat`` wraps the
  prompt as one user message in the tokenizer's chat template, with the generation prompt. The built-in
  presets (random weights) have no tokenizer: they take ``--prompt-ids`` and stdout gets token ids;
* generates with ``MegakernelDecoder.generate`` (greedy or sampled, EOS and ``--stop`` strings), streaming
  the new text (or ids) to stdout as each token is made, flushed; then stderr gets the prefill time, the
  number of new tokens, the decode ms/token and tokens/s, the backend and why it stopped (eos,
  max_new_tokens, stop_string). stdout holds only the generated text.

Exit codes (``megabake.errors``): 0 generated; 1 the work could not be done (package files that do not match
manifest.json, a model or Hub that could not be loaded, Hub code not trusted); 2 bad input, found before
generating (not a package folder nor a Hub repo id, no tokenizer for ``--prompt``, no chat template for
``--chat``, an option out of range, a prompt that does not fit the KV capacity, a token id outside the
vocabulary); 3 cannot run here (``--device cuda`` without a Hopper GPU, a GPU the plan does not fit, a missing
dependency). Errors print ``error: <message>`` on stderr, never a traceback. Heavy imports happen inside.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from megabake.errors import (HUB_REPO_ID_RE, DeviceError, InputError, MegaBakeError, MissingDependencyError,
                             check_endpoint, check_repo_id, exit_codes_help, reports_errors)

MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes (same bound as `megabake bake --seed`)
MAX_CAPACITY = 1 << 20
MAX_TOP_K = 1 << 24
MAX_TEMPERATURE = 100.0
DEFAULT_NEW_TOKENS = 256  # without --max-new-tokens: this many, or fewer when the KV capacity is smaller
EXAMPLE_IDS = "--prompt-ids 1,2,3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model")
TOKENIZER_PATTERNS = ["tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                      "chat_template*", "spiece.model", "*.tiktoken", "config.json"]
PACKAGE_FIX = ("fix: pass a package folder packages/<org>--<model>/<rev>/<variant>/ written by `megabake bake` "
               "(`megabake ls` lists them) or a Hub repo id ORG/NAME that holds published packages")

RUN_EXIT_CODES = exit_codes_help(
    ok="generated: the new text (or, with --prompt-ids, the new token ids) on stdout; prefill time, ms/token "
       "and tokens/s on stderr",
    failed="the work could not be done: package files that do not match manifest.json, a model or Hub that "
           "could not be loaded, Hub code not trusted (--trust-remote-code or a pinned --revision)",
    usage="usage or bad input, before generating: not a package folder nor a Hub repo id, no tokenizer for "
          "--prompt (use --prompt-ids), no chat template for --chat, an option out of range, a prompt that does "
          "not fit the KV capacity, a token id outside the vocabulary",
    cannot_run="cannot run here: --device cuda without a Hopper GPU, a GPU the plan does not fit, a missing "
               "dependency")


@dataclass(frozen=True)
class HubOptions:
    """Where a Hub repo's package comes from (only for REPO, not for a local package folder)."""

    revision: str | None
    capacity: int | None
    allow_unverified: bool
    trust_remote_code: bool
    endpoint: str | None
    token: str | None

    def given(self) -> list[str]:
        """The REPO-only options the user set (the envvar-backed --endpoint / --token are not counted)."""
        flags = (("--revision", self.revision is not None), ("--capacity", self.capacity is not None),
                 ("--allow-unverified", self.allow_unverified), ("--trust-remote-code", self.trust_remote_code))
        return [name for name, set_ in flags if set_]


@dataclass
class Target:
    """The package to run: its report; ``decoder`` once bound (a Hub package comes bound)."""

    name: str  # PACKAGE as the user typed it
    report: dict
    path: Path | None = None
    decoder: Any = None

    @property
    def model(self) -> dict:
        return self.report["model"]

    @property
    def capacity(self) -> int:
        return self.report["bucket"]["capacity"]

    def vocab(self) -> int:
        """The model's vocabulary size (from plan.json until the decoder is bound)."""
        if self.decoder is not None:
            return self.decoder.vocab_size
        return read_plan(self.path, self.name).dims.vocab


@click.command("run", epilog=RUN_EXIT_CODES)
@click.argument("package", metavar="PACKAGE|REPO")
@click.option("--prompt", default=None, help="Text to continue, tokenized with the model's own tokenizer.")
@click.option("--prompt-ids", default=None, metavar="ID,ID,...",
              help="Comma-separated token ids instead of --prompt, e.g. 1,2,3 (for models without a tokenizer, "
                   "such as the built-in presets); stdout then gets the new token ids.")
@click.option("--chat", is_flag=True, help="Send --prompt as one user message through the tokenizer's chat "
                                           "template, with the assistant's generation prompt.")
@click.option("--max-new-tokens", default=None, type=click.IntRange(1, MAX_CAPACITY),
              help=f"At most N new tokens, 1..{MAX_CAPACITY} (default {DEFAULT_NEW_TOKENS}, or what the KV "
                   "capacity leaves after the prompt); prompt + N must fit the capacity.")
@click.option("--stop", multiple=True, metavar="TEXT",
              help="Stop once the new text contains TEXT (repeatable; text prompts only).")
@click.option("--do-sample/--greedy", "do_sample", default=None,
              help="Sample, or pick the most likely token (default: the model's generation_config; greedy "
                   "when it says nothing).")
@click.option("--temperature", default=None, type=click.FloatRange(0, MAX_TEMPERATURE, min_open=True),
              help=f"Sampling temperature, (0, {MAX_TEMPERATURE:g}] (with --do-sample).")
@click.option("--top-k", default=None, type=click.IntRange(0, MAX_TOP_K),
              help="Sample among the k most likely tokens; 0 keeps all (with --do-sample).")
@click.option("--top-p", default=None, type=click.FloatRange(0, 1, min_open=True),
              help="Nucleus sampling: the smallest set of tokens reaching probability p, (0, 1] (with --do-sample).")
@click.option("--seed", default=None, type=click.IntRange(0, MAX_SEED),
              help="Seed of the sampler, 0..2**63-1: the same seed gives the same tokens (with --do-sample).")
@click.option("--device", default="auto", show_default=True,
              help="auto (the megakernel on a Hopper GPU, else the CPU reference executor), cpu, cuda or cuda:N.")
@click.option("--model-path", default=None, type=click.Path(exists=True, path_type=Path),
              help="Where the local model folder or .gguf file the package (a folder, or REPO's) was baked from "
                   "lies on this machine, when it is not where it was baked (its weights must still match the "
                   "package's sha256); its tokenizer is read there too.")
@click.option("--revision", default=None, help="REPO only: branch, tag or commit to load (default main). A "
                                               "40-hex commit is trusted without --trust-remote-code.")
@click.option("--capacity", default=None, type=click.IntRange(2, MAX_CAPACITY),
              help="REPO only: load the package with the smallest KV capacity >= N (default: the smallest).")
@click.option("--allow-unverified", is_flag=True, help="REPO only: also load packages whose status is "
                                                       "'unverified'.")
@click.option("--trust-remote-code", is_flag=True, help="REPO only: import the package's generated module.py "
                                                        "from a movable --revision (branch or tag).")
@click.option("--endpoint", envvar="HF_ENDPOINT", metavar="URL", help="Hub endpoint [env HF_ENDPOINT].")
@click.option("--token", envvar="HF_TOKEN", metavar="TOKEN", help="Hub token [env HF_TOKEN; default: saved login].")
@reports_errors
def run_command(package, prompt, prompt_ids, chat, max_new_tokens, stop, do_sample, temperature, top_k, top_p,
                seed, device, model_path, revision, capacity, allow_unverified, trust_remote_code, endpoint, token):
    """Generate with PACKAGE (a local package folder) or REPO (a Hub repo of published packages): the new
    text streams to stdout as it is made; prefill time, ms/token and tokens/s go to stderr at the end.

    \b
    Examples:
      megabake run packages/local--SmolLM2-135M-Instruct.Q4_1/sha256-<16 hex>/decode-b1-c2048-sm90a-132sm \\
          --prompt "What is the capital of France?" --chat --max-new-tokens 32
      megabake run my-org/SmolLM-135M-megabake --revision main --trust-remote-code --prompt "Once upon a time"
      megabake run packages/megabake--tiny-llama/random-seed0/decode-b1-c128-sm90a-132sm --prompt-ids 1,2,3
    """
    from megabake.sources import shared_gguf_readers

    hub = HubOptions(revision, capacity, allow_unverified, trust_remote_code, endpoint, token)
    ids = check_prompt_options(prompt, prompt_ids, chat, stop)
    sampling = sampling_settings(do_sample, temperature, top_k, top_p, seed)
    asked, device = device, resolve_device(device)
    target = open_target(package, hub, device, model_path)
    tokenizer = None
    with shared_gguf_readers():  # a package baked from a .gguf file: one parse for its tokenizer and weights
        if ids is None:
            tokenizer = load_tokenizer(target, hub, model_path, chat)
            ids = encode_prompt(tokenizer, prompt, chat, target)
        new_tokens = fit_new_tokens(len(ids), max_new_tokens, target)
        check_ids(ids, target)
        click.echo(f"[megabake] {backend_note(device, asked)}", err=True)
        decoder = bind(target, device, model_path)
    generation = generate(decoder, ids, new_tokens, tokenizer, stop, sampling)
    echo_stats(generation, decoder.backend)


# ------------------------------------------------------------------------------------------ option checks


def check_prompt_options(prompt: str | None, prompt_ids: str | None, chat: bool, stop) -> list[int] | None:
    """Exactly one of --prompt / --prompt-ids; the parsed ids of --prompt-ids (None for a text prompt)."""
    if (prompt is None) == (prompt_ids is None):
        raise InputError("pass exactly one of --prompt TEXT (tokenized with the model's tokenizer) and --prompt-ids "
                         "ID,ID,... (token ids, for models without a tokenizer), e.g. --prompt 'Hello' or "
                         f"{EXAMPLE_IDS}")
    if any(not text for text in stop):
        raise InputError("--stop '' is empty: pass the text that ends the generation, e.g. --stop '.'")
    if prompt is not None:
        if not prompt.strip():
            raise InputError("--prompt is empty: pass the text to continue")
        return None
    if chat or stop:
        option = "--chat" if chat else "--stop"
        raise InputError(f"{option} works on text and --prompt-ids are token ids (the output is token ids too): "
                         f"drop {option}, or pass --prompt TEXT")
    return parse_ids(prompt_ids)


def parse_ids(text: str) -> list[int]:
    """``"1, 2,3"`` -> [1, 2, 3]; InputError naming the bad item."""
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if not re.fullmatch(r"-?[0-9]+", item):
            raise InputError(f"--prompt-ids {text!r}: {item!r} is not a token id; pass comma-separated integers, "
                             f"e.g. {EXAMPLE_IDS}")
    return [int(item) for item in items]


def sampling_settings(do_sample, temperature, top_k, top_p, seed) -> dict:
    """The sampling settings for ``generate`` (None: the model's generation_config decides)."""
    given = {"--temperature": temperature, "--top-k": top_k, "--top-p": top_p, "--seed": seed}
    shaping = [name for name, value in given.items() if value is not None]
    if shaping and do_sample is not True:
        one = len(shaping) == 1
        raise InputError(f"{', '.join(shaping)} appl{'ies' if one else 'y'} only when sampling: add --do-sample, or "
                         f"drop {'it' if one else 'them'} for greedy decoding")
    return dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` on a Hopper GPU, else ``cpu``; an explicit CUDA device must be a Hopper (exit 3)."""
    from megabake.runtime import gpu_info

    if device == "auto":
        info = gpu_info()
        return "cuda" if info is not None and info.capability == (9, 0) else "cpu"
    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:[0-9]+)?", device):
        raise InputError(f"--device {device!r} is not auto, cpu, cuda or cuda:N (e.g. cuda:0)")
    try:
        info = gpu_info(device)
    except (RuntimeError, AssertionError, ValueError) as exc:  # e.g. a device index this machine lacks
        raise DeviceError(f"--device {device}: {first_line(exc)}. fix: pass a CUDA device this machine has, or "
                          "--device cpu") from None
    if info is None or info.capability != (9, 0):
        found = ("no CUDA GPU is visible" if info is None else
                 f"{info.name} has compute capability {info.capability[0]}.{info.capability[1]}")
        raise DeviceError(f"--device {device}: {found}, and the megakernel needs a Hopper (SM90) GPU such as the "
                          "H100/H200. fix: pass --device cpu to run the plan's CPU reference executor, or run on an "
                          "H100/H200")
    return device


def backend_note(device: str, asked: str) -> str:
    if device == "cpu":
        why = "--device cpu" if asked == "cpu" else "no Hopper GPU here"
        return f"backend: reference (the plan's CPU reference executor, not the megakernel: {why})"
    from megabake.runtime import gpu_info

    return f"backend: cuda (one megakernel launch per token on {gpu_info(device).name}, {device})"


# --------------------------------------------------------------------------------------------- the package


def open_target(name: str, hub: HubOptions, device: str, model_path: Path | None) -> Target:
    """A local package folder (checked, not yet bound) or a Hub repo's best package (bound)."""
    if not name.strip():
        raise InputError(f"PACKAGE is empty. {PACKAGE_FIX}")
    if is_local(name):
        given = hub.given()
        if given:
            one = len(given) == 1
            raise InputError(f"{', '.join(given)} select{'s' if one else ''} a package of a Hub repo, and {name} is "
                             f"a local package folder: drop {'it' if one else 'them'}")
        target = open_local(name)
    else:
        target = open_hub(name, hub, device, model_path)
    check_target(target, model_path)
    return target


def is_local(name: str) -> bool:
    """A path that exists, or one written as a path (./, /, ~), or anything that is not ORG/NAME."""
    path = Path(name).expanduser()
    try:
        exists = path.exists()
    except OSError:  # e.g. a name too long for the file system
        exists = False
    return exists or name.startswith((".", "/", "~")) or not HUB_REPO_ID_RE.match(name)


def open_local(name: str) -> Target:
    from megabake.package import read_package

    path = Path(name).expanduser()
    if not path.exists():
        raise InputError(f"{name}: no such package folder, and not a Hub repo id of the form ORG/NAME. {PACKAGE_FIX}")
    if path.is_file():
        raise InputError(f"{name} is a file, not a package folder. {PACKAGE_FIX}; bake a model file first with "
                         "`megabake bake --model FILE`")
    if not (path / "manifest.json").is_file():
        raise InputError(f"{name} is not a package folder: manifest.json is missing. {PACKAGE_FIX}")
    package = read_package(path)  # digests and schemas: a mismatch exits 1
    return Target(name, package.report, path=path)


def read_plan(path: Path, name: str):
    from megabake.plan import Plan

    try:
        return Plan.from_json((path / "plan.json").read_text())
    except (KeyError, TypeError, ValueError) as exc:
        raise MegaBakeError(f"{name}/plan.json is not a MegaBake plan ({type(exc).__name__}: {exc}). fix: re-bake "
                            "the package with `megabake bake`") from None


def open_hub(repo: str, hub: HubOptions, device: str, model_path: Path | None) -> Target:
    """The repo's best package, bound (its model read from ``model_path`` when it was baked from local weights)."""
    from megabake.hub import load_from_hub

    check_repo_id(repo, "REPO")
    if hub.endpoint:
        check_endpoint(hub.endpoint)
    try:
        decoder = load_from_hub(repo, hub.revision or "main", bucket=hub.capacity, device=device,
                                trust_remote_code=hub.trust_remote_code, allow_unverified=hub.allow_unverified,
                                endpoint=hub.endpoint, token=hub.token, model_path=model_path)
    except MegaBakeError as exc:
        raise with_cli_words(exc) from None
    return Target(repo, decoder.report, decoder=decoder)


_CLI_WORDS = ((r"\btrust_remote_code=True\b", "--trust-remote-code"),
              (r"\ballow_unverified=True\b", "--allow-unverified"),
              (r"\brevision='([0-9a-f]{40})'", r"--revision \1"),
              (r"\(MegakernelDecoder\.from_package\(\.\.\., model_path=PATH\) or megabake\.load_from_hub\(\.\.\., "
               r"model_path=PATH\)\)", "with --model-path PATH"),
              (r"\bmodel_path\b", "--model-path"))


def with_cli_words(exc: MegaBakeError) -> MegaBakeError:
    """The Hub layer's (or the model loader's) message with its Python keyword arguments named as this command's
    options."""
    message = str(exc)
    for pattern, replacement in _CLI_WORDS:
        message = re.sub(pattern, replacement, message)
    exc.args = (message, *exc.args[1:])
    return exc


def check_target(target: Target, model_path: Path | None) -> None:
    if model_path is not None and not target.model.get("local"):
        raise InputError(f"--model-path applies to packages baked from a local model folder or .gguf file, and "
                         f"{target.name} was baked from {target.model['id']}@{target.model['revision']}: drop "
                         "--model-path")
    batch = target.report["bucket"]["batch"]
    if batch != 1:
        raise InputError(f"{target.name} is a batch-{batch} bucket and `megabake run` generates one "
                         "sequence. fix: run a batch-1 package (megabake bake --batch 1)")


def bind(target: Target, device: str, model_path: Path | None):
    """The target's decoder: a local package is bound to its model now (the slow part)."""
    if target.decoder is not None:
        return target.decoder
    from megabake.runtime import MegakernelDecoder

    try:
        return MegakernelDecoder.from_package(target.path, device=device, model_path=model_path)
    except (KeyError, ValueError, RuntimeError) as exc:  # transformers / torch refusing the model
        raise MegaBakeError(f"could not load the model of {target.name} ({target.model['id']}@"
                            f"{target.model['revision']}): {type(exc).__name__}: {first_line(exc)}") from None


# ------------------------------------------------------------------------------------------- the tokenizer


def load_tokenizer(target: Target, hub: HubOptions, model_path: Path | None, chat: bool):
    """The tokenizer of the package's model: its local folder / .gguf file, or its Hub repo at the pinned
    revision. A preset (random weights) has none: InputError naming --prompt-ids."""
    from megabake.presets import is_preset

    model = target.model
    if model.get("local"):
        return local_tokenizer(model["local"], target.name, model_path, chat)
    if model.get("preset") and is_preset(model["preset"]):
        raise no_tokenizer(f"{target.name} holds the built-in preset {model['preset']!r} (random weights), which "
                           "has no tokenizer", chat)
    folder = hub_tokenizer_folder(model["id"], model["revision"], hub)
    where = f"the Hub model {model['id']}@{model['revision'][:12]}"
    require_tokenizer_files(folder, where, chat)
    return from_pretrained(folder, where, chat)


def no_tokenizer(cause: str, chat: bool, fix: str = "") -> InputError:
    drop = " and drop --chat" if chat else ""
    return InputError(f"{cause}, so the --prompt text cannot be tokenized. fix: {fix}pass token ids with "
                      f"--prompt-ids instead of --prompt{drop}, e.g. {EXAMPLE_IDS}")


def local_tokenizer(local: dict, name: str, model_path: Path | None, chat: bool):
    """From the folder or .gguf file the package was baked from (or its copy at --model-path)."""
    what = "GGUF file" if local["kind"] == "gguf" else "model folder"
    where = Path(model_path or local["path"]).expanduser()
    if not where.exists():
        raise InputError(f"{name} was baked from the local {what} {local['path']}, which is not on this machine "
                         f"(its weights and tokenizer are read from there). fix: pass its copy with --model-path PATH")
    if local["kind"] == "gguf":
        return from_pretrained(where.parent, f"the GGUF file {where}", chat, gguf_file=where.name)
    require_tokenizer_files(where, f"the model folder {where}", chat,
                            "save the model's tokenizer into that folder (tokenizer.save_pretrained(folder)), or ")
    return from_pretrained(where, f"the model folder {where}", chat)


def hub_tokenizer_folder(model_id: str, revision: str, hub: HubOptions) -> Path:
    """The tokenizer files of a Hub model at its pinned revision, in the HF cache (offline: from the cache)."""
    from huggingface_hub import snapshot_download

    from megabake.hub.errors import hub_io

    with hub_io(f"downloading the tokenizer of {model_id}@{revision[:12]}", "Nothing was generated.", hub.endpoint):
        return Path(snapshot_download(model_id, revision=revision, allow_patterns=TOKENIZER_PATTERNS,
                                      endpoint=hub.endpoint, token=hub.token, library_name="megabake"))


def require_tokenizer_files(folder: Path, where: str, chat: bool, fix: str = "") -> None:
    if any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return
    raise no_tokenizer(f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})", chat, fix)


def from_pretrained(folder: Path, where: str, chat: bool, **kwargs):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), **kwargs)
    except ImportError as exc:
        raise MissingDependencyError(f"loading the tokenizer of {where} needs a missing package ({exc}). fix: "
                                     "pip install 'megabake[gguf]' (or: pip install gguf sentencepiece)") from None
    except Exception as exc:  # transformers' errors are ValueError / OSError / KeyError / ...: name the cause
        raise no_tokenizer(f"transformers could not load the tokenizer of {where} ({type(exc).__name__}: "
                           f"{first_line(exc)})", chat) from None


def encode_prompt(tokenizer, prompt: str, chat: bool, target: Target) -> list[int]:
    """--prompt as token ids: plain (with the tokenizer's special tokens, e.g. BOS), or through the chat
    template with the generation prompt (the template writes the special tokens itself)."""
    if not chat:
        ids = tokenizer.encode(prompt)
    elif not getattr(tokenizer, "chat_template", None):
        raise InputError(f"--chat applies the tokenizer's chat template, and the tokenizer of {target.model['id']} "
                         "has none. fix: drop --chat to send --prompt as plain text, or run a chat (instruct) model")
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InputError("--prompt gives no tokens: pass some text to continue")
    return [int(i) for i in ids]


# ------------------------------------------------------------------------------------------- generation


def check_ids(ids: list[int], target: Target) -> None:
    vocab = target.vocab()
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}) of {target.name}: pass "
                         f"ids 0..{vocab - 1}")


def fit_new_tokens(prompt_length: int, asked: int | None, target: Target) -> int:
    """--max-new-tokens, checked against the KV capacity (decoding writes positions P .. P + N - 2)."""
    capacity = target.capacity
    room = capacity + 1 - prompt_length
    if prompt_length > capacity:
        raise InputError(f"the prompt is {prompt_length} tokens, more than the KV capacity {capacity} of "
                         f"{target.name}. fix: shorten the prompt, or run a package with a larger capacity")
    if asked is None:
        if room < DEFAULT_NEW_TOKENS:
            click.echo(f"[megabake] at most {room} new tokens: what the KV capacity {capacity} leaves after the "
                       f"{prompt_length}-token prompt", err=True)
        return min(DEFAULT_NEW_TOKENS, room)
    if asked > room:
        raise InputError(f"--max-new-tokens {asked} does not fit: the prompt is {prompt_length} tokens and the KV "
                         f"capacity of {target.name} is {capacity}, which leaves room for {room} new tokens. fix: "
                         f"pass --max-new-tokens 1..{room}, shorten the prompt, or run a package with a larger "
                         "capacity")
    return asked


class IdStreamer:
    """Writes each new token id to stdout as it is made (the ``TextStreamer`` protocol: the prompt first,
    which is skipped, then each new token, then ``end()``)."""

    def __init__(self):
        self.seen_prompt = False
        self.written = 0

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        for token in value.reshape(-1).tolist():
            click.echo(f"{' ' if self.written else ''}{int(token)}", nl=False)  # click.echo flushes
            self.written += 1

    def end(self) -> None:
        click.echo()


def streamer_for(tokenizer):
    if tokenizer is None:
        return IdStreamer()
    from transformers import TextStreamer

    # prints (flushed) to stdout; clean_up_tokenization_spaces=False keeps BPE text as the model wrote it
    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def generate(decoder, ids: list[int], new_tokens: int, tokenizer, stop, sampling: dict):
    import torch

    return decoder.generate(torch.tensor([ids]), new_tokens, return_details=True, streamer=streamer_for(tokenizer),
                            tokenizer=tokenizer, stop_strings=list(stop) or None, **sampling)


def echo_stats(generation, backend: str) -> None:
    """Prefill time, new tokens, decode ms/token and tokens/s, backend, and why it stopped, on stderr."""
    new = generation.new_tokens.shape[1]
    steps = len(generation.step_times_s)
    ms = generation.ms_per_token
    rate = ("no decode step (the one new token came from the prefill)" if ms is None else
            f"{ms:.2f} ms/token, {1e3 / ms:.2f} tokens/s over {steps} decode step{'s' if steps != 1 else ''}")
    steady = generation.steady_ms_per_token
    if steady is not None:
        first = generation.first_round_trip_steps
        rate += (f"; {steady:.2f} ms/token after the first host round trip (its {first} "
                 f"{'steps include' if first != 1 else 'step includes'} one-time set-up, e.g. capturing the "
                 "CUDA graphs)")
    for line in (f"prefill: {generation.prompt_length} tokens in {1e3 * generation.prefill_s:.1f} ms",
                 f"decode: {new} new token{'s' if new != 1 else ''}, {rate} (backend {backend})",
                 f"stopped by: {generation.stopped_by}"):
        click.echo(f"[megabake] {line}", err=True)


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
