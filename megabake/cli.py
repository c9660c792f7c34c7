"""The ``megabake`` command line (click): thin wrappers that parse, call the API and print.

Commands: bake, verify, publish, inspect, ls, registry. Errors from the pipeline (:class:`MegaBakeError`)
are shown as one clear message and exit code 1, never as a traceback.
"""

from __future__ import annotations

import importlib
import sys

import click

from . import __version__
from .presets import DEFAULT_PRESET, PRESETS


class _Group(click.Group):
    """Turn MegaBake errors into a one-line message instead of a traceback."""

    def invoke(self, ctx):
        from .errors import MegaBakeError

        try:
            return super().invoke(ctx)
        except MegaBakeError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megabake")
def cli():
    """MegaBake: bake Hugging Face decoders into one CuTe DSL megakernel per decode step,
    verify them against PyTorch, and ship them on the Hugging Face Hub."""


@cli.command()
@click.option("--model", "model", default=DEFAULT_PRESET, show_default=True,
              help=f"A built-in preset ({', '.join(sorted(PRESETS))}; random weights, no download) "
                   "or a Hub repo id such as HuggingFaceTB/SmolLM-135M.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) to bake; resolved to a "
                                               "commit sha that is recorded in the report. Hub models only.")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1, 64), help="Batch of the bucket.")
@click.option("--capacity", default=128, show_default=True, type=click.IntRange(2, 1 << 20),
              help="KV-cache capacity (positions) of the bucket.")
@click.option("--out", default="packages", show_default=True, type=click.Path(file_okay=False),
              help="Root folder; the package goes to OUT/<org>--<model>/<revision>/<variant>/.")
@click.option("--gpu-class", default=None, help="Target GPU class, e.g. sm90a-132sm (default: this GPU if it "
                                                "is a Hopper, else sm90a-132sm).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of a preset's random weights.")
@click.option("--threads", default=256, show_default=True, type=click.Choice(["128", "256", "512"]),
              help="Threads per CTA.")
@click.option("--no-gpu", is_flag=True, help="Do not run the kernel even if a Hopper GPU is present.")
@click.option("--steps", default=64, show_default=True, type=click.IntRange(1), help="Decode steps of the "
              "first numerical check on a GPU.")
@click.option("--autotune", is_flag=True, help="On a Hopper GPU: time candidate GEMV tilings stage by stage and "
              "bake the fastest per stage (about a minute; numerics are unchanged). Needs the GPU.")
@click.option("--tiling", default=None, metavar="SPEC",
              help="GEMV tiling of every GEMV stage, PER_TILExUNROLL[+spread][+preload][+pipeline][+ringSTAGES], "
                   "e.g. 2x4+spread+preload (from an earlier --autotune or scripts/gpu_tune.py); 'balanced:SPEC' "
                   "also picks each stage's rows per tile for tile balance. Works without a GPU.")
@click.option("--attention-preload", is_flag=True, help="Load each attention lane group's first cached K/V rows "
              "before the barrier that precedes attention.")
def bake(model, revision, batch, capacity, out, gpu_class, seed, threads, no_gpu, steps, autotune, tiling,
         attention_preload):
    """Bake MODEL into a decode package (module.py, plan.json, source_map.json, report.json, manifest.json).

    On any machine: capture -> IR -> plan -> codegen, the plan's CPU reference executor against eager
    fp32 PyTorch, and a CuTe DSL compile of module.py for sm_90a. On a Hopper GPU it also runs the kernel
    and records a first numerical check. The package path is printed on the last line of stdout.

    \b
    Examples:
      megabake bake                                  # the tiny default preset, offline, seconds
      megabake bake --model smollm-135m --capacity 128
      megabake bake --model HuggingFaceTB/SmolLM-135M --revision main
      megabake bake --model llama-3.2-1b --autotune     # on an H100/H200: per-stage GEMV tiling
      megabake bake --model smollm-135m --tiling 2x4+spread+preload --attention-preload
    """
    from .bake import bake as run_bake

    def progress(message: str) -> None:
        click.echo(f"[megabake] {message}", err=True)

    result = run_bake(model, revision=revision, batch=batch, capacity=capacity, out=out, gpu_class=gpu_class,
                      seed=seed, threads=int(threads), run_on_gpu=not no_gpu, gpu_steps=steps, autotune=autotune,
                      tiling=tiling, attention_preload=attention_preload, progress=progress)
    report = result.report
    click.echo(f"[megabake] status: {report['status']}" +
               (f" ({'; '.join(report['status_reasons'])})" if report["status_reasons"] else ""), err=True)
    click.echo(str(result.path))
    if report["status"] == "failed":
        sys.exit(2)


# Commands owned by other modules (registered lazily so `megabake --help` stays fast and robust).
_EXTERNAL = {
    "verify": ("megabake.verify.commands", "verify_command"),
    "publish": ("megabake.hub.commands", "publish"),
    "inspect": ("megabake.package.commands", "inspect"),
    "ls": ("megabake.hub.commands", "ls"),
    "registry": ("megabake.registry.commands", "registry"),
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
        raise click.ClickException(f"`megabake {name}` is unavailable: {where} failed to import ({exc})")

    return unavailable


_register_external()


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
