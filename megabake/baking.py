"""Bake: a model (preset, Hub id @ revision, local folder or .gguf: ``megabake.sources``) -> a decode package.

Contract: ``bake(model, revision=None, batch=1, capacity=128, out="packages", ...) -> BakeResult`` runs
capture -> ir -> plan -> codegen, checks the plan's reference executor against eager fp32 PyTorch, compiles
``module.py`` for sm_90a with CuTe DSL (works without a GPU), and on a Hopper GPU also runs the kernel and
records a first numerical check and its latency. It writes ``module.py``, ``plan.json``,
``source_map.json`` and ``report.json`` (+ ``manifest.json``) atomically through ``megabake.package`` into
``out/<org>--<model>/<rev>/<variant>``, the variant carrying the plan tag (``decode-b1-c128-sm90a-132sm-p<8
hex>``: of the plan's sha256, folded with the module's codegen record where it has one, ``report.kernel.codegen``).
It never silently replaces another package (``megabake.package.save_package``): the same files with an equal
or stronger report are left as is (``BakeResult.outcome == "unchanged"``); different files raise
``OverwriteRefusedError`` unless ``force=True``. Without a Hopper GPU the report is ``unverified`` with the
reason. Progress goes to ``progress(msg)``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .errors import MegaBakeError
from .plan import GemvTuning
from .sources import ModelSource, load_source

DEFAULT_GPU_CLASS = "sm90a-132sm"  # H100/H200 SXM


@dataclass
class BakeResult:
    """``report`` is this bake's report; when ``outcome`` is "unchanged" the package at ``path`` kept its own
    (``read_package(path).report``). ``outcome``: written | unchanged | upgraded | replaced; ``note``: what the
    write did, one line ("" for a plain first write)."""

    path: Path
    report: dict
    plan_hash: str
    timings: dict[str, float] = field(default_factory=dict)
    model: object = field(default=None, repr=False, compare=False)  # the baked model, for an in-process verify
    outcome: str = "written"
    note: str = ""


def parse_gpu_class(gpu_class: str) -> tuple[tuple[int, int], int]:
    import re

    match = re.fullmatch(r"sm(\d)(\d)a?-(\d+)sm", gpu_class)
    if not match:
        raise MegaBakeError(f"GPU class {gpu_class!r} is not of the form sm90a-132sm")
    return (int(match.group(1)), int(match.group(2))), int(match.group(3))


def bake(model: str, *, revision: str | None = None, batch: int = 1, capacity: int = 128,
         out: str | Path = "packages", gpu_class: str | None = None, seed: int = 0, threads: int = 256,
         reference_steps: int = 4, gpu_steps: int = 64, gpu_prefill: int = 16, run_on_gpu: bool = True,
         autotune: bool = False, tiling: str | None = None, attention_preload: bool = False, force: bool = False,
         progress: Callable[[str], None] = lambda msg: None) -> BakeResult:
    from .compiler import compile_step
    from .package import build_hash, package_destination, save_package
    from .presets import config_hash
    from .runtime import gpu_info

    if batch < 1:
        raise MegaBakeError(f"--batch must be at least 1, got {batch}")
    chosen_tuning = _chosen_tuning(tiling, attention_preload, autotune)
    timings: dict[str, float] = {}
    clock = _Clock(timings, progress)
    info = gpu_info() if run_on_gpu else None
    hopper = info is not None and info.capability == (9, 0)
    gpu_class = gpu_class or (info.gpu_class if hopper else DEFAULT_GPU_CLASS)
    _, sm_count = parse_gpu_class(gpu_class)
    if autotune and not run_on_gpu:
        raise MegaBakeError("--autotune runs candidate kernels on the GPU; it cannot be combined with --no-gpu")
    if autotune and not hopper:
        raise MegaBakeError("--autotune times candidate kernels on a Hopper GPU and this machine has none "
                            f"({'no CUDA GPU' if info is None else info.name}); drop --autotune to bake with the "
                            "default GEMV tiling, or bake on an H100/H200")

    with clock("load model"):
        source = load_source(model, revision, seed)
    compiled = compile_step(source.model, batch=batch, capacity=capacity, ctas=sm_count, threads=threads,
                            attention_preload=attention_preload and not chosen_tuning, clock=clock)
    build = compiled.plan_for
    tuned = None
    if autotune:
        with clock(f"autotune GEMV tilings on {info.name}"):
            tuned = _autotune(build, source.model, progress)
    if tuned:
        if tuned.build_tuning is not None or tuned.attention_preload:  # else the default plan won: keep it
            compiled = compiled.replan(tuning=tuned.build_tuning, attention_preload=tuned.attention_preload)
    elif chosen_tuning:
        compiled = compiled.replan(tuning=chosen_tuning(build()), attention_preload=attention_preload)
    plan, generated = compiled.plan, compiled.generated
    with clock(f"reference executor vs eager fp32 ({reference_steps} steps)"):
        reference = reference_check(plan, source.model, steps=reference_steps)
    with clock("CuTe DSL compile check for sm_90a and the precompiled kernel (loads without JIT)"):
        compile_result, precompiled = _compile_and_export(plan, generated.source)

    dest, variant = package_destination(out, source.model_id, source.revision, "decode", batch, capacity, gpu_class,
                                        build_hash(plan.hash, generated.codegen))
    report = _report(source, config_hash(source.model.config), plan, variant, gpu_class, compile_result, reference)
    if generated.codegen:
        report["kernel"]["codegen"] = generated.codegen
    report["kernel"]["precompiled"] = precompiled["report"]
    if tuned:
        report["kernel"]["autotune"] = tuned.report()
    if chosen_tuning or attention_preload:
        report["kernel"]["tiling"] = {"spec": normalized_tiling(tiling) if tiling else None,
                                      "attention_preload": attention_preload}
    if hopper:
        with clock(f"run on {info.name}: numerics ({gpu_steps} steps) and latency"):
            _gpu_evidence(report, plan, generated.source, source.model, steps=gpu_steps, prefill=gpu_prefill)
    else:
        reason = ("no Hopper GPU on this machine: module.py was compiled for sm_90a but not run; "
                  "run `megabake verify` on an H100/H200")
        report["status_reasons"].append(reason)
    if not reference["ok"]:
        report["status"] = "failed"
        report["status_reasons"].insert(0, f"reference executor disagrees with eager fp32 (rel_l2 {reference['rel_l2']:.3g})")
    if not compile_result.ok:
        report["status"] = "failed"
        report["status_reasons"].insert(0, f"CuTe DSL compile for sm_90a failed: {compile_result.error}")

    with clock(f"write package {dest}"):
        files = {
            "module.py": generated.source,
            "plan.json": plan.to_json(),
            "source_map.json": _json(generated.source_map),
            **precompiled["files"],
        }
        saved = save_package(dest, files, report, force=force)
    return BakeResult(dest, report, plan.hash, timings, model=source.model, outcome=saved.action, note=saved.message)


BALANCED = "balanced:"  # --tiling prefix: rows per tile chosen per stage for tile balance


def normalized_tiling(tiling: str) -> str:
    """``--tiling`` in its canonical form (``balanced:`` kept, the spec as :attr:`GemvTuning.spec`)."""
    balanced = tiling.strip().lower().startswith(BALANCED)
    spec = tiling.strip()[len(BALANCED):] if balanced else tiling
    return (BALANCED if balanced else "") + GemvTuning.parse(spec).spec


def _chosen_tuning(tiling: str | None, attention_preload: bool, autotune: bool):
    """``plan -> tuning`` for ``--tiling`` (validated now), or None. ``SPEC`` applies to every GEMV stage (the
    LM head never preloads); ``balanced:SPEC`` also picks each stage's rows per tile for tile balance over the
    plan's warps, keeping SPEC's loads in flight (``autotune.balanced_tuning``)."""
    if autotune and (tiling or attention_preload):
        raise MegaBakeError("--autotune chooses the GEMV tiling and attention preload itself; drop --tiling / "
                            "--attention-preload, or drop --autotune to bake the tiling you name")
    if not tiling:
        return None
    from .runtime.autotune import balanced_tuning, uniform_tuning

    canonical = normalized_tiling(tiling)
    base = GemvTuning.parse(canonical.removeprefix(BALANCED))
    if canonical.startswith(BALANCED):
        return lambda plan: balanced_tuning(plan, base)
    return lambda plan: uniform_tuning(base)


def _autotune(build, model, progress):
    """Autotune on a CUDA bf16 copy of the model (the bake's own copy stays on the CPU for the reference check)."""
    import copy

    from .runtime.autotune import autotune

    from .rope import cast_model

    gpu_model = cast_model(copy.deepcopy(model), device="cuda", dtype=torch.bfloat16)
    try:
        return autotune(build, gpu_model, progress=progress)
    finally:
        del gpu_model
        torch.cuda.empty_cache()


class _Clock:
    def __init__(self, timings: dict, progress):
        self.timings, self.progress = timings, progress

    def __call__(self, label: str):
        clock = self

        class _Span:
            def __enter__(self):
                clock.progress(f"{label} ...")
                self.started = time.perf_counter()

            def __exit__(self, *exc):
                clock.timings[label] = time.perf_counter() - self.started
                if exc[0] is None:
                    clock.progress(f"{label}: done in {clock.timings[label]:.1f} s")
                return False

        return _Span()


def _json(obj) -> str:
    """Compact JSON with sorted keys (source_map.json: read by tools, not people; ``megabake inspect`` shows it)."""
    import json

    return json.dumps(obj, separators=(",", ":"), sort_keys=True) + "\n"


@contextlib.contextmanager
def rounded_linear_inputs(model, enabled: bool = True):
    """While open, every ``nn.Linear`` of ``model`` sees its input rounded to bf16: the fp32 model that a
    bf16-staged plan computes (its GEMVs multiply bf16 input rows; ``plan.staging_dtype``)."""
    def round_input(module, args):
        return (args[0].to(torch.bfloat16).float(),)

    hooks = [m.register_forward_pre_hook(round_input) for m in model.modules()
             if enabled and isinstance(m, torch.nn.Linear)]
    try:
        yield model
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def reference_check(plan, model, *, steps: int = 4, seed: int = 0) -> dict:
    """Run the plan's reference executor and the eager fp32 HF model on the same random tokens (for a
    bf16-staged plan, the fp32 model with bf16-rounded linear inputs, which is what such a plan computes)."""
    from .capture import full_length_static_cache
    from .plan.reference import reference_executor_for

    from .rope import cast_model

    fp32 = cast_model(model, dtype=torch.float32)
    executor = reference_executor_for(plan, fp32, dtype=torch.float32)
    cache = full_length_static_cache(fp32.config, plan.capacity)
    generator = torch.Generator().manual_seed(seed)
    steps = min(steps, plan.capacity)
    tokens = torch.randint(0, plan.dims.vocab, (plan.batch, steps), generator=generator)
    worst_abs, worst_rel = 0.0, 0.0
    for position in range(steps):
        with rounded_linear_inputs(fp32, enabled=plan.staging_dtype == "bfloat16"):
            expected = fp32(tokens[:, position:position + 1], past_key_values=cache, use_cache=True,
                            cache_position=torch.tensor([position])).logits[:, -1]
        got = executor.step(tokens[:, position], position)
        worst_abs = max(worst_abs, float((got - expected).abs().max()))
        worst_rel = max(worst_rel, float((got - expected).norm() / expected.norm()))
    return {"ok": worst_rel < 1e-4, "steps": steps, "max_abs_err": worst_abs, "rel_l2": worst_rel}


def _compile_check(plan, source: str):
    from .runtime.compile import CompileResult, compile_check, load_module

    try:
        module = load_module(source)
    except Exception as exc:  # a missing cutlass or broken module is recorded, with the fix
        return CompileResult(False, "sm_90a", 0.0, error=f"{type(exc).__name__}: {exc}")
    return compile_check(plan, module)


def _compile_and_export(plan, source: str):
    """(compile check, precompiled kernel) of module.py for sm_90a from one compile where the export succeeds
    (it compiles the launch as the runtime calls it: that is the check); where it fails, the plain compile check
    tells a module that does not compile (the bake fails) from an export that did not work (recorded, JIT at
    load)."""
    from .runtime.compile import PRECOMPILED_ARCH, CompileResult

    precompiled = _export_precompiled(plan, source)
    report = precompiled["report"]
    if report["ok"]:
        return CompileResult(True, PRECOMPILED_ARCH, report["seconds"]), precompiled
    compile_result = _compile_check(plan, source)
    return compile_result, precompiled if compile_result.ok else {"files": {}, "report": None}


def _export_precompiled(plan, source: str) -> dict:
    """Package files + ``report.kernel.precompiled``; a failed export is recorded, never fatal (JIT at load)."""
    from .runtime.compile import METADATA_FILE, export_kernel, load_module

    started = time.perf_counter()
    try:
        exported = export_kernel(plan, load_module(source))
    except Exception as exc:  # evidence, not a requirement
        return {"files": {}, "report": {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                                        "seconds": round(time.perf_counter() - started, 3)}}
    meta = exported["metadata"]
    return {"files": exported["files"], "report": {
        "ok": True, "file": meta["object"], "metadata": METADATA_FILE, "sha256": meta["sha256"], "size": meta["size"],
        "arch": meta["arch"], "cutlass_dsl": meta["toolchain"]["cutlass_dsl"],
        "seconds": round(time.perf_counter() - started, 3), "error": None}}


def _toolchain() -> dict:
    """What built the package: the verifier's record (versions, git) and the device toolchain
    (``megabake.package.toolchain``: CuTe DSL, its CUDA, the minimum driver, the host)."""
    from .package.toolchain import toolchain_record

    try:
        device = toolchain_record()
    except Exception:  # never fatal: an unknown toolchain is recorded as unknown
        device = {}
    return {**_verifier_toolchain(), **{k: v for k, v in device.items() if v is not None}}


def _verifier_toolchain() -> dict:
    try:
        from .verification import toolchain

        return toolchain()
    except Exception:  # the verifier's helpers are optional at bake time
        import platform

        import transformers

        return {"megabake": __version__, "git_revision": None, "python": platform.python_version(),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "huggingface_hub": None, "cutlass_dsl": None, "cuda_driver": None}


def _report(source: ModelSource, cfg_hash: str, plan, variant: str, gpu_class: str, compile_result, reference) -> dict:
    created = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "schema_version": 1,
        "status": "unverified",
        "status_reasons": [],
        "created_at": created,
        "model": {"id": source.model_id, "revision": source.revision, "config_hash": cfg_hash,
                  "weights": source.weights, "seed": source.seed, "preset": source.preset,
                  "architecture": type(source.model).__name__, "dtype": "bfloat16",
                  **({"local": source.local} if source.local else {})},
        "bucket": {"mode": "decode", "batch": plan.batch, "capacity": plan.capacity},
        "gpu_class": gpu_class,
        "variant": variant,
        "plan": {"hash": plan.hash, "stages": len(plan.stages), "barriers_per_step": plan.barriers_per_step,
                 "ctas": plan.ctas, "threads_per_cta": plan.threads, "layers": plan.dims.layers,
                 "weight_bytes": plan.weight_bytes()},
        "toolchain": _toolchain(),
        "kernel": {"grid": [plan.ctas, 1, 1], "block": [plan.threads, 1, 1], "registers": None,
                   "shared_memory_bytes": plan.smem_bytes, "compile_check": compile_result.to_report()},
        "reference_check": reference,
        "environment": None,
        "numerics": None,
        "timings": None,
    }


