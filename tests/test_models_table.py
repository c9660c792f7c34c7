"""docs/MODELS.md (`megabake registry models`) and the leaderboard's Models section.

What these tests show:
* a family the compiler refuses shows the compiler's own exception class and the first sentence of its message
  (checked against a compile run here, not against a copy of the text); a family that compiles says "bakes (CPU)";
  a crash is told apart from a refusal;
* a preset's row comes from the newest report of its packages: verified rows show that report's numbers (the
  same the leaderboard shows) with a relative link that resolves to the report; others say why not;
* the output is deterministic and the rows read back from the Markdown are the rows written;
* `megabake registry models --check` passes on a fresh file and fails (exit 1, naming the row) on a stale one;
* `megabake registry build` renders the same rows as a self-contained "Models" section, flags a stale table;
* the checked-in docs/MODELS.md matches packages/, the presets and the family list (no CPU try needed).

CPU tries capture through torch.export (a few seconds each), so only one test runs real families; the others
use a family that the compiler refuses before capture.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest
from click.testing import CliRunner

import megabake.registry.models as models
from megabake.errors import MegaBakeError
from megabake.package import write_package
from megabake.presets import PRESETS
from megabake.registry.commands import registry
from megabake.registry.models import (FAMILIES, Family, first_sentence, get_families, model_rows, parse_table,
                                      preset_rows, read_table, render_markdown)

REPO = Path(__file__).resolve().parents[1]

# The compiler refuses this one before any capture (KV capacity above max_position_embeddings): fast, and it will
# stay refused however many families the compiler learns.
TOO_LONG = Family("too-long", "Too long", "LlamaForCausalLM",
                  dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, vocab_size=64, max_position_embeddings=64),
                  capacity=128, claims=lambda preset: False)
NO_SUCH_CLASS = Family("no-such-class", "No such class", "NoSuchModelForCausalLM", dict(hidden_size=64))


# ------------------------------------------------------------------------------------------- packages


def _timings(ours_ms, base_ms, speedup, speedup_ci):
    def meas(median):
        return {"median": median, "ci95": [median * 0.98, median * 1.02], "samples": [median] * 5}

    return {
        "unit": "ms",
        "candidates": {
            "megabake": {"kind": "megabake", "graph_replays": True, "sync_call": meas(ours_ms),
                         "pipelined": meas(ours_ms * 0.9), "gpu_event": None},
            "inductor-graph": {"kind": "baseline", "graph_replays": True, "sync_call": meas(base_ms),
                               "pipelined": meas(base_ms * 0.9), "gpu_event": None},
        },
        "baseline": "inductor-graph",
        "speedup": {"median": speedup, "ci95": list(speedup_ci), "measure": "sync_call"},
        "floor_ms": 0.06, "weight_bytes": 270000000, "copy_bandwidth_GBps": 4280.0,
    }


def _write(root: Path, preset: str, status: str, created_at: str, *, reasons=(), timings=None, capacity=128,
           config_hash: str | None = None, batch: int = 1) -> Path:
    """A schema-valid package of a built-in preset (random weights, seed 0)."""
    p = PRESETS[preset]
    plan = json.dumps({"layers": 2, "capacity": capacity, "created": created_at}, sort_keys=True).encode()
    plan_hash = hashlib.sha256(plan).hexdigest()
    variant = f"decode-b{batch}-c{capacity}-sm90a-132sm-p{plan_hash[:8]}"
    gpu = status in ("verified", "failed")
    report = {
        "schema_version": 1, "status": status, "status_reasons": list(reasons), "created_at": created_at,
        "model": {"id": p.model_id, "revision": "random-seed0", "config_hash": config_hash or p.config_hash(),
                  "weights": "random", "seed": 0, "preset": preset, "architecture": p.architecture,
                  "dtype": "bfloat16"},
        "bucket": {"mode": "decode", "batch": batch, "capacity": capacity},
        "gpu_class": "sm90a-132sm", "variant": variant,
        "plan": {"hash": plan_hash, "stages": 12, "barriers_per_step": 11, "ctas": 132, "threads_per_cta": 256,
                 "layers": 2, "weight_bytes": 123456},
        "toolchain": {"megabake": "0.1.0", "git_revision": None, "python": "3.12.3", "torch": "2.11.0",
                      "transformers": "5.17.0", "huggingface_hub": "1.33.0", "cutlass_dsl": "4.8.1",
                      "cuda_driver": "580.159.04"},
        "kernel": {"grid": [132, 1, 1], "block": [256, 1, 1], "registers": 96, "shared_memory_bytes": 16384,
                   "compile_check": {"target": "sm_90a", "ok": True, "seconds": 12.3, "error": None}},
        "reference_check": {"ok": True, "steps": 4, "max_abs_err": 1e-6, "rel_l2": 1e-7},
        "environment": ({"gpu_name": "NVIDIA H200", "gpu_class": "sm90a-132sm", "sm_count": 132,
                         "compute_capability": "9.0", "driver": "580.159.04", "cuda_runtime": "13.0",
                         "hostname": "runner"} if gpu else None),
        "numerics": None if not gpu else {
            "prefill": 16, "steps": 64, "slack": 1.25, "top1_min": 0.99, "pass": status == "verified",
            "per_step": [{"step": 0, "position": 16, "rel_l2_vs_fp32": 0.004, "finite": True}],
            "summary": {"top1_agreement": 1.0 if status == "verified" else 0.9}, "failures": [],
        },
        "timings": timings,
    }
    files = {"module.py": "import cutlass\n", "plan.json": plan}
    dest = root / p.model_id.replace("/", "--", 1) / "random-seed0" / variant
    return write_package(dest, files, report)


@pytest.fixture()
def repo(tmp_path) -> Path:
    """A repo-shaped folder: packages/ of three presets (the rest have none) and an empty docs/."""
    root = tmp_path / "repo"
    pk = root / "packages"
    # tiny-llama: verified first, then re-baked without a GPU: the newest report (unverified) is the one shown
    _write(pk, "tiny-llama", "verified", "2026-11-30T10:00:00Z", timings=_timings(0.0812, 0.95, 11.7, (11.5, 11.9)))
    _write(pk, "tiny-llama", "unverified", "2026-12-01T09:00:00Z", capacity=256,
           reasons=["no Hopper GPU on this machine: compiled for sm_90a but not run"])
    _write(pk, "smollm-135m", "verified", "2026-11-30T11:00:00Z",
           timings=_timings(0.4321, 1.2345, 2.857, (2.801, 2.913)))
    # a newer batch-8 package: the row keeps batch 1 (one sequence's ms/token)
    _write(pk, "smollm-135m", "verified", "2026-12-01T11:00:00Z", batch=8,
           timings=_timings(0.9, 3.6, 4.0, (3.9, 4.1)))
    _write(pk, "qwen3-0.6b", "failed", "2026-11-30T12:00:00Z", timings=_timings(0.5, 2.2, 4.4, (4.3, 4.5)),
           reasons=["step 12: <b>top-1</b> agreement 0.90 < 0.99"], config_hash="0" * 64)
    (root / "docs").mkdir()
    return root


def _rows_by_preset(rows):
    return {r.preset: r for r in rows if r.preset}


# ---------------------------------------------------------------------------------------------- tests


def test_first_sentence():
    msg = ("unsupported graph node 'mul' (target mul.Tensor) in HF module 'model.embed_tokens' at "
           "transformers/models/gemma/modeling_gemma.py:61 in forward: no IR op computes mul.Tensor.\n"
           "MegaBake's megakernel supports Llama-family decoders. Open an issue.")
    assert first_sentence(msg) == msg.split("\n")[0]
    assert first_sentence("expected one RMSNorm, found 0; not supported yet") == \
        "expected one RMSNorm, found 0; not supported yet"
    assert first_sentence("bad value at <object at 0x7f3a2b4c5d60>. Fix it") == "bad value at <object at 0x…>."


def test_cpu_try_states_what_the_compiler_says(monkeypatch):
    """Real families: the row is whatever compile_step raised (or not) on this run, recorded by a spy."""
    import megabake.compiler

    real, outcomes = megabake.compiler.compile_step, []  # (model class, exception or None), in call order

    def spy(model, **kwargs):
        try:
            result = real(model, **kwargs)
        except Exception as exc:
            outcomes.append((type(model).__name__, exc))
            raise
        outcomes.append((type(model).__name__, None))
        return result

    monkeypatch.setattr(megabake.compiler, "compile_step", spy)
    llama, gemma = get_families("llama,gemma")
    rows = model_rows(REPO / "packages", REPO / "docs", families=(llama, gemma, TOO_LONG, NO_SUCH_CLASS),
                      presets={})
    assert [r.family_key for r in rows] == ["llama", "gemma", "too-long", "no-such-class"]
    by_key = {r.family_key: r for r in rows}
    assert all(r.source == "cpu-try" and r.preset is None and r.report is None for r in rows)
    # no-such-class fails before compile_step (no such transformers class)
    assert [name for name, _ in outcomes] == ["LlamaForCausalLM", "GemmaForCausalLM", "LlamaForCausalLM"]

    # Llama: the tiny config compiles (capture -> IR -> plan -> module.py) on the CPU
    assert outcomes[0][1] is None, outcomes[0][1]
    assert by_key["llama"].status == "bakes-cpu" and by_key["llama"].label == "bakes (CPU)"
    assert by_key["llama"].bucket == "b1-c128" and "hidden 256, 2 layers, 4/2 heads × 64" in by_key["llama"].evidence

    # Gemma: whatever the compiler did with it on this run, the row says exactly that
    row, exc = by_key["gemma"], outcomes[1][1]
    if exc is None:
        assert row.status == "bakes-cpu" and row.error is None
    else:
        message = " ".join(str(exc).split())
        assert row.error_class == type(exc).__name__ and message.startswith(row.error)
        if isinstance(exc, MegaBakeError):
            assert row.status == "refused" and row.label == "refused" and row.error
            assert row.details == f"{type(exc).__name__}: {row.error}"
        else:  # the compiler crashed (e.g. mid-way through learning Gemma): not dressed up as a refusal
            assert row.status == "error" and row.label == "crashed"
            assert row.details == f"{type(exc).__name__} (not a MegaBake refusal): {row.error}"

    # a refusal before capture: the compiler's whole (one-sentence) message
    too_long = by_key["too-long"]
    assert too_long.status == "refused" and too_long.error_class == "MegaBakeError"
    assert too_long.details == ("MegaBakeError: KV capacity 128 exceeds the model's max_position_embeddings 64; "
                                "bake with --capacity 64 or less")
    # an exception that is not a MegaBake refusal is a crash, and says so
    crash = by_key["no-such-class"]
    assert crash.status == "error" and crash.label == "crashed" and crash.error_class == "AttributeError"
    assert "NoSuchModelForCausalLM" in crash.details and "not a MegaBake refusal" in crash.details

    text = render_markdown(rows)
    table = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| refused | MegaBakeError: KV capacity 128 exceeds the model's max_position_embeddings 64; bake " \
           "with --capacity 64 or less |" in table["Too long"]
    assert "| bakes (CPU) |" in table["Llama"]
    if exc is not None:
        assert f"| {row.label} | {type(exc).__name__}" in table["Gemma"]
        assert models._md(row.details) in table["Gemma"]
    assert "| crashed | AttributeError (not a MegaBake refusal): " in table["No such class"]


def test_preset_rows_come_from_the_newest_report(repo):
    docs = repo / "docs"
    rows = preset_rows(repo / "packages", docs)
    assert [r.preset for r in rows] == sorted(PRESETS)
    by = _rows_by_preset(rows)

    smol = by["smollm-135m"]  # batch 1 before the newer batch-8 package
    assert smol.bucket == "b1-c128"
    report_path = docs / unquote(smol.report)
    report = json.loads(report_path.read_text())
    assert report_path.name == "report.json" and report["model"]["preset"] == "smollm-135m"
    t = report["timings"]
    assert smol.status == "verified" and smol.label == "verified on NVIDIA H200" and smol.gpu == "NVIDIA H200"
    assert smol.megabake_ms == t["candidates"]["megabake"]["sync_call"]["median"] == 0.4321
    assert smol.baseline_ms == t["candidates"]["inductor-graph"]["sync_call"]["median"] == 1.2345
    assert smol.speedup == t["speedup"]["median"] == 2.857 and smol.speedup_ci == [2.801, 2.913]
    assert smol.details == ("0.432 ms/token vs 1.234 ms/token graphed Inductor: 2.86× (95% CI 2.80–2.91×); "
                            "synchronized call, batch 1 · KV 128")
    assert smol.family_key == "smollm"  # claimed by its family, not the first Llama-class one

    tiny = by["tiny-llama"]  # newest report wins over an older verified one
    assert tiny.status == "bakes-cpu" and tiny.bucket == "b1-c256" and tiny.megabake_ms is None
    assert tiny.details == "no Hopper GPU on this machine: compiled for sm_90a but not run"
    assert json.loads((docs / unquote(tiny.report)).read_text())["created_at"] == "2026-12-01T09:00:00Z"

    qwen3 = by["qwen3-0.6b"]  # failed: its timings are not shown; an out-of-date config is called out
    assert qwen3.status == "failed" and qwen3.label == "failed on NVIDIA H200" and qwen3.speedup is None
    assert qwen3.details.startswith("step 12: <b>top-1</b> agreement 0.90 < 0.99")
    assert "older config of the preset" in qwen3.details

    for name in ("llama-3.2-1b", "qwen2.5-0.5b"):
        assert by[name].status == "no-package" and by[name].report is None

    text = render_markdown(model_rows(repo / "packages", docs, families=()))
    smol_line = next(line for line in text.splitlines() if "`smollm-135m`" in line)
    assert "**verified on NVIDIA H200**" in smol_line and "2.86×" in smol_line and "0.432 ms/token" in smol_line
    assert f"[report.json]({smol.report})" in smol_line and smol.report.startswith("../packages/")
    qwen_line = next(line for line in text.splitlines() if "`qwen3-0.6b`" in line)
    assert "4.40" not in qwen_line and "&lt;b&gt;top-1&lt;/b&gt;" in qwen_line and "<b>" not in qwen_line
    # deterministic, and the rows read back from the Markdown are the rows written
    again = model_rows(repo / "packages", docs, families=())
    assert render_markdown(again) == text
    assert [r.to_json() for r in parse_table(text)] == [r.to_json() for r in again]


def test_models_command_writes_and_check_fails_when_stale(repo, monkeypatch):
    monkeypatch.setattr(models, "FAMILIES", (TOO_LONG,))
    out = repo / "docs" / "MODELS.md"
    args = ["models", "--packages", str(repo / "packages"), "--out", str(out)]
    result = CliRunner().invoke(registry, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == str(out)
    text = out.read_text()
    assert "GENERATED by `megabake registry models`" in text and "Too long" in text

    check = CliRunner().invoke(registry, [*args, "--check"])
    assert check.exit_code == 0, check.output

    # a hand edit makes it stale
    out.write_text(text.replace("2.86×", "3.10×"))
    check = CliRunner().invoke(registry, [*args, "--check"])
    assert check.exit_code == 1 and "is stale" in check.output and "Traceback" not in check.output
    assert out.read_text() == text.replace("2.86×", "3.10×")  # --check writes nothing

    # a new report makes it stale, and the message names the row
    out.write_text(text)
    _write(repo / "packages", "llama-3.2-1b", "verified", "2026-12-02T00:00:00Z",
           timings=_timings(1.0, 1.3, 1.3, (1.25, 1.35)))
    check = CliRunner().invoke(registry, [*args, "--check"])
    assert check.exit_code == 1
    assert "llama-3.2-1b: no package -> verified on NVIDIA H200" in " ".join(check.output.split())

    out.unlink()
    check = CliRunner().invoke(registry, [*args, "--check"])
    assert check.exit_code == 1 and "does not exist" in check.output

    bad = CliRunner().invoke(registry, [*args, "--families", "nope"])
    assert bad.exit_code == 2 and "unknown family 'nope'" in bad.output


class _Rows(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows, self.tags, self._row, self._cell = [], [], None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "tr" and "family-row" in (attrs.get("class") or "").split():
            self._row = {"attrs": {k[5:]: v for k, v in attrs.items() if k.startswith("data-")}, "cells": {},
                         "href": None}
        elif tag == "td" and self._row is not None:
            self._cell = (attrs.get("class") or "").split()[0]
            self._row["cells"][self._cell] = ""
        elif tag == "a" and self._row is not None:
            self._row["href"] = attrs.get("href")

    def handle_endtag(self, tag):
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._row is not None and self._cell:
            self._row["cells"][self._cell] += data


def test_leaderboard_has_the_models_section(repo, monkeypatch):
    table = repo / "docs" / "MODELS.md"
    rows = model_rows(repo / "packages", table.parent, families=(TOO_LONG,))
    table.write_text(render_markdown(rows))
    out = repo / "registry"

    result = CliRunner().invoke(registry, ["build", "--packages", str(repo / "packages"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"Models section: {len(rows)} row(s) from {table}" in result.output
    page = (out / "leaderboard.html").read_text()
    assert '<section class="models" id="models">' in page and "<h2>Models</h2>" in page
    assert 'id="models-stale"' not in page
    parsed = _Rows()
    parsed.feed(page)
    assert not [t for t, _ in parsed.tags if t in ("script", "link", "img", "iframe", "object", "embed")]
    assert len(parsed.rows) == len(rows)
    for shown, row in zip(parsed.rows, rows):  # same rows, same order, same words
        a = shown["attrs"]
        assert (a["family"], a["status"], a.get("preset")) == (row.family, row.status, row.preset)
        assert " ".join(shown["cells"]["details"].split()) == row.details
        assert shown["cells"]["status-cell"] == row.label
        if row.report:  # the link, re-based onto registry/, resolves to the same report
            assert (out / unquote(shown["href"])).resolve() == (table.parent / unquote(row.report)).resolve()
        if row.status == "verified":
            assert float(a["megabake-ms"]) == row.megabake_ms and float(a["speedup"]) == row.speedup
    smol = next(r for r in parsed.rows if r["attrs"].get("preset") == "smollm-135m")
    assert "2.86×" in smol["cells"]["details"] and smol["attrs"]["speedup"] == "2.857"
    refused = next(r for r in parsed.rows if r["attrs"]["family-key"] == "too-long")
    assert refused["attrs"]["error-class"] == "MegaBakeError"
    assert "KV capacity 128 exceeds the model's max_position_embeddings 64" in refused["cells"]["details"]
    assert "&lt;b&gt;top-1&lt;/b&gt;" in page and "<b>top-1</b>" not in page

    # a package the table does not know yet: the section says the table is stale (and still renders it)
    _write(repo / "packages", "qwen2.5-0.5b", "unverified", "2026-12-02T00:00:00Z", reasons=["no GPU"])
    result = CliRunner().invoke(registry, ["build", "--packages", str(repo / "packages"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "is stale" in result.output
    page = html.unescape((out / "leaderboard.html").read_text())
    assert 'id="models-stale"' in page and "qwen2.5-0.5b: no package -> baked, not verified on a GPU" in page

    # none: no section; a missing explicit table is bad input
    result = CliRunner().invoke(registry, ["build", "--packages", str(repo / "packages"), "--out", str(out),
                                           "--models-table", "none"])
    assert result.exit_code == 0 and 'id="models"' not in (out / "leaderboard.html").read_text()
    result = CliRunner().invoke(registry, ["build", "--packages", str(repo / "packages"), "--out", str(out),
                                           "--models-table", str(repo / "nope.md")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_checked_in_models_table_is_current():
    """docs/MODELS.md is generated: its Markdown is its rows, its presets match packages/, its families the list.
    (The CPU tries themselves are checked by `megabake registry models --check`.)"""
    path = REPO / "docs" / "MODELS.md"
    assert path.is_file(), "docs/MODELS.md is missing: run `megabake registry models`"
    text = path.read_text(encoding="utf-8")
    rows = read_table(path)
    assert render_markdown(rows) == text, "docs/MODELS.md was edited by hand: run `megabake registry models`"
    assert [r.family_key for r in rows if r.source == "cpu-try"] == [f.key for f in FAMILIES], \
        "the family list changed: run `megabake registry models`"
    fresh = preset_rows(REPO / "packages", REPO / "docs")
    stored = [r for r in rows if r.source != "cpu-try"]
    assert sorted((r.to_json() for r in stored), key=lambda d: d["preset"]) == [r.to_json() for r in fresh], \
        "docs/MODELS.md is stale for packages/: run `megabake registry models`"
    for row in stored:
        if row.report:
            assert (path.parent / unquote(row.report)).is_file(), row.report
    refused = [r for r in rows if r.status == "refused"]
    assert all(r.details.startswith(f"{r.error_class}: ") for r in refused)
    assert not re.search(r"0x[0-9a-f]{6,}", text) and str(REPO) not in text


def test_checked_in_models_table_matches_the_compiler_today(monkeypatch):
    """The CPU tries too: a compiler change that moves a family (bakes <-> refused, or another refusal text) must
    come with a regenerated docs/MODELS.md (`megabake registry models`, run from the repository root)."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("MEGABAKE_EXPERIMENTAL_LAYOUTS", raising=False)
    result = CliRunner().invoke(registry, ["models", "--check"])
    assert result.exit_code == 0, result.output
