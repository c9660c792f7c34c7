"""A package never silently replaces another (docs/FORMATS.md, "Writing a package over another").

Plan-tagged variant names, the write policy of ``save_package`` (unchanged / upgraded / refused / replaced with
force), the bake's use of it (three CPU bakes of tiny-llama in all, ~20 s each), the ``--force`` flag of the CLI,
old untagged names, and the Hub selector's deterministic choice among several plans of one bucket.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from megabake.cli import cli
from megabake.errors import EXIT_FAILED
from megabake.hub import fetch_package, publish
from megabake.hub.select import Request, select_entry
from megabake.package import (
    OverwriteRefusedError,
    SchemaValidationError,
    build_hash,
    build_index,
    package_destination,
    package_dir,
    package_tag,
    parse_variant,
    plan_tag,
    read_package,
    report_build_hash,
    save_package,
    validate,
    variant_name,
    write_package,
)

from tests.fixtures_packages import PRETRAINED, PRETRAINED_REV, fixture_files, make_report, plan_bytes, \
    write_fixture_package

PLAN_HASH = hashlib.sha256(plan_bytes(128)).hexdigest()
REPO = "my-org/plans-megabake"
TOKEN = "hf_fake_token"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _files(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in read_package(path).files if n not in ("report.json", "manifest.json")}


# ------------------------------------------------------------------------------------------ variant names


def test_variant_names_carry_a_plan_tag_and_old_names_still_parse():
    name = variant_name("decode", 1, 128, "sm90a-132sm", PLAN_HASH)
    assert name == f"decode-b1-c128-sm90a-132sm-p{PLAN_HASH[:8]}" and plan_tag(PLAN_HASH) == PLAN_HASH[:8]
    v = parse_variant(name)
    assert (v.mode, v.batch, v.capacity, v.gpu_class, v.plan_tag) == ("decode", 1, 128, "sm90a-132sm", PLAN_HASH[:8])
    assert v.name == name and v.bucket_name == "decode-b1-c128-sm90a-132sm"
    old = parse_variant("decode-b1-c128-sm90a-132sm")  # the committed packages and published ones use these
    assert old.plan_tag is None and old.name == "decode-b1-c128-sm90a-132sm"
    assert package_dir("packages", "megabake/tiny-llama", "random-seed0", name).name == name
    assert package_tag("megabake/tiny-llama", "random-seed0", name).endswith(f".{name}")
    for bad in ("decode-b1-c128-sm90a-132sm-p123", "decode-b1-c128-sm90a-132sm-pXYZXYZXY",
                "decode-b1-c128-sm90a-132sm-1a2b3c4d"):
        with pytest.raises(ValueError, match="p1a2b3c4d"):
            parse_variant(bad)
    with pytest.raises(ValueError, match="sha256"):
        variant_name("decode", 1, 128, "sm90a-132sm", "not-a-hash")


def test_committed_packages_with_old_names_still_read():
    root = Path(__file__).resolve().parents[1] / "packages"
    for path in sorted(root.glob("*/*/decode-b1-c128-sm90a-132sm")):
        assert read_package(path).variant.plan_tag is None


def test_the_plan_tag_must_name_the_plan(tmp_path):
    report = make_report(tagged=True)
    write_package(tmp_path / "ok", fixture_files(report), report)  # tagged: fine; untagged (old): fine too
    bad = copy.deepcopy(report)
    bad["variant"] = variant_name("decode", 1, 128, "sm90a-132sm", "0" * 64)
    with pytest.raises(SchemaValidationError) as err:
        write_package(tmp_path / "bad", fixture_files(bad), bad)
    assert err.value.pointer == "/variant" and report["variant"] in str(err.value)
    validate("report", report)


LOADER_RECORD = {"loader_warp": {"gates": ["qkv"], "drain": True, "warpgroup": True, "slots": 6, "qkv_slots": 3,
                                  "inflight": {"norm_qkv": 1, "norm_gate_up": 1, "lm_head": 1}}}


def test_a_codegen_record_gives_the_build_a_plan_tag_of_its_own(tmp_path):
    """Two builds of one plan (with and without a loader warp) never share a variant: the tag is taken from
    build_hash(plan.hash, kernel.codegen); a record that the name does not carry is refused."""
    assert build_hash(PLAN_HASH) == build_hash(PLAN_HASH, {}) == PLAN_HASH  # every older package keeps its name
    loader_hash = build_hash(PLAN_HASH, LOADER_RECORD)
    assert len(loader_hash) == 64 and loader_hash[:8] != PLAN_HASH[:8]
    other_pacing = copy.deepcopy(LOADER_RECORD)
    other_pacing["loader_warp"]["gates"] = ["qkv", "attention"]
    assert build_hash(PLAN_HASH, other_pacing) not in (loader_hash, PLAN_HASH)
    report = make_report(tagged=True)
    report["kernel"]["codegen"] = LOADER_RECORD
    with pytest.raises(SchemaValidationError) as err:  # still named after the plan alone
        write_package(tmp_path / "bad", fixture_files(report), report)
    assert err.value.pointer == "/variant" and "codegen" in str(err.value)
    report["variant"] = variant_name("decode", 1, 128, "sm90a-132sm", loader_hash)
    assert report_build_hash(report) == loader_hash
    path = write_package(tmp_path / report["variant"], fixture_files(report), report)
    assert read_package(path).variant.plan_tag == loader_hash[:8]
    args = ("megabake/tiny-llama", "random-seed0", "decode", 1, 128, "sm90a-132sm")
    legacy = write_fixture_package(tmp_path)  # untagged, no codegen record: holds the loader-less build only
    assert package_destination(tmp_path, *args, PLAN_HASH) == (legacy, "decode-b1-c128-sm90a-132sm")
    assert package_destination(tmp_path, *args, loader_hash)[1] == f"decode-b1-c128-sm90a-132sm-p{loader_hash[:8]}"
    broken = copy.deepcopy(report)
    broken["kernel"]["codegen"] = {"loader_warp": {"gates": "qkv"}}
    with pytest.raises(SchemaValidationError):
        validate("report", broken)


# ------------------------------------------------------------------------------------------ write policy


def test_identical_package_is_left_unchanged_byte_for_byte(tmp_path):
    path = write_fixture_package(tmp_path, status="unverified", megabake_ms=None, tagged=True)
    before = _snapshot(path)
    report = make_report(status="unverified", megabake_ms=None, tagged=True)
    report["created_at"] = "2026-12-24T10:00:00Z"  # a later bake: its report bytes differ, its kernel does not
    saved = save_package(path, fixture_files(report), report)
    assert saved.action == "unchanged" and not saved.wrote
    assert saved.message.startswith(f"unchanged: identical package already at {path}")
    assert _snapshot(path) == before


def test_an_invalid_package_is_refused_before_any_comparison(tmp_path):
    path = write_fixture_package(tmp_path)
    report = make_report()
    report["bucket"]["batch"] = "1"
    with pytest.raises(SchemaValidationError, match="/bucket/batch"):
        save_package(path, fixture_files(make_report()), report)


def test_a_verified_report_is_not_replaced_by_a_weaker_one_without_force(tmp_path):
    path = write_fixture_package(tmp_path, status="verified")
    before = _snapshot(path)
    for status in ("unverified", "failed"):
        report = make_report(status=status)
        saved = save_package(path, fixture_files(report), report)
        assert saved.action == "unchanged" and saved.previous_status == "verified"
        assert f"its verified report is kept, this bake's {status} report was not written" in saved.message
        assert _snapshot(path) == before
    report = make_report(status="unverified")
    saved = save_package(path, fixture_files(report), report, force=True)
    assert saved.action == "replaced" and read_package(path).status == "unverified"


def test_a_stronger_report_upgrades_an_identical_package(tmp_path):
    path = write_fixture_package(tmp_path, status="failed")
    report = make_report(status="unverified")
    saved = save_package(path, fixture_files(report), report)
    assert saved.action == "upgraded" and saved.previous_status == "failed"
    assert read_package(path).status == "unverified"


def test_a_different_package_at_the_same_path_is_refused_then_replaced_with_force(tmp_path):
    path = write_fixture_package(tmp_path, status="verified")
    before = _snapshot(path)
    report = make_report(status="unverified")
    files = fixture_files(report, module_text='"""Another kernel."""\nVARIANT = "x"\n\ndef describe():\n    pass\n')
    with pytest.raises(OverwriteRefusedError) as err:
        save_package(path, files, report)
    message = str(err.value)
    assert f"refusing to replace the package at {path}: module.py differs" in message
    assert "the package there is verified, this bake is unverified" in message and "--force" in message
    assert err.value.path == str(path) and err.value.differs == ["module.py differs"] and err.value.exit_code == 1
    assert _snapshot(path) == before
    assert [p.name for p in path.parent.iterdir()] == [path.name], "nothing half-written next to it"
    saved = save_package(path, files, report, force=True)
    assert saved.action == "replaced" and "module.py differs" in saved.message
    assert (path / "module.py").read_bytes() == files["module.py"] and read_package(path).status == "unverified"


def test_a_folder_that_is_not_a_valid_package_is_refused(tmp_path):
    path = write_fixture_package(tmp_path)
    (path / "module.py").write_text("tampered\n")
    report = make_report()
    with pytest.raises(OverwriteRefusedError, match="exists and it is not a valid package: package .* 'module.py'"):
        save_package(path, fixture_files(report), report)
    assert save_package(path, fixture_files(report), report, force=True).action == "replaced"
    read_package(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert save_package(empty, fixture_files(report), report).action == "written"


def test_destination_is_plan_tagged_unless_an_old_folder_holds_the_same_plan(tmp_path):
    args = ("megabake/tiny-llama", "random-seed0", "decode", 1, 128, "sm90a-132sm")
    dest, variant = package_destination(tmp_path, *args, PLAN_HASH)
    assert variant == f"decode-b1-c128-sm90a-132sm-p{PLAN_HASH[:8]}" and dest.name == variant
    legacy = write_fixture_package(tmp_path)  # untagged name, plan_bytes(128)
    assert package_destination(tmp_path, *args, PLAN_HASH) == (legacy, "decode-b1-c128-sm90a-132sm")
    other = "ab" * 32
    assert package_destination(tmp_path, *args, other)[1] == f"decode-b1-c128-sm90a-132sm-p{other[:8]}"


# ------------------------------------------------------------------------------------------------ bakes


@pytest.fixture(scope="module")
def baked(tmp_path_factory):
    from megabake.baking import bake

    root = tmp_path_factory.mktemp("packages")
    return root, bake("tiny-llama", out=root, run_on_gpu=False, reference_steps=1)


def _as_verified_legacy(path: Path) -> Path:
    """The baked package as a pre-plan-tag package would sit in packages/: untagged folder, verified report."""
    package = read_package(path)
    report = copy.deepcopy(package.report)
    report["variant"] = package.variant.bucket_name
    report.update(status="verified", status_reasons=[], numerics=make_report()["numerics"])
    dest = path.parent / report["variant"]
    write_package(dest, _files(path), report)
    shutil.rmtree(path)
    return dest


def test_bake_writes_a_plan_tagged_folder_and_rebaking_changes_nothing(baked):
    root, result = baked
    assert result.outcome == "written" and result.note == ""
    assert result.path.name == f"decode-b1-c128-sm90a-132sm-p{result.plan_hash[:8]}"
    assert result.report["variant"] == result.path.name
    legacy = _as_verified_legacy(result.path)
    before = _snapshot(legacy)
    run = CliRunner().invoke(cli, ["bake", "--no-gpu", "--out", str(root)])  # same inputs, via the CLI
    assert run.exit_code == 0, run.output
    assert run.stdout.strip().splitlines()[-1] == str(legacy)
    assert f"unchanged: identical package already at {legacy}" in run.stderr
    assert "its verified report is kept, this bake's unverified report was not written" in run.stderr
    assert _snapshot(legacy) == before, "an identical re-bake writes nothing: same bytes, verified evidence kept"
    assert [p.name for p in legacy.parent.iterdir()] == [legacy.name]


def test_two_tilings_give_two_folders(baked):
    from megabake.baking import bake

    root, first = baked
    other = bake("tiny-llama", out=root, run_on_gpu=False, reference_steps=1, tiling="1x2")
    assert other.outcome == "written" and other.plan_hash != first.plan_hash
    assert other.path.name == f"decode-b1-c128-sm90a-132sm-p{other.plan_hash[:8]}"
    assert other.path.parent == first.path.parent and other.path != first.path
    assert read_package(other.path).report["kernel"]["tiling"]["spec"] == "1x2"


def test_a_loader_build_of_the_same_plan_gets_a_folder_of_its_own(baked, monkeypatch):
    """With the loader_warp feature on (and its 16 MB threshold lowered to reach tiny-llama), the bake's module
    has a loader warp: same plan, but the report records the loader's pacing and the variant is tagged with it."""
    import megabake.codegen.loader as loader
    from megabake.baking import bake
    from megabake.plan import EXPERIMENTAL_LAYOUTS_ENV

    root, first = baked
    monkeypatch.setenv(EXPERIMENTAL_LAYOUTS_ENV, "loader_warp")
    monkeypatch.setattr(loader, "DEFAULT_MIN_LAYER_BYTES", 0)
    other = bake("tiny-llama", out=root, run_on_gpu=False, reference_steps=1)
    report = read_package(other.path).report
    assert other.outcome == "written" and other.plan_hash == first.plan_hash
    assert "LOADER_THREADS" in (other.path / "module.py").read_text() and report["kernel"]["compile_check"]["ok"]
    assert report["kernel"]["codegen"]["loader_warp"]["gates"] == ["qkv"]
    tag = build_hash(first.plan_hash, report["kernel"]["codegen"])[:8]
    assert other.path.name == report["variant"] == f"decode-b1-c128-sm90a-132sm-p{tag}" != first.report["variant"]
    assert "codegen" not in first.report["kernel"]
    shown = CliRunner().invoke(cli, ["inspect", str(other.path)])
    assert shown.exit_code == 0 and "loader warp (gates qkv, drain, " in shown.output, shown.output


