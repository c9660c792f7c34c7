"""Small, schema-valid fixture packages for package / hub tests (no bake, no torch).

``make_report(...)`` returns a report.json dict (``tagged=True``: the variant carries the plan tag, as a bake
writes it; default: the older untagged name); ``fixture_files(...)`` the other files (module.py, plan.json,
source_map.json) consistent with it; ``write_fixture_package(root, ...)`` writes one with
``megabake.package.write_package`` at ``package_dir(root, model_id, revision, variant)`` and returns its path.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megabake.package import package_dir, variant_name, write_package

PRETRAINED = "HuggingFaceTB/SmolLM-135M"
PRETRAINED_REV = "1" * 40


def plan_bytes(capacity: int, tag: str = "") -> bytes:
    return json.dumps({"fixture": True, "capacity": capacity, "tag": tag}, sort_keys=True).encode()


def make_report(*, model_id: str = "megabake/tiny-llama", revision: str = "random-seed0", batch: int = 1,
                capacity: int = 128, gpu_class: str = "sm90a-132sm", status: str = "verified",
                plan: bytes | None = None, timings: dict | None = None, megabake_ms: float | None = 0.5,
                baseline_ms: float | None = 1.0, tagged: bool = False) -> dict:
    weights = "random" if revision.startswith("random-seed") else "pretrained"
    seed = int(revision[len("random-seed"):]) if weights == "random" else None
    plan = plan if plan is not None else plan_bytes(capacity)
    if timings is None and megabake_ms is not None:
        timings = {
            "unit": "ms",
            "candidates": {
                "megabake": {"kind": "megabake", "graph_replays": True,
                             "sync_call": {"median": megabake_ms, "ci95": [megabake_ms * 0.9, megabake_ms * 1.1],
                                           "samples": [megabake_ms] * 3},
                             "pipelined": None, "gpu_event": None},
                "inductor-reduce-overhead": {"kind": "baseline", "graph_replays": True,
                                             "sync_call": {"median": baseline_ms, "ci95": [baseline_ms, baseline_ms],
                                                           "samples": [baseline_ms] * 3}},
            },
            "baseline": "inductor-reduce-overhead",
            "speedup": {"median": baseline_ms / megabake_ms, "ci95": [1.9, 2.1], "measure": "sync_call"},
            "floor_ms": 0.06, "weight_bytes": 123456, "copy_bandwidth_GBps": 4000.0,
        }
    numerics = {"prefill": 4, "steps": 2, "slack": 1.25, "top1_min": 0.99, "pass": status == "verified",
                "per_step": [{"step": 0, "position": 4, "rel_l2_vs_fp32": 0.004, "finite": True}],
                "summary": {"top1_agreement": 1.0, "max_rel_l2_vs_fp32": 0.004}, "failures": []}
    return {
        "schema_version": 1,
        "status": status,
        "status_reasons": [] if status == "verified" else [f"fixture package: {status}"],
        "created_at": "2026-11-30T10:00:00Z",
        "model": {"id": model_id, "revision": revision, "config_hash": "c" * 64, "weights": weights, "seed": seed,
                  "preset": "tiny-llama" if weights == "random" else None, "architecture": "LlamaForCausalLM",
                  "dtype": "bfloat16"},
        "bucket": {"mode": "decode", "batch": batch, "capacity": capacity},
        "gpu_class": gpu_class,
        "variant": variant_name("decode", batch, capacity, gpu_class,
                                hashlib.sha256(plan).hexdigest() if tagged else None),
        "plan": {"hash": hashlib.sha256(plan).hexdigest(), "stages": 3, "barriers_per_step": 2, "ctas": 132,
                 "threads_per_cta": 256, "layers": 2, "weight_bytes": 123456},
        "toolchain": {"megabake": "0.1.0", "git_revision": None, "python": "3.11.7", "torch": "2.13.0",
                      "transformers": "5.17.0", "huggingface_hub": "1.33.0", "cutlass_dsl": None,
                      "cuda_driver": None},
        "kernel": {"grid": [132, 1, 1], "block": [256, 1, 1], "registers": None, "shared_memory_bytes": 16384,
                   "compile_check": {"target": "sm_90a", "ok": True, "seconds": 1.5, "error": None}},
        "reference_check": {"ok": True, "steps": 2, "max_abs_err": 1e-6, "rel_l2": 1e-7},
        "environment": None,
        "numerics": numerics if status in ("verified", "failed") else None,
        "timings": timings,
    }


def fixture_files(report: dict, plan: bytes | None = None, module_text: str | None = None) -> dict[str, bytes]:
    capacity = report["bucket"]["capacity"]
    plan = plan if plan is not None else plan_bytes(capacity)
    module_text = module_text or (
        '"""Fixture module.py (not a real kernel)."""\n'
        f"VARIANT = {report['variant']!r}\n"
        "\n"
        "def describe():\n"
        "    return VARIANT\n"
    )
    source_map = {"schema_version": 1, "module": "module.py", "plan_hash": report["plan"]["hash"],
                  "entries": [{"kind": "barrier_interval", "stage": 0, "name": "describe", "lines": [4, 5],
                               "ir_ops": ["L0.attn"], "fx_nodes": ["scaled_dot_product_attention"],
                               "hf_modules": ["model.layers.0.self_attn"]}]}
    return {"module.py": module_text.encode(), "plan.json": plan,
            "source_map.json": json.dumps(source_map, indent=2).encode()}


def write_fixture_package(root: str | Path, *, module_text: str | None = None, plan_tag: str = "", **report_kw) -> Path:
    capacity = report_kw.get("capacity", 128)
    plan = plan_bytes(capacity, plan_tag)
    report = make_report(plan=plan, **report_kw)
    dest = package_dir(root, report["model"]["id"], report["model"]["revision"], report["variant"])
    return write_package(dest, fixture_files(report, plan, module_text), report)
