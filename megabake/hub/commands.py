"""Click commands ``publish`` and ``ls`` (registered in ``megabake/cli.py``); thin: parse, call the API, print.

Contract: ``megabake publish PACKAGE... --repo ORG/NAME`` publishes with :func:`megabake.hub.publish` (exit 1 with
cause and fix on refusal, conflict or failure; exit 2 for bad input found before any network call: a folder
without packages, a bad --repo / --parent-commit / --endpoint; ``--dry-run`` prints the commit it would make).
``megabake ls`` lists packages baked under ``--root``, the local registry index, and (with ``--repo``) a Hub
repo's index. Errors print ``error: <message>`` on stderr (``megabake.errors``), never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import click
from huggingface_hub.errors import HfHubHTTPError

from megabake.errors import (EXIT_FAILED, UNAVAILABLE_HELP, InputError, MegaBakeError, check_commit_sha, check_endpoint,
                             check_repo_id, exit_codes_help, fail, network_errors, reports_errors)
from megabake.hub.load import read_hub_index
from megabake.hub.publish import publish as publish_packages
from megabake.package import find_packages, iter_entries, read_index, read_package

WALKTHROUGH = """\b
Walkthrough (bake -> verify -> publish -> load; docs/PUBLISHING.md has the long form):
  megabake bake --model HuggingFaceTB/SmolLM-135M --revision main --out packages/
  megabake verify packages/HuggingFaceTB--SmolLM-135M/<sha>/decode-b1-c128-sm90a-132sm
  megabake inspect packages/HuggingFaceTB--SmolLM-135M/<sha>/decode-b1-c128-sm90a-132sm
  hf auth login                    # or export HF_TOKEN=hf_...
  megabake publish packages/HuggingFaceTB--SmolLM-135M --repo my-org/SmolLM-135M-megabake --dry-run
  megabake publish packages/HuggingFaceTB--SmolLM-135M --repo my-org/SmolLM-135M-megabake
\b
What one publish writes, in ONE commit on --branch (parent = the head read at start; if someone else
commits first you get a conflict error and nothing is overwritten; rerun to merge):
  packages/<org>--<model>/<model-rev>/<variant>/{module.py,plan.json,source_map.json,report.json,manifest.json}
  registry/index.json   model id -> model revision -> packages, headline numbers
  README.md             model card (library_name: megabake, base_model, tags, table of variants)
then one immutable tag per package: <org>--<model>.<model-rev>.<variant>
\b
Load it back (Python):
  import megabake
  dec = megabake.load_from_hub("my-org/SmolLM-135M-megabake", "main", bucket=512, trust_remote_code=True)
  dec = megabake.load_from_hub("my-org/SmolLM-135M-megabake", "<40-hex commit>")   # pinned: trusted
  HF_HUB_OFFLINE=1 python ...      # reloads from the Hugging Face cache