def _gpu_evidence(report: dict, plan, source: str, model, *, steps: int, prefill: int) -> None:
    """On a Hopper GPU: run the kernel, record numerics and a first latency (baselines: `megabake verify`)."""
    from .runtime import MegakernelDecoder
    from .verification import environment, run_numerics

    decoder = MegakernelDecoder(plan, source, model, device="cuda")
    report["environment"] = environment()
    numerics = run_numerics(decoder, prefill=prefill, steps=steps)
    report["numerics"] = numerics
    if not numerics.get("pass"):
        report["status"] = "failed"
        report["status_reasons"].extend(numerics.get("failures", [])[:10] or ["numerics check failed"])
        return
    report["status_reasons"].append(first_latency(report, decoder))


def first_latency(report: dict, decoder) -> str:
    """Time the megakernel alone (no baselines: those are `megabake verify`'s job); never fails the bake."""
    from .verification import run_timings

    try:
        report["timings"] = run_timings(decoder, baselines=())
        ms = report["timings"]["candidates"]["megabake"]["sync_call"]["median"]
        measured = f"first latency {ms:.3f} ms per synchronized step"
    except Exception as exc:  # the numbers are evidence, not a requirement of baking
        measured = f"latency not measured ({type(exc).__name__}: {str(exc)[:200]})"
    return (f"numerics pass on {report['environment'].get('gpu_name')}; {measured}; not yet timed against "
            "graphed Inductor: run `megabake verify` to verify this package")
