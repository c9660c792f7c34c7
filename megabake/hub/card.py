"""Model card (README.md) of a MegaBake Hub repo, rendered from its registry index.

Contract: ``render_model_card(repo_id, index)`` returns README.md text: YAML front matter built with
``huggingface_hub.ModelCardData`` (``library_name: megabake``, ``base_model`` = the real Hub models packaged,
``tags``) and a body with one table row per package (variant, bucket, GPU class, status, headline numbers,
tag) and a load snippet. Rendering is deterministic for a given index (``generated_at`` aside).
"""

from __future__ import annotations

from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from megabake.package import iter_entries

PRESET_NAMESPACE = "megabake/"  # built-in presets: not models on the Hub, so never a base_model


def render_model_card(repo_id: str, index: dict[str, Any]) -> str:
    entries = list(iter_entries(index))
    model_ids = sorted({model_id for model_id, _, _ in entries})
    base_models = [m for m in model_ids if not m.startswith(PRESET_NAMESPACE) and "/" in m]
    gpu_classes = sorted({entry["gpu_class"] for _, _, entry in entries})
    data = ModelCardData(
        library_name="megabake",
        base_model=base_models or None,
        tags=["megabake", "megakernel", "cute-dsl", "decode", *gpu_classes],
    )
    content = f"---\n{data.to_yaml()}\n---\n\n{_body(repo_id, entries)}"
    return str(ModelCard(content))


def _fmt(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:.3g}{unit}"


def _body(repo_id: str, entries: list[tuple[str, str, dict[str, Any]]]) -> str:
    lines = [
        f"# {repo_id}",
        "",
        "MegaBake decode packages: each runs a whole decode step of the model below as one persistent CuTe DSL "
        "kernel on the GPU class it was baked for. Every package folder holds the generated `module.py`, its "
        "`plan.json`, a `source_map.json`, the evidence in `report.json` and a `manifest.json` of sha256 digests.",
        "",
        "| model | model revision | variant | batch | KV capacity | GPU class | status | megabake ms | "
        "baseline ms | speedup | tag |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model_id, revision, e in entries:
        status = e["status"] + (" (random weights)" if e["weights"] == "random" else "")
        lines.append(
            f"| {model_id} | `{revision[:12]}` | `{e['variant']}` | {e['batch']} | {e['capacity']} | "
            f"{e['gpu_class']} | {status} | {_fmt(e['megabake_ms'])} | {_fmt(e['baseline_ms'])} | "
            f"{_fmt(e['speedup'], '×')} | `{e['tag'] or ''}` |"
        )
    example = entries[0][2]["tag"] if entries and entries[0][2]["tag"] else "main"
    lines += [
        "",
        "Numbers are medians from each package's `report.json` (`timings`); baseline is "
        f"{_baselines(entries)}. A dash means the package was not timed on its GPU class.",
        "",
        "## Load",
        "",
        "```python",
        "import megabake",
        "",
        f'decoder = megabake.load_from_hub("{repo_id}", revision="{example}", trust_remote_code=True)',
        "```",
        "",
        "`module.py` is code: `load_from_hub` imports it only from a digest-verified download, and only with "
        "`trust_remote_code=True` or a 40-hex commit pinned as `revision`. Tags are immutable: one per "
        "package, `<org>--<model>.<model-revision>.<variant>`. The registry index is `registry/index.json`.",
        "",
    ]
    return "\n".join(lines)


def _baselines(entries: list[tuple[str, str, dict[str, Any]]]) -> str:
    names = sorted({e["baseline"] for _, _, e in entries if e["baseline"]})
    return ", ".join(f"`{n}`" for n in names) if names else "not measured yet"