def test_cli_refuses_a_different_package_and_passes_force(tmp_path, monkeypatch):
    """The CLI's side of the policy, with the bake itself replaced by a writer of a fixture package."""
    import megabake.baking as baking

    path = write_fixture_package(tmp_path, status="verified")
    report = make_report(status="unverified")
    files = fixture_files(report, module_text='"""Another kernel."""\nVARIANT = "x"\n\ndef describe():\n    pass\n')
    seen = []

    def fake_bake(model, *, force=False, **kwargs):
        seen.append(force)
        saved = save_package(path, files, report, force=force)
        return baking.BakeResult(path, report, report["plan"]["hash"], outcome=saved.action, note=saved.message)

    monkeypatch.setattr(baking, "bake", fake_bake)
    refused = CliRunner().invoke(cli, ["bake", "--no-gpu", "--out", str(tmp_path)])
    assert refused.exit_code == EXIT_FAILED and "Traceback" not in refused.output
    assert refused.stderr.startswith(f"error: refusing to replace the package at {path}: module.py differs")
    assert read_package(path).status == "verified"
    forced = CliRunner().invoke(cli, ["bake", "--no-gpu", "--out", str(tmp_path), "--force"])
    assert forced.exit_code == 0 and seen == [False, True]
    assert f"replaced (--force): {path} held a different package (module.py differs; its report verified)" in \
        forced.stderr
    assert forced.stdout.strip().splitlines()[-1] == str(path) and read_package(path).status == "unverified"
    assert "--force" in CliRunner().invoke(cli, ["bake", "--help"]).output


