"""The ``megabake`` command line (click): thin wrappers that parse, check, call the API and print.

Commands: bake, verify, publish, inspect, ls, lock, registry, run. One error style and one exit-code policy for all
(``megabake.errors``): ``error: <message>`` on stderr, never a traceback; exit 0 ok, 1 a check failed (or
the work could not be completed), 2 usage or bad input (found before any work), 3 cannot run here (no Hopper
GPU, missing dependency). Click's own usage errors keep click's format and exit 2.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import click

from . import __version__
from .errors import (EXIT_CANNOT_RUN, EXIT_FAILED, MegaBakeError, exit_codes_help, fail, os_error_message,
                     reports_errors)
from .presets import DEFAULT_PRESET, PRESETS

MAX_SEED = 2**63 - 1  # torch.manual_seed takes 0..2**64-1; the preset also seeds seed + 1
MAX_CAPACITY = 1 << 20
MAX_BATCH = 64
MAX_SM_COUNT = 1024
GPU_STEPS = 64  # decode steps of the first numerical check on a GPU, when the bucket leaves room
GPU_PREFILL = 16  # tokens of its eager prefill (fewer for buckets under 32 positions)


class _Group(click.Group):
    """Turn MegaBake errors (and OSErrors) into ``error: <message>`` and the error's exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MegaBakeError as exc:
            fail(exc)
        except BrokenPipeError:
            raise
        except OSError as exc:
            fail(os_error_message(exc), EXIT_FAILED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]}, epilog=exit_codes_help())
@click.version_option(__version__, prog_name="megabake")
def cli():
    """MegaBake: bake Hugging Face decoders into one CuTe DSL megakernel per decode step,
    verify them against PyTorch, and ship them on the Hugging Face Hub."""


BAKE_EXIT_CODES = exit_codes_help(
    ok="baked: the package path is the last line of stdout (status unverified, or verified on a GPU); also when "
       "an identical package was already there ('unchanged: ...' on stderr, nothing written)",
    failed="the bake's status is 'failed' (reasons on stderr), the pipeline failed (model not supported, Hub "
           "unreachable), or the package folder holds a different package (nothing written; --force replaces it)",
    usage="usage or bad input (option out of range, unknown model, bad --tiling, --out not writable): "
          "found before any work, nothing written",
    cannot_run="cannot run here (--autotune without a Hopper GPU, a missing dependency)")


@cli.command(epilog=BAKE_EXIT_CODES)
@click.option("--model", "model", default=DEFAULT_PRESET, show_default=True,
              help=f"A built-in preset ({', '.join(sorted(PRESETS))}; random weights, no download), "
                   "a Hub repo id such as HuggingFaceTB/SmolLM-135M, a local model folder or a .gguf file.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) to bake; resolved to a "
                                               "commit sha that is recorded in the report. Hub models only.")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1, MAX_BATCH),
              help=f"Batch of the bucket (1..{MAX_BATCH}).")
@click.option("--capacity", default=128, show_default=True, type=click.IntRange(2, MAX_CAPACITY),
              help=f"KV-cache capacity (positions) of the bucket (2..{MAX_CAPACITY}).")
@click.option("--out", default="packages", show_default=True, type=click.Path(file_okay=False),
              help="Root folder, checked (created, writable) before any work; the package goes to "
                   "OUT/<org>--<model>/<revision>/<variant>/.")
@click.option("--gpu-class", default=None, help="Target GPU class sm<CC>[a]-<SMs>sm, e.g. sm90a-132sm (default: "
                                                "this GPU if it is a Hopper, else sm90a-132sm).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, MAX_SEED),
              help="Seed of a preset's random weights (0..2**63-1).")
@click.option("--threads", default="256", show_default=True, type=click.Choice(["128", "256", "512"]),
              help="Threads per CTA.")
@click.option("--no-gpu", is_flag=True, help="Do not run the kernel even if a Hopper GPU is present.")
@click.option("--steps", default=None, type=click.IntRange(1, MAX_CAPACITY),
              help=f"Decode steps of the first numerical check on a GPU (default {GPU_STEPS}, or fewer if the "
                   f"bucket is small); at most --capacity minus the prefill ({GPU_PREFILL} tokens, or half the "
                   f"capacity under {2 * GPU_PREFILL}).")
@click.option("--autotune", is_flag=True, help="On a Hopper GPU: time the default kernel and candidate GEMV tilings "
              "stage by stage and bake the fastest whole step (the default, a candidate or the per-stage "
              "winners; about a minute; numerics are unchanged). Needs the GPU.")
