"""``megabake run`` on the CPU (the plan's reference executor): what it prints, and its errors.

A tiny-llama package (random weights, capacity 32, vocab 1024) is baked once per module: with --prompt-ids
the printed ids are exactly ``decoder.generate``'s. A second one is baked from a local model folder without a
tokenizer; copies of that folder with a small word-level tokenizer (with and without a chat template), passed
with --model-path, cover the text path (streamed text, --chat, --stop) in seconds. The Hub path runs against
the local fake Hub. The real-weights test (slow) bakes the SmolLM2 GGUF and asks it a question with --chat.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from megabake.cli import cli
from megabake.errors import EXIT_CANNOT_RUN, EXIT_FAILED, EXIT_USAGE

CAPACITY = 32
PROMPT_IDS = [5, 17, 301]
PROMPT_WORDS = "w5 w17 w301"
CHAT_TEMPLATE = ("{% for m in messages %}w10 {{ m['content'] }} w11{% endfor %}"
                 "{% if add_generation_prompt %} w12{% endif %}")
STATS = re.compile(r"\[megabake\] decode: \d+ new tokens?, [0-9.]+ ms/token, [0-9.]+ tokens/s")


def run(*args):
    result = CliRunner().invoke(cli, ["run", *map(str, args)])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def ids_of(stdout: str) -> list[int]:
    return [int(token) for token in stdout.split()]


def reference_decoder(path, **kwargs):
    from megabake.runtime import MegakernelDecoder

    return MegakernelDecoder.from_package(path, device="cpu", **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny-llama preset baked on the CPU: (package path, its reference decoder)."""
    from megabake.baking import bake

    path = bake("tiny-llama", capacity=CAPACITY, out=tmp_path_factory.mktemp("packages"), run_on_gpu=False).path
    return path, reference_decoder(path)


# ------------------------------------------------------------------------------------------ token ids


def test_prompt_ids_print_the_greedy_ids_and_the_stats(tiny):
    path, decoder = tiny
    result = run(path, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", 8, "--device", "cpu")
    assert result.exit_code == 0, result.output
    expected = decoder.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=8)[0, len(PROMPT_IDS):].tolist()
    assert ids_of(result.stdout) == expected and result.stdout.endswith("\n")
    assert "[megabake]" not in result.stdout  # stdout is the generation only
    assert STATS.search(result.stderr), result.stderr
    assert "backend reference" in result.stderr and "backend: reference" in result.stderr
    assert re.search(r"prefill: 3 tokens in [0-9.]+ ms", result.stderr)
    assert re.search(r"stopped by: (max_new_tokens|eos)", result.stderr)


def test_sampling_with_a_seed_is_generate_with_that_seed(tiny):
    path, decoder = tiny
    args = (path, "--prompt-ids", "1, 2,3", "--max-new-tokens", 6, "--do-sample", "--seed", 7, "--temperature",
            2.0, "--top-k", 50, "--top-p", 0.9)
    first, second = run(*args), run(*args)
    assert first.exit_code == second.exit_code == 0, first.output
    expected = decoder.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=True, seed=7,
                                temperature=2.0, top_k=50, top_p=0.9)[0, 3:].tolist()
    assert ids_of(first.stdout) == ids_of(second.stdout) == expected


def test_without_max_new_tokens_it_fills_the_capacity(tiny):
    path, _ = tiny
    result = run(path, "--prompt-ids", ",".join(map(str, range(1, 29))))
    assert result.exit_code == 0, result.output
    assert "at most 5 new tokens: what the KV capacity 32 leaves after the 28-token prompt" in result.stderr
    assert 1 <= len(ids_of(result.stdout)) <= 5


def test_help_ends_with_the_exit_codes():
    out = CliRunner().invoke(cli, ["run", "--help"], terminal_width=200).output
    assert "Exit codes" in out and "--prompt-ids" in out
    for code in ("0", "1", "2", "3"):
        assert re.search(rf"^\s+{code}\s+\S", out, re.M), code


