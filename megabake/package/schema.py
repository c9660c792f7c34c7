"""JSON-Schema validation of package files (report, source_map, manifest, registry index).

Contract: ``validate(kind, obj, source=None)`` returns ``obj`` unchanged when it matches
``schemas/<kind>.schema.json`` (JSON Schema 2020-12) and otherwise raises
:class:`~megabake.package.errors.SchemaValidationError` whose message holds the JSON pointer of the bad field
and what the schema expected there. ``kind`` is one of ``KINDS``. Schemas are read once from the repository's
``schemas/`` folder (or ``$MEGABAKE_SCHEMAS``).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from megabake.package.errors import SCHEMA_FILES, PackageError, SchemaValidationError

KINDS = tuple(SCHEMA_FILES)


def schemas_dir() -> Path:
    """The folder holding the ``*.schema.json`` files."""
    override = os.environ.get("MEGABAKE_SCHEMAS")
    if override:
        return Path(override)
    # megabake/schemas: in a checkout a link to the top-level schemas/, in an installed wheel a copy of it
    return Path(__file__).resolve().parents[1] / "schemas"


@functools.lru_cache(maxsize=None)
def load_schema(kind: str) -> dict[str, Any]:
    if kind not in SCHEMA_FILES:
        raise ValueError(f"unknown schema kind {kind!r}; known kinds: {', '.join(KINDS)}")
    path = schemas_dir() / SCHEMA_FILES[kind]
    try:
        schema = json.loads(path.read_text())
    except FileNotFoundError:
        raise PackageError(
            f"schema file {path} is missing; MegaBake reads its JSON Schemas from the repository's schemas/ "
            "folder. fix: run from a full checkout (pip install -e .) or set MEGABAKE_SCHEMAS to that folder"
        ) from None
    Draft202012Validator.check_schema(schema)
    return schema


@functools.lru_cache(maxsize=None)
def _validator(kind: str) -> Draft202012Validator:
    return Draft202012Validator(load_schema(kind))


def validate(kind: str, obj: Any, source: str | None = None) -> Any:
    """Validate ``obj`` against the ``kind`` schema; raise SchemaValidationError naming pointer + expectation."""
    validator = _validator(kind)
    errors = list(validator.iter_errors(obj))
    if not errors:
        return obj
    first = best_match(errors)
    pointer, expected = describe(first)
    problems = [(describe(e)[0], e.message) for e in sorted(errors, key=lambda e: list(map(str, e.absolute_path)))]
    problems.sort(key=lambda p: p[0] != pointer)
    raise SchemaValidationError(kind, pointer, expected, first.message, problems, source)


def json_pointer(parts) -> str:
    """RFC 6901 pointer for a sequence of keys / indices."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def describe(error: ValidationError) -> tuple[str, str]:
    """(JSON pointer of the offending field, human description of what the schema expects there)."""
    path = list(error.absolute_path)
    value = error.validator_value
    hint = error.schema.get("description") if isinstance(error.schema, dict) else None
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [name for name in value if name not in error.instance]
        return json_pointer(path + missing[:1]), f"required property {missing[0]!r} to be present"
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = sorted(error.schema.get("properties", {}))
        extra = [k for k in error.instance if k not in allowed]
        return json_pointer(path + extra[:1]), f"no property {extra[0]!r} (allowed: {', '.join(allowed)})"
    expected = {
        "type": lambda: f"a value of type {' or '.join(value) if isinstance(value, list) else value}",
        "enum": lambda: f"one of {json.dumps(value)}",
        "const": lambda: f"exactly {json.dumps(value)}",
        "pattern": lambda: f"a string matching {value!r}" + (f" ({hint})" if hint else ""),
        "minimum": lambda: f"a number >= {value}",
        "exclusiveMinimum": lambda: f"a number > {value}",
        "maximum": lambda: f"a number <= {value}",
        "minItems": lambda: f"at least {value} items",
        "maxItems": lambda: f"at most {value} items",
        "minLength": lambda: f"a string of at least {value} characters",
        "minProperties": lambda: f"an object with at least {value} properties",
        "propertyNames": lambda: "keys matching " + json.dumps(value),
        "not": lambda: f"anything except {json.dumps(value)}",
    }.get(error.validator, lambda: f"{error.validator} {json.dumps(value)}")()
    return json_pointer(path), expected
