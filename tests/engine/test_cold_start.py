"""A cold first start: the GGUF file parsed once, the kernels compiled while the model converts."""

from __future__ import annotations

import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import pytest

from engine.gguf_parse import shared_gguf_readers
from engine.kernels import UNITS, build_library


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", 7)
    writer.add_tensor("t", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _open(path):
    from gguf import GGUFReader  # as transformers does: the name looked up at each call

    return GGUFReader(path)


@pytest.fixture
def every_kind_gguf(tmp_path):
    """A GGUF file with a field of each value type transformers reads: numbers, strings (one not ASCII), and
    arrays of both."""
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.context_length", 4096)
    writer.add_int32("test.negative", -3)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("general.name", "tiny-模型")
    writer.add_array("tokenizer.ggml.tokens", ["<|endoftext|>", "Ġthe", "é", "模"])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, -3.0])
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.add_tensor("output.weight", np.ones((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_parse_per_file_within_the_block(tiny_gguf, monkeypatch):
    """Within the block every open of a path is one reader over one fast parse; gguf-py's own reader is made
    only when a tensor's data is asked for, and once."""
    from engine import gguf_parse

    parses, full_parses = [], []
    original, fast = gguf.GGUFReader, gguf_parse.GgufFile

    class Counting(original):
        def __init__(self, *args, **kwargs):
            full_parses.append(args[0])
            super().__init__(*args, **kwargs)

    class CountingFast(fast):
        def __init__(self, *args, **kwargs):
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    monkeypatch.setattr(gguf_parse, "GgufFile", CountingFast)
    with shared_gguf_readers():
        first = _open(tiny_gguf)
        with shared_gguf_readers():  # nested, as a cold engine start's conversion is
            assert _open(str(tiny_gguf)) is first
        assert _open(tiny_gguf.parent / ".." / tiny_gguf.parent.name / tiny_gguf.name) is first  # one real path
        assert int(first.fields["test.value"].parts[-1][0]) == 7
        assert [t.name for t in first.tensors] == ["t"]
        assert not full_parses  # names and metadata: the fast parse alone
        assert first.tensors[0].data.tolist() == list(range(8))
        assert first.tensors[0].tensor_type == gguf.GGMLQuantizationType.F32
    assert len(parses) == 1 and len(full_parses) == 1
    assert gguf.GGUFReader is Counting  # restored
    assert _open(tiny_gguf) is not first  # outside a block, each open parses
    with pytest.raises(RuntimeError), shared_gguf_readers():
        raise RuntimeError("a failed conversion")
    assert gguf.GGUFReader is Counting


def test_the_fast_reader_gives_transformers_the_values_gguf_py_gives(every_kind_gguf):
    """Every field, read the way transformers reads it (``_gguf_parse_value`` over ``parts`` at ``data``) and by
    ``contents()``, equals gguf-py's own reader's; so do the tensors' names."""
    from transformers.integrations.ggml import _gguf_parse_value

    real = gguf.GGUFReader(str(every_kind_gguf))
    with shared_gguf_readers():
        fast = _open(every_kind_gguf)

    def as_transformers_reads(field):
        return [_gguf_parse_value(field.parts[i], field.types) for i in field.data]

    assert list(fast.fields) == list(real.fields)
    for name, field in real.fields.items():
        assert fast.fields[name].types == field.types, name
        assert as_transformers_reads(fast.fields[name]) == as_transformers_reads(field), name
        assert fast.fields[name].contents() == field.contents(), name
    assert as_transformers_reads(fast.fields["general.name"]) == ["tiny-模型"]
    assert [t.name for t in fast.tensors] == [t.name for t in real.tensors]


def test_the_metadata_is_read_once_per_path_within_the_block(every_kind_gguf, monkeypatch):
    """transformers reads a GGUF file's metadata once for the tokenizer and twice for the config; within the
    block the first read answers the others, each caller getting its own copy, and the function is restored
    after in every module that holds it."""
    import transformers.configuration_utils as configuration_utils
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    reads = []
    original = gguf_utils.load_gguf_checkpoint

    def counting(path, return_tensors=False, model_to_load=None):
        reads.append(return_tensors)
        return {"config": {"model_type": "llama", "path": str(path)}}

    for module in (gguf_utils, configuration_utils):
        monkeypatch.setattr(module, "load_gguf_checkpoint", counting)
    with shared_gguf_readers():
        first = configuration_utils.load_gguf_checkpoint(str(every_kind_gguf), return_tensors=False)
        first["config"]["model_type"] = "changed by its caller"
        second = gguf_utils.load_gguf_checkpoint(every_kind_gguf)
        assert second["config"]["model_type"] == "llama"
        gguf_utils.load_gguf_checkpoint(every_kind_gguf, return_tensors=True)  # the weights: never shared
    assert reads == [False, True]
    assert gguf_utils.load_gguf_checkpoint is counting and configuration_utils.load_gguf_checkpoint is counting
    assert original is not counting


def test_one_tensor_name_map_per_architecture_within_the_block(monkeypatch):
    """transformers asks gguf for the tensor name map once per submodule while converting; within the block
    each (architecture, layer count) is built once, and the function is restored after."""
    built = []
    original = gguf.get_tensor_name_map

    def counting(arch, n_blocks):
        built.append((arch, n_blocks))
        return original(arch, n_blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counting)
    llama = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
    with shared_gguf_readers():
        first = gguf.get_tensor_name_map(llama, 30)
        assert all(gguf.get_tensor_name_map(llama, 30) is first for _ in range(5))
        assert gguf.get_tensor_name_map(llama, 2) is not first
        assert first.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert built == [(llama, 30), (llama, 2)]
    assert gguf.get_tensor_name_map is counting  # restored


def test_starts_on_a_cold_cache_compile_the_kernels_once(tmp_path):
    """Three builds of one library at once (a fleet's replicas on a cold cache): one build, the others wait
    for its file. One build compiles each unit, side by side, then links them. The compiler here is a
    stand-in that takes a second and writes down when each of its runs starts and ends."""
    runs = tmp_path / "runs"
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n"
                  'if [ "$1" = "--version" ]; then echo stand-in 1.0; exit 0; fi\n'
                  'kind=link; for a in "$@"; do if [ "$a" = "-c" ]; then kind=compile; fi; done\n'
                  f"echo start-$kind >> {runs}\n"
                  "sleep 1\n"
                  f"echo end-$kind >> {runs}\n"
                  'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then : > "$2"; fi; shift; done\n')
    cc.chmod(0o755)
    with ThreadPoolExecutor(3) as pool:
        built = list(pool.map(lambda _: build_library(str(cc), "-march=x86-64-v2", tmp_path / "kernels"), range(3)))
    assert len(set(built)) == 1 and built[0].exists()
    units = len(UNITS)
    assert units >= 2
    events = runs.read_text().split()
    # each unit compiled once, up to one compiler per core at a time, all before the one link
    assert events[-2:] == ["start-link", "end-link"]
    assert sorted(events[:-2]) == sorted(["start-compile", "end-compile"] * units)
    side_by_side = peak = 0
    for event in events[:-2]:
        side_by_side += 1 if event == "start-compile" else -1
        peak = max(peak, side_by_side)
    assert peak == min(units, max(2, os.cpu_count() or 1))


def test_a_failing_compile_says_why(tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n"
                  'if [ "$1" = "--version" ]; then echo stand-in 1.0; exit 0; fi\n'
                  'echo "cpu_linear.c:1: error: no such instruction" >&2; exit 1\n')
    cc.chmod(0o755)
    with pytest.raises(RuntimeError, match="no such instruction"):
        build_library(str(cc), "-march=x86-64-v2", tmp_path / "kernels")
    assert not list((tmp_path / "kernels").glob("*.so"))


def _gguf_string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _raw_gguf(path, fields):
    """A GGUF v3 file of metadata alone, written byte by byte: ``fields`` is [(key, type code, value bytes)]."""
    body = b"".join(_gguf_string(key.encode()) + struct.pack("<I", kind) + value for key, kind, value in fields)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + body)
    return path


def test_a_string_that_is_not_utf8_is_refused_as_gguf_py_refuses_it(tmp_path):
    """A damaged string is not rewritten into the kept metadata: transformers' read of it fails through the
    stand-in as through gguf-py's reader, and so does ``contents()``."""
    from transformers.integrations.ggml import _gguf_parse_value

    path = _raw_gguf(tmp_path / "bad.gguf", [("general.name", 8, _gguf_string(b"bad\xff-name"))])
    real = gguf.GGUFReader(str(path))
    with shared_gguf_readers():
        fast = _open(path)
    for reader in (real, fast):
        field = reader.fields["general.name"]
        with pytest.raises(UnicodeDecodeError):
            [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
    with pytest.raises(UnicodeDecodeError):
        fast.fields["general.name"].contents()


def test_metadata_reads_are_shared_from_a_nested_block_when_transformers_loads_inside(tmp_path, monkeypatch):
    """An engine start enters the block before it first imports transformers; the conversion's nested block
    then installs the shared reads, and the outermost exit removes them."""

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    name = "transformers.modeling_gguf_pytorch_utils"
    monkeypatch.delitem(sys.modules, name)
    with shared_gguf_readers():
        assert gguf_utils.load_gguf_checkpoint is original  # not loaded at the block's start
        sys.modules[name] = gguf_utils  # "imported" now
        with shared_gguf_readers():
            assert gguf_utils.load_gguf_checkpoint is not original
        assert gguf_utils.load_gguf_checkpoint is not original  # until the outermost exit
    assert gguf_utils.load_gguf_checkpoint is original
