"""Package layout: folder names, variant names and GPU classes.

Contract (docs/FORMATS.md):
``package_dir(root, model_id, model_revision, variant)`` -> ``root/<org>--<model>/<model-rev>/<variant>`` where
``root`` is a packages root (e.g. ``packages/``); ``repo_path(...)`` is the same folder inside a repository
(``packages/<org>--<model>/<model-rev>/<variant>``), used for the Hub and the registry index.
``variant_name(mode, batch, capacity, gpu_class, plan_hash=None)`` -> ``decode-b1-c128-sm90a-132sm``, or with the
plan's sha256 ``decode-b1-c128-sm90a-132sm-p1a2b3c4d`` (``-p`` + its first 8 hex digits: what ``megabake bake``
writes, so two plans of one bucket never share a folder); ``parse_variant`` inverts both forms (names without
the plan tag are the packages baked before the tag existed and stay valid).
``build_hash(plan_hash, codegen)`` is the hash the tag is taken from: the plan's sha256, or, for a module with
codegen choices its plan does not say (``report.kernel.codegen``: a loader warp's pacing), the sha256 of both, so
two builds of one plan never share a variant name; ``report_build_hash(report)`` reads it off a report.
``gpu_class_of((9, 0), 132, "a")`` -> ``sm90a-132sm``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGES_DIR = "packages"
MODES = ("decode",)
_GPU_CLASS = r"sm(?P<cc>[0-9]+)(?P<suffix>[a-z]*)-(?P<sm_count>[0-9]+)sm"
GPU_CLASS_RE = re.compile(rf"^{_GPU_CLASS}$")
PLAN_TAG_LEN = 8  # hex digits of the plan's sha256 in a variant name
VARIANT_RE = re.compile(rf"^(?P<mode>[a-z]+)-b(?P<batch>[0-9]+)-c(?P<capacity>[0-9]+)-(?P<gpu_class>{_GPU_CLASS})"
                        rf"(?:-p(?P<plan_tag>[0-9a-f]{{{PLAN_TAG_LEN}}}))?$")
MODEL_ID_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
MODEL_REVISION_RE = re.compile(r"^([0-9a-f]{40}|random-seed[0-9]+|sha256-[0-9a-f]{16})$")


@dataclass(frozen=True, order=True)
class Variant:
    """What must match at load time: mode, bucket (batch, KV capacity) and GPU class; ``plan_tag`` (8 hex digits
    of the plan's sha256, or None for a name without one) tells plans of one bucket apart."""

    mode: str
    batch: int
    capacity: int
    gpu_class: str
    plan_tag: str | None = None

    @property
    def name(self) -> str:
        return variant_name(self.mode, self.batch, self.capacity, self.gpu_class, self.plan_tag)

    @property
    def bucket_name(self) -> str:
        """The name without the plan tag: ``decode-b1-c128-sm90a-132sm``."""
        return variant_name(self.mode, self.batch, self.capacity, self.gpu_class)

    def __str__(self) -> str:
        return self.name


def gpu_class_of(compute_capability: tuple[int, int] = (9, 0), sm_count: int = 132,
                 arch_suffix: str | None = None) -> str:
    """GPU class = compute capability + arch suffix + SM count, e.g. ((9, 0), 132) -> "sm90a-132sm". The one
    place that spells it: ``arch_suffix=None`` is the arch-specific "a" of SM90 and later (sm_90a, sm_100a),
    none before. The runtime (``GpuInfo.gpu_class``) and the verifier's environment both call this."""
    major, minor = compute_capability
    if arch_suffix is None:
        arch_suffix = "a" if major >= 9 else ""
    name = f"sm{major}{minor}{arch_suffix}-{sm_count}sm"
    if not GPU_CLASS_RE.match(name) or sm_count < 1:
        raise ValueError(f"cannot form a GPU class from compute capability {compute_capability}, "
                         f"sm_count {sm_count}, suffix {arch_suffix!r}; expected e.g. ((9, 0), 132, 'a')")
    return name


def variant_name(mode: str, batch: int, capacity: int, gpu_class: str, plan_hash: str | None = None) -> str:
    """``decode-b<batch>-c<capacity>-<gpu_class>``, plus ``-p<first 8 hex of plan_hash>`` when it is given
    (``plan_hash``: the plan's sha256, or an 8-hex plan tag)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; supported modes: {', '.join(MODES)}")
    if int(batch) < 1 or int(capacity) < 1:
        raise ValueError(f"batch and capacity must be >= 1, got batch={batch}, capacity={capacity}")
    if not GPU_CLASS_RE.match(gpu_class):
        raise ValueError(f"GPU class {gpu_class!r} is not like 'sm90a-132sm' (see gpu_class_of)")
    return f"{mode}-b{int(batch)}-c{int(capacity)}-{gpu_class}" + (f"-p{plan_tag(plan_hash)}" if plan_hash else "")


def plan_tag(plan_hash: str) -> str:
    """The first 8 hex digits of a plan's sha256 (the plan tag of a variant name)."""
    if not re.fullmatch(r"[0-9a-f]{8}(?:[0-9a-f]{56})?", plan_hash or ""):
        raise ValueError(f"plan hash {plan_hash!r} is not a sha256 (64 lowercase hex digits) or an 8-hex plan tag")
    return plan_hash[:PLAN_TAG_LEN]


def build_hash(plan_hash: str, codegen: dict | None = None) -> str:
    """The sha256 a package's plan tag is taken from: ``plan_hash`` itself where ``codegen`` is empty (every
    package baked before codegen choices were recorded keeps its name), else the sha256 of ``plan_hash``, a
    newline and ``codegen`` as canonical JSON (sorted keys, no spaces)."""
    plan_tag(plan_hash)  # a sha256 or a plan tag, else ValueError
    if not codegen:
        return plan_hash
    if len(plan_hash) != 64:
        raise ValueError(f"build_hash folds a codegen record into the plan's whole sha256, not the tag {plan_hash!r}")
    text = plan_hash + "\n" + json.dumps(codegen, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def report_build_hash(report: dict) -> str:
    """:func:`build_hash` of a package report: its ``plan.hash`` and ``kernel.codegen`` (absent: none)."""
    return build_hash(report["plan"]["hash"], (report.get("kernel") or {}).get("codegen"))


def parse_variant(name: str) -> Variant:
    """Inverse of :func:`variant_name`; raises ValueError naming the expected form."""
    match = VARIANT_RE.match(name)
    if not match or match["mode"] not in MODES:
        raise ValueError(f"variant {name!r} is not of the form <mode>-b<batch>-c<capacity>-<gpu_class>[-p<plan "
                         "tag>], e.g. 'decode-b1-c128-sm90a-132sm' or 'decode-b1-c128-sm90a-132sm-p1a2b3c4d'")
    return Variant(match["mode"], int(match["batch"]), int(match["capacity"]), match["gpu_class"], match["plan_tag"])


def model_dirname(model_id: str) -> str:
    """``org/model`` -> ``org--model`` (a model id without an org stays as is)."""
    if not MODEL_ID_RE.match(model_id) or "--" in model_id.split("/")[0]:
        raise ValueError(f"model id {model_id!r} is not a Hub model id like 'HuggingFaceTB/SmolLM-135M'")
    return model_id.replace("/", "--", 1)


def check_model_revision(model_revision: str) -> str:
    if not MODEL_REVISION_RE.match(model_revision):
        raise ValueError(f"model revision {model_revision!r} must be a resolved 40-hex commit sha "
                         "or 'random-seed<N>' for preset weights, or 'sha256-<16 hex>' for local weights")
    return model_revision


def package_dir(root: str | Path, model_id: str, model_revision: str, variant: str) -> Path:
    """``root/<org>--<model>/<model-rev>/<variant>``; ``root`` is a packages root such as ``packages/``."""
    parse_variant(variant)
    return Path(root) / model_dirname(model_id) / check_model_revision(model_revision) / variant


def repo_path(model_id: str, model_revision: str, variant: str) -> str:
    """The package folder inside a repository (Hub or git): ``packages/<org>--<model>/<model-rev>/<variant>``."""
    return package_dir(PACKAGES_DIR, model_id, model_revision, variant).as_posix()


def package_tag(model_id: str, model_revision: str, variant: str) -> str:
    """Immutable Hub tag of a published package: ``<org>--<model>.<model-rev>.<variant>``."""
    parse_variant(variant)
    return f"{model_dirname(model_id)}.{check_model_revision(model_revision)}.{variant}"
