"""``megabake registry``: the click group that builds the registry and plans CI bakes.

Contract (thin: parse, call megabake.registry, print; errors exit 1 with the message, never a traceback):

* ``megabake registry build [--packages packages/] [--out registry/] [--hub-repo ORG/NAME]`` writes
  ``<out>/index.json`` (schema-checked) and ``<out>/leaderboard.html`` from every package under ``--packages``,
  prints one summary line then the two paths (one per line, the leaderboard last).
* ``megabake registry matrix [--matrix registry/bake-matrix.json] [--models all] [--buckets all]
  [--github-output FILE]`` prints the bake job list as a JSON array (one object per model x bucket:
  model, revision, batch, capacity, bucket, key); with ``--github-output`` it also appends ``matrix=<json>`` to
  that file (GitHub Actions' ``$GITHUB_OUTPUT``). The bake workflow's plan job runs exactly this.

Registered on the main CLI by ``megabake/cli.py`` (``cli.add_command(registry)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from megabake.errors import MegaBakeError


@click.group(name="registry")
def registry() -> None:
    """Registry index, leaderboard page, and the CI bake matrix."""


@registry.command(name="build")
@click.option("--packages", "packages_root", default="packages/", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Packages root to index.")
@click.option("--out", "out_dir", default="registry/", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Where index.json and leaderboard.html go.")
@click.option("--hub-repo", default=None, metavar="ORG/NAME",
              help="Hub repo the packages are published in (recorded in the index, linked from the page).")
def build(packages_root: Path, out_dir: Path, hub_repo: str | None) -> None:
    """Build registry/index.json and registry/leaderboard.html from the packages and their reports."""
    from megabake.registry.leaderboard import build_registry

    try:
        result = build_registry(packages_root, out_dir, hub_repo=hub_repo or None)
    except (MegaBakeError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    models = len({r.model_id for r in result.rows})
    click.echo(f"{len(result.rows)} package(s) of {models} model(s), {result.verified} verified", err=True)
    click.echo(str(result.index_path))
    click.echo(str(result.leaderboard_path))


@registry.command(name="matrix")
@click.option("--matrix", "matrix_path", default="registry/bake-matrix.json", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The checked-in bake matrix.")
@click.option("--models", default="all", show_default=True,
              help='"all", or comma-separated model ids (listed, or any Hub org/name, optionally @revision).')
@click.option("--buckets", default="all", show_default=True,
              help='"all", or comma-separated b<batch>-c<capacity> (e.g. b1-c128).')
@click.option("--github-output", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Append matrix=<json> to this file (GitHub Actions $GITHUB_OUTPUT).")
def matrix(matrix_path: Path, models: str, buckets: str, github_output: Path | None) -> None:
    """Print the bake jobs (models x buckets) as JSON, for the CI bake workflow or a by-hand loop."""
    from megabake.registry.matrix import load_matrix, select

    try:
        jobs = select(load_matrix(matrix_path), models=models, buckets=buckets)
    except MegaBakeError as exc:
        raise click.ClickException(str(exc)) from None
    text = json.dumps(jobs, separators=(",", ":"))
    if github_output is not None:
        with open(github_output, "a", encoding="utf-8") as handle:
            handle.write(f"matrix={text}\n")
    for job in jobs:
        rev = f"@{job['revision']}" if job["revision"] else ""
        click.echo(f"  {job['model']}{rev}  {job['bucket']}", err=True)
    click.echo(text)
