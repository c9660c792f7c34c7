"""The fake Hub (tests/hub_server.py) against the real, unmocked huggingface_hub client."""

import os
import subprocess
import sys
import threading

import httpx
import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.hub_server import git_blob_sha1

REPO = "megabake/tiny-llama"
BIG = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MB: must still travel inline ("regular")


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _api(server):
    return HfApi(endpoint=server.url, token="hf_fake_token")


def _publish(api, parent=None, extra=()):
    ops = [
        CommitOperationAdd("a.txt", b"hello"),
        CommitOperationAdd("weights/big.bin", BIG),
        CommitOperationAdd("weights/sub/c.json", b'{"x": 1}'),
        *extra,
    ]
    return api.create_commit(REPO, operations=ops, commit_message="publish", parent_commit=parent)


def test_create_repo_info_and_conflict(hub_server):
    api = _api(hub_server)
    url = api.create_repo(REPO, exist_ok=True)
    assert url.repo_id == REPO and url.endpoint == hub_server.url
    api.create_repo(REPO, exist_ok=True)  # 409 swallowed by the client
    with pytest.raises(HfHubHTTPError) as e:
        api.create_repo(REPO)
    assert e.value.response.status_code == 409
    info = api.repo_info(REPO, revision="main")
    assert info.sha == hub_server.head(REPO) and info.siblings == []
    assert [c.title for c in api.list_repo_commits(REPO)] == ["initial commit"]
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info("megabake/nope")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")


def test_commit_history_tree_and_paths_info(hub_server):
    api = _api(hub_server)
    api.create_repo(REPO)
    root = hub_server.head(REPO)
    c1 = _publish(api, parent=root)
    assert c1.oid == hub_server.head(REPO) and c1.oid != root and len(c1.oid) == 40
    assert hub_server.files(REPO) == {"a.txt": b"hello", "weights/big.bin": BIG, "weights/sub/c.json": b'{"x": 1}'}
    commit_reqs = [r for r in hub_server.requests if r["path"].endswith("/commit/main")]
    assert len(commit_reqs) == 1 and not any("lfs" in r["path"] for r in hub_server.requests)

    c2 = api.create_commit(REPO, commit_message="second", commit_description="details", parent_commit=c1.oid,
                           operations=[CommitOperationDelete("a.txt"), CommitOperationAdd("b.txt", b"bee")])
    assert [c.commit_id for c in api.list_repo_commits(REPO)] == [c2.oid, c1.oid, root]
    assert api.list_repo_commits(REPO)[0].message == "second\n\ndetails"
    assert [c["parent"] for c in hub_server.commits(REPO)] == [c1.oid, root, None]

    files_now = ["b.txt", "weights/big.bin", "weights/sub/c.json"]
    assert sorted(api.list_repo_files(REPO)) == files_now
    assert "a.txt" in api.list_repo_files(REPO, revision=c1.oid)  # old snapshot intact
    top = {e.path: type(e).__name__ for e in api.list_repo_tree(REPO)}
    assert top == {"b.txt": "RepoFile", "weights": "RepoFolder"}
    deep = {e.path for e in api.list_repo_tree(REPO, path_in_repo="weights", recursive=True)}
    assert deep == {"weights/big.bin", "weights/sub", "weights/sub/c.json"}
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="missing"))

    info = api.model_info(REPO, revision=c2.oid, files_metadata=True)
    sizes = {s.rfilename: s.size for s in info.siblings}
    assert info.sha == c2.oid and sizes["weights/big.bin"] == len(BIG)
    got = {p.path: p for p in api.get_paths_info(REPO, ["weights/big.bin", "weights", "nope"], revision="main")}
    assert set(got) == {"weights/big.bin", "weights"}
    assert got["weights/big.bin"].size == len(BIG) and got["weights/big.bin"].blob_id == git_blob_sha1(BIG)


def test_stale_parent_gives_412_and_nothing_changes(hub_server):
    api = _api(hub_server)
    api.create_repo(REPO)
    root = hub_server.head(REPO)
    _publish(api, parent=root)
    head, before = hub_server.head(REPO), hub_server.files(REPO)
    with pytest.raises(HfHubHTTPError) as e:
        api.create_commit(REPO, operations=[CommitOperationAdd("x.txt", b"x")], commit_message="late",
                          parent_commit=root)
    assert e.value.response.status_code == 412 and "conflict" in str(e.value).lower()
    assert hub_server.head(REPO) == head and hub_server.files(REPO) == before


def test_concurrent_commits_on_same_parent_one_wins(hub_server):
    api = _api(hub_server)
    api.create_repo(REPO)
    root, results = hub_server.head(REPO), []

    def commit(i):
        try:
            api.create_commit(REPO, operations=[CommitOperationAdd(f"f{i}", b"%d" % i)], commit_message=f"c{i}",
                              parent_commit=root)
            results.append(200)
        except HfHubHTTPError as e:
            results.append(e.response.status_code)

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [200] + [412] * 5
    assert len(hub_server.commits(REPO)) == 2 and len(hub_server.files(REPO)) == 1


