"""Loading and compiling generated modules.

Contract: ``load_module(path_or_source)`` imports a generated ``module.py`` as a private module object;
``compile_check(plan, module, arch="sm_90a")`` compiles its ``launch`` for the target with fake tensors (no
GPU or driver needed) and returns a :class:`CompileResult` (ok, seconds, error, ptx stats). The runtime
compiles against real device tensors itself (``MegakernelDecoder._compile``).

Precompiled kernels (CuTe DSL ahead-of-time export, no JIT at load):

* ``export_kernel(plan, module, out_dir=None, arch="sm_90a") -> dict`` compiles ``module.launch`` on fake
  tensors typed exactly as the runtime's ``from_dlpack(t, assumed_align=...)`` arguments
  (:func:`runtime_alignments`), exports it with ``JitCompiledFunction.export_to_c`` and returns
  ``{"files": {OBJECT_FILE: bytes, METADATA_FILE: bytes}, "metadata": {...}}`` (also written to ``out_dir``
  when given). The object holds the host launch code (for the baseline CPU of this ISA, :data:`HOST_TARGETS`)
  and the sm_90a cubin (SASS, no PTX); it is byte-identical across exports of the same module with the same
  toolchain, on any machine of that ISA, so the manifest digests are stable. Works on a CPU.
* ``load_precompiled(package_dir, module_source=None, tensors=None) -> PrecompiledKernel`` returns the
  loaded kernel (called exactly like ``cute.compile``'s result: cute tensors, then the stream), or None and
  the reason (no object, toolchain mismatch, digest mismatch, another module.py, an argument whose shape,
  dtype, layout or alignment differs from the export's, a loader error), so the caller can fall back to JIT
  and log why. Never compiles. The loaded kernel itself checks none of its arguments (static shapes: only
  data pointers are passed), which is why ``tensors`` (the torch tensors in ``module.ARGUMENTS`` order) are
  checked here.
* ``imports_megabake(source)``: True for the legacy module.py form whose device code is the installed
  ``megabake.codegen.bodies`` rather than the package's own copy.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

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
    if not path.exists() or path.read_text() != text:  # written whole, then renamed: another process importing
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # the same module never reads half a file
        partial.write_text(text)
        os.replace(partial, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # CuTe DSL inspects the source of decorated functions
    spec.loader.exec_module(module)
    return module


def extra_buffers(module) -> list:
    """The workspace buffers a module declares beyond its plan's (``EXTRA_BUFFERS``, name -> shape: a
    ``generate(plan, fused_o=True)`` build's ``o_mid`` and ``o_part``, a ``fused_mlp`` build's ``mlp_acc``), as plan
    buffers, fp32 unless ``EXTRA_BUFFER_DTYPES`` names another dtype; none for other builds."""
    from ..plan import Buffer

    dtypes = getattr(module, "EXTRA_BUFFER_DTYPES", {})
    return [Buffer(name, "workspace", dtypes.get(name, "float32"), list(shape))
            for name, shape in getattr(module, "EXTRA_BUFFERS", {}).items()]


def block_columns(weight, per_block: int):
    """A module's ``DERIVED_BUFFERS`` entry (a ``bulk_down`` build's ``w_down_cta``): ``weight`` [layers, rows,
    blocks x per_block] as [layers, blocks, rows x per_block], block b holding columns [b x per_block, (b + 1) x
    per_block) of every row, row-major, so each CTA's columns are one contiguous run."""
    layers, rows, cols = weight.shape
    if cols % per_block:
        raise ValueError(f"{cols} columns are not whole blocks of {per_block}: re-bake the package")
    blocks = cols // per_block
    return weight.reshape(layers, rows, blocks, per_block).permute(0, 2, 1, 3).reshape(layers, blocks, rows * per_block)


def argument_buffers(plan: Plan, module) -> list:
    """Plan buffers in kernel-parameter order (an untied LM head falls back to the embedding)."""
    names = {b.name: b for b in plan.buffers + extra_buffers(module)}
    out = []
    for arg in module.ARGUMENTS:
        out.append(names.get(arg) or names["embed"])
    return out


