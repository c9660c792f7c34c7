"""The ``megabake verify`` click command (thin: parse, call ``verify_package``, print, exit code).

Contract: ``verify_command`` verifies a package folder on this machine's Hopper GPU and updates its
report.json. Exit codes: 0 verified, 1 failed (report written, reasons printed), 3 cannot run here (no
Hopper GPU, missing dependency, broken package: report unchanged). Heavy imports happen inside the command.
Register with ``cli.add_command(verify_command)``.
"""

from __future__ import annotations

from pathlib import Path

import click

EXIT_FAILED = 1
EXIT_CANNOT_RUN = 3
KNOWN_BASELINES = ("inductor-reduce-overhead", "inductor-graph", "eager")


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


@click.command("verify")
@click.argument("package", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--steps", default="64", show_default=True, callback=lambda ctx, param, value: parse_steps(value),
              help="Advancing decode steps after the prefill, or 'max' to fill the bucket's KV capacity.")
@click.option("--prefill", default=16, show_default=True, type=click.IntRange(min=1),
              help="Tokens of the eager prefill that starts the shared state.")
@click.option("--samples", default=40, show_default=True, type=click.IntRange(min=1),
              help="Timing samples per candidate and measure (fewer than 40 marks the report failed).")
@click.option("--baselines", multiple=True, metavar="NAME[,NAME]",
              callback=lambda ctx, param, value: parse_baselines(value),
              help=f"Baselines to time against (default inductor-reduce-overhead,inductor-graph); "
                   f"known: {', '.join(KNOWN_BASELINES)}.")
@click.option("--device", default=None, help="CUDA device, e.g. cuda:0 (default: the current one).")
def verify_command(package: Path, steps, prefill: int, samples: int, baselines, device):
    """Verify PACKAGE on this Hopper GPU: numerics across advancing decode calls and timing against
    CUDA-graphed Inductor; writes the evidence and the status into PACKAGE/report.json."""
    from megabake.errors import MegaBakeError

    from .api import verify_package
    from .report import summary_lines

    try:
        report = verify_package(package, steps=steps, prefill=prefill, samples=samples, baselines=baselines,
                                device=device)
    except MegaBakeError as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        raise SystemExit(EXIT_CANNOT_RUN) from None
    for line in summary_lines(report):
        click.echo(line)
    click.echo(f"report: {package / 'report.json'}")
    if report["status"] != "verified":
        raise SystemExit(EXIT_FAILED)
