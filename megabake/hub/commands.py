"""Click commands ``publish``, ``ls`` and ``lock`` (registered in ``megabake/cli.py``); thin: parse, call the API,
print.

Contract: ``megabake publish PACKAGE... --repo ORG/NAME`` publishes with :func:`megabake.hub.publish` (exit 1 with
cause and fix on refusal, conflict or failure; exit 2 for bad input found before any network call: a folder
without packages, a bad --repo / --parent-commit / --endpoint; ``--dry-run`` prints the commit it would make).
``megabake ls`` lists packages baked under ``--root``, the local registry index, and (with ``--repo``) a Hub
repo's index. ``megabake lock REPO[@REV]... [--out megabake.lock]`` resolves each repo's package as
``load_from_hub`` would (same selection options), downloads and verifies it, and writes the lock file
(:mod:`megabake.hub.lock`; exit 1 when a repo cannot be read, nothing fits, or ``--out`` pins other packages
without ``--force``; exit 2 for bad input found before any network call). Errors print ``error: <message>`` on
stderr (``megabake.errors``), never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import click
from huggingface_hub.errors import HfHubHTTPError

from megabake.errors import (EXIT_FAILED, UNAVAILABLE_HELP, InputError, MegaBakeError, check_commit_sha, check_endpoint,
                             check_repo_id, exit_codes_help, fail, network_errors, reports_errors)
from megabake.hub.errors import LockFileError
from megabake.hub.load import fetch_to_lock, read_hub_index
from megabake.hub.lock import LOCK_FILE, lock_entry, make_lock, read_lock, write_lock
from megabake.hub.select import Request
from megabake.package.layout import GPU_CLASS_RE, check_model_revision
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
  megabake lock my-org/SmolLM-135M-megabake   # then load_from_hub(repo, lockfile="megabake.lock"): that commit + digest
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


LOCK_EXIT_CODES = exit_codes_help(
    ok="the lock file was written, or left unchanged because it already pins the same packages",
    failed="a repo could not be read, no package fits, a package failed verification, or --out pins other "
           "packages (nothing written; --force replaces it)",
    usage="usage or bad input, before any network call: a bad REPO[@REV], --model-revision, --bucket, "
          "--gpu-class or --endpoint, a repo named twice, an --out that is a folder or not a lock file",
    cannot_run=UNAVAILABLE_HELP)
LOCK_HELP = """\b
The lock file (JSON, schemas/lock.schema.json) pins, for each repo: the resolved commit, the package folder,
its variant and the sha256 of its manifest.json. Load exactly that package (trusted: the commit is pinned):
  dec = megabake.load_from_hub("my-org/SmolLM-135M-megabake", lockfile="megabake.lock")