def fake_arguments(plan: Plan, module, alignments: list[int] | None = None) -> list:
    """Fake compact row-major tensors of the kernel arguments; ``alignments`` per argument (default 16)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    buffers = argument_buffers(plan, module)
    fakes = []
    for buf, align in zip(buffers, alignments or [16] * len(buffers)):
        dtype = getattr(cutlass, _CUTE_DTYPES[buf.dtype])
        order = tuple(range(len(buf.shape) - 1, -1, -1))
        fakes.append(make_fake_compact_tensor(dtype, tuple(buf.shape), stride_order=order, assumed_align=align))
    return fakes


_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8}
_POSITION = "position"  # follows the batch tokens in the runtime's one int32 upload buffer


def runtime_alignments(plan: Plan, module) -> list[int]:
    """The ``assumed_align`` the runtime gives each kernel argument (``16 if ptr % 16 == 0 else element
    size``, MegakernelDecoder._compile). Every buffer is its own allocation (256-byte aligned) except
    ``position``, which follows the ``batch`` int32 tokens in one buffer: 16-byte aligned only when batch is
    a multiple of 4."""
    aligns = []
    for buf in argument_buffers(plan, module):
        offset = 4 * plan.batch if buf.name == _POSITION else 0
        aligns.append(16 if offset % 16 == 0 else _ELEMENT_BYTES[buf.dtype])
    return aligns


def tensor_alignments(tensors) -> list[int]:
    """What the runtime passes as ``assumed_align`` for these torch tensors."""
    return [16 if t.data_ptr() % 16 == 0 else t.element_size() for t in tensors]


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


# ------------------------------------------------------------------------------------ precompiled kernels
PRECOMPILED_ARCH = "sm_90a"
OBJECT_FILE = f"megakernel.{PRECOMPILED_ARCH}.o"
METADATA_FILE = f"megakernel.{PRECOMPILED_ARCH}.json"
# The object's host code (launch glue) for the baseline CPU of this machine's ISA, never the bake machine's own
# CPU: CuTe DSL's default is LLVM's native CPU, which put AVX-512 instructions into the object on an AVX-512
# bake machine (a SIGILL on a host without them) and made the bytes depend on the machine that baked.
HOST_TARGETS = {"x86_64": "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64", "aarch64": "linux-aarch64"}


class PrecompiledKernel(NamedTuple):
    function: object | None  # the loaded kernel, or None
    reason: str | None  # why there is none (for the JIT fallback's log)


def imports_megabake(source: str) -> bool:
    """Whether module.py text imports megabake (the legacy form, whose device code no package digest covers)."""
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(name == "megabake" or name.startswith("megabake.") for name in names):
            return True
    return False


def function_prefix(module) -> str:
    """Symbol prefix of an exported kernel: unique per plan, so two packages can load in one process."""
    return f"megabake_{module.PLAN_HASH[:16]}"


def export_kernel(plan: Plan, module, out_dir: str | Path | None = None, *, arch: str = PRECOMPILED_ARCH) -> dict:
    """Compile ``module.launch`` for ``arch`` as the runtime calls it and export it (no GPU needed)."""
    from ..package.toolchain import precompiled_record

    require_cutlass()
    alignments = runtime_alignments(plan, module)
    host_target = HOST_TARGETS.get(platform.machine().lower())
    compiled = _compile_for_export(plan, module, alignments, arch, host_target)
    prefix = function_prefix(module)
    blob = _export_object(compiled, prefix)
    metadata = {
        "schema_version": 1, "object": OBJECT_FILE, "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob),
        "arch": arch, "host_target": host_target or "native", "function_prefix": prefix,
        "host_function": compiled.function_name, "kernels": sorted(compiled.kernel_info or {}),
        "arguments": _argument_records(plan, module, alignments),
        "module_sha256": hashlib.sha256(Path(module.__file__).read_text().encode()).hexdigest(),
        "plan_hash": module.PLAN_HASH, "object_format": _object_format(), "toolchain": precompiled_record(),
    }
    files = {OBJECT_FILE: blob, METADATA_FILE: (json.dumps(metadata, indent=1, sort_keys=True) + "\n").encode()}
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (Path(out_dir) / name).write_bytes(data)
    return {"files": files, "metadata": metadata}


def _compile_for_export(plan: Plan, module, alignments: list[int], arch: str, host_target: str | None):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    options = f"--gpu-arch {arch}" + (f" --host-target '{host_target}'" if host_target else "")
    return cute.compile(module.launch, *fake_arguments(plan, module, alignments), make_fake_stream(),
                        options=options)


def _export_object(compiled, prefix: str) -> bytes:
    """``export_to_c``'s object file (the C header it also writes is not kept)."""
    if getattr(compiled, "engine", None) is None:
        _expose_runtime_symbols()
    with tempfile.TemporaryDirectory() as tmp:
        compiled.export_to_c(tmp, "megakernel", prefix)
        return (Path(tmp) / "megakernel.o").read_bytes()


