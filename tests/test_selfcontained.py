"""CPU tests of self-contained packages: module.py carries its device code, the toolchain record and its
compatibility rules, and the precompiled (exported) kernel: deterministic, loadable without JIT, refused with a
reason when it does not fit.

Run: ``timeout 1200 python3 -m pytest -q tests/test_selfcontained.py -x`` (CuTe DSL installed; no GPU needed).
"""

from __future__ import annotations

import ast
import json
import shutil

import pytest
import torch

from megabake.codegen import (
    bodies_source,
    called_bodies,
    check_top_level_names,
    generate,
    needed_routines,
    parse_routines,
)
from megabake.errors import EXIT_CANNOT_RUN, MegaBakeError
from megabake.package import toolchain as tc
from megabake.plan import GemvTuning, build_plan
from megabake.plan.rotary import recover_rotary
from megabake.presets import get_preset
from tests.compiler_fixtures import compile_model

pytest.importorskip("cutlass.cute")


@pytest.fixture(scope="module")
def tiny():
    return compile_model(get_preset("tiny-llama").build_model(seed=0))


def _other_tiling(tiny):
    """A second plan that calls other routines than the default one (preloads, pipelined K loops)."""
    from megabake.runtime.autotune import uniform_tuning

    inv_freq, scaling = recover_rotary(tiny.captured, tiny.ir)
    tuning = uniform_tuning(GemvTuning.parse("1x8+preload+pipeline"))
    return build_plan(tiny.ir, inv_freq_buffer=inv_freq, rotary_scaling=scaling, tuning=tuning)


def _imported_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def _ptx(plan, source: str, directory) -> tuple[str, str]:
    from megabake.runtime.compile import compile_check, load_module

    result = compile_check(plan, load_module(source), dump_dir=str(directory))
    assert result.ok, result.error
    (ptx,) = directory.glob("*.ptx")
    return ptx.name, ptx.read_text()


# ------------------------------------------------------------------------------------------ module.py
@pytest.mark.parametrize("which", ["default", "preload+pipeline"])
def test_module_imports_no_megabake_and_compiles_to_the_same_ptx_as_the_installed_bodies(tiny, which, tmp_path):
    """The self-contained module.py compiles for sm_90a to PTX identical (file name and text) to the legacy
    module that imports megabake.codegen.bodies: the kernel's behaviour is unchanged."""
    from megabake.runtime.compile import imports_megabake

    plan = tiny.plan if which == "default" else _other_tiling(tiny)
    own, legacy = generate(plan), generate(plan, self_contained=False)
    assert not any(name.split(".")[0] == "megabake" for name in _imported_modules(own.source))
    assert not imports_megabake(own.source) and imports_megabake(legacy.source)
    assert own.kernel_source.replace(_appendix_note(), "") == legacy.source.replace(
        "from megabake.codegen import bodies\n\n", "")
    (tmp_path / "own").mkdir()
    (tmp_path / "legacy").mkdir()
    assert _ptx(plan, own.source, tmp_path / "own") == _ptx(plan, legacy.source, tmp_path / "legacy")


def _appendix_note() -> str:
    from megabake import __version__

    return ("\nSelf-contained: the device routines the kernel calls as bodies.<name> are copied at the end of this "
            f"file\nfrom megabake.codegen.bodies (MegaBake {__version__}); it needs CuTe DSL, not MegaBake.\n")


def test_copied_routines_are_verbatim_and_only_those_the_kernel_reaches(tiny):
    source = generate(tiny.plan).source
    bodies_text = bodies_source()
    routines = parse_routines(bodies_text)
    called = called_bodies(source)
    reached = needed_routines(routines, called)
    tree = ast.parse(source)
    copied = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
              and node.name not in ("megakernel", "launch")]
    assert copied == [name for name in reached if name in copied]  # in the order of the bodies source
    assert set(copied) == {name for name in reached if not name.isupper()}  # constants aside
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in copied:
            assert ast.get_source_segment(source, node) in bodies_text  # verbatim
    namespace = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "bodies")
    bound = [stmt.targets[0].id for stmt in namespace.body if isinstance(stmt, ast.Assign)]
    assert bound == called
    unused = set(routines.text) - set(reached)
    assert "decode_attention_early" in unused and "def decode_attention_early" not in source