# ----------------------------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def tampered(tiny, tmp_path_factory):
    copy = tmp_path_factory.mktemp("tampered") / "pkg"
    shutil.copytree(tiny[0], copy)
    (copy / "module.py").write_text("tampered\n")
    return copy


ERRORS = [
    # (id, argv after PACKAGE, exit code, a part of the message)
    ("chat-preset", ["--prompt", "hi", "--chat"], EXIT_USAGE,
     "holds the built-in preset 'tiny-llama' (random weights), which has no tokenizer, so the --prompt text cannot "
     "be tokenized. fix: pass token ids with --prompt-ids instead of --prompt and drop --chat, e.g. --prompt-ids "
     "1,2,3"),
    ("text-preset", ["--prompt", "hi"], EXIT_USAGE, "fix: pass token ids with --prompt-ids instead of --prompt, e.g."),
    ("max-new-tokens-zero", ["--prompt-ids", "1", "--max-new-tokens", "0"], EXIT_USAGE,
     "Invalid value for '--max-new-tokens': 0 is not in the range 1<=x<=1048576."),
    ("max-new-tokens-over-capacity", ["--prompt-ids", "1,2,3", "--max-new-tokens", "31"], EXIT_USAGE,
     "--max-new-tokens 31 does not fit: the prompt is 3 tokens and the KV capacity of <pkg> is 32, which leaves "
     "room for 30 new tokens. fix: pass --max-new-tokens 1..30"),
    ("prompt-too-long", ["--prompt-ids", ",".join(["1"] * 33)], EXIT_USAGE,
     "the prompt is 33 tokens, more than the KV capacity 32 of <pkg>"),
    ("id-outside-vocab", ["--prompt-ids", "1,2,1024"], EXIT_USAGE,
     "prompt token id 1024 is outside the vocabulary [0, 1024) of <pkg>: pass ids 0..1023"),
    ("id-negative", ["--prompt-ids", "-1"], EXIT_USAGE, "prompt token id -1 is outside the vocabulary"),
    ("id-not-int", ["--prompt-ids", "1,x"], EXIT_USAGE, "--prompt-ids '1,x': 'x' is not a token id"),
    ("no-prompt", [], EXIT_USAGE, "pass exactly one of --prompt TEXT"),
    ("both-prompts", ["--prompt", "hi", "--prompt-ids", "1"], EXIT_USAGE, "pass exactly one of --prompt TEXT"),
    ("empty-prompt", ["--prompt", " "], EXIT_USAGE, "--prompt is empty"),
    ("chat-ids", ["--prompt-ids", "1", "--chat"], EXIT_USAGE, "--chat works on text and --prompt-ids are token ids"),
    ("stop-ids", ["--prompt-ids", "1", "--stop", "x"], EXIT_USAGE, "--stop works on text"),
    ("stop-empty", ["--prompt", "hi", "--stop", ""], EXIT_USAGE, "--stop '' is empty"),
    ("temperature-greedy", ["--prompt-ids", "1", "--temperature", "0.5"], EXIT_USAGE,
     "--temperature applies only when sampling: add --do-sample, or drop it for greedy decoding"),
    ("temperature-zero", ["--prompt-ids", "1", "--do-sample", "--temperature", "0"], EXIT_USAGE,
     "Invalid value for '--temperature'"),
    ("top-p", ["--prompt-ids", "1", "--do-sample", "--top-p", "1.5"], EXIT_USAGE, "Invalid value for '--top-p'"),
    ("top-k", ["--prompt-ids", "1", "--do-sample", "--top-k", "-1"], EXIT_USAGE, "Invalid value for '--top-k'"),
    ("seed", ["--prompt-ids", "1", "--do-sample", "--seed", "-1"], EXIT_USAGE, "Invalid value for '--seed'"),
    ("device", ["--prompt-ids", "1", "--device", "tpu"], EXIT_USAGE, "--device 'tpu' is not auto, cpu, cuda or cuda:N"),
    ("revision-local", ["--prompt-ids", "1", "--revision", "main"], EXIT_USAGE,
     "--revision selects a package of a Hub repo, and <pkg> is a local package folder: drop it"),
    ("capacity-local", ["--prompt-ids", "1", "--capacity", "64"], EXIT_USAGE, "--capacity selects a package"),
    ("model-path-preset", ["--prompt-ids", "1", "--model-path", "<tmp>"], EXIT_USAGE,
     "--model-path applies to packages baked from a local model folder or .gguf file, and <pkg> was baked from "
     "megabake/tiny-llama@random-seed0: drop --model-path"),
]