Locking the same state again leaves the file unchanged (identical bytes); a lock that would pin other
packages replaces --out only with --force.
"""


@click.command("lock", epilog=LOCK_HELP + "\n\n" + LOCK_EXIT_CODES)
@click.argument("repos", nargs=-1, required=True, metavar="REPO[@REV]...")
@click.option("--model-id", metavar="ID", help="The model whose package to lock, when a repo holds several.")
@click.option("--model-revision", metavar="REV", help="The model revision (40-hex sha, random-seed<N> or "
              "sha256-<16 hex>), when a repo holds several.")
@click.option("--bucket", metavar="BUCKET", help="KV capacity (512), b<batch>-c<capacity> or a variant name; the "
              "smallest capacity that fits is locked (default: batch 1, any capacity).")
@click.option("--gpu-class", metavar="CLASS", help="GPU class of the machines that will load it, e.g. sm90a-132sm "
              "(default: any; the loader refuses a CUDA device of another class).")
@click.option("--allow-unverified", is_flag=True, help="Lock an unverified package (loading it then needs "
              "allow_unverified=True too).")
@click.option("--out", default=LOCK_FILE, show_default=True, type=click.Path(dir_okay=False),
              help="Lock file to write (atomically).")
@click.option("--force", is_flag=True, help="Replace an --out file that pins other packages or is not a lock.")
@click.option("--endpoint", envvar="HF_ENDPOINT", metavar="URL", help="Hub endpoint [env HF_ENDPOINT].")
@click.option("--token", envvar="HF_TOKEN", metavar="TOKEN", help="Hub token [env HF_TOKEN; default: saved login].")
@reports_errors
def lock(repos, model_id, model_revision, bucket, gpu_class, allow_unverified, out, force, endpoint, token) -> None:
    """Pin the package each Hub REPO (at REV: a branch, tag or commit; default main) would load, in a lock file."""
    targets = [_repo_arg(arg) for arg in repos]
    names = [repo for repo, _ in targets]
    twice = sorted({repo for repo in names if names.count(repo) > 1})
    if twice:
        raise InputError(f"{', '.join(twice)} is named more than once; a lock holds one package per repo. fix: name "
                         "each repo once")
    bucket = _lock_request(bucket, gpu_class, model_id, model_revision)
    if endpoint:
        check_endpoint(endpoint)
    _check_lock_out(Path(out), force)
    entries = []
    for repo, revision in targets:
        try:
            fetched = fetch_to_lock(repo, revision, model_id=model_id, model_revision=model_revision, bucket=bucket,
                                    gpu_class=gpu_class, allow_unverified=allow_unverified, endpoint=endpoint,
                                    token=token)
        except MegaBakeError:
            raise
        except (HfHubHTTPError, *network_errors()) as exc:
            fail(f"cannot read {repo}@{revision or 'main'}: {exc}. Nothing was written; retry with network access",
                 EXIT_FAILED)
        entry = lock_entry(fetched)
        entries.append(entry)
        click.echo(f"locked {repo}@{entry['revision']}: commit {entry['commit']} {entry['path']} ({entry['status']}, "
                   f"manifest sha256 {entry['manifest_sha256']})")
    outcome = write_lock(out, make_lock(entries), force=force)
    click.echo({"written": f"wrote {out}", "updated": f"updated {out} (--force)",
                "unchanged": f"unchanged: {out} already pins these packages"}[outcome])
    click.echo(f"load with: megabake.load_from_hub({names[0]!r}, lockfile={str(out)!r})")


def _repo_arg(arg: str) -> tuple[str, str | None]:
    """``ORG/NAME[@REV]`` -> (repo id, revision or None)."""
    repo, at, revision = arg.partition("@")
    check_repo_id(repo, "REPO")
    if at and not revision.strip():
        raise InputError(f"REPO {arg!r} ends with '@' but names no revision; pass ORG/NAME or ORG/NAME@REV (a branch, "
                         "tag or commit)")
    return repo, revision or None


def _lock_request(bucket: str | None, gpu_class: str | None, model_id: str | None, model_revision: str | None):
    """The --bucket value as load_from_hub takes it; every selection option checked before any network call."""
    if gpu_class is not None and not GPU_CLASS_RE.match(gpu_class):
        raise InputError(f"--gpu-class {gpu_class!r} is not of the form sm<CC>[a]-<SMs>sm, e.g. sm90a-132sm "
                         "(H100/H200 SXM) or sm90a-114sm (H100 PCIe)")
    if model_revision is not None:
        try:
            check_model_revision(model_revision)
        except ValueError as exc:
            raise InputError(f"--model-revision: {exc}") from None
    value = int(bucket) if bucket and bucket.isdigit() else bucket
    try:
        Request.from_args(value, gpu_class, model_id, model_revision)
    except (ValueError, TypeError) as exc:
        raise InputError(f"--bucket {bucket!r}: {exc}. fix: pass a KV capacity (512), b<batch>-c<capacity> "
                         "(b1-c512) or a variant name (decode-b1-c512-sm90a-132sm)") from None
    return value


def _check_lock_out(out: Path, force: bool) -> None:
    """--out must be a file in an existing folder; an existing file must be a lock unless --force."""
    if out.is_dir():
        raise InputError(f"--out {out} is a folder; pass the lock file's path, e.g. {out / LOCK_FILE}")
    if not out.parent.is_dir():
        raise InputError(f"--out {out}: the folder {out.parent} does not exist. fix: create it, or pass another --out")
    if out.exists() and not force:
        try:
            read_lock(out)
        except LockFileError as exc:
            raise InputError(f"--out {out} exists and is not a MegaBake lock file ({str(exc).split('. fix:')[0]}). "
                             "Nothing was written. fix: pass another --out, or --force to overwrite it") from None
