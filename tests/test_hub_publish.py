"""`megabake publish` against the local fake Hub with the real huggingface_hub client (nothing mocked)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from huggingface_hub import HfApi, ModelCard

from megabake.hub import (
    CARD_PATH,
    INDEX_PATH,
    ImmutableTagError,
    PublishConflictError,
    PublishFailedError,
    PublishRefusedError,
    commit_publish,
    make_api,
    plan_publish,
    publish,
)
from megabake.hub.commands import publish as publish_cmd
from megabake.package import DigestMismatchError, read_package, validate, write_package

from tests.fixtures_packages import PRETRAINED, PRETRAINED_REV, fixture_files, make_report, write_fixture_package

REPO = "my-org/smollm-megabake"
TOKEN = "hf_fake_token"


def _pub(server, packages, **kw):
    return publish(packages, REPO, endpoint=server.url, token=TOKEN, **kw)


def _api(server) -> HfApi:
    return make_api(server.url, TOKEN)


def _package_files(package, prefix=None) -> dict[str, bytes]:
    prefix = prefix or package.repo_path
    return {f"{prefix}/{name}": (package.path / name).read_bytes() for name in package.files}


@pytest.fixture
def pretrained(tmp_path):
    """Two verified pretrained packages (c128 on H100-class, c512) of one model revision."""
    root = tmp_path / "packages"
    return [write_fixture_package(root, model_id=PRETRAINED, revision=PRETRAINED_REV, capacity=c) for c in (128, 512)]


def test_publish_refuses_unverified_random_and_tampered(hub_server, tmp_path):
    unverified = write_fixture_package(tmp_path / "a", model_id=PRETRAINED, revision=PRETRAINED_REV,
                                       status="unverified")
    random = write_fixture_package(tmp_path / "b")
    failed = write_fixture_package(tmp_path / "c", model_id=PRETRAINED, revision=PRETRAINED_REV, status="failed")
    with pytest.raises(PublishRefusedError, match="--allow-unverified"):
        _pub(hub_server, [unverified])
    with pytest.raises(PublishRefusedError, match="--allow-random-weights"):
        _pub(hub_server, [random])
    with pytest.raises(PublishRefusedError, match="'failed' packages are never published|failed packages are never"):
        _pub(hub_server, [failed], allow_unverified=True)
    (unverified / "module.py").write_text("tampered = True\n")
    with pytest.raises(DigestMismatchError, match="module.py"):
        _pub(hub_server, [unverified], allow_unverified=True)
    assert not _api(hub_server).repo_exists(REPO), "a refused publish must not touch the Hub"


def test_publish_writes_one_atomic_commit_with_tags_card_and_index(hub_server, pretrained):
    result = _pub(hub_server, pretrained)
    api = _api(hub_server)
    commits = api.list_repo_commits(REPO)
    assert len(commits) == 2 and commits[0].commit_id == result.commit  # initial commit + exactly one publish
    files = hub_server.files(REPO, "main")
    packages = [read_package(p) for p in pretrained]
    for package in packages:
        for path, data in _package_files(package).items():
            assert files[path] == data
    assert sorted(files) == sorted([*_package_files(packages[0]), *_package_files(packages[1]), INDEX_PATH, CARD_PATH])
    refs = {t.name: t.target_commit for t in api.list_repo_refs(REPO).tags}
    assert refs == {f"HuggingFaceTB--SmolLM-135M.{PRETRAINED_REV}.decode-b1-c{c}-sm90a-132sm": result.commit
                    for c in (128, 512)}
    index = validate("registry_index", json.loads(files[INDEX_PATH]))
    entries = index["models"][PRETRAINED][PRETRAINED_REV]
    assert [(e["capacity"], e["hub_repo"], e["status"], e["speedup"]) for e in entries] == \
        [(128, REPO, "verified", 2.0), (512, REPO, "verified", 2.0)]
    assert {e["manifest_sha256"] for e in entries} == {p.manifest_sha256 for p in packages}
    card = ModelCard(files[CARD_PATH].decode())
    assert card.data.library_name == "megabake"
    assert card.data.base_model == [PRETRAINED]
    assert "megabake" in card.data.tags and "sm90a-132sm" in card.data.tags
    assert "| `decode-b1-c512-sm90a-132sm` |" in card.text and "| 0.5 | 1 | 2× |" in card.text


def test_dry_run_writes_nothing(hub_server, pretrained):
    result = _pub(hub_server, pretrained, dry_run=True)
    assert result.dry_run and result.commit is None
    assert not _api(hub_server).repo_exists(REPO)
    summary = result.plan.summary()
    assert "repo will be created" in summary and INDEX_PATH in summary and "README.md" in summary
    assert f"{read_package(pretrained[0]).repo_path}/module.py" in summary


def test_republish_is_idempotent_and_tags_are_immutable(hub_server, pretrained, tmp_path):
    first = _pub(hub_server, pretrained)
    again = _pub(hub_server, pretrained)
    assert again.commit is None and again.tags == []
    assert [a.action for a in again.plan.actions] == ["skip", "skip"]
    assert hub_server.head(REPO) == first.commit
    # same variant, different contents: the tag would have to move
    report = make_report(model_id=PRETRAINED, revision=PRETRAINED_REV, capacity=128, megabake_ms=0.4)
    changed = write_package(tmp_path / "changed", fixture_files(report), report)
    with pytest.raises(ImmutableTagError, match="immutable"):
        _pub(hub_server, [changed])
    assert hub_server.head(REPO) == first.commit


def test_missing_tag_is_recreated_without_a_new_commit(hub_server, pretrained):
    first = _pub(hub_server, pretrained[:1])
    api = _api(hub_server)
    tag = first.tags[0]
    api.delete_tag(REPO, tag=tag)  # e.g. the publisher died between commit and tag
    again = _pub(hub_server, pretrained[:1])
    assert [a.action for a in again.plan.actions] == ["tag"]
    assert hub_server.head(REPO) == first.commit
    assert {t.name: t.target_commit for t in api.list_repo_refs(REPO).tags} == {tag: first.commit}


def test_publish_killed_half_way_leaves_no_partial_commit(hub_server, pretrained):
    base = _pub(hub_server, pretrained[:1])
    before = hub_server.files(REPO, "main")
    hub_server.fail_next_commit("disconnect")
    with pytest.raises(PublishFailedError) as err:
        _pub(hub_server, pretrained[1:])
    assert "nothing of this publish is visible" in str(err.value) and "rerun" in str(err.value)
    assert hub_server.head(REPO) == base.commit
    assert hub_server.files(REPO, "main") == before
    assert {t.name for t in _api(hub_server).list_repo_refs(REPO).tags} == set(base.tags)
    retry = _pub(hub_server, pretrained[1:])  # the same command succeeds afterwards
    assert retry.commit != base.commit and len(retry.tags) == 1


def test_stale_parent_gets_conflict_and_overwrites_nothing(hub_server, pretrained, tmp_path):
    api = _api(hub_server)
    api.create_repo(REPO)
    other = write_fixture_package(tmp_path / "other", model_id=PRETRAINED, revision=PRETRAINED_REV,
                                  gpu_class="sm100a-148sm")
    stale_plan = plan_publish(api, pretrained, REPO)  # publisher A reads the head...
    winner = _pub(hub_server, [other])  # ...publisher B commits first
    with pytest.raises(PublishConflictError) as err:
        commit_publish(api, stale_plan)
    assert stale_plan.parent_commit in str(err.value) and winner.commit in str(err.value)
    assert "nothing was overwritten" in str(err.value).lower()
    assert hub_server.head(REPO) == winner.commit
    files = hub_server.files(REPO, "main")
    index = json.loads(files[INDEX_PATH])
    assert [e["variant"] for e in index["models"][PRETRAINED][PRETRAINED_REV]] == ["decode-b1-c128-sm100a-148sm"]
    assert not any("sm90a" in path for path in files)
    merged = _pub(hub_server, pretrained)  # rerunning merges with B's packages
    index = json.loads(hub_server.files(REPO, "main")[INDEX_PATH])
    assert len(index["models"][PRETRAINED][PRETRAINED_REV]) == 3 and merged.commit != winner.commit


def test_cli_publish_dry_run_then_publish_with_parent_commit(hub_server, pretrained):
    runner = CliRunner()
    root = str(pretrained[0].parents[2])  # the packages root: both packages are found under it
    common = ["--repo", REPO, "--endpoint", hub_server.url, "--token", TOKEN]
    dry = runner.invoke(publish_cmd, [root, *common, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "dry run: nothing was written" in dry.output and dry.output.count("upload") == 2
    api = _api(hub_server)
    api.create_repo(REPO)
    head = hub_server.head(REPO)
    stale = runner.invoke(publish_cmd, [root, *common, "--parent-commit", "0" * 40])
    assert stale.exit_code == 1 and "moved" in stale.output and hub_server.head(REPO) == head
    done = runner.invoke(publish_cmd, [root, *common, "--parent-commit", head])
    assert done.exit_code == 0, done.output
    assert "tags created" in done.output and "load_from_hub" in done.output
    assert hub_server.head(REPO) != head
    refused = runner.invoke(publish_cmd, [str(write_fixture_package(pretrained[0].parents[4] / "rnd")), *common])
    assert refused.exit_code == 1 and "--allow-random-weights" in refused.output


def test_publish_help_shows_walkthrough():
    out = CliRunner().invoke(publish_cmd, ["--help"]).output
    for text in ("--allow-unverified", "--allow-random-weights", "--dry-run", "ONE commit", "load_from_hub",
                 "HF_HUB_OFFLINE=1", "registry/index.json", "trust_remote_code=True"):
        assert text in out


def test_ls_lists_local_packages_registry_and_hub(hub_server, pretrained, tmp_path):
    from megabake.hub.commands import ls
    from megabake.package import build_index, write_index

    root = pretrained[0].parents[2]
    registry = write_index(tmp_path / "registry" / "index.json", build_index(root))
    broken = write_fixture_package(root)
    (broken / "module.py").write_text("tampered\n")
    _pub(hub_server, pretrained)
    out = CliRunner().invoke(ls, ["--root", str(root), "--registry", str(registry), "--repo", REPO,
                                  "--endpoint", hub_server.url, "--token", TOKEN])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    local = [line for line in lines if "decode-b1-c128-sm90a-132sm  verified" in line and str(root) in line]
    assert len(local) == 1
    assert any(line.strip().startswith("INVALID") and "module.py" in line for line in lines)
    start = next(i for i, line in enumerate(lines) if line.startswith("registry index"))
    hub_start = next(i for i, line in enumerate(lines) if line.startswith("Hub repo"))
    assert sum("  packages/HuggingFaceTB--SmolLM-135M" in line for line in lines[start:hub_start]) == 2
    hub = lines[hub_start:]
    assert hub[0].startswith(f"Hub repo {REPO}@main (commit {hub_server.head(REPO)})")
    assert sum(f"{REPO}:packages/HuggingFaceTB--SmolLM-135M" in line
               and "0.5 ms (2x vs inductor-reduce-overhead)" in line for line in hub) == 2


def test_publish_to_an_unreachable_hub_is_a_clear_error(tmp_path):
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "packages" / "megabake--tiny-llama"
    result = CliRunner().invoke(publish_cmd, [str(package), "--repo", "acme/x", "--endpoint", "http://127.0.0.1:9",
                                              "--allow-unverified", "--allow-random-weights"])
    assert result.exit_code == 1, result.output
    assert "could not reach the Hub at http://127.0.0.1:9" in result.output and "Nothing was published" in result.output
