"""Registry index + leaderboard page (`megabake registry build`) and the bake matrix (`megabake registry matrix`).

What these tests show:
* the index written by `registry build` is schema-valid and lists every package with its status;
* every leaderboard row matches its report.json: verified rows show the report's medians, 95% CIs and speedup;
  every other row shows "not verified: <the report's reason>" and no numbers, even when the report holds timings;
* the page renders in headless Chromium (network blocked): a non-trivial PNG screenshot whose status badge colours
  are really painted, and a DOM dump (`--dump-dom`) whose table rows match the reports;
* the page is self-contained (no script, no external resource) and its evidence links resolve to files;
* a tampered package makes the build fail loudly instead of being listed;
* the checked-in bake matrix parses, and selections give models x buckets jobs with unique artifact keys.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from megabake.package import read_package, validate, write_package
from megabake.registry.commands import registry
from megabake.registry.leaderboard import build_registry
from megabake.registry.matrix import MatrixError, load_matrix, select

REPO = Path(__file__).resolve().parents[1]
SHA_SMOL = "93efa2f097d58c2a74874c7e644dbc9b0cee75a2"
SHA_LLAMA = "4e20de362430cd3b72f300e6b0f18e50e7166e08"


# ------------------------------------------------------------------------------------------- fixtures


def _timings(ours_ms, ours_ci, base_ms, base_ci, speedup, speedup_ci, measure="sync_call"):
    def meas(median, ci):
        return {"median": median, "ci95": list(ci), "samples": [median] * 5}

    return {
        "unit": "ms",
        "candidates": {
            "megabake": {"kind": "megabake", "graph_replays": True, "sync_call": meas(ours_ms, ours_ci),
                         "pipelined": meas(ours_ms * 0.9, (ours_ms * 0.89, ours_ms * 0.91)), "gpu_event": None},
            "inductor-reduce-overhead": {"kind": "baseline", "graph_replays": True,
                                         "sync_call": meas(base_ms, base_ci),
                                         "pipelined": meas(base_ms * 0.95, (base_ms * 0.94, base_ms * 0.96)),
                                         "gpu_event": None},
        },
        "baseline": "inductor-reduce-overhead",
        "speedup": {"median": speedup, "ci95": list(speedup_ci), "measure": measure},
        "floor_ms": 0.06, "weight_bytes": 270000000, "copy_bandwidth_GBps": 4280.0,
    }


def _write(root: Path, model_id, revision, capacity, status, reasons, timings, *, weights="pretrained",
           numerics_pass=None, source_map=True, gpu_class="sm90a-132sm", environment=True) -> Path:
    plan = json.dumps({"layers": 2, "capacity": capacity}, sort_keys=True).encode()
    plan_hash = hashlib.sha256(plan).hexdigest()
    variant = f"decode-b1-c{capacity}-{gpu_class}"
    module = "import cutlass\n" + "\n".join(f"# line {i}" for i in range(40)) + "\n"
    report = {
        "schema_version": 1, "status": status, "status_reasons": reasons, "created_at": "2026-11-30T10:00:00Z",
        "model": {"id": model_id, "revision": revision, "config_hash": "c" * 64, "weights": weights,
                  "seed": 0 if weights == "random" else None, "preset": None,
                  "architecture": "LlamaForCausalLM", "dtype": "bfloat16"},
        "bucket": {"mode": "decode", "batch": 1, "capacity": capacity},
        "gpu_class": gpu_class, "variant": variant,
        "plan": {"hash": plan_hash, "stages": 12, "barriers_per_step": 11, "ctas": 132, "threads_per_cta": 256,
                 "layers": 2, "weight_bytes": 123456},
        "toolchain": {"megabake": "0.1.0", "git_revision": None, "python": "3.12.3", "torch": "2.11.0",
                      "transformers": "5.17.0", "huggingface_hub": "1.33.0", "cutlass_dsl": "4.8.1",
                      "cuda_driver": "580.159.04"},
        "kernel": {"grid": [132, 1, 1], "block": [256, 1, 1], "registers": 96, "shared_memory_bytes": 16384,
                   "compile_check": {"target": "sm_90a", "ok": True, "seconds": 12.3, "error": None}},
        "reference_check": {"ok": True, "steps": 4, "max_abs_err": 1e-6, "rel_l2": 1e-7},
        "environment": ({"gpu_name": "NVIDIA H200", "gpu_class": gpu_class, "sm_count": 132,
                         "compute_capability": "9.0", "driver": "580.159.04", "cuda_runtime": "13.0",
                         "hostname": "runner"} if environment else None),
        "numerics": None if numerics_pass is None else {
            "prefill": 16, "steps": 64, "slack": 1.25, "top1_min": 0.99, "pass": numerics_pass,
            "per_step": [{"step": 0, "position": 16, "rel_l2_vs_fp32": 0.004, "finite": True}],
            "summary": {"top1_agreement": 1.0 if numerics_pass else 0.9}, "failures": [],
        },
        "timings": timings,
    }
    files = {"module.py": module, "plan.json": plan}
    if source_map:
        files["source_map.json"] = json.dumps({
            "schema_version": 1, "module": "module.py", "plan_hash": plan_hash,
            "entries": [{"kind": "body_call", "stage": 0, "name": "embed", "lines": [2, 5], "ir_ops": ["embed"],
                         "fx_nodes": ["embedding"], "hf_modules": ["model.embed_tokens"]}]})
    dirname = model_id.replace("/", "--", 1)
    return write_package(root / dirname / revision / variant, files, report)


@pytest.fixture()
def packages(tmp_path) -> Path:
    """Four packages: two verified, one failed that still holds timings, one unverified without timings."""
    root = tmp_path / "repo" / "packages"
    _write(root, "megabake/tiny-llama", "random-seed0", 128, "verified", [],
           _timings(0.0812, (0.0801, 0.0825), 0.95, (0.93, 0.97), 11.7, (11.5, 11.9)),
           weights="random", numerics_pass=True)
    _write(root, "HuggingFaceTB/SmolLM-135M", SHA_SMOL, 128, "verified", [],
           _timings(0.412, (0.405, 0.419), 2.05, (2.01, 2.09), 4.98, (4.90, 5.07)), numerics_pass=True)
    _write(root, "HuggingFaceTB/SmolLM-135M", SHA_SMOL, 512, "failed",
           ["step 12: rel_l2_vs_fp32 0.03 > 1.25 x eager bf16 0.005", "<b>top-1</b> agreement 0.90 < 0.99"],
           _timings(0.5, (0.49, 0.51), 2.2, (2.1, 2.3), 4.4, (4.3, 4.5)), numerics_pass=False)
    _write(root, "meta-llama/Llama-3.2-1B", SHA_LLAMA, 128, "unverified",
           ["no Hopper GPU on this machine: compiled for sm_90a but not run"], None, source_map=False,
           environment=False)
    return root


def _build(packages: Path, *extra: str) -> tuple[Path, Path]:
    out = packages.parent / "registry"
    result = CliRunner().invoke(registry, ["build", "--packages", str(packages), "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[-2:] == [str(out / "index.json"), str(out / "leaderboard.html")]
    return out / "index.json", out / "leaderboard.html"


def _reports(packages: Path) -> dict[str, dict]:
    return {p.parent.relative_to(packages).as_posix(): json.loads(p.read_text())
            for p in packages.glob("*/*/*/report.json")}


# ------------------------------------------------------------------------------------------ table reading


class _Table(HTMLParser):
    """Collects every <tr class="package">: its data-* attributes, each cell's text and its links."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows: list[dict] = []
        self._row = None
        self._cell = None
        self.text: list[str] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "tr" and "package" in (attrs.get("class") or "").split():
            self._row = {"attrs": {k[5:]: v for k, v in attrs.items() if k.startswith("data-")}, "cells": {},
                         "links": {}}
        elif tag == "td" and self._row is not None:
            self._cell = [c for c in (attrs.get("class") or "").split() if c not in ("num", "speedup-cell")][0]
            self._row["cells"][self._cell] = ""
        elif tag == "a" and self._row is not None:
            self._href = attrs.get("href")

    def handle_endtag(self, tag):
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None
        elif tag == "td":
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._row is not None and self._cell is not None:
            self._row["cells"][self._cell] += data
            if self._cell == "links" and data.strip():
                self._row["links"][data.strip()] = self._href