@click.option("--tiling", default=None, metavar="SPEC",
              help="GEMV tiling of every GEMV stage, PER_TILExUNROLL[+spread][+preload][+pipeline][+ringSTAGES], "
                   "e.g. 2x4+spread+preload (from an earlier --autotune or scripts/gpu_tune.py); 'balanced:SPEC' "
                   "also picks each stage's rows per tile for tile balance; '8x8+mma' runs batched GEMVs on the "
                   "tensor cores with bf16 inputs (the default of bf16 models at --batch 2 to 8); '+gated' "
                   "applies the MLP's activation in the gate/up GEMV's write (the default of SiLU and tanh-GELU "
                   "models on the plain and ring tilings). Works without a GPU.")
@click.option("--attention-preload", is_flag=True, help="Load each attention lane group's first cached K/V rows "
              "before the barrier that precedes attention.")
@click.option("--force", is_flag=True, help="Write the package even when its folder holds a different package "
              "(other module.py / plan.json / source_map.json: refused without --force, exit 1) or the same files "
              "with an equal or stronger report (verified > unverified > failed: left unchanged without --force, "
              "exit 0).")
@reports_errors
def bake(model, revision, batch, capacity, out, gpu_class, seed, threads, no_gpu, steps, autotune, tiling,
         attention_preload, force):
    """Bake MODEL into a decode package (module.py, plan.json, source_map.json, report.json, manifest.json).

    On any machine: capture -> IR -> plan -> codegen, the plan's CPU reference executor against eager
    fp32 PyTorch, and a CuTe DSL compile of module.py for sm_90a. On a Hopper GPU it also runs the kernel
    and records a first numerical check. The package path is printed on the last line of stdout:
    OUT/<org>--<model>/<rev>/<variant>, the variant naming the bucket, the GPU class and the plan
    (decode-b1-c128-sm90a-132sm-p<8 hex of the plan's sha256>). A bake never silently replaces another
    package: the same inputs leave the folder unchanged; a different package there is refused without --force.

    \b
    Examples:
      megabake bake                                  # the tiny default preset, offline, seconds
      megabake bake --model smollm-135m --capacity 128
      megabake bake --model HuggingFaceTB/SmolLM-135M --revision main
      megabake bake --model llama-3.2-1b --autotune     # on an H100/H200: per-stage GEMV tiling
      megabake bake --model smollm-135m --tiling 2x4+spread+preload --attention-preload
    """
    # Everything the user typed is checked before any work (exit 2, nothing written).
    _check_model(model, revision, seed)
    _check_tiling(tiling, attention_preload, autotune, no_gpu)
    _check_gpu_class(gpu_class)
    prefill, steps = _gpu_check_length(capacity, steps)
    if autotune:
        _require_hopper_for_autotune()
    created = _check_out(out)

    from .baking import bake as run_bake

    def progress(message: str) -> None:
        click.echo(f"[megabake] {message}", err=True)

    try:
        result = run_bake(model, revision=revision, batch=batch, capacity=capacity, out=out, gpu_class=gpu_class,
                          seed=seed, threads=int(threads), run_on_gpu=not no_gpu, gpu_steps=steps,
                          gpu_prefill=prefill, autotune=autotune, tiling=tiling,
                          attention_preload=attention_preload, force=force, progress=progress)
    except BaseException:
        from .errors import remove_created

        remove_created(created)  # only the (empty) folders the --out check made
        raise
    report = result.report
    click.echo(f"[megabake] status: {report['status']}" +
               (f" ({'; '.join(report['status_reasons'])})" if report["status_reasons"] else ""), err=True)
    if result.note:
        click.echo(result.note, err=True)
    click.echo(str(result.path))
    if report["status"] == "failed":
        raise SystemExit(EXIT_FAILED)


def _usage(message: str):
    from .errors import InputError

    return InputError(message)


def _check_model(model: str, revision: str | None, seed: int) -> None:
    """``--model`` names a preset, an existing local folder / .gguf file, or has the form of a Hub repo id
    (``megabake.sources.load_source`` dispatches the same way); ``--revision`` only for Hub ids."""
    from .package.layout import MODEL_ID_RE
    from .presets import is_preset

    if is_preset(model):
        if revision not in (None, "", f"random-seed{seed}"):
            raise _usage(f"--revision does not apply to the built-in preset {model!r} (random weights from "
                         "--seed); drop it or bake a Hub model id")
        return
    if not model.strip():
        raise _usage(f"--model is empty; pass a built-in preset ({', '.join(sorted(PRESETS))}), a Hub repo id "
                     "or a local model folder / .gguf file")
    path = Path(model).expanduser()
    exists = _exists(path)
    if model.endswith(".gguf") or exists or model.startswith((".", "/", "~")):
        if not exists:
            raise _usage(f"--model {model}: no such local model folder or .gguf file. fix: pass an existing "
                         f"folder or file, a built-in preset ({', '.join(sorted(PRESETS))}) or a Hub repo id")
        if revision:
            raise _usage(f"--revision does not apply to the local input {model} (it is pinned by the sha256 of "
                         "its weight files); drop --revision")
        return
    if not MODEL_ID_RE.match(model):
        raise _usage(f"{model!r} is neither a built-in preset ({', '.join(sorted(PRESETS))}), a local model "
                     "folder or .gguf file that exists, nor a Hub repo id such as gpt2 or ORG/NAME")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. a name too long for the file system: not a local input
        return False