def test_commit_is_all_or_nothing(hub_server):
    api = _api(hub_server)
    api.create_repo(REPO)
    head = hub_server.head(REPO)
    with pytest.raises(EntryNotFoundError):  # second op fails -> first op must not land
        api.create_commit(REPO, commit_message="bad", operations=[
            CommitOperationAdd("ok.txt", b"ok"), CommitOperationDelete("does-not-exist.txt")])
    assert hub_server.head(REPO) == head and hub_server.files(REPO) == {}


def test_unchanged_files_are_skipped_by_client(hub_server):
    api = _api(hub_server)
    api.create_repo(REPO)
    c1 = _publish(api)
    c2 = _publish(api)  # same bytes: preupload returns matching oids, the client sends no commit
    assert c2.oid == c1.oid and len(hub_server.commits(REPO)) == 2


def test_tags(hub_server):
    api = _api(hub_server)
    api.create_repo(REPO)
    c1 = _publish(api)
    api.create_tag(REPO, tag="v1", revision="main", tag_message="first")
    api.create_commit(REPO, operations=[CommitOperationAdd("a.txt", b"changed")], commit_message="more")
    refs = api.list_repo_refs(REPO)
    assert {t.name: t.target_commit for t in refs.tags} == {"v1": c1.oid}
    assert {b.name: b.target_commit for b in refs.branches} == {"main": hub_server.head(REPO)}
    with pytest.raises(HfHubHTTPError) as e:
        api.create_tag(REPO, tag="v1", revision="main")
    assert e.value.response.status_code == 409
    assert hub_server.refs(REPO)["tags"]["v1"] == c1.oid  # immutable
    api.create_tag(REPO, tag="v1", revision="main", exist_ok=True)
    assert api.repo_info(REPO, revision="v1").sha == c1.oid
    api.delete_tag(REPO, tag="v1")
    assert api.list_repo_refs(REPO).tags == []


def test_downloads_snapshot_and_offline_reload(hub_server, tmp_path):
    api = _api(hub_server)
    api.create_repo(REPO)
    c1 = _publish(api)
    api.create_tag(REPO, tag="v1")
    api.create_commit(REPO, operations=[CommitOperationAdd("a.txt", b"v2")], commit_message="v2")
    kw = dict(endpoint=hub_server.url, token="hf_fake_token")
    cache = tmp_path / "cache"
    assert _read(hf_hub_download(REPO, "a.txt", cache_dir=cache, **kw)) == b"v2"
    for rev in ("v1", c1.oid):
        p = hf_hub_download(REPO, "a.txt", revision=rev, cache_dir=cache, **kw)
        assert _read(p) == b"hello" and c1.oid in p
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "nope.txt", cache_dir=cache, **kw)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "a.txt", revision="nope", cache_dir=cache, **kw)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("megabake/nope", "a.txt", cache_dir=cache, **kw)

    cache = tmp_path / "cache2"  # fresh cache: the loop above already put v1's a.txt in the first one
    snap = snapshot_download(REPO, revision="v1", allow_patterns=["weights/*"], cache_dir=cache, **kw)
    assert sorted(os.listdir(os.path.join(snap, "weights"))) == ["big.bin", "sub"]
    assert _read(os.path.join(snap, "weights", "big.bin")) == BIG
    assert not os.path.exists(os.path.join(snap, "a.txt"))

    # HF_HUB_OFFLINE=1 is read at import time: check the reload in a fresh interpreter.
    n_requests = len(hub_server.requests)
    code = ("import sys; from huggingface_hub import snapshot_download as s, hf_hub_download as h;"
            f"p = s({REPO!r}, revision='v1', allow_patterns=['weights/*'], cache_dir=sys.argv[1]);"
            f"q = h({REPO!r}, 'a.txt', revision='main', cache_dir=sys.argv[2]);"
            "print(p); print(open(q, 'rb').read().decode())")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub_server.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(cache), str(tmp_path / "cache")], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout.split("\n")
    assert out[0] == snap and out[1] == "v2"
    assert len(hub_server.requests) == n_requests  # offline: the server saw nothing


