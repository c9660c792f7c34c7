"""Pick the package to load: model, model revision, GPU class, and the smallest bucket that fits.

Contract: ``Request.from_args(bucket=..., gpu_class=..., ...)`` normalizes what the caller asked for;
``select_entry(index, request, allow_unverified)`` returns ``(model_id, model_revision, entry)`` for the best
registry-index entry or raises :class:`NoMatchingPackageError` listing the variants, buckets and GPU classes that
exist next to what was asked for. Pure data in, data out: no I/O.

Fit: batch equal, KV capacity >= the one asked, GPU class equal when one is asked; a variant name asked for
fits exactly that variant, or, without a plan tag (``decode-b1-c512-sm90a-132sm``), every plan of that bucket
and GPU class; a package tag as the revision fits exactly its own package (``Request.exact``). Among the fits,
deterministically: the smallest capacity, then verified before unverified, then the GPU class (by name), then
the lowest measured ``megabake_ms`` (unmeasured last), then the newest ``created_at``, then the variant name.
So when a bucket holds several plans (tilings), the fastest verified one is loaded; a package tag or a
plan-tagged variant name pins one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from megabake.hub.errors import NoMatchingPackageError
from megabake.package import iter_entries, parse_variant
from megabake.package.layout import GPU_CLASS_RE, check_model_revision

LOADABLE = {"verified": 0, "unverified": 1}
_BUCKET_RE = re.compile(r"^(?:(?P<mode>[a-z]+)-)?b(?P<batch>[0-9]+)-c(?P<capacity>[0-9]+)$")
_TAG_RE = re.compile(r"^(?P<model>[^.]+)\.(?P<revision>[0-9a-f]{40}|random-seed[0-9]+|sha256-[0-9a-f]{16})"
                     r"\.(?P<variant>.+)$")


@dataclass(frozen=True)
class Request:
    """What the caller needs. None means "any"; capacity is a minimum, batch is exact."""

    model_id: str | None = None
    model_revision: str | None = None
    mode: str = "decode"
    batch: int = 1
    capacity: int | None = None
    gpu_class: str | None = None
    variant: str | None = None
    exact: bool = False  # the variant is a package tag's: only that name fits, even without a plan tag

    @classmethod
    def from_args(cls, bucket: Any = None, gpu_class: str | None = None, model_id: str | None = None,
                  model_revision: str | None = None) -> "Request":
        """``bucket``: None | capacity int | (batch, capacity) | {"batch", "capacity"} | "b1-c128" | a variant."""
        if gpu_class is not None and not GPU_CLASS_RE.match(gpu_class):
            raise ValueError(f"gpu_class {gpu_class!r} is not like 'sm90a-132sm'")
        if model_revision is not None:
            check_model_revision(model_revision)
        fields = dict(model_id=model_id, model_revision=model_revision, gpu_class=gpu_class)
        if bucket is None:
            return cls(**fields)
        if isinstance(bucket, bool):
            raise TypeError("bucket must be a capacity, (batch, capacity), a dict, 'b1-c128' or a variant name")
        if isinstance(bucket, int):
            return cls(**fields, capacity=bucket)
        if isinstance(bucket, (tuple, list)) and len(bucket) == 2:
            return cls(**fields, batch=int(bucket[0]), capacity=int(bucket[1]))
        if isinstance(bucket, dict):
            return cls(**fields, mode=bucket.get("mode", "decode"), batch=int(bucket.get("batch", 1)),
                       capacity=bucket.get("capacity"))
        if isinstance(bucket, str):
            match = _BUCKET_RE.match(bucket)
            if match:
                return cls(**fields, mode=match["mode"] or "decode", batch=int(match["batch"]),
                           capacity=int(match["capacity"]))
            variant = parse_variant(bucket)
            if gpu_class not in (None, variant.gpu_class):
                raise ValueError(f"bucket {bucket!r} names GPU class {variant.gpu_class}, but gpu_class={gpu_class!r}")
            return cls(model_id=model_id, model_revision=model_revision, mode=variant.mode, batch=variant.batch,
                       capacity=variant.capacity, gpu_class=variant.gpu_class, variant=variant.name)
        raise TypeError(f"bucket {bucket!r}: expected a capacity, (batch, capacity), a dict, 'b1-c128' or a variant")

    def with_tag_defaults(self, revision: str | None) -> "Request":
        """A MegaBake package tag (``<org>--<model>.<rev>.<variant>``) pins model, revision and variant."""
        match = _TAG_RE.match(revision or "")
        if not match:
            return self
        try:
            variant = parse_variant(match["variant"])
        except ValueError:
            return self
        model_id = match["model"].replace("--", "/", 1)
        if self.model_id not in (None, model_id) or self.model_revision not in (None, match["revision"]):
            return self
        untouched = self.capacity is None and self.gpu_class is None and self.batch == 1
        return Request(model_id=model_id, model_revision=match["revision"], mode=self.mode, batch=self.batch,
                       capacity=self.capacity, gpu_class=self.gpu_class,
                       variant=variant.name if untouched else self.variant,
                       exact=untouched or self.exact)

    def describe(self) -> str:
        parts = [f"model {self.model_id or 'any'}", f"model revision {self.model_revision or 'any'}",
                 f"bucket {self.mode} batch {self.batch} capacity >= {self.capacity or 1}",
                 f"GPU class {self.gpu_class or 'any (CPU reference executor)'}"]
        if self.variant:
            parts.append(f"variant {self.variant}")
        return ", ".join(parts)


def select_entry(index: dict[str, Any], request: Request, allow_unverified: bool = False,
                 where: str = "the registry index") -> tuple[str, str, dict[str, Any]]:
    """Best entry for ``request`` or NoMatchingPackageError listing what exists."""
    everything = list(iter_entries(index))
    pool = [item for item in everything if _same_model(item, request)]
    if not pool:
        raise _no_match("no packages for this model and model revision", everything, request, where)
    models = sorted({(m, r) for m, r, _ in pool})
    if len(models) > 1:
        listing = ", ".join(f"{m}@{r}" for m, r in models)
        raise NoMatchingPackageError(f"{where} holds packages for several models / model revisions ({listing}); "
                                     "pass model_id= and/or model_revision= to choose one")
    fitting = [item for item in pool if fits(item[2], request)]
    if not fitting:
        raise _no_match("no package fits the bucket / GPU class asked for", pool, request, where)
    allowed = {"verified"} | ({"unverified"} if allow_unverified else set())
    loadable = [item for item in fitting if item[2]["status"] in allowed]
    if not loadable:
        statuses = sorted({item[2]["status"] for item in fitting})
        hint = " pass allow_unverified=True to load an unverified package" if "unverified" in statuses else ""
        raise _no_match(f"packages fit but none is loadable (statuses: {', '.join(statuses)});{hint}",
                        pool, request, where)
    return min(loadable, key=lambda item: preference(item[2]))


def preference(entry: dict[str, Any]) -> tuple:
    """Sort key of a loadable entry: smaller is preferred (see the module docstring)."""
    measured = entry.get("megabake_ms")
    return (entry["capacity"], LOADABLE[entry["status"]], entry["gpu_class"],
            measured is None, measured or 0.0, -_timestamp(entry.get("created_at")), entry["variant"])


def _timestamp(text: str | None) -> float:
    """Seconds since the epoch of an RFC 3339 time (0 when absent or unreadable: oldest)."""
    try:
        return datetime.fromisoformat((text or "").replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _same_model(item: tuple[str, str, dict], request: Request) -> bool:
    model_id, revision, _ = item
    return request.model_id in (None, model_id) and request.model_revision in (None, revision)


def fits(entry: dict[str, Any], request: Request) -> bool:
    """``entry`` (an index entry: variant, mode, batch, capacity, gpu_class) fits ``request``."""
    if request.variant is not None:
        return variant_matches(entry["variant"], request.variant, request.exact)
    return (entry["mode"] == request.mode and entry["batch"] == request.batch
            and entry["capacity"] >= (request.capacity or 1)
            and request.gpu_class in (None, entry["gpu_class"]))


def variant_matches(name: str, asked: str, exact: bool = False) -> bool:
    """``name`` is the variant ``asked`` for: equal, or (unless ``exact``) ``asked`` has no plan tag and names
    ``name``'s bucket and GPU class."""
    if name == asked or exact:
        return name == asked
    wanted = parse_variant(asked)
    try:
        have = parse_variant(name)
    except ValueError:
        return False
    return wanted.plan_tag is None and have.bucket_name == wanted.name


def _no_match(reason: str, pool: list, request: Request, where: str) -> NoMatchingPackageError:
    entries = [entry for _, _, entry in pool]
    models = sorted({f"{m}@{r}" for m, r, _ in pool})
    variants = sorted({f"{e['variant']} ({e['status']})" for e in entries})
    buckets = sorted({f"{e['mode']}-b{e['batch']}-c{e['capacity']}" for e in entries})
    gpu_classes = sorted({e["gpu_class"] for e in entries})
    return NoMatchingPackageError(
        f"{reason}.\n"
        f"  asked for: {request.describe()}\n"
        f"  available in {where}:\n"
        f"    models: {', '.join(models) or 'none'}\n"
        f"    variants: {', '.join(variants) or 'none'}\n"
        f"    buckets: {', '.join(buckets) or 'none'}\n"
        f"    GPU classes: {', '.join(gpu_classes) or 'none'}\n"
        "  fix: ask for one of the available buckets / GPU classes, or bake and publish the missing variant "
        "(megabake bake ... && megabake publish ...)"
    )
