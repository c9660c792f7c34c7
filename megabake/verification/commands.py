"""The ``megabake verify`` click command (thin: parse, check, call ``verify_package``, print, exit code).

Contract: ``verify_command`` verifies a package folder on this machine's Hopper GPU and updates its
report.json. Exit codes (``megabake.errors``): 0 verified; 1 a check failed: verification failed (report
written, reasons printed) or the package's files do not match manifest.json (report unchanged); 2 usage or
bad input, before any work: the folder is not a package, --steps/--prefill do not fit the bucket, a bad
--device; 3 cannot run here: no Hopper GPU, a GPU the plan does not fit, a missing dependency (report
unchanged). Errors print ``error: <message>`` on stderr. Heavy imports happen inside the command.
Register with ``cli.add_command(verify_command)``.
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from megabake.errors import (EXIT_CANNOT_RUN, EXIT_FAILED, EXIT_USAGE, InputError,  # noqa: F401  (re-exported)
                             exit_codes_help, reports_errors)

# the names of baselines.BASELINES (a test keeps them equal; importing that module here would import torch)
KNOWN_BASELINES = ("inductor-reduce-overhead", "inductor-graph", "inductor-default-graph", "eager")
MAX_SAMPLES = 100_000
MAX_POSITIONS = 1 << 20

VERIFY_EXIT_CODES = exit_codes_help(
    ok="verified (report.json updated)",
    failed="a check failed: numerics or timing (report written, reasons printed), or files that do not match "
           "manifest.json (report unchanged)",
    usage="usage or bad input, before any work: not a package folder, --steps/--prefill do not fit the "
          "bucket, a bad --device",
    cannot_run="cannot run here: no Hopper GPU, a GPU the plan does not fit, a missing dependency (report "
               "unchanged)")


def parse_steps(value: str):
    """``--steps``: a positive int, or ``max`` for every position the bucket has left."""
    if str(value).lower() == "max":
        return "max"
    try:
        steps = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither an integer nor 'max'") from None
    if steps < 1:
        raise click.BadParameter(f"need at least 1 decode step, got {steps}")
    return steps


def parse_baselines(values) -> tuple[str, ...] | None:
    """``--baselines a,b --baselines c`` -> ('a', 'b', 'c'); nothing given -> None (the defaults)."""
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN_BASELINES]
    if unknown:
        raise click.BadParameter(f"unknown baseline(s) {', '.join(unknown)}; known: {', '.join(KNOWN_BASELINES)}")
    return tuple(dict.fromkeys(names)) or None


@click.command("verify", epilog=VERIFY_EXIT_CODES)
@click.argument("package", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--steps", default="64", show_default=True, callback=lambda ctx, param, value: parse_steps(value),
              help="Advancing decode steps after the prefill, or 'max' to fill the bucket's KV capacity; "
                   "prefill + steps must fit the bucket's capacity.")
@click.option("--prefill", default=16, show_default=True, type=click.IntRange(1, MAX_POSITIONS),
              help="Tokens of the eager prefill that starts the shared state (less than the bucket's capacity).")
@click.option("--samples", default=40, show_default=True, type=click.IntRange(1, MAX_SAMPLES),
              help=f"Timing samples per candidate and measure, 1..{MAX_SAMPLES} (fewer than 40 marks the report "
                   "failed).")
@click.option("--baselines", multiple=True, metavar="NAME[,NAME]",
              callback=lambda ctx, param, value: parse_baselines(value),
              help=f"Baselines to time against (default inductor-reduce-overhead,inductor-graph); "
                   f"known: {', '.join(KNOWN_BASELINES)}.")
@click.option("--device", default=None, help="CUDA device, cuda or cuda:N (default: the current one).")
@click.option("--model-path", default=None, type=click.Path(exists=True, path_type=Path),
              help="Where the local model folder or .gguf file a package was baked from lies on this machine, when "
                   "it moved (its weights must still match the package's sha256).")
@reports_errors
def verify_command(package: Path, steps, prefill: int, samples: int, baselines, device, model_path):
    """Verify PACKAGE on this Hopper GPU: numerics across advancing decode calls and timing against
    CUDA-graphed Inductor; writes the evidence and the status into PACKAGE/report.json."""
    from megabake.package import read_package

    from .api import verify_package
    from .numerics import resolve_steps
    from .report import summary_lines

    if not (package / "manifest.json").is_file():
        raise InputError(f"{package} is not a package folder: manifest.json is missing. fix: pass the variant "
                         "folder packages/<org>--<model>/<rev>/<variant>/ written by `megabake bake` "
                         "(`megabake ls` lists them)")
    if device is not None and not re.fullmatch(r"cuda(:[0-9]+)?", device):
        raise InputError(f"--device {device!r} is not a CUDA device; pass cuda or cuda:N (e.g. cuda:0)")
    capacity = read_package(package).variant.capacity  # digests and schemas: a mismatch exits 1
    if prefill >= capacity:
        raise InputError(f"--prefill {prefill} does not fit the KV capacity {capacity} of {package.name}: use "
                         f"--prefill 1..{capacity - 1}")
    resolve_steps(steps, prefill, capacity)  # an InputError (exit 2) names the steps that fit
    report = verify_package(package, steps=steps, prefill=prefill, samples=samples, baselines=baselines,
                            device=device, model_path=model_path)
    for line in summary_lines(report):
        click.echo(line)
    click.echo(f"report: {package / 'report.json'}")
    if report["status"] != "verified":
        raise SystemExit(EXIT_FAILED)