def test_self_contained_module_loads_without_the_installed_bodies(tiny, monkeypatch):
    """Importing module.py must not touch megabake.codegen.bodies: a broken installed copy changes nothing."""
    import sys

    from megabake.runtime.compile import load_module

    monkeypatch.setitem(sys.modules, "megabake.codegen.bodies", None)  # any import of it now fails
    module = load_module(generate(tiny.plan).source)
    assert module.bodies.grid_wait is module.grid_wait and module.ARGUMENTS


def test_legacy_modules_of_old_packages_still_load(tiny):
    from megabake.runtime.compile import imports_megabake, load_module

    legacy = generate(tiny.plan, self_contained=False).source
    assert "from megabake.codegen import bodies" in legacy and imports_megabake(legacy)
    module = load_module(legacy)
    assert module.bodies.__name__ == "megabake.codegen.bodies"


def test_a_copied_name_colliding_with_a_generated_one_is_refused():
    check_top_level_names("A = 1\nimport os\nimport os\ndef f():\n    pass\n")
    with pytest.raises(ValueError, match="defines 'BATCH' twice"):
        check_top_level_names("BATCH = 1\nX = 2\nBATCH = 3\n")


# ------------------------------------------------------------------------------------------ toolchain
def test_toolchain_record_names_what_built_the_package():
    from cutlass import CUDA_VERSION

    from megabake import __version__
    from megabake.verification.env import cutlass_dsl_version

    record = tc.toolchain_record()
    assert set(record) == {"megabake", "cutlass_dsl", "cutlass_dsl_cuda", "torch_cuda", "driver_min", "host",
                           "python"}
    assert record["megabake"] == __version__ and record["cutlass_dsl"] == cutlass_dsl_version() is not None
    assert record["cutlass_dsl_cuda"] == f"{CUDA_VERSION.major}.{CUDA_VERSION.minor}"
    assert record["driver_min"] == tc.driver_minimum(record["cutlass_dsl_cuda"]) is not None
    assert record["torch_cuda"] == torch.version.cuda
    assert tc.driver_minimum("13.4") == "580" and tc.driver_minimum("12.8") == "525.60.13"
    assert tc.driver_minimum(None) is None and json.loads(json.dumps(record)) == record


def _record(**changes) -> dict:
    return dict(tc.toolchain_record(), **changes)


def test_jit_needs_the_same_cute_dsl_major_minor():
    here = tc.toolchain_record()["cutlass_dsl"]
    major, minor, *_ = here.split(".")
    tc.check_compatible(_record(), precompiled=False)
    tc.check_compatible(_record(cutlass_dsl=f"{major}.{minor}.99"), precompiled=False)  # a patch release: fine
    tc.check_compatible({"megabake": "0.0.1"}, precompiled=False)  # unrecorded (older packages): not checkable
    other = f"{major}.{int(minor) + 1}.0"
    with pytest.raises(tc.ToolchainError) as info:
        tc.check_compatible(_record(cutlass_dsl=other), precompiled=False)
    message = str(info.value)
    assert f"CuTe DSL {other}" in message and f"nvidia-cutlass-dsl {here} is installed" in message
    assert f"pip install nvidia-cutlass-dsl=={other}" in message and "re-bake" in message
    assert isinstance(info.value, MegaBakeError) and info.value.exit_code == EXIT_CANNOT_RUN
    with pytest.raises(tc.ToolchainError, match="same major.minor"):
        tc.check_compatible(_record(cutlass_dsl=f"{int(major) + 1}.{minor}.0"), precompiled=False)