def _expose_runtime_symbols() -> None:
    """Make the CuTe DSL runtime library's symbols (cudaLaunchKernelEx, ...) globally visible.

    A cross-compile (target arch != this machine's: every CPU machine, whose DSL defaults to sm_100a unless
    CUTE_DSL_ARCH=sm_90a) builds no JIT engine, so nothing has loaded that library, and 4.8.1's object export
    fails with "Symbols not found: [_cudaLaunchKernelEx, ...]". With it loaded the export is byte-identical to
    the one made where the engine exists (CUTE_DSL_ARCH=sm_90a, or on the H200)."""
    import ctypes

    import cutlass.cute as cute

    for path in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _object_format() -> str | None:
    try:
        from cutlass.cute.export.export import object_file_version
    except Exception:  # moved in another release: unknown, the toolchain check still pins the version
        return None
    return object_file_version


def _argument_records(plan: Plan, module, alignments: list[int]) -> list[dict]:
    return [{"name": name, "shape": list(buf.shape), "dtype": buf.dtype, "align": align}
            for name, buf, align in zip(module.ARGUMENTS, argument_buffers(plan, module), alignments)]


def load_precompiled(package_dir: str | Path, *, module_source: str | None = None, tensors=None,
                     arch: str = PRECOMPILED_ARCH) -> PrecompiledKernel:
    """The package's precompiled kernel, loaded without JIT, or None and why (see the module docstring)."""
    from ..package.toolchain import ToolchainError, check_compatible

    directory = Path(package_dir)
    try:
        metadata = json.loads((directory / METADATA_FILE).read_text())
    except FileNotFoundError:
        return PrecompiledKernel(None, f"the package has no precompiled kernel ({METADATA_FILE})")
    except (OSError, ValueError) as exc:
        return PrecompiledKernel(None, f"{METADATA_FILE} is unreadable: {exc}")
    try:
        check_compatible(metadata.get("toolchain") or {}, precompiled=True)
    except ToolchainError as exc:
        return PrecompiledKernel(None, str(exc))
    problem = _package_problem(directory, metadata, module_source, arch) or _arguments_problem(metadata, tensors)
    if problem:
        return PrecompiledKernel(None, problem)
    try:
        import cutlass.cute as cute

        loaded = cute.runtime.load_module(str(directory / OBJECT_FILE))
        return PrecompiledKernel(loaded[metadata["function_prefix"]], None)
    except Exception as exc:  # the DSL's loader refused it: fall back to JIT, saying why
        return PrecompiledKernel(None, f"CuTe DSL could not load {OBJECT_FILE}: {type(exc).__name__}: {exc}")


def _package_problem(directory: Path, metadata: dict, module_source: str | None, arch: str) -> str | None:
    """Why the exported object does not belong to this package's module.py, or None."""
    if metadata.get("arch") != arch or metadata.get("object") != OBJECT_FILE:
        return f"{METADATA_FILE} describes {metadata.get('object')} for {metadata.get('arch')}, not {OBJECT_FILE}"
    try:
        blob = (directory / OBJECT_FILE).read_bytes()
    except OSError as exc:
        return f"the precompiled object is unreadable: {exc}"
    if hashlib.sha256(blob).hexdigest() != metadata.get("sha256"):
        return f"{OBJECT_FILE} does not match the sha256 in {METADATA_FILE}: the package is damaged"
    source = module_source if module_source is not None else (directory / "module.py").read_text()
    if hashlib.sha256(source.encode()).hexdigest() != metadata.get("module_sha256"):
        return "the precompiled kernel was exported from another module.py than the one being loaded"
    return None


def _arguments_problem(metadata: dict, tensors) -> str | None:
    """Why these torch tensors are not what the kernel was exported for (count, shape, dtype, row-major
    contiguity, alignment), or None."""
    if tensors is None:
        return None
    expected = metadata.get("arguments") or []
    if len(tensors) != len(expected):
        return f"{len(tensors)} kernel arguments given, the precompiled kernel takes {len(expected)}"
    for tensor, want, align in zip(tensors, expected, tensor_alignments(tensors)):
        got = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."), "align": align}
        if not tensor.is_contiguous() or any(got[key] != want[key] for key in got):
            return (f"argument {want['name']} is {got} (contiguous: {tensor.is_contiguous()}), the precompiled "
                    f"kernel was exported for {want}")
    return None
