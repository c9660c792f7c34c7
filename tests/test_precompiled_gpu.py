"""GPU tests (H200): a precompiled (exported) megakernel loads without JIT and computes bit-identical logits.

Run on the H200: ``source .cute/activate.sh && python3 -m pytest -m gpu -q tests/test_precompiled_gpu.py``.
The cold-start numbers come from ``scripts/gpu_cold_load.py`` (a smoke run of it is the last test here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.compiler_fixtures import compile_preset

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def jit():
    """The tiny preset bound on the GPU through the runtime's JIT compile, direct launches."""
    from megabake.runtime import MegakernelDecoder, gpu_info

    compiled = compile_preset("tiny-llama", capacity=128, ctas=gpu_info().sm_count)
    decoder = MegakernelDecoder(compiled.plan, compiled.generated.source, compiled.model, device="cuda",
                                use_graph=False)
    yield compiled, decoder
    del decoder
    torch.cuda.empty_cache()


def _run(decoder, tokens, positions, caches) -> list[torch.Tensor]:
    """Steps from the same random KV cache; poisoned logits before each."""
    decoder.buffers["k_cache"].copy_(caches[0])
    decoder.buffers["v_cache"].copy_(caches[1])
    out = []
    for t, position in enumerate(positions):
        decoder.buffers["logits"].fill_(float("nan"))
        out.append(decoder.step(tokens[:, t], position).clone())
    torch.cuda.synchronize()
    return out + [decoder.buffers["k_cache"].clone(), decoder.buffers["v_cache"].clone()]


def _load_without_jit(directory, source, tensors, monkeypatch):
    import cutlass.cute as cute

    from megabake.runtime.compile import load_precompiled

    with monkeypatch.context() as patch:
        patch.setattr(cute, "compile", lambda *a, **k: pytest.fail("loading a precompiled kernel compiled"))
        return load_precompiled(directory, module_source=source, tensors=tensors)


def test_precompiled_kernel_matches_the_jit_kernel_bit_for_bit(jit, tmp_path, monkeypatch):
    from megabake.runtime.compile import export_kernel

    compiled, decoder = jit
    export_kernel(compiled.plan, decoder.module, tmp_path)
    loaded = _load_without_jit(tmp_path, compiled.generated.source, decoder._torch_args, monkeypatch)
    assert loaded.reason is None and loaded.function is not None
    # kernel names encode every argument's dtype, memory space, layout and alignment: same kernel signature
    assert sorted(loaded.function.kernel_info) == sorted(decoder._compiled.kernel_info)

    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(decoder.buffers[k].shape, generator=generator).to(decoder.buffers[k]) * 0.5
              for k in ("k_cache", "v_cache")]
    tokens = torch.randint(0, compiled.plan.dims.vocab, (compiled.plan.batch, 8), generator=generator)
    positions = [0, 5, 6, 31, 32, 64, 100, 127]
    first, again = _run(decoder, tokens, positions, caches), _run(decoder, tokens, positions, caches)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "the JIT kernel is not deterministic run to run"
    assert all(torch.isfinite(x).all() for x in first[:len(positions)])
    jit_kernel = decoder._compiled
    try:
        decoder._compiled = loaded.function
        precompiled = _run(decoder, tokens, positions, caches)
        decoder._use_graph, decoder._graph = True, None  # CUDA-graph capture and replay of the loaded kernel
        graphed = _run(decoder, tokens, positions, caches)
        assert decoder._graph is not None, f"graph capture failed: {getattr(decoder, 'graph_error', None)}"
    finally:
        decoder._compiled, decoder._use_graph, decoder._graph = jit_kernel, False, None
    for name, results in (("direct launches", precompiled), ("graph replay", graphed)):
        for step, (want, got) in enumerate(zip(first, results)):
            assert torch.equal(want, got), f"{name}: output {step} differs from the JIT kernel's"


def test_runtime_prefers_the_shipped_kernel_and_falls_back_to_jit_with_a_reason(tmp_path):
    """Bake ships megakernel.sm_90a.o and MegakernelDecoder._compile tries it first; a
    package loads without JIT, and a package without it, or from another toolchain, JIT-compiles and says why."""
    import shutil

    from megabake.baking import bake
    from megabake.package import read_package
    from megabake.runtime import MegakernelDecoder
    from megabake.runtime.compile import METADATA_FILE, OBJECT_FILE

    package = bake("tiny-llama", capacity=128, out=tmp_path / "packages", run_on_gpu=False).path
    assert (package / OBJECT_FILE).exists(), "bake must ship the precompiled kernel"
    assert OBJECT_FILE in read_package(package).files  # covered by the manifest digests
    decoder = MegakernelDecoder.from_package(package, device="cuda", use_graph=False)
    assert decoder.compile_path == "precompiled" and decoder.compile_fallback is None
    logits = decoder.step([3], 0).clone()

    bare = tmp_path / "bare"
    shutil.copytree(package, bare)
    (bare / OBJECT_FILE).unlink()
    (bare / METADATA_FILE).unlink()
    fallback = MegakernelDecoder.from_package(bare, device="cuda", use_graph=False)
    assert fallback.compile_path == "jit" and "no precompiled kernel" in fallback.compile_fallback
    assert torch.equal(fallback.step([3], 0), logits)

    older = tmp_path / "older"
    shutil.copytree(package, older)
    metadata = json.loads((older / METADATA_FILE).read_text())
    metadata["toolchain"]["cutlass_dsl"] = "0.0.1"
    (older / METADATA_FILE).write_text(json.dumps(metadata))
    other = MegakernelDecoder.from_package(older, device="cuda", use_graph=False)
    assert other.compile_path == "jit" and "CuTe DSL 0.0.1" in other.compile_fallback


def test_cold_load_script_measures_both_paths(tmp_path):
    """One repetition of scripts/gpu_cold_load.py: both paths reach a first token, with identical logits."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_cold_load.py"), "--out", str(tmp_path),
                           "--reps", "1", "--timeout", "600"], capture_output=True, text=True, timeout=1500,
                          cwd=REPO)
    print(done.stdout[-4000:], done.stderr[-4000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((tmp_path / "cold_load.json").read_text())["summary"]
    assert summary["jit"]["runs"] == summary["precompiled"]["runs"] == 1
    assert summary["logits_identical_across_paths"] is True