def _parse(html_text: str) -> _Table:
    table = _Table()
    table.feed(html_text)
    return table


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+", text)]


def check_rows_against_reports(html_text: str, packages: Path, leaderboard: Path) -> None:
    """The table-vs-report check shared by the plain-HTML and the Chromium-DOM tests."""
    table = _parse(html_text)
    reports = _reports(packages)
    assert len(table.rows) == len(reports) == 4
    seen = set()
    for row in table.rows:
        a = row["attrs"]
        key = f"{a['model'].replace('/', '--', 1)}/{a['revision']}/{a['variant']}"
        assert key in reports, key
        seen.add(key)
        report = reports[key]
        assert a["status"] == report["status"]
        assert a["gpu-class"] == report["gpu_class"] and report["gpu_class"] in row["cells"]["gpu"]
        assert int(a["batch"]) == report["bucket"]["batch"] and int(a["capacity"]) == report["bucket"]["capacity"]
        assert f"KV {report['bucket']['capacity']}" in row["cells"]["bucket"]
        assert report["status"] in row["cells"]["status-cell"]
        # evidence links resolve to the package's own files
        assert (leaderboard.parent / row["links"]["report.json"]).resolve() == \
            (packages / key / "report.json").resolve()
        if (packages / key / "source_map.json").exists():
            assert (leaderboard.parent / row["links"]["source_map.json"]).resolve() == \
                (packages / key / "source_map.json").resolve()
        else:
            assert "source_map.json" not in row["links"]
        if report["status"] == "verified":
            t = report["timings"]
            ours = t["candidates"]["megabake"]["sync_call"]
            base = t["candidates"][t["baseline"]]["sync_call"]
            assert a["verified"] == "true" and a["measure"] == "sync_call"
            assert float(a["megabake-ms"]) == ours["median"]
            assert float(a["baseline-ms"]) == base["median"]
            assert float(a["speedup"]) == t["speedup"]["median"]
            shown = {"megabake-ms": (ours["median"], *ours["ci95"]), "baseline-ms": (base["median"], *base["ci95"]),
                     "speedup": (t["speedup"]["median"], *t["speedup"]["ci95"])}
            for cell, expected in shown.items():
                got = _numbers(row["cells"][cell])
                assert got == pytest.approx(list(expected), rel=6e-3), (cell, row["cells"][cell])
            assert "not-verified" not in row["cells"]
        else:
            assert a["verified"] == "false"
            assert not {"megabake-ms", "baseline-ms", "speedup"} & set(a) & set(row["cells"])
            text = " ".join(row["cells"]["not-verified"].split())
            assert text == "not verified: " + "; ".join(report["status_reasons"])
    assert seen == set(reports)
    # ranking: models with verified numbers first, by best speedup; then the rest
    order = list(dict.fromkeys(r["attrs"]["model"] for r in table.rows))
    assert order == ["megabake/tiny-llama", "HuggingFaceTB/SmolLM-135M", "meta-llama/Llama-3.2-1B"]


