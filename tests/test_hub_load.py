"""`fetch_package` / `load_from_hub` against the local fake Hub with the real huggingface_hub client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megabake.hub import (
    INDEX_PATH,
    NoMatchingPackageError,
    UntrustedCodeError,
    check_trust,
    fetch_package,
    load_from_hub,
    publish,
    read_hub_index,
)
from megabake.hub.select import Request, select_entry
from megabake.package import DigestMismatchError, build_index, build_manifest, read_package, store

from tests.fixtures_packages import PRETRAINED, PRETRAINED_REV, write_fixture_package

REPO = "my-org/smollm-megabake"
TOKEN = "hf_fake_token"
REPO_ROOT = Path(__file__).resolve().parents[1]
BUCKETS = [(128, "sm90a-132sm"), (512, "sm90a-132sm"), (2048, "sm90a-132sm"), (128, "sm100a-148sm")]


@pytest.fixture
def published(hub_server, tmp_path):
    """Four verified packages of one pretrained model revision, published in one commit."""
    paths = [write_fixture_package(tmp_path / "packages", model_id=PRETRAINED, revision=PRETRAINED_REV,
                                   capacity=c, gpu_class=g) for c, g in BUCKETS]
    result = publish(paths, REPO, endpoint=hub_server.url, token=TOKEN)
    return result, {read_package(p).report["variant"]: read_package(p) for p in paths}


def _fetch(server, cache, revision="main", **kw):
    return fetch_package(REPO, revision, endpoint=server.url, token=TOKEN, cache_dir=cache, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_load_by_branch_tag_and_commit_gives_identical_files(hub_server, published, tmp_path):
    result, local = published
    variant = "decode-b1-c512-sm90a-132sm"
    tag = next(t for t in result.tags if t.endswith(variant))
    fetched = [_fetch(hub_server, tmp_path / f"cache-{i}", rev, bucket=300, gpu_class="sm90a-132sm")
               for i, rev in enumerate(["main", tag, result.commit])]
    for f in fetched:
        assert f.commit == result.commit
        assert f.package.report["variant"] == variant and f.model_id == PRETRAINED
        assert _files(f.path) == _files(local[variant].path)
    assert [f.pinned for f in fetched] == [False, False, True]
    snapshot = fetched[0].path.parents[3]  # only the chosen package (and the index) were downloaded
    downloaded = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert downloaded == sorted([INDEX_PATH] + [f"{local[variant].repo_path}/{n}" for n in local[variant].files])


def test_a_tag_selects_its_own_variant(hub_server, published, tmp_path):
    result, _ = published
    tag = next(t for t in result.tags if t.endswith("decode-b1-c2048-sm90a-132sm"))
    fetched = _fetch(hub_server, tmp_path / "cache", tag)
    assert fetched.package.report["variant"] == "decode-b1-c2048-sm90a-132sm"


@pytest.mark.parametrize(
    "bucket, gpu_class, variant",
    [
        (None, "sm90a-132sm", "decode-b1-c128-sm90a-132sm"),
        (129, "sm90a-132sm", "decode-b1-c512-sm90a-132sm"),
        ((1, 1000), "sm90a-132sm", "decode-b1-c2048-sm90a-132sm"),
        ("b1-c64", "sm100a-148sm", "decode-b1-c128-sm100a-148sm"),
        ("decode-b1-c512-sm90a-132sm", None, "decode-b1-c512-sm90a-132sm"),
    ],
)
def test_smallest_bucket_that_fits_for_the_gpu_class(hub_server, published, tmp_path, bucket, gpu_class, variant):
    fetched = _fetch(hub_server, tmp_path / "cache", bucket=bucket, gpu_class=gpu_class)
    assert fetched.package.report["variant"] == variant


def test_missing_bucket_lists_what_exists(hub_server, published, tmp_path):
    with pytest.raises(NoMatchingPackageError) as err:
        _fetch(hub_server, tmp_path / "cache", bucket=4096, gpu_class="sm90a-132sm")
    message = str(err.value)
    assert "capacity >= 4096" in message and "GPU class sm90a-132sm" in message
    assert "decode-b1-c128, decode-b1-c2048, decode-b1-c512" in message
    assert "sm100a-148sm, sm90a-132sm" in message and "decode-b1-c2048-sm90a-132sm (verified)" in message


def test_missing_gpu_class_lists_what_exists(hub_server, published, tmp_path):
    with pytest.raises(NoMatchingPackageError) as err:
        _fetch(hub_server, tmp_path / "cache", gpu_class="sm80-108sm")
    assert "GPU class sm80-108sm" in str(err.value) and "GPU classes: sm100a-148sm, sm90a-132sm" in str(err.value)
    with pytest.raises(NoMatchingPackageError, match="model revision 2222"):
        _fetch(hub_server, tmp_path / "cache", model_revision="2" * 40)


def test_unverified_packages_load_only_when_allowed(hub_server, tmp_path):
    path = write_fixture_package(tmp_path, model_id=PRETRAINED, revision=PRETRAINED_REV, status="unverified")
    publish([path], REPO, endpoint=hub_server.url, token=TOKEN, allow_unverified=True)
    with pytest.raises(NoMatchingPackageError, match="allow_unverified=True"):
        _fetch(hub_server, tmp_path / "cache")
    assert _fetch(hub_server, tmp_path / "cache", allow_unverified=True).package.status == "unverified"


def test_tampered_file_in_the_cache_is_detected(hub_server, published, tmp_path):
    cache = tmp_path / "cache"
    fetched = _fetch(hub_server, cache, gpu_class="sm90a-132sm")
    module = fetched.path / "module.py"
    blob = module.resolve()  # the HF cache stores content in blobs/, snapshots/ links to it
    blob.chmod(0o644)
    blob.write_text("import os\nos.system('rm -rf ~')\n")
    with pytest.raises(DigestMismatchError) as err:
        _fetch(hub_server, cache, gpu_class="sm90a-132sm")
    assert err.value.path == "module.py" and "force_download=True" in str(err.value)
    repaired = _fetch(hub_server, cache, gpu_class="sm90a-132sm", force_download=True)
    original = published[1][repaired.entry["variant"]].path / "module.py"
    assert (repaired.path / "module.py").read_bytes() == original.read_bytes()


def test_tampered_file_on_the_server_is_detected(hub_server, published, tmp_path):
    result, local = published
    package = local["decode-b1-c128-sm90a-132sm"]
    hub_server.tamper(REPO, f"{package.repo_path}/module.py", b"import os\nos.system('evil')\n", result.commit)
    with pytest.raises(DigestMismatchError, match="module.py"):
        _fetch(hub_server, tmp_path / "cache", gpu_class="sm90a-132sm")
    # a consistent forgery (module.py AND manifest.json) still differs from the registry index's manifest digest
    forged = {n: (package.path / n).read_bytes() for n in package.files if n != "manifest.json"}
    forged["module.py"] = b"import os\nos.system('evil')\n\n\n\n"
    manifest = store.dump_json(build_manifest(forged))
    hub_server.tamper(REPO, f"{package.repo_path}/module.py", forged["module.py"], result.commit)
    hub_server.tamper(REPO, f"{package.repo_path}/manifest.json", manifest, result.commit)
    with pytest.raises(DigestMismatchError) as err:
        _fetch(hub_server, tmp_path / "cache2", gpu_class="sm90a-132sm")
    assert "manifest_sha256: index says" in str(err.value)


def test_untrusted_code_is_refused_with_the_reason(hub_server, published, tmp_path):
    result, _ = published
    with pytest.raises(UntrustedCodeError) as err:
        load_from_hub(REPO, "main", device="cpu", endpoint=hub_server.url, token=TOKEN, cache_dir=tmp_path / "c")
    message = str(err.value)
    assert "trust_remote_code=True" in message and result.commit in message and "module.py" in message
    assert "'main' is a movable reference" in message
    tag = result.tags[0]
    with pytest.raises(UntrustedCodeError):
        load_from_hub(REPO, tag, device="cpu", endpoint=hub_server.url, token=TOKEN, cache_dir=tmp_path / "c")
    pinned = _fetch(hub_server, tmp_path / "c", result.commit)
    check_trust(pinned, trust_remote_code=False)  # a caller-pinned commit is trusted
    check_trust(_fetch(hub_server, tmp_path / "c"), trust_remote_code=True)


def test_offline_reload_from_the_cache(hub_server, published, tmp_path):
    result, _ = published
    cache = tmp_path / "cache"
    online = _fetch(hub_server, cache, gpu_class="sm90a-132sm", bucket=512)
    tag = online.entry["tag"]
    _fetch(hub_server, cache, tag)  # cache the tag -> commit mapping too
    hub_server.clear_requests()
    script = textwrap.dedent(f"""
        import json
        from megabake.hub import fetch_package
        out = []
        for rev in ("main", {tag!r}, {result.commit!r}):
            f = fetch_package({REPO!r}, rev, endpoint={hub_server.url!r}, cache_dir={str(cache)!r},
                              gpu_class="sm90a-132sm", bucket=512)
            out.append([f.commit, str(f.path), f.package.report["variant"]])
        print(json.dumps(out))
    """)
    pythonpath = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rows == [[result.commit, str(online.path), "decode-b1-c512-sm90a-132sm"]] * 3
    assert hub_server.requests == [], "offline mode must not touch the network"


def test_repo_without_index_is_read_from_package_reports(hub_server, tmp_path):
    path = write_fixture_package(tmp_path, model_id=PRETRAINED, revision=PRETRAINED_REV)
    package = read_package(path)
    hub_server.commit_files(REPO, {f"{package.repo_path}/{n}": (path / n).read_bytes() for n in package.files})
    fetched = _fetch(hub_server, tmp_path / "cache")
    assert fetched.package.manifest == package.manifest
    index, commit = read_hub_index(REPO, endpoint=hub_server.url, cache_dir=tmp_path / "cache")
    assert commit == fetched.commit and list(index["models"]) == [PRETRAINED]


def test_selection_needs_a_model_when_the_repo_holds_several(tmp_path):
    write_fixture_package(tmp_path, model_id=PRETRAINED, revision=PRETRAINED_REV)
    write_fixture_package(tmp_path)
    index = build_index(tmp_path, hub_repo=REPO)
    with pytest.raises(NoMatchingPackageError, match="pass model_id="):
        select_entry(index, Request.from_args(), allow_unverified=True)
    model, revision, entry = select_entry(index, Request.from_args(model_id="megabake/tiny-llama"))
    assert (model, revision, entry["variant"]) == ("megabake/tiny-llama", "random-seed0", "decode-b1-c128-sm90a-132sm")
    with pytest.raises(TypeError):
        Request.from_args(bucket=1.5)
