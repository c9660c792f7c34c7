"""`megabake lock` and `load_from_hub(..., lockfile=...)` against the local fake Hub (real huggingface_hub client)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from megabake.cli import cli
from megabake.errors import EXIT_FAILED, EXIT_USAGE
from megabake.hub import LockFileError, fetch_package, load_from_hub, publish, read_lock
from megabake.package import DigestMismatchError, build_manifest, read_package, store, validate

from tests.fixtures_packages import PRETRAINED, PRETRAINED_REV, write_fixture_package

REPO = "my-org/smollm-megabake"
OTHER = "my-org/second-megabake"
TOKEN = "hf_fake_token"


@pytest.fixture
def published(hub_server, tmp_path):
    """Two verified packages (capacity 128 and 512) in REPO, and the 512 one in OTHER."""
    paths = {c: write_fixture_package(tmp_path / "packages", model_id=PRETRAINED, revision=PRETRAINED_REV,
                                      capacity=c) for c in (128, 512)}
    result = publish(list(paths.values()), REPO, endpoint=hub_server.url, token=TOKEN)
    publish([paths[512]], OTHER, endpoint=hub_server.url, token=TOKEN)
    return result, {c: read_package(p) for c, p in paths.items()}


def _lock(server, out: Path, *args: str):
    return CliRunner().invoke(cli, ["lock", *args, "--endpoint", server.url, "--token", TOKEN, "--out", str(out)])


def _load(server, tmp_path, repo=REPO, **kw):
    kw.setdefault("cache_dir", tmp_path / "cache")
    return fetch_package(repo, endpoint=server.url, token=TOKEN, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_lock_then_load_gives_the_locked_package(hub_server, published, tmp_path, monkeypatch):
    result, local = published
    out = tmp_path / "megabake.lock"
    run = _lock(hub_server, out, OTHER, f"{REPO}@main", "--bucket", "1000", "--gpu-class", "sm90a-132sm")
    assert run.exit_code == 1 and "no package fits" in run.stderr and not out.exists()  # one fails: no file
    run = _lock(hub_server, out, OTHER, f"{REPO}@main", "--bucket", "b1-c300")
    assert run.exit_code == 0, run.output
    assert run.stdout.splitlines()[-2] == f"wrote {out}"
    lock = validate("lock", json.loads(out.read_text()))
    assert [e["repo"] for e in lock["packages"]] == [OTHER, REPO]  # one entry per repo, sorted
    entry = lock["packages"][1]
    assert entry == {"repo": REPO, "revision": "main", "commit": result.commit, "path": local[512].repo_path,
                     "variant": "decode-b1-c512-sm90a-132sm", "model_id": PRETRAINED,
                     "model_revision": PRETRAINED_REV, "gpu_class": "sm90a-132sm", "status": "verified",
                     "manifest_sha256": local[512].manifest_sha256,
                     "tag": f"HuggingFaceTB--SmolLM-135M.{PRETRAINED_REV}.decode-b1-c512-sm90a-132sm"}
    before = out.read_bytes()
    again = _lock(hub_server, out, f"{REPO}@main", OTHER, "--bucket", "300")
    assert again.exit_code == 0 and f"unchanged: {out} already pins these packages" in again.stdout
    assert out.read_bytes() == before  # idempotent: same state, same bytes

    fetched = _load(hub_server, tmp_path, lockfile=out)  # no bucket: the lock decides
    assert fetched.commit == result.commit and fetched.pinned and fetched.lockfile == out
    assert _files(fetched.path) == _files(local[512].path)
    from megabake.runtime import MegakernelDecoder

    monkeypatch.setattr(MegakernelDecoder, "from_package",
                        classmethod(lambda cls, path, device=None, model_path=None:
                                    ("decoder", Path(path), device, model_path)))
    decoder = load_from_hub(REPO, device="cpu", lockfile=out, endpoint=hub_server.url, token=TOKEN,
                            cache_dir=tmp_path / "cache")  # a lock pins a commit: trusted without the flag
    assert decoder == ("decoder", fetched.path, "cpu", None)


def test_the_lock_pins_the_commit_not_the_branch(hub_server, published, tmp_path):
    result, local = published
    out = tmp_path / "megabake.lock"
    assert _lock(hub_server, out, REPO).exit_code == 0
    package = local[128]
    forged = {n: (package.path / n).read_bytes() for n in package.files if n != "manifest.json"}
    forged["module.py"] = b"import os\nos.system('evil')\n\n\n\n"
    newer = hub_server.commit_files(REPO, {f"{package.repo_path}/module.py": forged["module.py"],
                                           f"{package.repo_path}/manifest.json":
                                               store.dump_json(build_manifest(forged))}, message="changed")
    assert newer != result.commit and hub_server.head(REPO) == newer
    fetched = _load(hub_server, tmp_path, lockfile=out)
    assert fetched.commit == result.commit
    assert (fetched.path / "module.py").read_bytes() == (package.path / "module.py").read_bytes()
    with pytest.raises(DigestMismatchError):  # without the lock, main is read: the index catches the change
        _load(hub_server, tmp_path / "other")


def test_a_package_that_differs_from_the_lock_is_refused(hub_server, published, tmp_path):
    result, local = published
    out = tmp_path / "megabake.lock"
    assert _lock(hub_server, out, REPO).exit_code == 0
    package = local[128]
    forged = {n: (package.path / n).read_bytes() for n in package.files if n != "manifest.json"}
    forged["module.py"] = b"import os\nos.system('evil')\n\n\n\n"
    hub_server.tamper(REPO, f"{package.repo_path}/module.py", forged["module.py"], result.commit)
    hub_server.tamper(REPO, f"{package.repo_path}/manifest.json", store.dump_json(build_manifest(forged)),
                      result.commit)
    with pytest.raises(DigestMismatchError) as err:
        _load(hub_server, tmp_path, lockfile=out)
    assert f"manifest_sha256: lock file {out} says" in str(err.value) and "megabake lock" in str(err.value)
    lock = json.loads(out.read_text())
    lock["packages"][0]["manifest_sha256"] = "0" * 64
    out.write_text(json.dumps(lock))
    with pytest.raises(DigestMismatchError, match="lock file"):
        _load(hub_server, tmp_path / "fresh", lockfile=out)


def test_bad_lock_files_get_clear_errors(hub_server, published, tmp_path):
    out = tmp_path / "megabake.lock"
    assert _lock(hub_server, out, REPO).exit_code == 0
    good = json.loads(out.read_text())

    def load(lock_text: str | None = None, **kw):
        path = tmp_path / "case.lock"
        if lock_text is not None:
            path.write_text(lock_text)
        with pytest.raises(LockFileError) as err:
            _load(hub_server, tmp_path, lockfile=path, **kw)
        assert err.value.exit_code == EXIT_USAGE and "fix:" in str(err.value)
        return str(err.value)

    assert "does not exist" in load()
    assert "is not readable JSON" in load("{not json")
    bad = json.loads(json.dumps(good))
    bad["packages"][0]["commit"] = "main"
    assert "malformed: at JSON pointer '/packages/0/commit'" in load(json.dumps(bad))
    twice = dict(good, packages=good["packages"] * 2)
    assert "has more than one entry" in load(json.dumps(twice))
    with pytest.raises(LockFileError, match=f"has no entry for {OTHER} \\(it pins: {REPO}\\)"):
        fetch_package(OTHER, endpoint=hub_server.url, token=TOKEN, lockfile=out, cache_dir=tmp_path / "c")
    assert "asks for a bucket / GPU class that variant does not fit (batch 1, KV capacity >= 2048" in \
        load(json.dumps(good), bucket=2048)
    assert "but the call asks for revision 'other-branch'" in load(json.dumps(good), revision="other-branch")


def test_lock_cli_refuses_to_replace_another_lock_without_force(hub_server, published, tmp_path):
    out = tmp_path / "megabake.lock"
    assert _lock(hub_server, out, REPO, "--bucket", "128").exit_code == 0
    before = out.read_bytes()
    refused = _lock(hub_server, out, REPO, "--bucket", "512")
    assert refused.exit_code == EXIT_FAILED and "Traceback" not in refused.output
    assert refused.stderr.startswith(f"error: refusing to replace lock file {out}: it pins other packages")
    assert "variant decode-b1-c128-sm90a-132sm -> decode-b1-c512-sm90a-132sm" in refused.stderr
    assert out.read_bytes() == before
    forced = _lock(hub_server, out, REPO, "--bucket", "512", "--force")
    assert forced.exit_code == 0 and f"updated {out} (--force)" in forced.stdout
    assert read_lock(out)["packages"][0]["variant"] == "decode-b1-c512-sm90a-132sm"
    (tmp_path / "notes.txt").write_text("my notes\n")
    usage = _lock(hub_server, tmp_path / "notes.txt", REPO)
    assert usage.exit_code == EXIT_USAGE and "is not a MegaBake lock file" in usage.stderr
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def test_lock_help_lists_exit_codes():
    out = CliRunner().invoke(cli, ["lock", "--help"], terminal_width=200).output
    assert "Exit codes" in out and "lockfile=" in out
    for code in ("0", "1", "2", "3"):
        assert f"\n  {code}  " in out or f"\n    {code}  " in out