# ----------------------------------------------------------------------------------------------- tests


def test_build_writes_schema_valid_index(packages):
    index_path, html_path = _build(packages)
    index = json.loads(index_path.read_text())
    validate("registry_index", index)
    entries = [(m, r, e) for m, revs in index["models"].items() for r, es in revs.items() for e in es]
    assert len(entries) == 4
    statuses = {(m, e["variant"]): e["status"] for m, _, e in entries}
    assert statuses[("HuggingFaceTB/SmolLM-135M", "decode-b1-c512-sm90a-132sm")] == "failed"
    assert statuses[("megabake/tiny-llama", "decode-b1-c128-sm90a-132sm")] == "verified"
    assert all(e["hub_repo"] is None for _, _, e in entries)
    assert html_path.stat().st_size > 2000


def test_rows_match_reports_in_html(packages):
    _, html_path = _build(packages)
    check_rows_against_reports(html_path.read_text(), packages, html_path)


def test_failed_row_hides_its_timings_and_escapes_reasons(packages):
    _, html_path = _build(packages)
    page = html_path.read_text()
    # the failed report holds a 4.4x speedup and 0.5 ms: neither may appear as a number on the page
    assert "4.40" not in page and "0.500" not in page
    assert "&lt;b&gt;top-1&lt;/b&gt;" in page and "<b>top-1</b>" not in page
    llama = _parse(page).rows
    row = next(r for r in llama if r["attrs"]["model"] == "meta-llama/Llama-3.2-1B")
    assert "not verified: no Hopper GPU on this machine" in row["cells"]["not-verified"]
    assert "not verified: no package of this model has verified numbers" in " ".join(page.split())


