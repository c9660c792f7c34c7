"""``megabake registry``: the click group that builds the registry and plans CI bakes.

Contract (thin: parse, check, call megabake.registry, print; never a traceback). Errors print
``error: <message>`` on stderr; exit 0 ok, 1 a check failed (a package whose files or report do not check
out), 2 usage or bad input (a missing --packages folder, an --out that cannot be written, a bad --hub-repo,
an unknown model or bucket in --models / --buckets, a bad matrix file):

* ``megabake registry build [--packages packages/] [--out registry/] [--hub-repo ORG/NAME]`` writes
  ``<out>/index.json`` (schema-checked) and ``<out>/leaderboard.html`` from every package under ``--packages``,
  prints one summary line then the two paths (one per line, the leaderboard last).
  With a generated ``docs/MODELS.md`` (``--models-table``, by default ``<packages>/../docs/MODELS.md`` when it
  exists; ``none`` to leave it out) the page ends with its Models section; a table whose preset rows the packages
  changed is rendered with a "stale" banner and a warning on stderr.
* ``megabake registry models [--packages packages/] [--out docs/MODELS.md] [--families all] [--check]`` writes
  the architecture x status table (:mod:`.models`): built-in presets from their newest package reports, and each
  family of the declarative list tried on the CPU (capture -> IR -> plan -> module.py, tens of seconds). Prints
  one line per family on stderr, then the path. ``--check`` writes nothing and exits 1 when the file differs from
  what would be written (saying which rows changed), 0 when it is up to date.
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
MODELS_EXIT_CODES = exit_codes_help(
    ok="the table written (or, with --check, it is up to date)",
    failed="--check: the file is missing or stale (which rows changed is printed); or a package's files or report "
           "do not check out",
    usage="usage or bad input: --packages does not exist, an unknown family in --families, --out cannot be "
          "written",
    cannot_run=UNAVAILABLE_HELP)
MATRIX_EXIT_CODES = exit_codes_help(
    ok="the job list printed (and appended to --github-output)",
    failed="--github-output could not be written",
    usage="usage or bad input: a missing or invalid matrix file, an unknown model or bucket",
    cannot_run=UNAVAILABLE_HELP)


@click.group(name="registry", epilog=exit_codes_help(cannot_run=UNAVAILABLE_HELP))
def registry() -> None:
    """Registry index, leaderboard page, models table (docs/MODELS.md), and the CI bake matrix."""


@registry.command(name="build", epilog=BUILD_EXIT_CODES)
@click.option("--packages", "packages_root", default="packages/", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Packages root to index.")
@click.option("--out", "out_dir", default="registry/", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="Where index.json and leaderboard.html go.")
@click.option("--hub-repo", default=None, metavar="ORG/NAME",
              help="Hub repo the packages are published in (recorded in the index, linked from the page).")
@click.option("--models-table", default="auto", show_default=True, metavar="PATH|auto|none",
              help="The generated models table (`megabake registry models`) whose rows become the page's Models "
                   "section; auto: <packages>/../docs/MODELS.md if it exists; none: no Models section.")
@reports_errors
def build(packages_root: Path, out_dir: Path, hub_repo: str | None, models_table: str) -> None:
    """Build registry/index.json and registry/leaderboard.html from the packages and their reports."""
    from megabake.registry.leaderboard import build_registry

    if not packages_root.is_dir():
        raise InputError(f"packages folder {packages_root} does not exist; pass --packages DIR (the folder "
                         "`megabake bake --out` wrote to)")
    if hub_repo:
        check_repo_id(hub_repo, "--hub-repo")
    table = _models_table(models_table, packages_root)
    created = check_out_dir(out_dir, "--out")
    try:
        result = build_registry(packages_root, out_dir, hub_repo=hub_repo or None, models_table=table)
    except BaseException as exc:
        remove_created(created)  # only the folders the --out check made, and only while still empty
        if isinstance(exc, ValueError) and not isinstance(exc, MegaBakeError):  # a package missing from the index
            fail(exc, EXIT_FAILED)
        raise
    models = len({r.model_id for r in result.rows})
    click.echo(f"{len(result.rows)} package(s) of {models} model(s), {result.verified} verified", err=True)
    if result.models_table is None:
        click.echo("no models table: the page has no Models section (write one with `megabake registry models`)",
                   err=True)
    elif result.models_stale:
        click.secho(f"warning: {result.models_table} is stale ({'; '.join(result.models_stale)}); the Models "
                    "section says so. Regenerate it with `megabake registry models`.", fg="yellow", err=True)
    else:
        click.echo(f"Models section: {len(result.model_rows)} row(s) from {result.models_table}", err=True)
    click.echo(str(result.index_path))
    click.echo(str(result.leaderboard_path))


def _models_table(option: str, packages_root: Path) -> Path | None:
    """--models-table: auto (next to the packages root, if there), none, or a path that must exist."""
    if option.lower() == "none":
        return None
    if option.lower() == "auto":
        from megabake.registry.models import MODELS_FILE

        path = packages_root.parent / MODELS_FILE
        return path if path.is_file() else None
    path = Path(option)
    if not path.is_file():
        raise InputError(f"--models-table {path} does not exist; write it with `megabake registry models --out "
                         f"{path}` or pass --models-table none")
    return path


@registry.command(name="models", epilog=MODELS_EXIT_CODES)
@click.option("--packages", "packages_root", default="packages/", show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="Packages root whose reports give each built-in preset's status.")
@click.option("--out", "out_path", default="docs/MODELS.md", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The Markdown table to write (or --check).")
@click.option("--families", default="all", show_default=True,
              help='"all", or comma-separated family keys of megabake/registry/models.py (e.g. llama,gemma).')
@click.option("--check", is_flag=True,
              help="Write nothing; exit 1 if --out is missing or differs from what would be written.")
@reports_errors
def models(packages_root: Path, out_path: Path, families: str, check: bool) -> None:
    """Write docs/MODELS.md: architecture families and presets x status (verified on a GPU, bakes on the CPU,
    or refused and why), from the package reports and a CPU try of each family's tiny config."""
    from megabake.registry.models import get_families, model_rows, parse_table, render_markdown, stale_rows

    if not packages_root.is_dir():
        raise InputError(f"packages folder {packages_root} does not exist; pass --packages DIR (the folder "
                         "`megabake bake --out` wrote to)")
    chosen = get_families(families)
    if not check:
        check_out_dir(out_path.parent, "--out")  # before the CPU tries, not after

    def progress(row) -> None:
        click.echo(f"  {row.family}: {row.label}" + (f" ({row.error_class})" if row.error_class else ""), err=True)

    rows = model_rows(packages_root, out_path.parent, families=chosen, progress=progress)
    text = render_markdown(rows, packages=packages_root.as_posix().rstrip("/") + "/")
    if check:
        if not out_path.is_file():
            fail(f"{out_path} does not exist; write it with `megabake registry models --out {out_path}`", EXIT_FAILED)
        current = out_path.read_text(encoding="utf-8")
        if current != text:
            try:
                changes = stale_rows(parse_table(current, str(out_path)), rows)
            except MegaBakeError:
                changes = []
            what = "; ".join(changes) or "the text around the table differs"
            fail(f"{out_path} is stale: {what}. Regenerate it with `megabake registry models --out {out_path}`",
                 EXIT_FAILED)
        click.echo(f"{out_path} is up to date ({len(rows)} rows)", err=True)
        click.echo(str(out_path))
        return
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out_path)
    click.echo(f"{len(rows)} row(s) written", err=True)
    click.echo(str(out_path))


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
