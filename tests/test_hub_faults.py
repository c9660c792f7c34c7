"""Hub faults, driven through the local Hub server with the real huggingface_hub client (127.0.0.1 only).

Each fault -- 5xx on the index and on each package file, truncated bodies, a server stopped mid-download, an
index deleted or corrupted between publishes -- must leave: no lost index entries, nothing half-written, no
import of unverified code, a MegaBake error naming the file, the status or failure and the fix, and an HF cache
from which a later retry loads the correct bytes. ``fast_retries`` keeps huggingface_hub's retries but skips
their sleeps, so every test takes well under a second of Hub time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from megabake.hub import (
    INDEX_PATH,
    HubError,
    PublishFailedError,
    PublishRefusedError,
    commit_publish,
    fetch_package,
    load_from_hub,
    publish,
)
from megabake.hub.commands import publish as publish_cmd
from megabake.hub.errors import HubIOError
from megabake.package import DigestMismatchError, build_manifest, iter_entries, read_package, store

from tests.fixtures_packages import PRETRAINED, PRETRAINED_REV, write_fixture_package

REPO = "my-org/faults-megabake"
TOKEN = "hf_fake_token"
PACKAGE_FILES = ("manifest.json", "module.py", "plan.json", "source_map.json", "report.json")
BROKEN_BODIES = ("truncate", "short", "drop", "stop")

pytestmark = pytest.mark.usefixtures("fast_retries")


@pytest.fixture
def packages(tmp_path):
    """Three verified packages of one pretrained model revision, by KV capacity."""
    root = tmp_path / "packages"
    return {c: write_fixture_package(root, model_id=PRETRAINED, revision=PRETRAINED_REV, capacity=c)
            for c in (128, 512, 2048)}


@pytest.fixture
def imports(monkeypatch):
    """Every MegakernelDecoder.from_package call (where module.py gets imported); it returns a stand-in."""
    import megabake.runtime

    calls: list[Path] = []

    def from_package(cls, path, device=None, **kw):
        calls.append(Path(path))
        return "decoder"

    monkeypatch.setattr(megabake.runtime.MegakernelDecoder, "from_package", classmethod(from_package))
    return calls


def _pub(server, paths, **kw):
    return publish(paths, REPO, endpoint=server.url, token=TOKEN, **kw)


def _load(server, cache, **kw):
    return load_from_hub(REPO, "main", device="cpu", trust_remote_code=True, endpoint=server.url, token=TOKEN,
                         cache_dir=cache, **kw)


def _index_paths(server) -> list[str]:
    index = json.loads(server.files(REPO)[INDEX_PATH])
    return sorted(entry["path"] for _, _, entry in iter_entries(index))


def _repo_state(server):
    return server.head(REPO), server.refs(REPO), server.files(REPO)


def _repo_path(path: Path) -> str:
    return read_package(path).repo_path


def _recover(server) -> None:
    server.clear_faults()
    if not server.running:
        server.restart()


def _assert_clear(err: HubIOError, path: str | None, consequence: str) -> None:
    message = str(err)
    assert path and err.path == path and path in message, message
    assert consequence in message and "fix:" in message, message
    assert not isinstance(err.__cause__, HubIOError)


# ------------------------------------------------------------------------------------------------ publish


@pytest.mark.parametrize("kind", ["status", *BROKEN_BODIES])
def test_publish_with_the_index_unreadable_commits_nothing_and_loses_nothing(hub_server, packages, kind):
    first = _pub(hub_server, [packages[128], packages[512]])
    before = _repo_state(hub_server)
    hub_server.fail_file(INDEX_PATH, kind)
    with pytest.raises(HubIOError) as err:
        _pub(hub_server, [packages[2048]])
    # a stopped server fails whichever of the parallel reads comes first: that file is the one named
    _assert_clear(err.value, INDEX_PATH if kind != "stop" else err.value.path, "Nothing was published (no commit")
    if kind == "status":
        assert err.value.status == 503 and "HTTP 503" in str(err.value) and "retry" in str(err.value)
    _recover(hub_server)
    assert _repo_state(hub_server) == before  # no commit, no tag: the old index with both packages is intact
    retry = _pub(hub_server, [packages[2048]])
    assert retry.commit != first.commit and len(retry.tags) == 1
    assert _index_paths(hub_server) == sorted(_repo_path(p) for p in packages.values())


@pytest.mark.parametrize("name", ["manifest.json", "report.json"])
@pytest.mark.parametrize("kind", ["status", "truncate", "short", "stop"])
def test_publish_with_a_package_file_in_the_repo_unreadable_commits_nothing(hub_server, packages, name, kind):
    _pub(hub_server, [packages[128]])
    before = _repo_state(hub_server)
    path = f"{_repo_path(packages[128])}/{name}"
    hub_server.fail_file(path, kind)
    with pytest.raises(HubIOError) as err:
        _pub(hub_server, [packages[512]])
    _assert_clear(err.value, path if kind != "stop" else err.value.path, "Nothing was published")
    _recover(hub_server)
    assert _repo_state(hub_server) == before
    _pub(hub_server, [packages[512]])
    assert _index_paths(hub_server) == sorted(_repo_path(packages[c]) for c in (128, 512))


@pytest.mark.parametrize("pattern, kind", [
    ("/api/models/*/refs", "status"),
    ("/api/models/*/tree/*", "status"),
    ("/api/models/*/tree/*", "short"),
    ("/api/models/*/revision/*", "status"),
])
def test_publish_with_the_repo_listing_unreadable_commits_nothing(hub_server, packages, pattern, kind):
    _pub(hub_server, [packages[128]])
    before = _repo_state(hub_server)
    hub_server.inject_fault(pattern, kind)
    with pytest.raises(HubIOError) as err:
        _pub(hub_server, [packages[512]])
    assert "Nothing was published" in str(err.value) and REPO in str(err.value)
    _recover(hub_server)
    assert _repo_state(hub_server) == before


@pytest.mark.parametrize("pattern, kind", [("/api/models/*/commit/*", "status"),
                                           ("/api/models/*/commit/*", "drop"),
                                           ("/api/models/*/preupload/*", "status")])
def test_publish_with_the_commit_failing_leaves_nothing_half_written(hub_server, packages, pattern, kind):
    _pub(hub_server, [packages[128]])
    before = _repo_state(hub_server)
    hub_server.inject_fault(pattern, kind, methods=("POST",))
    with pytest.raises(PublishFailedError) as err:
        _pub(hub_server, [packages[512]])
    assert "nothing of this publish is visible" in str(err.value) and "rerun" in str(err.value)
    _recover(hub_server)
    assert _repo_state(hub_server) == before
    _pub(hub_server, [packages[512]])
    assert _index_paths(hub_server) == sorted(_repo_path(packages[c]) for c in (128, 512))


def test_tag_failure_after_the_commit_is_a_clear_error_and_a_rerun_finishes(hub_server, packages):
    hub_server.inject_fault("/api/models/*/tag/*", "status", status=502, methods=("POST",))
    with pytest.raises(HubError) as err:
        _pub(hub_server, [packages[128]])
    assert "could not be created" in str(err.value) and "HTTP 502" in str(err.value) and "rerun" in str(err.value)
    landed = hub_server.head(REPO)
    assert hub_server.refs(REPO)["tags"] == {}
    hub_server.clear_faults()
    again = _pub(hub_server, [packages[128]])
    assert [a.action for a in again.plan.actions] == ["tag"] and hub_server.head(REPO) == landed
    assert list(hub_server.refs(REPO)["tags"].values()) == [landed]


def test_transient_5xx_is_retried_by_the_client_and_publish_succeeds(hub_server, packages):
    _pub(hub_server, [packages[128]])
    fault = hub_server.fail_file(INDEX_PATH, "status", times=2)
    _pub(hub_server, [packages[512]])
    assert fault.hits == 2
    assert _index_paths(hub_server) == sorted(_repo_path(packages[c]) for c in (128, 512))


# ----------------------------------------------------------------------------- index deleted / corrupted


def test_index_deleted_between_publishes_is_rebuilt_by_republishing_the_same_packages(hub_server, packages):
    first = _pub(hub_server, [packages[128], packages[512]])
    hub_server.commit_files(REPO, {}, deletes=[INDEX_PATH], message="delete the index")
    again = _pub(hub_server, [packages[128], packages[512]])
    assert [a.action for a in again.plan.actions] == ["skip", "skip"] and again.tags == []
    assert again.commit is not None and set(again.plan.files) == {INDEX_PATH, "README.md"}
    assert any("absent" in note for note in again.plan.notes)
    assert _index_paths(hub_server) == sorted(_repo_path(packages[c]) for c in (128, 512))
    assert set(hub_server.refs(REPO)["tags"].values()) == {first.commit}
    _pub(hub_server, [packages[2048]])  # and the next publish keeps everything
    assert _index_paths(hub_server) == sorted(_repo_path(p) for p in packages.values())


@pytest.mark.parametrize("corrupt", [b"{not json", b'{"schema_version": 1}', b"\xff\xfe"])
def test_corrupt_index_is_rebuilt_from_every_package_in_the_repo(hub_server, packages, corrupt):
    _pub(hub_server, [packages[128], packages[512]])
    hub_server.commit_files(REPO, {INDEX_PATH: corrupt}, message="corrupt the index")
    result = _pub(hub_server, [packages[2048]])
    assert any("unusable" in note for note in result.plan.notes), result.plan.notes
    assert _index_paths(hub_server) == sorted(_repo_path(p) for p in packages.values())


def test_index_missing_packages_is_repaired_by_any_publish(hub_server, packages):
    """The state the old lost-update bug left behind: folders and tags in the repo, entries gone from the index."""
    _pub(hub_server, [packages[128], packages[512]])
    index = json.loads(hub_server.files(REPO)[INDEX_PATH])
    index["models"][PRETRAINED][PRETRAINED_REV] = index["models"][PRETRAINED][PRETRAINED_REV][1:]
    hub_server.commit_files(REPO, {INDEX_PATH: store.dump_json(index)}, message="lose an entry")
    again = _pub(hub_server, [packages[512]])  # republishing an already-published package is enough
    assert [a.action for a in again.plan.actions] == ["skip"] and again.commit is not None
    assert any("repaired" in note and _repo_path(packages[128]) in note for note in again.plan.notes)
    assert _index_paths(hub_server) == sorted(_repo_path(packages[c]) for c in (128, 512))
    assert _pub(hub_server, [packages[512]]).commit is None  # repaired: a no-op again


def test_load_with_a_corrupt_index_is_refused_before_any_import(hub_server, packages, imports, tmp_path):
    _pub(hub_server, [packages[128]])
    hub_server.commit_files(REPO, {INDEX_PATH: b"{not json"}, message="corrupt the index")
    with pytest.raises(HubError) as err:
        _load(hub_server, tmp_path / "cache")
    assert "not a valid registry index" in str(err.value) and "Nothing was imported" in str(err.value)
    assert imports == []


# -------------------------------------------------------------------------------------------------- load


@pytest.mark.parametrize("kind", ["status", *BROKEN_BODIES])
def test_load_with_the_index_unreadable_imports_nothing(hub_server, packages, imports, tmp_path, kind):
    """The index is never taken as absent: a consistent module.py + manifest forgery stays refused."""
    result = _pub(hub_server, [packages[128]])
    folder = _repo_path(packages[128])
    forged = {n: (packages[128] / n).read_bytes() for n in read_package(packages[128]).files if n != "manifest.json"}
    forged["module.py"] = b"import os\nos.system('evil')\n\n\n\n"  # as many lines as source_map needs
    hub_server.tamper(REPO, f"{folder}/module.py", forged["module.py"], result.commit)
    hub_server.tamper(REPO, f"{folder}/manifest.json", store.dump_json(build_manifest(forged)), result.commit)
    hub_server.fail_file(INDEX_PATH, kind)
    cache = tmp_path / "cache"
    with pytest.raises(HubIOError) as err:
        _load(hub_server, cache)
    _assert_clear(err.value, INDEX_PATH, "Nothing was imported")
    if kind == "status":
        assert err.value.status == 503 and "HTTP 503" in str(err.value)
    assert imports == []
    _recover(hub_server)
    with pytest.raises(DigestMismatchError, match="manifest_sha256: index says"):  # the cross-check still runs
        _load(hub_server, cache)
    assert imports == []


@pytest.mark.parametrize("name", PACKAGE_FILES)
def test_load_with_5xx_on_a_package_file_imports_nothing_and_a_retry_loads_correct_bytes(
        hub_server, packages, imports, tmp_path, name):
    _pub(hub_server, [packages[128]])
    path = f"{_repo_path(packages[128])}/{name}"
    hub_server.fail_file(path, "status", status=500)
    cache = tmp_path / "cache"
    with pytest.raises(HubIOError) as err:
        _load(hub_server, cache)
    _assert_clear(err.value, path, "Nothing was imported")
    assert err.value.status == 500 and "HTTP 500" in str(err.value)
    assert imports == []
    _recover(hub_server)
    _load(hub_server, cache)  # same cache, no force_download
    assert _same_files(imports[-1], packages[128])


@pytest.mark.parametrize("kind", BROKEN_BODIES)
@pytest.mark.parametrize("name", ["module.py", "manifest.json"])
def test_load_with_a_broken_download_imports_nothing_and_leaves_the_cache_clean(
        hub_server, packages, imports, tmp_path, name, kind):
    _pub(hub_server, [packages[128]])
    path = f"{_repo_path(packages[128])}/{name}"
    hub_server.fail_file(path, kind)
    cache = tmp_path / "cache"
    with pytest.raises(HubIOError) as err:
        _load(hub_server, cache)
    _assert_clear(err.value, path, "Nothing was imported")
    assert imports == []
    assert not [p for p in cache.rglob("*") if p.is_file() and p.name.endswith(".incomplete")]
    _recover(hub_server)
    _load(hub_server, cache)
    assert _same_files(imports[-1], packages[128])


def test_load_from_a_stopped_hub_is_a_clear_error(hub_server, packages, imports, tmp_path):
    _pub(hub_server, [packages[128]])
    hub_server.stop()
    with pytest.raises(HubIOError) as err:
        _load(hub_server, tmp_path / "cache")
    assert f"could not reach the Hub at {hub_server.url}" in str(err.value)
    assert "Nothing was imported" in str(err.value) and imports == []
    hub_server.restart()
    _load(hub_server, tmp_path / "cache")
    assert _same_files(imports[-1], packages[128])


def test_missing_repo_and_offline_without_cache_are_megabake_errors(hub_server, tmp_path):
    with pytest.raises(HubIOError, match="repository was not found") as err:
        fetch_package("my-org/nothing-here", endpoint=hub_server.url, token=TOKEN, cache_dir=tmp_path / "c")
    assert err.value.status == 404
    with pytest.raises(HubIOError, match="offline mode is on"):
        fetch_package(REPO, endpoint=hub_server.url, cache_dir=tmp_path / "c", local_files_only=True)


def test_repo_without_index_is_still_read_from_reports_and_offline(hub_server, packages, tmp_path):
    """A real 404 on the index (live, or recorded in the HF cache for this commit) still means "no index"."""
    package = read_package(packages[128])
    hub_server.commit_files(REPO, {f"{package.repo_path}/{n}": (package.path / n).read_bytes()
                                   for n in package.files})
    cache = tmp_path / "cache"
    online = fetch_package(REPO, endpoint=hub_server.url, token=TOKEN, cache_dir=cache)
    hub_server.stop()
    offline = fetch_package(REPO, endpoint=hub_server.url, cache_dir=cache, local_files_only=True)
    assert offline.path == online.path and offline.entry == online.entry


def _same_files(loaded: Path, original: Path) -> bool:
    names = read_package(original).files
    return all((loaded / n).read_bytes() == (original / n).read_bytes() for n in names)


# ----------------------------------------------------------------------------------------- dry run offline


def test_dry_run_works_offline_and_says_what_it_did_not_compare(hub_server, packages, tmp_path):
    hub_server.stop()
    result = _pub(hub_server, [packages[128], packages[512]], dry_run=True)
    plan = result.plan
    assert result.dry_run and result.commit is None and plan.unchecked
    assert [a.action for a in plan.actions] == ["upload", "upload"]
    assert {INDEX_PATH, "README.md", f"{_repo_path(packages[128])}/module.py"} <= set(plan.files)
    summary = plan.summary()
    assert "not compared with the Hub" in summary and "could not reach the Hub" in summary
    assert "checked locally" in summary and "parent commit unknown" in summary
    with pytest.raises(HubError, match="cannot be committed"):
        commit_publish(None, plan)
    random = write_fixture_package(tmp_path / "random")  # local gates still apply offline
    with pytest.raises(PublishRefusedError, match="--allow-random-weights"):
        _pub(hub_server, [random], dry_run=True)


def test_cli_dry_run_offline_exits_0_and_real_publish_exits_1(hub_server, packages):
    hub_server.stop()
    args = [str(packages[128]), "--repo", REPO, "--endpoint", hub_server.url, "--token", TOKEN]
    dry = CliRunner().invoke(publish_cmd, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "not compared with the Hub" in dry.output and "dry run: nothing was written" in dry.output
    real = CliRunner().invoke(publish_cmd, args)
    assert real.exit_code == 1 and "Nothing was published" in real.output and "Traceback" not in real.output