def test_resolve_headers_and_ranges(hub_server):
    sha = hub_server.commit_files(REPO, {"w/x.bin": BIG})
    url = f"{hub_server.url}/{REPO}/resolve/main/w/x.bin"
    h = httpx.head(url)
    assert h.status_code == 200 and h.headers["X-Repo-Commit"] == sha
    assert h.headers["ETag"] == f'"{git_blob_sha1(BIG)}"' and int(h.headers["Content-Length"]) == len(BIG)
    assert h.headers["Accept-Ranges"] == "bytes"
    r = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == BIG[10:20]
    assert r.headers["Content-Range"] == f"bytes 10-19/{len(BIG)}"
    assert httpx.get(url, headers={"Range": "bytes=-5"}).content == BIG[-5:]
    assert httpx.get(url, headers={"Range": f"bytes={len(BIG)}-"}).status_code == 416
    miss = httpx.head(f"{hub_server.url}/{REPO}/resolve/main/nope")
    assert miss.status_code == 404 and miss.headers["X-Error-Code"] == "EntryNotFound"


def test_tamper_serves_corrupt_bytes_under_same_commit(hub_server, tmp_path):
    sha = hub_server.commit_files(REPO, {"m.json": b'{"ok": true}'})
    hub_server.tamper(REPO, "m.json", b'{"ok": false, "evil": 1}')
    assert hub_server.head(REPO) == sha
    assert hub_server.files(REPO) == {"m.json": b'{"ok": false, "evil": 1}'}
    p = hf_hub_download(REPO, "m.json", endpoint=hub_server.url, cache_dir=tmp_path, token=False)
    assert _read(p) == b'{"ok": false, "evil": 1}' and sha in p
    info = _api(hub_server).get_paths_info(REPO, ["m.json"])[0]
    assert info.blob_id == git_blob_sha1(b'{"ok": true}')  # metadata still claims the original


def test_commit_killed_after_preupload(hub_server):
    api = _api(hub_server)
    api.create_repo(REPO)
    head = hub_server.head(REPO)
    hub_server.fail_next_commit_after_preupload()
    with pytest.raises(httpx.TransportError):
        _publish(api, parent=head)
    assert hub_server.head(REPO) == head and hub_server.files(REPO) == {}
    paths = [(r["path"].rsplit("/", 2)[-2], r["status"]) for r in hub_server.requests[-2:]]
    assert paths == [("preupload", 200), ("commit", 0)]
    hub_server.fail_next_commit(503)
    with pytest.raises(HfHubHTTPError):
        _publish(api, parent=head)
    assert _publish(api, parent=head).oid == hub_server.head(REPO) != head  # hooks are one-shot


def test_require_token_and_reset(hub_server):
    hub_server.require_token = True
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub_server.url, token=False).create_repo(REPO)
    assert e.value.response.status_code == 401
    _api(hub_server).create_repo(REPO)
    assert hub_server.requests[-1]["auth"] is True
    hub_server.reset()
    assert hub_server.requests == [] and not hub_server.require_token
    with pytest.raises(RepositoryNotFoundError):
        _api(hub_server).repo_info(REPO)


def test_hub_env_makes_fake_hub_the_default(hub_env, tmp_path):
    api = HfApi(token="hf_fake_token")
    assert api.endpoint == hub_env.url
    api.create_repo(REPO)
    api.upload_file(path_or_fileobj=b"cfg", path_in_repo="config.json", repo_id=REPO)
    assert _read(hf_hub_download(REPO, "config.json", cache_dir=tmp_path)) == b"cfg"
    assert os.environ["HF_ENDPOINT"] == hub_env.url


def test_fault_injection_kinds_counts_and_restart(hub_server):
    sha = hub_server.commit_files(REPO, {"w/x.bin": BIG, "a.txt": b"hello world"})
    url = f"{hub_server.url}/{REPO}/resolve/main/w/x.bin"
    status = hub_server.fail_file("w/x.bin", times=2)  # 503 on any method, twice
    assert [httpx.head(url).status_code, httpx.get(url).status_code, httpx.get(url).status_code] == [503, 503, 200]
    assert status.hits == 2 and status.remaining == 0
    hub_server.fail_file("w/x.bin", "truncate", times=1)
    assert httpx.head(url).status_code == 200  # body faults leave HEAD alone
    with pytest.raises(httpx.RemoteProtocolError):  # full Content-Length, half the body
        httpx.get(url)
    hub_server.fail_file("w/x.bin", "short", times=1)
    short = httpx.get(url)
    assert short.content == BIG[: len(BIG) // 2] and int(short.headers["Content-Length"]) == len(BIG) // 2
    hub_server.inject_fault("/api/models/*/refs", "drop", times=1)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(f"{hub_server.url}/api/models/{REPO}/refs")
    assert [r["fault"] for r in hub_server.requests[-4:]] == [None, "truncate", "short", "drop"]
    hub_server.fail_file("a.txt", "stop")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{hub_server.url}/{REPO}/resolve/main/a.txt")
    assert not hub_server.running
    with pytest.raises(httpx.ConnectError):  # nothing listens until restart()
        httpx.get(url)
    hub_server.clear_faults()
    assert hub_server.faults == [] and hub_server.restart().running
    assert httpx.get(url).content == BIG and hub_server.head(REPO) == sha  # same port, same repos
