"""Package layer: layout names, schema validation with JSON pointers, atomic write, digests, registry index."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from megabake.package import (
    DigestMismatchError,
    PackageError,
    SchemaValidationError,
    build_index,
    build_manifest,
    gpu_class_of,
    package_dir,
    parse_variant,
    read_index,
    read_package,
    repo_path,
    update_report,
    validate,
    variant_name,
    write_index,
    write_package,
)
from megabake.package import store
from megabake.package.commands import inspect

from tests.fixtures_packages import PRETRAINED, PRETRAINED_REV, fixture_files, make_report, write_fixture_package


def _dest(root: Path, report: dict) -> Path:
    return package_dir(root, report["model"]["id"], report["model"]["revision"], report["variant"])


def _rewrite_consistently(path: Path, name: str, data: bytes) -> None:
    """Replace a file AND its manifest entry (so only the schema / consistency checks can catch it)."""
    (path / name).write_bytes(data)
    listed = json.loads((path / "manifest.json").read_text())["files"]
    contents = {e["path"]: (path / e["path"]).read_bytes() for e in listed}
    (path / "manifest.json").write_bytes(store.dump_json(build_manifest(contents)))


# ---------------------------------------------------------------------------------------------- layout


def test_variant_gpu_class_and_paths():
    assert gpu_class_of() == "sm90a-132sm"
    assert gpu_class_of((10, 0), 148, "a") == "sm100a-148sm"
    assert gpu_class_of((8, 9), 128, "") == "sm89-128sm"
    assert gpu_class_of((10, 0), 148) == "sm100a-148sm" and gpu_class_of((8, 0), 108) == "sm80-108sm"
    from megabake.runtime import GpuInfo
    from megabake.verification.env import gpu_class_name

    for cc, sms in (((9, 0), 132), ((10, 0), 148), ((8, 0), 108)):  # runtime and verifier spell it alike
        assert GpuInfo("gpu", cc, sms, 0).gpu_class == gpu_class_name(*cc, sms) == gpu_class_of(cc, sms)
    name = variant_name("decode", 1, 128, "sm90a-132sm")
    assert name == "decode-b1-c128-sm90a-132sm"
    v = parse_variant("decode-b4-c2048-sm100a-148sm")
    assert (v.mode, v.batch, v.capacity, v.gpu_class, v.name) == ("decode", 4, 2048, "sm100a-148sm",
                                                                   "decode-b4-c2048-sm100a-148sm")
    assert package_dir("packages", "HuggingFaceTB/SmolLM-135M", "a" * 40, name) == \
        Path("packages/HuggingFaceTB--SmolLM-135M") / ("a" * 40) / name
    assert repo_path("megabake/tiny-llama", "random-seed0", name) == \
        "packages/megabake--tiny-llama/random-seed0/decode-b1-c128-sm90a-132sm"
    for bad in ("decode-b1-sm90a-132sm", "prefill-b1-c128-sm90a-132sm", "decode-b1-c128-h100"):
        with pytest.raises(ValueError, match="decode-b1-c128-sm90a-132sm"):
            parse_variant(bad)
    with pytest.raises(ValueError, match="40-hex"):
        package_dir("packages", "megabake/tiny-llama", "main", name)
    with pytest.raises(ValueError):
        variant_name("decode", 0, 128, "sm90a-132sm")


# --------------------------------------------------------------------------------------- write / read


def test_write_then_read_round_trip(tmp_path):
    path = write_fixture_package(tmp_path)
    package = read_package(path)
    assert package.path == path
    assert package.report == make_report()
    assert package.plan == {"fixture": True, "capacity": 128, "tag": ""}
    assert package.source_map["plan_hash"] == package.report["plan"]["hash"]
    listed = {e["path"]: e for e in package.manifest["files"]}
    assert sorted(listed) == ["module.py", "plan.json", "report.json", "source_map.json"]
    for name, entry in listed.items():
        data = (path / name).read_bytes()
        assert entry["size"] == len(data) and entry["sha256"] == store.sha256_bytes(data)
    assert package.files[-1] == "manifest.json"
    assert sorted(p.name for p in path.iterdir()) == sorted(package.files)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp folders left behind


@pytest.mark.parametrize(
    "mutate, pointer, expected",
    [
        (lambda r: r["bucket"].__setitem__("batch", "1"), "/bucket/batch", "type integer"),
        (lambda r: r["toolchain"].pop("torch"), "/toolchain/torch", "required property 'torch'"),
        (lambda r: r.__setitem__("status", "great"), "/status", '"verified"'),
        (lambda r: r["model"].__setitem__("revision", "main"), "/model/revision", "40-hex"),
        (lambda r: r.__setitem__("colour", "blue"), "/colour", "no property 'colour'"),
        (lambda r: r["plan"].__setitem__("hash", "xyz"), "/plan/hash", "64 lowercase hex"),
    ],
)
def test_schema_invalid_report_is_refused_with_pointer(tmp_path, mutate, pointer, expected):
    report = make_report()
    files = fixture_files(report)
    mutate(report)
    with pytest.raises(SchemaValidationError) as err:
        write_package(_dest(tmp_path, make_report()), files, report)
    assert err.value.pointer == pointer
    assert pointer in str(err.value) and expected in str(err.value)
    assert expected in err.value.expected
    assert not any(tmp_path.rglob("*.json")), "nothing may be written for an invalid report"


def test_schema_invalid_report_on_disk_is_refused_on_read(tmp_path):
    path = write_fixture_package(tmp_path)
    report = json.loads((path / "report.json").read_text())
    report["kernel"]["grid"] = [132, 1]
    _rewrite_consistently(path, "report.json", json.dumps(report).encode())
    with pytest.raises(SchemaValidationError) as err:
        read_package(path)
    assert err.value.pointer == "/kernel/grid"
    assert "at least 3 items" in str(err.value) and "report.json" in str(err.value)


@pytest.mark.parametrize(
    "change, kind, pointer",
    [
        (lambda r, f: r.__setitem__("variant", "decode-b1-c256-sm90a-132sm"), "report", "/variant"),
        (lambda r, f: f.__setitem__("plan.json", b'{"other": 1}'), "report", "/plan/hash"),
        (lambda r, f: r["model"].__setitem__("revision", "random-seed7"), "report", "/model/revision"),
        (lambda r, f: r["numerics"].__setitem__("pass", False), "report", "/numerics/pass"),
        (lambda r, f: r["timings"].__setitem__("baseline", "eager"), "report", "/timings/baseline"),
        (lambda r, f: f.__setitem__("module.py", b"x = 1\n"), "source_map", "/entries/0/lines"),
    ],
)
def test_cross_field_rules(tmp_path, change, kind, pointer):
    report = make_report()
    files = fixture_files(report)
    change(report, files)
    with pytest.raises(SchemaValidationError) as err:
        write_package(tmp_path / "pkg", files, report)
    assert (err.value.kind, err.value.pointer) == (kind, pointer)
    assert not (tmp_path / "pkg").exists()


def test_validate_names_pointer_for_every_kind():
    with pytest.raises(SchemaValidationError) as err:
        validate("manifest", {"schema_version": 1, "files": [{"path": "../x", "size": 1, "sha256": "0" * 64}]})
    assert err.value.pointer == "/files/0/path"
    with pytest.raises(SchemaValidationError) as err:
        validate("source_map", {"schema_version": 1, "module": "module.py", "plan_hash": "0" * 64,
                                "entries": [{"kind": "body_call", "stage": -1, "lines": [1, 2], "ir_ops": []}]})
    assert err.value.pointer == "/entries/0/stage" and ">= 0" in err.value.expected
    with pytest.raises(SchemaValidationError) as err:
        validate("registry_index", {"schema_version": 2, "generated_at": "2026-11-30T10:00:00Z", "models": {}})
    assert err.value.pointer == "/schema_version" and "exactly 1" in str(err.value)


def test_digest_mismatch_names_the_file(tmp_path):
    path = write_fixture_package(tmp_path)
    (path / "module.py").write_text("import os; os.system('evil')\n")
    with pytest.raises(DigestMismatchError) as err:
        read_package(path)
    assert err.value.path == "module.py" and "module.py" in str(err.value) and "fix:" in str(err.value)


def test_unlisted_or_missing_file_is_refused(tmp_path):
    path = write_fixture_package(tmp_path)
    (path / "extra.py").write_text("print('hi')\n")
    with pytest.raises(PackageError, match="'extra.py' is not listed in manifest.json"):
        read_package(path)
    (path / "extra.py").unlink()
    (path / "__pycache__").mkdir()
    (path / "__pycache__" / "module.cpython-311.pyc").write_bytes(b"\0")
    read_package(path)  # Python's bytecode cache is not part of the package
    (path / "plan.json").unlink()
    with pytest.raises(PackageError, match="'plan.json' is listed in manifest.json but missing"):
        read_package(path)
    with pytest.raises(PackageError, match="manifest.json is missing"):
        read_package(tmp_path)


def test_failed_rewrite_keeps_the_old_package(tmp_path, monkeypatch):
    path = write_fixture_package(tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    report = make_report(status="unverified")
    calls = []

    def dying_write(target, data):
        calls.append(target)
        if len(calls) == 3:
            raise OSError("disk died half-way")
        return real_write(target, data)

    real_write = store._write_file
    monkeypatch.setattr(store, "_write_file", dying_write)
    with pytest.raises(OSError, match="half-way"):
        write_package(path, fixture_files(report), report)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert read_package(path).status == "verified"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "temp folder must be cleaned up"


def test_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    def dying_write(target, data):
        raise OSError("disk full")

    monkeypatch.setattr(store, "_write_file", dying_write)
    report = make_report()
    with pytest.raises(OSError):
        write_package(tmp_path / "pkg", fixture_files(report), report)
    assert list(tmp_path.iterdir()) == []


def test_write_replaces_existing_package(tmp_path):
    path = write_fixture_package(tmp_path)
    report = make_report(status="unverified")
    write_package(path, fixture_files(report), report)
    assert read_package(path).status == "unverified"


def test_update_report_rewrites_report_and_manifest(tmp_path):
    path = write_fixture_package(tmp_path, status="unverified", megabake_ms=None)
    old_manifest = (path / "manifest.json").read_bytes()
    report = make_report(status="verified", megabake_ms=0.25, baseline_ms=1.0)
    package = update_report(path, report)
    assert package.report == report and package.status == "verified"
    assert (path / "manifest.json").read_bytes() != old_manifest
    assert (path / "module.py").read_bytes() == fixture_files(report)["module.py"]
    other = make_report(capacity=256)
    with pytest.raises(SchemaValidationError, match="/variant"):
        update_report(path, other)
    (path / "module.py").write_text("tampered\n")
    with pytest.raises(DigestMismatchError):
        update_report(path, report)  # never launders a tampered package


# --------------------------------------------------------------------------------------------- registry


def test_build_index_maps_models_to_packages_with_headline_numbers(tmp_path):
    write_fixture_package(tmp_path, capacity=128, megabake_ms=0.5, baseline_ms=1.5)
    write_fixture_package(tmp_path, capacity=512, status="unverified", megabake_ms=None)
    write_fixture_package(tmp_path, model_id=PRETRAINED, revision=PRETRAINED_REV, gpu_class="sm100a-148sm")
    index = build_index(tmp_path, hub_repo="my-org/tiny")
    assert sorted(index["models"]) == [PRETRAINED, "megabake/tiny-llama"]
    tiny = index["models"]["megabake/tiny-llama"]["random-seed0"]
    assert [e["variant"] for e in tiny] == ["decode-b1-c128-sm90a-132sm", "decode-b1-c512-sm90a-132sm"]
    fast, slow = tiny
    assert (fast["megabake_ms"], fast["baseline_ms"], fast["speedup"]) == (0.5, 1.5, 3.0)
    assert fast["baseline"] == "inductor-reduce-overhead" and fast["timing_measure"] == "sync_call"
    assert (slow["megabake_ms"], slow["baseline_ms"], slow["speedup"]) == (None, None, None)
    assert slow["status"] == "unverified"
    assert fast["hub_repo"] == "my-org/tiny"
    assert fast["tag"] == "megabake--tiny-llama.random-seed0.decode-b1-c128-sm90a-132sm"
    fast_dir = tmp_path / "megabake--tiny-llama/random-seed0" / fast["variant"]
    assert fast["manifest_sha256"] == read_package(fast_dir).manifest_sha256
    pre = index["models"][PRETRAINED][PRETRAINED_REV][0]
    assert pre["gpu_class"] == "sm100a-148sm" and pre["weights"] == "pretrained"
    local = build_index(tmp_path)
    assert local["models"]["megabake/tiny-llama"]["random-seed0"][0]["tag"] is None
    out = write_index(tmp_path / "registry" / "index.json", index)
    assert read_index(out) == index


def test_invalid_registry_index_is_refused(tmp_path):
    write_fixture_package(tmp_path / "packages")
    index = build_index(tmp_path / "packages")
    bad = copy.deepcopy(index)
    bad["models"]["megabake/tiny-llama"]["random-seed0"][0]["speedup"] = "fast"
    (tmp_path / "index.json").write_text(json.dumps(bad))
    with pytest.raises(SchemaValidationError) as err:
        read_index(tmp_path / "index.json")
    assert err.value.pointer == "/models/megabake~1tiny-llama/random-seed0/0/speedup"


# ------------------------------------------------------------------------------------------------- CLI


def test_inspect_prints_summary_and_refuses_tampered(tmp_path):
    path = write_fixture_package(tmp_path)
    result = CliRunner().invoke(inspect, [str(path)])
    assert result.exit_code == 0, result.output
    for text in ("megabake/tiny-llama @ random-seed0", "decode-b1-c128-sm90a-132sm", "status     verified",
                 "speedup 2x", "all digests ok", "packages/megabake--tiny-llama/random-seed0"):
        assert text in result.output
    as_json = CliRunner().invoke(inspect, [str(path), "--json"])
    assert json.loads(as_json.output)["report"]["variant"] == "decode-b1-c128-sm90a-132sm"
    (path / "plan.json").write_text("{}")
    bad = CliRunner().invoke(inspect, [str(path)])
    assert bad.exit_code == 1 and "plan.json" in bad.output and "does not match manifest.json" in bad.output


def test_inspect_names_a_chosen_gemv_tiling():
    from megabake.package.commands import _kernel, tiling_note

    kernel = {"grid": [132, 1, 1], "block": [256, 1, 1]}
    assert tiling_note(kernel) == "" and "GEMV tiling" not in _kernel(kernel)
    kernel["tiling"] = {"spec": "balanced:2x4+ring4", "attention_preload": True}
    assert _kernel(kernel).endswith(", GEMV tiling balanced:2x4+ring4 + attention preload")
    kernel["autotune"] = {"tuning": {}, "stage_us": {}, "chosen": "per-stage"}
    assert tiling_note(kernel) == "autotuned (per-stage)"