@pytest.mark.parametrize("argv, code, message", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_input_is_refused_before_generating(tiny, tmp_path, argv, code, message):
    path = str(tiny[0])
    result = run(path, *[a.replace("<tmp>", str(tmp_path)) for a in argv])
    assert result.exit_code == code, result.output
    assert message.replace("<pkg>", path) in result.stderr, result.stderr
    assert result.stdout == "" and "prefill:" not in result.stderr


@pytest.mark.parametrize("package, message", [
    ("<tmp>", "<tmp> is not a package folder: manifest.json is missing. fix: pass a package folder "
              "packages/<org>--<model>/<rev>/<variant>/ written by `megabake bake`"),
    ("<tmp>/nope", "<tmp>/nope: no such package folder, and not a Hub repo id of the form ORG/NAME"),
    ("<tmp>/model.gguf", "<tmp>/model.gguf is a file, not a package folder"),
    ("no/such/repo", "no/such/repo: no such package folder, and not a Hub repo id of the form ORG/NAME"),
    ("", "PACKAGE is empty"),
])
def test_not_a_package_is_a_usage_error(tmp_path, package, message):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    result = run(package.replace("<tmp>", str(tmp_path)), "--prompt-ids", "1")
    assert result.exit_code == EXIT_USAGE, result.output
    assert f"error: {message.replace('<tmp>', str(tmp_path))}" in result.stderr, result.stderr


def test_tampered_package_fails(tampered):
    result = run(tampered, "--prompt-ids", "1")
    assert result.exit_code == EXIT_FAILED, result.output
    assert result.stderr.startswith("error: ") and "module.py" in result.stderr


def test_cuda_without_a_hopper_cannot_run_here(tiny):
    if torch.cuda.is_available():
        pytest.skip("the case is a machine without a CUDA GPU")
    result = run(tiny[0], "--prompt-ids", "1", "--device", "cuda")
    assert result.exit_code == EXIT_CANNOT_RUN, result.output
    assert result.stderr == ("error: --device cuda: no CUDA GPU is visible, and the megakernel needs a Hopper (SM90) "
                             "GPU such as the H100/H200. fix: pass --device cpu to run the plan's CPU reference "
                             "executor, or run on an H100/H200\n")


# ------------------------------------------------------------------------------ text: a local model folder


def _word_tokenizer(chat_template: str | None):
    """A word-level tokenizer over the tiny model's vocabulary: w3..w1023, [UNK] 0, <s> 1, </s> 2 (its EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1024)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A package baked from a model folder without a tokenizer, and two copies of the folder with one
    (``plain``: no chat template, ``chat``: one): (package path, {name: folder})."""
    from megabake.baking import bake
    from megabake.presets import get_preset

    root = tmp_path_factory.mktemp("folder")
    get_preset("tiny-llama").build_model(seed=3).save_pretrained(root / "model")
    path = bake(str(root / "model"), capacity=CAPACITY, out=root / "packages", run_on_gpu=False).path
    copies = {}
    for name, template in (("plain", None), ("chat", CHAT_TEMPLATE)):
        copies[name] = root / name
        shutil.copytree(root / "model", copies[name])  # same weights: the package's sha256 still matches
        _word_tokenizer(template).save_pretrained(copies[name])
    return path, copies


def _expected_text(path, model_path, ids, **settings):
    from transformers import AutoTokenizer

    decoder = reference_decoder(path, model_path=model_path)
    new = decoder.generate(torch.tensor([ids]), **settings)[0, len(ids):]
    return AutoTokenizer.from_pretrained(model_path).decode(new, skip_special_tokens=True), new.tolist()


def test_folder_without_a_tokenizer_names_the_fix(folder):
    path, copies = folder
    result = run(path, "--prompt", PROMPT_WORDS)
    assert result.exit_code == EXIT_USAGE, result.output
    assert "/model has no tokenizer (none of tokenizer.json, " in result.stderr
    assert ("fix: save the model's tokenizer into that folder (tokenizer.save_pretrained(folder)), or pass token ids "
            "with --prompt-ids instead of --prompt, e.g. --prompt-ids 1,2,3") in result.stderr


def test_text_prompt_streams_the_decoded_greedy_text(folder):
    path, copies = folder
    result = run(path, "--prompt", PROMPT_WORDS, "--model-path", copies["plain"], "--max-new-tokens", 10)
    assert result.exit_code == 0, result.output
    text, _ = _expected_text(path, copies["plain"], PROMPT_IDS, max_new_tokens=10)
    assert text.strip() and result.stdout == text + "\n"
    assert STATS.search(result.stderr) or "no decode step" in result.stderr, result.stderr


def test_chat_applies_the_template_with_the_generation_prompt(folder):
    path, copies = folder
    result = run(path, "--prompt", PROMPT_WORDS, "--chat", "--model-path", copies["chat"], "--max-new-tokens", 6)
    assert result.exit_code == 0, result.output
    chat_ids = [10, *PROMPT_IDS, 11, 12]  # w10 <prompt> w11, then the generation prompt w12
    text, _ = _expected_text(path, copies["chat"], chat_ids, max_new_tokens=6)
    assert result.stdout == text + "\n"


def test_chat_without_a_chat_template_is_refused(folder):
    path, copies = folder
    result = run(path, "--prompt", PROMPT_WORDS, "--chat", "--model-path", copies["plain"])
    assert result.exit_code == EXIT_USAGE, result.output
    assert ("error: --chat applies the tokenizer's chat template, and the tokenizer of local/model has none. fix: "
            "drop --chat to send --prompt as plain text, or run a chat (instruct) model") in result.stderr


def test_stop_string_ends_the_generation(folder):
    path, copies = folder
    _, new = _expected_text(path, copies["plain"], PROMPT_IDS, max_new_tokens=10)
    first = f"w{new[0]}"
    assert new[0] >= 3, "the first greedy token is a special token: pick another prompt"
    result = run(path, "--prompt", PROMPT_WORDS, "--model-path", copies["plain"], "--stop", first, "--stop", "w2000")
    assert result.exit_code == 0, result.output
    assert result.stdout == first + "\n" and "stopped by: stop_string" in result.stderr


def test_moved_model_folder_needs_model_path(folder):
    path, _ = folder
    model = path.parents[3] / "model"  # <root>/packages/local--model/<rev>/<variant>
    moved = model.with_name("model-moved")
    model.rename(moved)
    try:
        result = run(path, "--prompt", PROMPT_WORDS)
        found = run(path, "--prompt", PROMPT_WORDS, "--model-path", moved)
    finally:
        moved.rename(model)
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr == (f"error: {path} was baked from the local model folder {model}, which is not on this "
                             "machine (its weights and tokenizer are read from there). fix: pass its copy with "
                             "--model-path PATH\n")
    assert found.exit_code == EXIT_USAGE and f"{moved} has no tokenizer" in found.stderr, found.output


# ------------------------------------------------------------------------------------------------ the Hub


REPO, TOKEN = "acme/tiny-llama-megabake", "hf_fake_token"


@pytest.fixture
def published(hub_server, tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from megabake.hub import publish

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    publish([tiny[0]], REPO, endpoint=hub_server.url, token=TOKEN, allow_unverified=True, allow_random_weights=True)
    return hub_server


def test_hub_repo_runs_the_published_package(published, tiny):
    hub = ("--endpoint", published.url, "--token", TOKEN, "--allow-unverified", "--device", "cpu")
    refused = run(REPO, "--prompt-ids", "5,17,301", "--max-new-tokens", 8, *hub)
    assert refused.exit_code == EXIT_FAILED, refused.output
    assert "refusing to import" in refused.stderr and "fix: review that module.py, then pass --trust-remote-code, " \
                                                       "or pin --revision " in refused.stderr
    result = run(REPO, "--prompt-ids", "5,17,301", "--max-new-tokens", 8, "--trust-remote-code", *hub)
    assert result.exit_code == 0, result.output
    expected = tiny[1].generate(torch.tensor([PROMPT_IDS]), max_new_tokens=8)[0, 3:].tolist()
    assert ids_of(result.stdout) == expected and STATS.search(result.stderr)
    commit = published.head(REPO)
    pinned = run(REPO, "--revision", commit, "--prompt-ids", "5,17,301", "--max-new-tokens", 8, *hub)
    assert pinned.exit_code == 0 and ids_of(pinned.stdout) == expected, pinned.output


def test_hub_repo_options(published, tiny):
    hub = ("--endpoint", published.url, "--token", TOKEN, "--allow-unverified", "--trust-remote-code",
           "--device", "cpu")
    result = run(REPO, "--prompt-ids", "1", "--model-path", tiny[0], *hub)
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr == (f"error: --model-path applies to packages baked from a local model folder or .gguf file, "
                             f"and {REPO}'s package {tiny[0].name} was baked from megabake/tiny-llama@random-seed0: "
                             "drop --model-path\n")
    result = run(REPO, "--prompt-ids", "1", "--endpoint", "ftp://hub")
    assert result.exit_code == EXIT_USAGE and "--endpoint 'ftp://hub' is not an http(s) URL" in result.stderr


def _hub_model_package(tiny_path, dest, repo: str, sha: str, config_hash: str):
    """The tiny package as if baked from the Hub model ``repo@sha`` (the same weights, uploaded there)."""
    import json

    from megabake.package import write_package

    report = json.loads((tiny_path / "report.json").read_text())
    report["model"].update(id=repo, revision=sha, weights="pretrained", seed=None, preset=None,
                           config_hash=config_hash)
    files = {name: (tiny_path / name).read_bytes() for name in ("module.py", "plan.json", "source_map.json")}
    return write_package(dest, files, report)


def test_hub_model_tokenizer_comes_from_its_pinned_revision(hub_env, tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from transformers import AutoModelForCausalLM

    from megabake.presets import config_hash, get_preset

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    get_preset("tiny-llama").build_model(seed=0).save_pretrained(tmp_path / "model")
    digest = config_hash(AutoModelForCausalLM.from_pretrained(tmp_path / "model").config)  # as loaded back
    weights = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}
    _word_tokenizer(CHAT_TEMPLATE).save_pretrained(tmp_path / "tokenizer")
    tokenizer = {p.name: p.read_bytes() for p in (tmp_path / "tokenizer").iterdir()}
    bare = hub_env.commit_files("acme/bare", weights, message="weights only")
    chatty = hub_env.commit_files("acme/chatty", {**weights, **tokenizer}, message="weights and tokenizer")

    refused = run(_hub_model_package(tiny[0], tmp_path / "bare", "acme/bare", bare, digest), "--prompt", PROMPT_WORDS)
    assert refused.exit_code == EXIT_USAGE, refused.output
    assert f"error: the Hub model acme/bare@{bare[:12]} has no tokenizer (none of tokenizer.json," in refused.stderr

    package = _hub_model_package(tiny[0], tmp_path / "chatty", "acme/chatty", chatty, digest)
    result = run(package, "--prompt", PROMPT_WORDS, "--chat", "--max-new-tokens", 6)
    assert result.exit_code == 0, result.output
    new = tiny[1].generate(torch.tensor([[10, *PROMPT_IDS, 11, 12]]), max_new_tokens=6)[0, 6:]
    assert result.stdout == _word_tokenizer(None).decode(new, skip_special_tokens=True) + "\n"


# -------------------------------------------------------------------------------------------- real weights


@pytest.mark.slow
def test_real_weights_chat_answer(tmp_path_factory):
    """SmolLM2-135M-Instruct (GGUF), capacity 256, on the reference executor: the streamed answer is the
    decoded greedy tokens of ``decoder.generate`` on the same chat prompt."""
    from megabake.baking import bake
    from tests.real_weights import CHAT_PROMPTS, chat_ids, require_smollm2_gguf, smollm2_fp32

    gguf = require_smollm2_gguf()
    path = bake(str(gguf), capacity=256, out=tmp_path_factory.mktemp("gguf"), run_on_gpu=False,
                reference_steps=2).path
    prompt = CHAT_PROMPTS[0]  # What is the capital of France?
    result = run(path, "--prompt", prompt, "--chat", "--max-new-tokens", 12)
    assert result.exit_code == 0, result.output
    _, tokenizer = smollm2_fp32()
    ids = chat_ids(tokenizer, prompt)
    new = reference_decoder(path).generate(ids, max_new_tokens=12)[0, ids.shape[1]:]
    assert result.stdout == tokenizer.decode(new, skip_special_tokens=True) + "\n"
    assert "Paris" in result.stdout
    assert STATS.search(result.stderr) and "prefill: 37 tokens" in result.stderr, result.stderr


def test_hub_package_baked_from_a_local_folder_reads_its_model_at_model_path(hub_server, folder, tmp_path,
                                                                               monkeypatch):
    """A package baked from a local model folder, published, then run from the Hub on a machine where that
    folder is elsewhere: without --model-path the error names the folder and the fix; with it (a copy holding a
    tokenizer) the text is the same as from the package folder. load_from_hub takes model_path likewise."""
    from huggingface_hub import constants

    from megabake.hub import load_from_hub, publish

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    path, copies = folder
    repo = "acme/local-model-megabake"
    publish([path], repo, endpoint=hub_server.url, token=TOKEN, allow_unverified=True)
    hub = ("--endpoint", hub_server.url, "--token", TOKEN, "--allow-unverified", "--trust-remote-code",
           "--device", "cpu")
    model = path.parents[3] / "model"
    moved = model.with_name("model-elsewhere")
    model.rename(moved)
    try:
        missing = run(repo, "--prompt", PROMPT_WORDS, *hub)
        with pytest.raises(Exception, match=r"not on this machine: pass its copy .*load_from_hub\(\.\.\., "
                                            r"model_path=PATH\)"):
            load_from_hub(repo, endpoint=hub_server.url, token=TOKEN, allow_unverified=True, trust_remote_code=True,
                          device="cpu")
        decoder = load_from_hub(repo, endpoint=hub_server.url, token=TOKEN, allow_unverified=True,
                                trust_remote_code=True, device="cpu", model_path=copies["plain"])
        result = run(repo, "--prompt", PROMPT_WORDS, "--model-path", copies["plain"], "--max-new-tokens", 6, *hub)
    finally:
        moved.rename(model)
    assert missing.exit_code == EXIT_FAILED and missing.stderr == (
        f"error: the package was baked from the local folder {model}, which is not on this machine: pass its copy "
        "with --model-path PATH\n"), missing.stderr
    assert decoder.report["model"]["local"]["kind"] == "folder"
    assert result.exit_code == 0, result.output
    text, _ = _expected_text(path, copies["plain"], PROMPT_IDS, max_new_tokens=6)
    assert result.stdout == text + "\n"