def test_precompiled_needs_the_exact_cute_dsl_host_and_a_new_enough_driver(monkeypatch):
    here = tc.toolchain_record()["cutlass_dsl"]
    tc.check_compatible(_record(), precompiled=True)
    with pytest.raises(tc.ToolchainError, match=f"needs exactly that version.*=={here}.99"):
        tc.check_compatible(_record(cutlass_dsl=f"{here}.99"), precompiled=True)
    with pytest.raises(tc.ToolchainError, match="host code is for aarch64-linux"):
        tc.check_compatible(_record(host="aarch64-linux"), precompiled=True)
    monkeypatch.setattr(tc, "_installed_driver", lambda: "575.57.08")
    with pytest.raises(tc.ToolchainError, match=r"driver >= 580, but driver 575.57.08 is installed"):
        tc.check_compatible(_record(driver_min="580"), precompiled=True)
    monkeypatch.setattr(tc, "_installed_driver", lambda: "580.159.04")
    tc.check_compatible(_record(driver_min="580"), precompiled=True)


def test_without_cute_dsl_nothing_is_compatible(monkeypatch):
    monkeypatch.setattr(tc, "_cutlass_dsl_version", lambda: None)
    with pytest.raises(tc.ToolchainError, match=r"not installed.*pip install nvidia-cutlass-dsl==4\.8\.1"):
        tc.check_compatible({"cutlass_dsl": "4.8.1"}, precompiled=False)


# -------------------------------------------------------------------------------- precompiled kernels
@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
    """The tiny default plan's kernel exported twice (two compiles), and its module source."""
    from megabake.runtime.compile import export_kernel, load_module

    source = generate(tiny.plan).source
    first = tmp_path_factory.mktemp("export1")
    one = export_kernel(tiny.plan, load_module(source), first)
    two = export_kernel(tiny.plan, load_module(source), tmp_path_factory.mktemp("export2"))
    return source, first, one, two


def test_export_on_cpu_is_deterministic_and_describes_the_runtime_arguments(tiny, exported):
    import platform

    from megabake.runtime.compile import HOST_TARGETS, METADATA_FILE, OBJECT_FILE

    source, directory, one, two = exported
    assert sorted(one["files"]) == [METADATA_FILE, OBJECT_FILE] == sorted(p.name for p in directory.iterdir())
    assert one["files"] == two["files"]  # same bytes: stable manifest digests
    metadata = json.loads(one["files"][METADATA_FILE])
    assert metadata == one["metadata"] and metadata["arch"] == "sm_90a" and metadata["object_format"]
    assert metadata["plan_hash"] == tiny.plan.hash and metadata["toolchain"] == tc.precompiled_record()
    assert set(metadata["toolchain"]) == {"megabake", "cutlass_dsl", "cutlass_dsl_cuda", "driver_min", "host"}
    assert metadata["kernels"] and all(name.startswith("kernel_cutlass_megakernel") for name in metadata["kernels"])
    blob = one["files"][OBJECT_FILE]
    cubin = blob.find(b"\x7fELF", 1)  # the embedded device binary: an sm_90a cubin (EM_CUDA), SASS, no PTX
    assert cubin > 0 and int.from_bytes(blob[cubin + 18:cubin + 20], "little") == 190 and b".target" not in blob
    assert metadata["host_target"] == HOST_TARGETS[platform.machine().lower()]  # portable host code
    arguments = {arg["name"]: arg for arg in metadata["arguments"]}
    assert [arg["name"] for arg in metadata["arguments"]] == list(generate(tiny.plan).arguments)
    assert arguments["position"]["align"] == 4 and arguments["tokens"]["align"] == 16  # batch 1: offset 4 bytes
    assert arguments["embed"] == {"name": "embed", "shape": list(tiny.plan.buffer("embed").shape),
                                  "dtype": "bfloat16", "align": 16}


def _runtime_tensors(plan, names, source):
    """CPU stand-ins laid out as MegakernelDecoder._bind_cuda lays out its buffers: the plan's and the module's
    own workspace (``EXTRA_BUFFERS``: the fused attention+O build's ``o_mid`` / ``o_part``)."""
    from megabake.plan.packing import torch_dtype
    from megabake.runtime.compile import extra_buffers, load_module

    inputs = torch.zeros(plan.batch + 1, dtype=torch.int32)
    tensors = {"tokens": inputs[:plan.batch], "position": inputs[plan.batch:]}
    for buf in plan.buffers + extra_buffers(load_module(source)):
        tensors.setdefault(buf.name, torch.zeros(buf.shape, dtype=torch_dtype(buf.dtype)))
    return [tensors.get(name, tensors["embed"]) for name in names]  # a tied LM head is the embedding