def test_page_is_self_contained(packages):
    _, html_path = _build(packages, "--hub-repo", "megabake/packages")
    page = html_path.read_text()
    table = _parse(page)
    assert not [t for t, _ in table.tags if t in ("script", "link", "img", "iframe", "object", "embed")]
    assert not re.search(r"(?i)@import|url\(|\bsrc\s*=", page)
    hrefs = [a["href"] for t, a in table.tags if t == "a"]
    assert hrefs
    for href in hrefs:
        assert href.startswith("https://huggingface.co/megabake/packages/tree/") or "://" not in href, href
    # only the package `megabake publish` accepts (verified, pretrained) is linked to and indexed on the Hub
    hub = [h for h in hrefs if h.startswith("https://")]
    assert hub == ["https://huggingface.co/megabake/packages/tree/HuggingFaceTB--SmolLM-135M."
                   f"{SHA_SMOL}.decode-b1-c128-sm90a-132sm/packages/HuggingFaceTB--SmolLM-135M/{SHA_SMOL}/"
                   "decode-b1-c128-sm90a-132sm"]
    index = json.loads((html_path.parent / "index.json").read_text())
    validate("registry_index", index)
    on_hub = {(e["variant"], e["status"], e["weights"]): (e["hub_repo"], e["tag"])
              for revs in index["models"].values() for es in revs.values() for e in es}
    assert [k for k, (repo, tag) in on_hub.items() if repo] == [
        ("decode-b1-c128-sm90a-132sm", "verified", "pretrained")]
    assert all(tag is None for k, (repo, tag) in on_hub.items() if repo is None)


def test_output_is_deterministic(packages):
    _, html_path = _build(packages)
    first = html_path.read_bytes()
    _, html_path = _build(packages)
    assert html_path.read_bytes() == first


def test_no_packages_says_not_verified(tmp_path):
    (tmp_path / "packages").mkdir()
    _, html_path = _build(tmp_path / "packages")
    page = html_path.read_text()
    assert 'id="no-packages"' in page and "not verified: no packages found" in page
    assert _parse(page).rows == []
    validate("registry_index", json.loads((html_path.parent / "index.json").read_text()))


def test_nothing_verified_banner(packages):
    for report in packages.glob("*/*/*/report.json"):
        if json.loads(report.read_text())["status"] == "verified":
            shutil.rmtree(report.parent)
    _, html_path = _build(packages)
    page = html_path.read_text()
    assert 'id="no-verified"' in page
    assert all(r["attrs"]["verified"] == "false" for r in _parse(page).rows)


def test_verified_without_timings_is_not_shown_as_verified(tmp_path):
    root = tmp_path / "packages"
    _write(root, "megabake/tiny-llama", "random-seed0", 128, "verified", [], None, weights="random",
           numerics_pass=True)
    result = build_registry(root, tmp_path / "registry")
    (row,) = result.rows
    assert not row.verified and row.megabake_ms is None
    page = html.unescape(result.leaderboard_path.read_text())
    assert "not verified: report says 'verified' but has no MegaBake timing, baseline timing, speedup" in page


