"""``megabake inspect PATH``: verify a package folder and print its summary (click command ``inspect``).

Contract: exit 0 and a human summary (or ``--json``: report + manifest) for a package whose digests and
schemas check out; exit 1 with the cause and the fix when they do not; exit 2 when PATH is not a package
folder (no manifest.json) or does not exist. Errors print ``error: <message>`` on stderr. Registered in
``megabake/cli.py``.
"""

from __future__ import annotations

import json

import click

from megabake.errors import UNAVAILABLE_HELP, InputError, exit_codes_help, reports_errors
from megabake.package.layout import package_tag
from megabake.package.registry import headline
from megabake.package.store import Package, read_package


def summarize(package: Package) -> str:
    """Multi-line human summary of a verified package."""
    r = package.report
    model, variant, plan = r["model"], package.variant, r["plan"]
    weights = f"random weights, seed {model.get('seed')}" if model["weights"] == "random" else "pretrained weights"
    reasons = f": {'; '.join(r['status_reasons'])}" if r["status_reasons"] else ""
    rows = [
        ("package", str(package.path)),
        ("model", f"{model['id']} @ {model['revision']} ({model['architecture']}, {model['dtype']}, {weights})"),
        ("variant", f"{variant.name} (mode {variant.mode}, batch {variant.batch}, KV capacity {variant.capacity}, "
                    f"GPU class {variant.gpu_class})"),
        ("status", r["status"] + reasons),
        ("plan", f"{plan['hash'][:16]}  " + ", ".join(f"{k} {v}" for k, v in plan.items() if k != "hash")),
        ("kernel", _kernel(r.get("kernel"))),
        ("numerics", _numerics(r.get("numerics"))),
        ("timings", _timings(r)),
        ("toolchain", ", ".join(f"{k} {v}" for k, v in r["toolchain"].items() if v is not None)),
        ("files", f"{len(package.manifest['files'])} + manifest.json, all digests ok: " + ", ".join(
            f"{e['path']} ({e['size']} B)" for e in package.manifest["files"])),
        ("hub path", f"{package.repo_path}  "
                     f"(tag {package_tag(package.model_id, package.model_revision, variant.name)})"),
    ]
    return "\n".join(f"{name:<10} {value}" for name, value in rows)


def _kernel(kernel: dict | None) -> str:
    if not kernel:
        return "not recorded"
    text = f"grid {kernel['grid']} block {kernel['block']}"
    if kernel.get("shared_memory_bytes") is not None:
        text += f", shared memory {kernel['shared_memory_bytes']} B"
    if kernel.get("registers") is not None:
        text += f", {kernel['registers']} registers"
    check = kernel.get("compile_check")
    if check:
        text += f", compile check {check['target']} {'ok' if check['ok'] else 'FAILED: ' + str(check.get('error'))}"
    tiling = tiling_note(kernel)
    loader = (kernel.get("codegen") or {}).get("loader_warp")
    if loader:
        text += (f", loader warp (gates {', '.join(loader['gates']) or 'none'}, "
                 f"{'drain' if loader['drain'] else 'no drain'}, {loader['slots']} ring slots)")
    return text + (f", GEMV tiling {tiling}" if tiling else "")


def tiling_note(kernel: dict | None) -> str:
    """How the kernel's GEMV tiling was chosen when it is not the default ("" for the default): the
    ``--tiling`` spec (and attention preload) or "autotuned (<chosen>)"."""
    kernel = kernel or {}
    if kernel.get("autotune"):
        return f"autotuned ({kernel['autotune'].get('chosen', 'per-stage')})"
    tiling = kernel.get("tiling") or {}
    parts = [str(tiling["spec"])] if tiling.get("spec") else []
    parts += ["attention preload"] if tiling.get("attention_preload") else []
    return " + ".join(parts)


def _numerics(numerics: dict | None) -> str:
    if not numerics:
        return "not measured (run `megabake verify` on the GPU class)"
    summary = ", ".join(f"{k} {v:.3g}" for k, v in numerics["summary"].items() if isinstance(v, (int, float)))
    verdict = "pass" if numerics["pass"] else "FAIL: " + "; ".join(numerics["failures"][:3])
    return f"{verdict} over {numerics['steps']} steps; {summary}"


def _timings(report: dict) -> str:
    h = headline(report)
    if h["megabake_ms"] is None:
        return "not measured (run `megabake verify` on the GPU class)"
    text = f"megabake {h['megabake_ms']:.4g} ms ({h['timing_measure']})"
    if h["baseline_ms"] is not None:
        text += f" vs {h['baseline']} {h['baseline_ms']:.4g} ms"
    if h["speedup"] is not None:
        text += f", speedup {h['speedup']:.3g}x"
    return text


INSPECT_EXIT_CODES = exit_codes_help(
    ok="the package checks out (digests, schemas); summary printed",
    failed="a check failed: a file does not match manifest.json, or a document breaks its schema",
    usage="usage or bad input: PATH does not exist or is not a package folder (no manifest.json)",
    cannot_run=UNAVAILABLE_HELP)


@click.command("inspect", epilog=INSPECT_EXIT_CODES)
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print report.json and manifest.json as one JSON object.")
@reports_errors
def inspect(path: str, as_json: bool) -> None:
    """Verify the package folder PATH (digests, schemas) and print its summary."""
    from pathlib import Path

    if not (Path(path) / "manifest.json").is_file():
        raise InputError(f"{path} is not a package folder: manifest.json is missing. fix: pass the variant "
                         "folder packages/<org>--<model>/<rev>/<variant>/ written by `megabake bake` "
                         "(`megabake ls` lists them)")
    package = read_package(path)  # a PackageError (digest, schema) exits 1 with the cause and the fix
    if as_json:
        click.echo(json.dumps({"path": str(package.path), "report": package.report, "manifest": package.manifest},
                              indent=2))
    else:
        click.echo(summarize(package))
