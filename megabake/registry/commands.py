"""``megabake registry``: the click group that builds the registry and plans CI bakes.

Contract (thin: parse, check, call megabake.registry, print; never a traceback). Errors print
``error: <message>`` on stderr; exit 0 ok, 1 a check failed (a package whose files or report do not check
out), 2 usage or bad input (a missing --packages folder, an --out that cannot be written, a bad --hub-repo,
an unknown model or bucket in --models / --buckets, a bad matrix file):

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

from megabake.errors import (EXIT_FAILED, EXIT_USAGE, UNAVAILABLE_HELP, InputError, MegaBakeError, check_out_dir,
                             check_repo_id, exit_codes_help, fail, remove_created, reports_errors)

BUILD_EXIT_CODES = exit_codes_help(
    ok="index.json and leaderboard.html written",
    failed="a check failed: a package's files do not match its manifest, or its report breaks the schema "
           "(no leaderboard written)",
    usage="usage or bad input: --packages does not exist, --out cannot be written, a bad --hub-repo",
    cannot_run=UNAVAILABLE_HELP)
MATRIX_EXIT_CODES = exit_codes_help(
    ok="the job list printed (and appended to --github-output)",
    failed="--github-output could not be written",
    usage="usage or bad input: a missing or invalid matrix file, an unknown model or bucket",
    cannot_run=UNAVAILABLE_HELP)


@click.group(name="registry", epilog=exit_codes_help(cannot_run=UNAVAILABLE_HELP))
def registry() -> None:
    """Registry index, leaderboard page, and the CI bake matrix."""


@registry.command(name="build", epilog=BUILD_EXIT_CODES)
@click.option("--packages", "packages_root", default="packages/", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Packages root to index.")
@click.option("--out", "out_dir", default="registry/", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Where index.json and leaderboard.html go.")
@click.option("--hub-repo", default=None, metavar="ORG/NAME",
              help="Hub repo the packages are published in (recorded in the index, linked from the page).")
@reports_errors
def build(packages_root: Path, out_dir: Path, hub_repo: str | None) -> None:
    """Build registry/index.json and registry/leaderboard.html from the packages and their reports."""
    from megabake.registry.leaderboard import build_registry

    if not packages_root.is_dir():
        raise InputError(f"packages folder {packages_root} does not exist; pass --packages DIR (the folder "
                         "`megabake bake --out` wrote to)")
    if hub_repo:
        check_repo_id(hub_repo, "--hub-repo")
    created = check_out_dir(out_dir, "--out")
    try:
        result = build_registry(packages_root, out_dir, hub_repo=hub_repo or None)
    except BaseException as exc:
        remove_created(created)  # only the folders the --out check made, and only while still empty
        if isinstance(exc, ValueError) and not isinstance(exc, MegaBakeError):  # a package missing from the index
            fail(exc, EXIT_FAILED)
        raise
    models = len({r.model_id for r in result.rows})
    click.echo(f"{len(result.rows)} package(s) of {models} model(s), {result.verified} verified", err=True)
    click.echo(str(result.index_path))
    click.echo(str(result.leaderboard_path))


@registry.command(name="matrix", epilog=MATRIX_EXIT_CODES)
@click.option("--matrix", "matrix_path", default="registry/bake-matrix.json", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The checked-in bake matrix.")
@click.option("--models", default="all", show_default=True,
              help='"all", or comma-separated model ids (listed, or any Hub org/name, optionally @revision).')
@click.option("--buckets", default="all", show_default=True,
              help='"all", or comma-separated b<batch>-c<capacity> (e.g. b1-c128).')
@click.option("--github-output", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Append matrix=<json> to this file (GitHub Actions $GITHUB_OUTPUT).")
@reports_errors
def matrix(matrix_path: Path, models: str, buckets: str, github_output: Path | None) -> None:
    """Print the bake jobs (models x buckets) as JSON, for the CI bake workflow or a by-hand loop."""
    from megabake.registry.matrix import load_matrix, select

    if github_output is not None and not github_output.parent.is_dir():
        raise InputError(f"--github-output {github_output}: folder {github_output.parent} does not exist")
    try:
        jobs = select(load_matrix(matrix_path), models=models, buckets=buckets)
    except MegaBakeError as exc:  # the matrix file or the selection is bad input
        fail(exc, EXIT_USAGE)
    text = json.dumps(jobs, separators=(",", ":"))
    if github_output is not None:
        with open(github_output, "a", encoding="utf-8") as handle:
            handle.write(f"matrix={text}\n")
    for job in jobs:
        rev = f"@{job['revision']}" if job["revision"] else ""
        click.echo(f"  {job['model']}{rev}  {job['bucket']}", err=True)
    click.echo(text)