# ------------------------------------------------------------------------------ several plans, one bucket


def _plans(root: Path) -> dict[str, Path]:
    """One bucket, four plans: old name verified 0.5 ms, tagged verified 0.4 ms and 0.4 ms (newer), unverified."""
    common = dict(model_id=PRETRAINED, revision=PRETRAINED_REV)
    paths = {
        "old": write_fixture_package(root, megabake_ms=0.5, **common),
        "fast": write_fixture_package(root, megabake_ms=0.4, plan_tag="fast", tagged=True, **common),
        "unverified": write_fixture_package(root, status="unverified", megabake_ms=0.1, plan_tag="u", tagged=True,
                                            **common),
    }
    newer = make_report(megabake_ms=0.4, plan=plan_bytes(128, "newer"), tagged=True, **common)
    newer["created_at"] = "2026-12-24T10:00:00Z"
    dest = package_dir(root, PRETRAINED, PRETRAINED_REV, newer["variant"])
    paths["newer"] = write_package(dest, fixture_files(newer, plan_bytes(128, "newer")), newer)
    return paths


def test_selection_among_plans_of_one_bucket_is_deterministic(tmp_path):
    paths = _plans(tmp_path)
    name = {key: read_package(path).report["variant"] for key, path in paths.items()}
    index = build_index(tmp_path, hub_repo=REPO)

    def pick(bucket=None, index=index):
        return select_entry(index, Request.from_args(bucket=bucket), allow_unverified=True)[2]["variant"]

    assert pick() == name["newer"]  # verified first (not the 0.1 ms unverified), fastest, newest of the fastest
    assert pick("decode-b1-c128-sm90a-132sm") == name["newer"]  # an untagged name: every plan of its bucket
    assert pick(name["fast"]) == name["fast"]  # a plan-tagged name: exactly that one
    assert pick(name["unverified"]) == name["unverified"]
    shuffled = dict(index, models={m: {r: list(reversed(e)) for r, e in revs.items()}
                                   for m, revs in index["models"].items()})
    assert pick(index=shuffled) == name["newer"]  # the order of the index does not matter
    tag = Request.from_args().with_tag_defaults(f"HuggingFaceTB--SmolLM-135M.{PRETRAINED_REV}.{name['old']}")
    assert select_entry(index, tag)[2]["variant"] == name["old"]  # an old package's tag: exactly that package


def test_old_and_tagged_names_load_from_the_hub(hub_server, tmp_path):
    paths = _plans(tmp_path / "packages")
    result = publish(list(paths.values()), REPO, endpoint=hub_server.url, token=TOKEN, allow_unverified=True)
    fetch = lambda revision="main", **kw: fetch_package(  # noqa: E731
        REPO, revision, endpoint=hub_server.url, token=TOKEN, cache_dir=tmp_path / "cache", **kw)
    newer = read_package(paths["newer"]).report["variant"]
    assert fetch().package.report["variant"] == newer
    old = read_package(paths["old"])
    tag = next(t for t in result.tags if t.endswith(".decode-b1-c128-sm90a-132sm"))
    by_tag = fetch(tag)
    assert by_tag.package.report["variant"] == "decode-b1-c128-sm90a-132sm"
    assert by_tag.package.manifest == old.manifest
    fast = read_package(paths["fast"]).report["variant"]
    assert fetch(bucket=fast).package.report["variant"] == fast