\b
Refused unless a flag says otherwise: unverified packages (--allow-unverified), random weights
(--allow-random-weights). Always refused: failed / fallback packages, files whose sha256 differs from
manifest.json, a tag that already names different contents.
"""

PUBLISH_EXIT_CODES = exit_codes_help(
    ok="published (or, with --dry-run, planned; or nothing new to publish)",
    failed="refused (unverified, random weights, failed, tampered), a conflict (the branch moved), a tag that "
           "names other contents, or the Hub could not be reached: nothing was published",
    usage="usage or bad input, before any network call: a missing folder, a folder without packages, a bad "
          "--repo, --parent-commit or --endpoint",
    cannot_run=UNAVAILABLE_HELP)
LS_EXIT_CODES = exit_codes_help(
    ok="listed",
    failed="the registry index is invalid, or the Hub repo's index could not be read",
    usage="usage or bad input: a bad --repo or --endpoint",
    cannot_run=UNAVAILABLE_HELP)


def _package_paths(paths: tuple[str, ...]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        inside = find_packages(path)
        if not inside:
            raise InputError(f"{path}: no package folder (manifest.json) found. fix: pass a folder written by "
                             "`megabake bake` (see `megabake ls`)")
        found += inside
    return found


@click.command("publish", epilog=WALKTHROUGH + "\n\n" + PUBLISH_EXIT_CODES)
@click.argument("packages", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--repo", "repo_id", required=True, metavar="ORG/NAME", help="Hub model repo (created if needed).")
@click.option("--branch", default="main", show_default=True, help="Branch to commit to.")
@click.option("--parent-commit", metavar="SHA", help="Commit only if the branch head is still SHA (e.g. the parent "
              "a --dry-run showed); otherwise fail with a conflict.")
@click.option("--allow-unverified", is_flag=True, help="Publish packages whose status is 'unverified'.")
@click.option("--allow-random-weights", is_flag=True, help="Publish packages baked from random preset weights.")
@click.option("--dry-run", is_flag=True, help="Show the commit, files and tags that would be written; write nothing.")
@click.option("--private", is_flag=True, default=None, help="Create the repo private (if it does not exist).")
@click.option("--endpoint", envvar="HF_ENDPOINT", metavar="URL", help="Hub endpoint [env HF_ENDPOINT].")
@click.option("--token", envvar="HF_TOKEN", metavar="TOKEN", help="Hub token [env HF_TOKEN; default: saved login].")
@reports_errors
def publish(packages, repo_id, branch, parent_commit, allow_unverified, allow_random_weights, dry_run, private,
            endpoint, token) -> None:
    """Publish PACKAGE folders (or folders holding packages) to the Hub in one atomic commit."""
    check_repo_id(repo_id)
    if not branch.strip():
        raise InputError("--branch is empty; pass a branch name such as main")
    if parent_commit is not None:
        check_commit_sha(parent_commit, "--parent-commit")
    if endpoint:
        check_endpoint(endpoint)
    paths = _package_paths(packages)
    try:
        result = publish_packages(paths, repo_id, branch=branch, parent_commit=parent_commit,
                                  allow_unverified=allow_unverified, allow_random_weights=allow_random_weights,
                                  dry_run=dry_run, private=private or None, endpoint=endpoint, token=token)
    except MegaBakeError:
        raise  # error: <message>, with the error's exit code
    except HfHubHTTPError as exc:
        fail(f"the Hub refused the request: {exc}. Nothing was published", EXIT_FAILED)
    except network_errors() as exc:
        fail(f"could not reach the Hub at {endpoint or 'the default endpoint'}: {exc}. Nothing was published; "
             "retry with network access", EXIT_FAILED)
    click.echo(result.plan.summary())
    if dry_run:
        click.echo("dry run: nothing was written")
        return
    if result.commit is None:
        click.echo("nothing to publish: every package is already published under its tag")
        return
    click.echo(f"published to {repo_id} at commit {result.commit}; tags created: {', '.join(result.tags) or 'none'}")
    example = result.tags[0] if result.tags else result.commit
    click.echo(f"load with: megabake.load_from_hub({repo_id!r}, revision={example!r}, trust_remote_code=True)")


@click.command("ls", epilog=LS_EXIT_CODES)
@click.option("--root", default="packages", show_default=True, type=click.Path(), help="Packages root to scan.")
@click.option("--registry", default="registry/index.json", show_default=True, type=click.Path(),
              help="Local registry index (skipped if absent).")
@click.option("--repo", "repo_id", metavar="ORG/NAME", help="Also list the registry index of this Hub repo.")
@click.option("--revision", default="main", show_default=True, help="Revision of --repo.")
@click.option("--endpoint", envvar="HF_ENDPOINT", metavar="URL", help="Hub endpoint [env HF_ENDPOINT].")
@click.option("--token", envvar="HF_TOKEN", metavar="TOKEN", help="Hub token [env HF_TOKEN].")
@reports_errors
def ls(root, registry, repo_id, revision, endpoint, token) -> None:
    """List packages baked locally and the packages the registry knows."""
    if repo_id:
        check_repo_id(repo_id)
    if endpoint:
        check_endpoint(endpoint)
    click.echo(f"baked locally under {root}:")
    paths = find_packages(root) if Path(root).is_dir() else []
    for path in paths:
        try:
            package = read_package(path)
            click.echo(f"  {package.model_id}@{package.model_revision}  {package.report['variant']}  "
                       f"{package.status}  {path}")
        except MegaBakeError as exc:
            click.echo(f"  INVALID  {path}: {str(exc).splitlines()[0]}")
    if not paths:
        click.echo("  (none)")
    if Path(registry).is_file():
        _echo_index(f"registry index {registry}:", read_index(registry))  # an invalid index exits 1
    if repo_id:
        try:
            index, commit = read_hub_index(repo_id, revision, endpoint=endpoint, token=token)
        except MegaBakeError as exc:
            fail(f"cannot read the registry index of {repo_id}@{revision}: {exc}", exc.exit_code)
        except (HfHubHTTPError, *network_errors()) as exc:
            fail(f"cannot read the registry index of {repo_id}@{revision}: {exc}", EXIT_FAILED)
        _echo_index(f"Hub repo {repo_id}@{revision} (commit {commit}):", index)


def _echo_index(title: str, index: dict) -> None:
    click.echo(title)
    rows = list(iter_entries(index))
    for model_id, revision, e in rows:
        numbers = "" if e["megabake_ms"] is None else f"  {e['megabake_ms']:.4g} ms"
        if e["speedup"] is not None:
            numbers += f" ({e['speedup']:.3g}x vs {e['baseline']})"
        where = f"{e['hub_repo']}:{e['path']}" if e["hub_repo"] else e["path"]
        click.echo(f"  {model_id}@{revision}  {e['variant']}  {e['status']}{numbers}  {where}")
    if not rows:
        click.echo("  (none)")
