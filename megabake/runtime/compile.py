"""Loading and compiling generated modules.

Contract: ``load_module(path_or_source)`` imports a generated ``module.py`` as a private module object;
``compile_check(plan, module, arch="sm_90a")`` compiles its ``launch`` for the target with fake tensors (no
GPU or driver needed) and returns a :class:`CompileResult` (ok, seconds, error, ptx stats);
``compile_for_tensors(module, tensors)`` compiles against real device tensors (cached by the caller).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import require_cutlass
from ..plan import Plan

_CUTE_DTYPES = {"bfloat16": "BFloat16", "float16": "Float16", "float32": "Float32", "int32": "Int32",
                "int64": "Int64"}


@dataclass
class CompileResult:
    ok: bool
    target: str
    seconds: float
    error: str | None = None
    ptx_stats: dict = field(default_factory=dict)

    def to_report(self) -> dict:
        return {"target": self.target, "ok": self.ok, "seconds": round(self.seconds, 3), "error": self.error}


def load_module(source: str | Path, name: str | None = None) -> types.ModuleType:
    """Import generated module text (or a module.py path) under a unique private name."""
    require_cutlass()
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and source.endswith(".py")):
        text = Path(source).read_text()
    else:
        text = source
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    name = name or f"megabake_generated_{digest}"
    directory = Path(tempfile.gettempdir()) / "megabake-modules"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # CuTe DSL inspects the source of decorated functions
    spec.loader.exec_module(module)
    return module


def argument_buffers(plan: Plan, module) -> list:
    """Plan buffers in kernel-parameter order (an untied LM head falls back to the embedding)."""
    names = {b.name: b for b in plan.buffers}
    out = []
    for arg in module.ARGUMENTS:
        out.append(names.get(arg) or names["embed"])
    return out


def fake_arguments(plan: Plan, module) -> list:
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    fakes = []
    for buf in argument_buffers(plan, module):
        dtype = getattr(cutlass, _CUTE_DTYPES[buf.dtype])
        order = tuple(range(len(buf.shape) - 1, -1, -1))
        fakes.append(make_fake_compact_tensor(dtype, tuple(buf.shape), stride_order=order, assumed_align=16))
    return fakes


def compile_check(plan: Plan, module, *, arch: str = "sm_90a", dump_dir: str | None = None) -> CompileResult:
    """Compile the module's launch for ``arch`` on fake tensors; works without a GPU."""
    require_cutlass()
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    options = f"--gpu-arch {arch}"
    if dump_dir:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        options += f" --keep-ptx --dump-dir {dump_dir}"
    started = time.perf_counter()
    try:
        cute.compile(module.launch, *fake_arguments(plan, module), make_fake_stream(), options=options)
        result = CompileResult(True, arch, time.perf_counter() - started)
    except Exception as exc:  # report, do not crash the bake: the report records the failure
        message = f"{type(exc).__name__}: {exc}".strip()
        result = CompileResult(False, arch, time.perf_counter() - started, error=message[:4000])
    if dump_dir and result.ok:
        result.ptx_stats = ptx_stats(dump_dir)
    return result


def ptx_stats(dump_dir: str) -> dict:
    """Counts of the instructions we care about in the newest PTX dump (16-byte loads, atomics)."""
    files = sorted(Path(dump_dir).glob("*.ptx"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    text = files[-1].read_text()
    return {
        "ptx_file": files[-1].name,
        "vector_loads_16B": text.count("ld.global.v4") + text.count("ld.global.nc.v4"),
        "acquire_loads": text.count("ld.acquire.gpu"),
        "atomics": text.count("atom.global"),
        "lines": text.count("\n"),
    }
