"""The bake matrix: which models x buckets the CI bake workflow bakes.

Contract: ``load_matrix(path)`` reads ``registry/bake-matrix.json`` (``{"schema_version": 1, "models": [{"model",
"revision", ...}], "buckets": [{"batch", "capacity"}]}``) and checks its shape; ``select(matrix, models, buckets)``
returns one job entry per (model, bucket) pair, in file order, each ``{"model", "revision" ("" when unpinned),
"batch", "capacity", "bucket", "key", "publish", "artifact"}``. ``key`` is unique and safe as a GitHub artifact
name; ``publish`` is the model's ``"publish"`` flag (default true; false for preset models, whose random weights
``megabake publish`` refuses); ``artifact`` is the name the bake job gives a verified package:
``package-verified-<key>`` (published when asked) or ``package-local-<key>`` (registry only). Selections are
comma- or space-separated:

* models: ``all``, or listed models by id (``HuggingFaceTB/SmolLM-135M``) or by the part after the ``/``
  (``SmolLM-135M``), case-insensitive; an unlisted Hub id (``org/name``) is accepted as an ad-hoc job; ``@REV``
  after any model pins a revision (``org/name@<sha>``).
* buckets: ``all``, or ``b<batch>-c<capacity>`` (``b1-c128``), listed or not.

Anything else raises :class:`MatrixError` naming what is available. Pure data: no network, no GPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from megabake.errors import MegaBakeError

DEFAULT_MATRIX = Path("registry") / "bake-matrix.json"
_BUCKET_RE = re.compile(r"^b(\d+)-c(\d+)$")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class MatrixError(MegaBakeError, ValueError):
    """The bake matrix file or a selection from it is invalid."""


def bucket_name(batch: int, capacity: int) -> str:
    return f"b{batch}-c{capacity}"


def load_matrix(path: str | Path = DEFAULT_MATRIX) -> dict[str, Any]:
    """Read and shape-check a bake matrix file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise MatrixError(f"bake matrix {path} not found; run from the repository root or pass --matrix") from None
    except json.JSONDecodeError as exc:
        raise MatrixError(f"bake matrix {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("schema_version") != 1:
        raise MatrixError(f"bake matrix {path}: expected an object with schema_version 1")
    models, buckets = data.get("models"), data.get("buckets")
    if not isinstance(models, list) or not models:
        raise MatrixError(f"bake matrix {path}: 'models' must be a non-empty list")
    if not isinstance(buckets, list) or not buckets:
        raise MatrixError(f"bake matrix {path}: 'buckets' must be a non-empty list")
    seen: set[str] = set()
    for i, m in enumerate(models):
        if not isinstance(m, dict) or not isinstance(m.get("model"), str) or not m["model"]:
            raise MatrixError(f"bake matrix {path}: models[{i}] needs a 'model' string")
        rev = m.get("revision")
        if rev is not None and (not isinstance(rev, str) or not rev):
            raise MatrixError(f"bake matrix {path}: models[{i}].revision must be a string or null")
        if not isinstance(m.get("publish", True), bool):
            raise MatrixError(f"bake matrix {path}: models[{i}].publish must be true or false")
        if m["model"].lower() in seen:
            raise MatrixError(f"bake matrix {path}: model {m['model']!r} is listed twice")
        seen.add(m["model"].lower())
    for i, b in enumerate(buckets):
        if not isinstance(b, dict) or not all(
            isinstance(b.get(k), int) and not isinstance(b.get(k), bool) and b[k] > 0 for k in ("batch", "capacity")
        ):
            raise MatrixError(f"bake matrix {path}: buckets[{i}] needs positive integers 'batch' and 'capacity'")
    return data


def _tokens(selection: str | None) -> list[str]:
    if selection is None:
        return ["all"]
    toks = [t for t in re.split(r"[,\s]+", selection.strip()) if t]
    return toks or ["all"]


def _artifact_key(model: str, bucket: str, revision: str | None) -> str:
    key = model.replace("/", "--") + "--" + bucket
    if revision:
        key += "--" + revision[:12]
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def _select_models(matrix: dict[str, Any], selection: str | None) -> list[tuple[str, str | None, bool]]:
    listed = matrix["models"]
    toks = _tokens(selection)
    if toks == ["all"]:
        return [(m["model"], m.get("revision"), m.get("publish", True)) for m in listed]
    out: list[tuple[str, str | None, bool]] = []
    for tok in toks:
        name, _, rev = tok.partition("@")
        match = [
            m for m in listed
            if m["model"].lower() == name.lower() or m["model"].split("/")[-1].lower() == name.lower()
        ]
        if len(match) > 1:
            raise MatrixError(f"model {name!r} is ambiguous in the bake matrix: {', '.join(m['model'] for m in match)}")
        if match:
            out.append((match[0]["model"], rev or match[0].get("revision"), match[0].get("publish", True)))
        elif _HUB_ID_RE.match(name):
            out.append((name, rev or None, True))
        else:
            raise MatrixError(
                f"model {name!r} is not in the bake matrix and is not a Hub id (org/name); listed models: "
                + ", ".join(m["model"] for m in listed)
            )
    return out


def _select_buckets(matrix: dict[str, Any], selection: str | None) -> list[tuple[int, int]]:
    listed = [(b["batch"], b["capacity"]) for b in matrix["buckets"]]
    toks = _tokens(selection)
    if toks == ["all"]:
        return listed
    out = []
    for tok in toks:
        m = _BUCKET_RE.match(tok.lower())
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise MatrixError(
                f"bucket {tok!r} is not of the form b<batch>-c<capacity> (e.g. b1-c128); listed buckets: "
                + ", ".join(bucket_name(*b) for b in listed)
            )
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def select(matrix: dict[str, Any], models: str | None = "all", buckets: str | None = "all") -> list[dict[str, Any]]:
    """The job list for ``models`` x ``buckets`` (see the module docstring for the selection syntax)."""
    jobs: list[dict[str, Any]] = []
    keys: set[str] = set()
    for model, revision, publish in _select_models(matrix, models):
        for batch, capacity in _select_buckets(matrix, buckets):
            bucket = bucket_name(batch, capacity)
            key = _artifact_key(model, bucket, revision)
            if key in keys:
                continue
            keys.add(key)
            jobs.append({"model": model, "revision": revision or "", "batch": batch, "capacity": capacity,
                         "bucket": bucket, "key": key, "publish": publish,
                         "artifact": f"package-{'verified' if publish else 'local'}-{key}"})
    return jobs
