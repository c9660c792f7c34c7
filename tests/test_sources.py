"""megabake.sources: GGUF loads parse the file's metadata once (``shared_gguf_readers``)."""

from __future__ import annotations

import pytest


def _write_gguf(path, architecture: str = "llama") -> None:
    """A GGUF file with a header, an architecture and a small vocabulary array, no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(64)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_one_gguf_reader_per_file_inside_the_block_and_a_fresh_one_outside(tmp_path):
    import gguf

    from megabake.sources import gguf_architecture, shared_gguf_readers

    path, other = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write_gguf(path)
    _write_gguf(other, "qwen2")
    original = gguf.GGUFReader
    with shared_gguf_readers():
        from gguf import GGUFReader  # as transformers imports it, at each call

        first = gguf.GGUFReader(path)
        assert GGUFReader(str(path)) is first
        assert GGUFReader(other) is not first
        assert gguf_architecture(path) == "llama" and gguf_architecture(other) == "qwen2"
        assert len(first.fields["tokenizer.ggml.tokens"].data) == 64
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_the_reader_name_is_restored_when_the_load_fails(tmp_path):
    import gguf

    from megabake.sources import shared_gguf_readers

    original = gguf.GGUFReader
    with pytest.raises(RuntimeError, match="load failed"), shared_gguf_readers():
        raise RuntimeError("load failed")
    assert gguf.GGUFReader is original


def test_one_tensor_name_map_per_architecture_and_depth_inside_the_block():
    """transformers rebuilds gguf's tensor-name map once per module of the model (~11 ms each): inside the block
    one map per (architecture, layers) is shared; outside, every call builds a new one again."""
    import gguf

    from megabake.sources import shared_gguf_readers

    llama = next(arch for arch, name in gguf.MODEL_ARCH_NAMES.items() if name == "llama")
    qwen2 = next(arch for arch, name in gguf.MODEL_ARCH_NAMES.items() if name == "qwen2")
    original = gguf.get_tensor_name_map
    with shared_gguf_readers():
        from gguf import get_tensor_name_map  # as transformers imports it, at each call

        first = get_tensor_name_map(llama, 4)
        assert gguf.get_tensor_name_map(llama, 4) is first
        assert get_tensor_name_map(llama, 6) is not first and get_tensor_name_map(qwen2, 4) is not first
        assert first.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert gguf.get_tensor_name_map is original
    assert gguf.get_tensor_name_map(llama, 4) is not gguf.get_tensor_name_map(llama, 4)