def _check_tiling(tiling: str | None, attention_preload: bool, autotune: bool, no_gpu: bool) -> None:
    if autotune and (tiling or attention_preload):
        raise _usage("--autotune chooses the GEMV tiling and attention preload itself; drop --tiling / "
                     "--attention-preload, or drop --autotune to bake the tiling you name")
    if autotune and no_gpu:
        raise _usage("--autotune runs candidate kernels on the GPU; it cannot be combined with --no-gpu")
    if tiling is None:
        return
    from .baking import normalized_tiling

    try:
        normalized_tiling(tiling)
    except MegaBakeError as exc:
        raise _usage(f"--tiling: {exc}") from None


def _check_gpu_class(gpu_class: str | None) -> None:
    if gpu_class is None:
        return
    from .package.layout import GPU_CLASS_RE

    match = re.fullmatch(r"sm(\d)(\d)a?-(\d+)sm", gpu_class)
    if not match or not GPU_CLASS_RE.match(gpu_class):
        raise _usage(f"--gpu-class {gpu_class!r} is not of the form sm<CC>[a]-<SMs>sm, e.g. sm90a-132sm "
                     "(H100/H200 SXM) or sm90a-114sm (H100 PCIe)")
    sms = int(match.group(3))
    if not 1 <= sms <= MAX_SM_COUNT:
        raise _usage(f"--gpu-class {gpu_class!r}: {sms} SMs is outside 1..{MAX_SM_COUNT}")


def _gpu_check_length(capacity: int, steps: int | None) -> tuple[int, int]:
    """(prefill, steps) of the first numerical check on a GPU: both must fit the bucket's KV capacity."""
    prefill = min(GPU_PREFILL, capacity // 2)
    room = capacity - prefill
    if steps is None:
        return prefill, min(GPU_STEPS, room)
    if steps > room:
        raise _usage(f"--steps {steps} does not fit: the GPU check decodes after a {prefill}-token prefill in a "
                     f"KV capacity of {capacity}; use --steps 1..{room} or a larger --capacity")
    return prefill, steps


def _require_hopper_for_autotune() -> None:
    from .runtime import gpu_info

    info = gpu_info()
    if info is None or info.capability != (9, 0):
        fail("--autotune times candidate kernels on a Hopper GPU and this machine has none "
             f"({'no CUDA GPU' if info is None else info.name}); drop --autotune to bake with the default "
             "GEMV tiling, or bake on an H100/H200", EXIT_CANNOT_RUN)


def _check_out(out: str) -> list[Path]:
    from .errors import check_out_dir

    return check_out_dir(out, "--out")


# Commands owned by other modules (registered lazily so `megabake --help` stays fast and robust).
_EXTERNAL = {
    "verify": ("megabake.verification.commands", "verify_command"),
    "publish": ("megabake.hub.commands", "publish"),
    "inspect": ("megabake.package.commands", "inspect"),
    "ls": ("megabake.hub.commands", "ls"),
    "lock": ("megabake.hub.commands", "lock"),
    "registry": ("megabake.registry.commands", "registry"),
    "run": ("megabake.runtime.commands", "run_command"),
}


def _register_external() -> None:
    for name, (module_name, attr) in _EXTERNAL.items():
        try:
            command = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:  # keep the CLI usable; say what is missing
            command = _missing_command(name, f"{module_name}.{attr}", exc)
        cli.add_command(command, name)


def _missing_command(name: str, where: str, exc: Exception) -> click.Command:
    @click.command(name, help=f"(unavailable: {where} failed to import: {exc})")
    def unavailable():
        fail(f"`megabake {name}` is unavailable: {where} failed to import ({exc}). fix: reinstall MegaBake "
             "with its dependencies (pip install -e '.[dev]')", EXIT_CANNOT_RUN)

    return unavailable


_register_external()


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
