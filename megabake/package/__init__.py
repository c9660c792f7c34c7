"""Decode packages: layout, manifest digests, JSON-Schema validation, atomic read/write, registry index.

Contract (docs/FORMATS.md is the prose form, ``schemas/`` the normative one):

* layout: ``package_dir(root, model_id, model_revision, variant)``, ``repo_path(...)``, ``variant_name``
  (with an optional plan tag), ``build_hash`` / ``report_build_hash`` (the hash the tag is taken from),
  ``parse_variant``, ``gpu_class_of``, ``package_tag``;
* files: ``write_package(dest_dir, files, report)`` (validated, atomic, replaces what is there),
  ``read_package(path) -> Package`` (digests + schemas checked), ``update_report(path, report)``;
* write policy for new packages: ``package_destination(...)`` (the plan-tagged folder of a bake) and
  ``save_package(dest_dir, files, report, force=False) -> SaveResult`` (identical files and a report at least
  as strong: unchanged; different files: :class:`OverwriteRefusedError` unless ``force``);
* schemas: ``validate(kind, obj)`` raising :class:`SchemaValidationError` (JSON pointer + expectation);
* registry: ``build_index(packages_root, hub_repo=None)``, ``registry_entry(package)``, ``merge_index``,
  ``read_index`` / ``write_index``.

Importing this package is cheap: no torch, no huggingface_hub.
"""

from megabake.package.errors import DigestMismatchError, OverwriteRefusedError, PackageError, SchemaValidationError
from megabake.package.layout import (
    Variant,
    build_hash,
    gpu_class_of,
    model_dirname,
    package_dir,
    package_tag,
    parse_variant,
    plan_tag,
    repo_path,
    report_build_hash,
    variant_name,
)
from megabake.package.policy import SaveResult, package_destination, save_package
from megabake.package.registry import (
    build_index,
    empty_index,
    entry_from_report,
    find_packages,
    headline,
    iter_entries,
    merge_index,
    read_index,
    registry_entry,
    write_index,
)
from megabake.package.schema import KINDS, validate
from megabake.package.store import (
    Package,
    build_manifest,
    read_package,
    sha256_bytes,
    sha256_file,
    update_report,
    write_package,
)

__all__ = [
    "KINDS",
    "DigestMismatchError",
    "OverwriteRefusedError",
    "Package",
    "PackageError",
    "SaveResult",
    "SchemaValidationError",
    "Variant",
    "build_hash",
    "build_index",
    "build_manifest",
    "empty_index",
    "entry_from_report",
    "find_packages",
    "gpu_class_of",
    "headline",
    "iter_entries",
    "merge_index",
    "model_dirname",
    "package_destination",
    "package_dir",
    "package_tag",
    "parse_variant",
    "plan_tag",
    "read_index",
    "read_package",
    "registry_entry",
    "report_build_hash",
    "repo_path",
    "save_package",
    "sha256_bytes",
    "sha256_file",
    "update_report",
    "validate",
    "variant_name",
    "write_index",
    "write_package",
]