def test_precompiled_kernel_loads_without_jit(tiny, exported, monkeypatch):
    import cutlass.cute as cute

    from megabake.runtime.compile import load_precompiled

    source, directory, one, _ = exported
    monkeypatch.setattr(cute, "compile", lambda *a, **k: pytest.fail("load_precompiled must not compile"))
    tensors = _runtime_tensors(tiny.plan, generate(tiny.plan).arguments, source)
    loaded = load_precompiled(directory, module_source=source, tensors=tensors)
    assert loaded.reason is None and loaded.function is not None
    assert sorted(loaded.function.kernel_info) == one["metadata"]["kernels"]


def test_precompiled_kernel_that_does_not_fit_gives_a_reason(tiny, exported, tmp_path):
    from megabake.runtime.compile import METADATA_FILE, OBJECT_FILE, load_precompiled

    source, directory, _, _ = exported
    names = generate(tiny.plan).arguments
    assert "no precompiled kernel" in load_precompiled(tmp_path, module_source=source).reason
    assert "another module.py" in load_precompiled(directory, module_source=source + "# edited\n").reason
    tensors = _runtime_tensors(tiny.plan, names, source)
    tensors[names.index("logits")] = torch.zeros(3, 3)
    assert "argument logits is" in load_precompiled(directory, module_source=source, tensors=tensors).reason
    whole = torch.zeros(tiny.plan.batch + 4, dtype=torch.int32)  # position 16-byte aligned: another kernel
    tensors = _runtime_tensors(tiny.plan, names, source)
    tensors[names.index("position")] = whole[4:5]
    assert "'align': 16" in load_precompiled(directory, module_source=source, tensors=tensors).reason

    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    blob = bytearray((damaged / OBJECT_FILE).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (damaged / OBJECT_FILE).write_bytes(bytes(blob))
    assert "does not match the sha256" in load_precompiled(damaged, module_source=source).reason

    older = tmp_path / "older"
    shutil.copytree(directory, older)
    metadata = json.loads((older / METADATA_FILE).read_text())
    metadata["toolchain"]["cutlass_dsl"] = "4.7.0"
    (older / METADATA_FILE).write_text(json.dumps(metadata))
    loaded = load_precompiled(older, module_source=source)
    assert loaded.function is None and "built with CuTe DSL 4.7.0" in loaded.reason


def test_every_routine_of_the_bodies_can_be_copied_into_a_module():
    """Whatever a future plan calls, its copy imports (no forward reference that only the bodies' postponed
    annotations allowed) and binds no name twice."""
    from megabake.codegen import bodies_appendix
    from megabake.runtime.compile import load_module

    routines = parse_routines(bodies_source())
    every = [name for name in routines.text if not name.isupper()]
    appendix = bodies_appendix(every)
    check_top_level_names(appendix)
    module = load_module(appendix + "\n")
    assert all(getattr(module.bodies, name) is getattr(module, name) for name in every)


def test_bodies_package_reexports_every_routine_its_files_define():
    """Legacy module.py files call ``megabake.codegen.bodies.<name>``: the split files' public routines and
    constants all stay reachable there, and the files listed for copying are exactly the package's."""
    from pathlib import Path

    from megabake import codegen
    from megabake.codegen import bodies

    routines = parse_routines(bodies_source())
    public = [name for name in routines.text if not name.startswith("_")]
    assert public and all(hasattr(bodies, name) for name in public)
    files = {p.name for p in Path(bodies.__file__).parent.glob("*.py")} - {"__init__.py"}
    assert set(codegen.BODY_FILES) == files and codegen.BODY_FILES == bodies.BODY_FILES
