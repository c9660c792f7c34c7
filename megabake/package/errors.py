"""Errors of the package layer. Every message names the file, the cause and the fix.

``PackageError`` is the base; ``SchemaValidationError`` carries the JSON pointer of the bad field and what was
expected; ``DigestMismatchError`` names the file whose bytes do not match manifest.json;
``OverwriteRefusedError`` says why a new package may not replace the one already at its folder.
"""

from __future__ import annotations

from megabake.errors import MegaBakeError


class PackageError(MegaBakeError):
    """A package folder is missing, malformed, or inconsistent."""


class SchemaValidationError(PackageError, ValueError):
    """A JSON document does not match its schema (or a cross-field rule of docs/FORMATS.md).

    ``pointer`` is the RFC 6901 JSON pointer of the first bad field ("" is the document root), ``expected`` says
    what the schema wants there, ``problems`` lists every violation as (pointer, message).
    """

    def __init__(self, kind: str, pointer: str, expected: str, message: str,
                 problems: list[tuple[str, str]] | None = None, source: str | None = None):
        self.kind = kind
        self.pointer = pointer
        self.expected = expected
        self.problems = problems or [(pointer, message)]
        self.source = source
        where = f"{source} " if source else ""
        lines = [f"invalid {kind}: {where}at JSON pointer {pointer or '/'!r}: {message}; expected {expected}"]
        for other_pointer, other_message in self.problems[1:6]:
            lines.append(f"  also at {other_pointer or '/'!r}: {other_message}")
        if len(self.problems) > 6:
            lines.append(f"  ... and {len(self.problems) - 6} more problems")
        lines.append(f"  fix: correct the field to match schemas/{SCHEMA_FILES.get(kind, kind)} "
                     "(see docs/FORMATS.md), then write the package again")
        super().__init__("\n".join(lines))


class DigestMismatchError(PackageError):
    """A file's size or sha256 differs from what manifest.json records (tampering or corruption)."""

    def __init__(self, package: str, path: str, expected: str, actual: str, fix: str | None = None):
        self.package = package
        self.path = path
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"package {package}: file {path!r} does not match manifest.json (expected {expected}, got {actual}); "
            "the file was modified or corrupted after the package was written. "
            f"fix: {fix or 'restore the package from its source (re-bake, or re-download from the Hub)'}"
        )


class OverwriteRefusedError(PackageError):
    """A package folder already holds a different package (or something that is not a package) and ``force``
    was not given; nothing was written. ``path``: the folder; ``differs``: what differs, in words."""

    def __init__(self, message: str, path: str, differs: list[str]):
        self.path = path
        self.differs = differs
        super().__init__(message)


SCHEMA_FILES = {
    "report": "report.schema.json",
    "source_map": "source_map.schema.json",
    "manifest": "manifest.schema.json",
    "registry_index": "registry-index.schema.json",
    "lock": "lock.schema.json",
}