def test_tampered_package_fails_the_build(packages):
    module = next(packages.glob("HuggingFaceTB--SmolLM-135M/*/decode-b1-c128-*/module.py"))
    module.write_text(module.read_text() + "# edited after baking\n")
    out = packages.parent / "registry"
    result = CliRunner().invoke(registry, ["build", "--packages", str(packages), "--out", str(out)])
    assert result.exit_code == 1
    assert "module.py" in result.output and "manifest.json" in result.output
    assert "Traceback" not in result.output
    assert not (out / "leaderboard.html").exists()


def test_missing_packages_folder_is_an_error(tmp_path):
    result = CliRunner().invoke(registry, ["build", "--packages", str(tmp_path / "nope"),
                                           "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "does not exist" in result.output


# ------------------------------------------------------------------------------------ headless Chromium

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _chromium() -> str:
    exe = os.environ.get("CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    if not exe:
        pytest.fail("headless Chromium not found (chromium); install it with `bash scripts/setup.sh` "
                    "(apt-get install chromium) or set CHROMIUM=/path/to/chrome")
    return exe


def _chromium_run(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-extensions", "--mute-audio",
           "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}", *args, url]
    env = dict(os.environ, HOME=str(tmp_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into rows of RGB bytes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        rows.append(bytes(v for j, v in enumerate(line) if j % bpp < 3))
    return width, height, rows


def test_leaderboard_renders_in_headless_chromium(packages, tmp_path):
    _, html_path = _build(packages)
    url = html_path.resolve().as_uri()

    dom = _chromium_run(tmp_path, url, "--dump-dom").stdout
    assert "<table" in dom and "MegaBake decode leaderboard" in dom
    check_rows_against_reports(dom, packages, html_path)

    shot = tmp_path / "leaderboard.png"
    _chromium_run(tmp_path, url, f"--screenshot={shot}", "--window-size=1400,1100", "--hide-scrollbars")
    data = shot.read_bytes()
    assert len(data) > 20_000, f"screenshot is only {len(data)} bytes"
    width, height, rows = _png_pixels(data)
    assert (width, height) == (1400, 1100)
    colors: dict[bytes, int] = {}
    for line in rows[::2]:
        for x in range(0, len(line), 6):
            px = line[x:x + 3]
            colors[px] = colors.get(px, 0) + 1
    total = sum(colors.values())
    white = colors.get(b"\xff\xff\xff", 0)
    assert len(colors) > 50, "screenshot has almost no distinct colours: blank page?"
    assert 0.02 < 1 - white / total < 0.6, f"non-white fraction {1 - white / total:.3f}"
    # the status badges' CSS colours are really painted: verified green and failed red
    pixels_all = {row[x:x + 3] for row in rows for x in range(0, len(row), 3)}
    assert bytes((0x1A, 0x7F, 0x37)) in pixels_all, "no verified (green) badge pixels"
    assert bytes((0xB4, 0x23, 0x18)) in pixels_all, "no failed (red) badge pixels"
    artifacts = os.environ.get("MEGABAKE_TEST_ARTIFACTS")
    if artifacts:  # keep the screenshot for a person to look at
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / "leaderboard.png")


# ------------------------------------------------------------------------------------------ bake matrix


def test_checked_in_bake_matrix():
    matrix = load_matrix(REPO / "registry" / "bake-matrix.json")
    jobs = select(matrix)
    assert len(jobs) == len(matrix["models"]) * len(matrix["buckets"]) >= 2
    assert len({j["key"] for j in jobs}) == len(jobs)
    for job in jobs:
        assert re.fullmatch(r"[A-Za-z0-9._-]+", job["key"]), job["key"]
        assert job["bucket"] == f"b{job['batch']}-c{job['capacity']}"
        # random-weight presets stay off the Hub (`megabake publish` refuses them); Hub models are published
        prefix = "package-local-" if job["model"] == "tiny-llama" else "package-verified-"
        assert job["artifact"] == prefix + job["key"] and job["publish"] is (prefix == "package-verified-")
    assert any(j["model"] == "tiny-llama" for j in jobs)


def test_matrix_selection(tmp_path):
    matrix = load_matrix(REPO / "registry" / "bake-matrix.json")
    jobs = select(matrix, "smollm-135m, Org/New-Model@abc123", "b1-c128 b2-c256")
    assert [(j["model"], j["revision"], j["bucket"]) for j in jobs] == [
        ("HuggingFaceTB/SmolLM-135M", "", "b1-c128"), ("HuggingFaceTB/SmolLM-135M", "", "b2-c256"),
        ("Org/New-Model", "abc123", "b1-c128"), ("Org/New-Model", "abc123", "b2-c256")]
    assert all(j["publish"] for j in jobs)
    assert [j["publish"] for j in select(matrix, "tiny-llama", "b1-c128")] == [False]
    with pytest.raises(MatrixError, match="not in the bake matrix"):
        select(matrix, "smollm", "all")
    with pytest.raises(MatrixError, match="b<batch>-c<capacity>"):
        select(matrix, "all", "128")
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"schema_version": 1, "models": [{"model": "a"}], "buckets": [{"batch": 0}]}))
    with pytest.raises(MatrixError, match="buckets"):
        load_matrix(bad)


def test_matrix_command_writes_github_output(tmp_path):
    out = tmp_path / "github_output"
    out.write_text("earlier=1\n")
    result = CliRunner().invoke(registry, ["matrix", "--matrix", str(REPO / "registry" / "bake-matrix.json"),
                                           "--models", "tiny-llama", "--buckets", "all",
                                           "--github-output", str(out)])
    assert result.exit_code == 0, result.output
    jobs = json.loads(result.stdout.strip().splitlines()[-1])
    lines = out.read_text().splitlines()
    assert lines[0] == "earlier=1" and lines[1].startswith("matrix=")
    assert json.loads(lines[1][len("matrix="):]) == jobs
    assert {j["model"] for j in jobs} == {"tiny-llama"}


def test_read_back_packages_are_the_ones_indexed(packages):
    index_path, _ = _build(packages)
    index = json.loads(index_path.read_text())
    paths = {e["path"] for revs in index["models"].values() for es in revs.values() for e in es}
    assert paths == {read_package(p.parent).repo_path for p in packages.glob("*/*/*/manifest.json")}


def test_checked_in_registry_matches_packages(tmp_path, monkeypatch):
    """registry/index.json and leaderboard.html in the repo are schema-valid and list exactly packages/."""
    index_path = REPO / "registry" / "index.json"
    if not index_path.exists():
        pytest.skip("no registry/index.json checked in yet (build it with `megabake registry build`)")
    committed = json.loads(index_path.read_text())
    validate("registry_index", committed)
    packages_dir = REPO / "packages"
    if not packages_dir.is_dir():
        packages_dir = tmp_path / "packages"
        packages_dir.mkdir()
    fresh = build_registry(packages_dir, tmp_path / "registry").index

    # Fields that identify a package and its evidence; created_at / manifest digests change on every re-bake
    # of the same model (the README's quick start re-bakes the default into packages/), so they are left out.
    stable = ("variant", "status", "plan_hash", "gpu_class", "batch", "capacity", "megabake_ms", "speedup")

    def entries(index):
        return sorted(json.dumps([m, r, {k: e.get(k) for k in stable}], sort_keys=True)
                      for m, revs in index["models"].items() for r, es in revs.items() for e in es)

    assert entries(committed) == entries(fresh), \
        "registry/index.json is stale: run `megabake registry build --packages packages/ --out registry/`"
    rows = [r for r in _parse((REPO / "registry" / "leaderboard.html").read_text()).rows
            if "model" in r["attrs"]]  # package rows (the Models section's rows describe families)
    assert sorted((r["attrs"]["model"], r["attrs"]["revision"], r["attrs"]["variant"], r["attrs"]["status"])
                  for r in rows) == sorted((m, r, e["variant"], e["status"])
                                           for m, revs in fresh["models"].items() for r, es in revs.items()
                                           for e in es), "registry/leaderboard.html is stale: rebuild it"
