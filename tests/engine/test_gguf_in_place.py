"""A GGUF file served in place: no dequantized copy written (the packed projections kept at about the file's
size, none of them larger than it), a warm start that converts, packs and measures nothing, and a KV cache
that cannot fit refused at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine import llm_engine, loader
from engine.config import EngineConfig
from engine.gguf_file import GgufFile
from engine.kernels import CpuKernels, load_cpu_kernels
from engine.model_loader import embedded_gguf_path
from engine.models import weights
from engine.quant.formats import quantize_int4, quantize_int8
from engine.quant.packing import pack_quantized, unpack_quantized, unpack_rows
from tests.engine.helpers import QuietMachine

MAKE_MODEL = Path(__file__).resolve().parents[3] / "shared" / "peers" / "make_model.py"


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _start(model: str | None, **overrides) -> llm_engine.LLMEngine:
    return llm_engine.LLMEngine(EngineConfig(model=model, device="cpu", num_kv_blocks=16, kv_cache_prefault=False,
                                             **overrides))


@pytest.fixture(scope="module")
def cold_cache(tmp_path_factory):
    """The embedded model started once on an empty cache directory: (the directory, its files after)."""
    load_cpu_kernels()  # built (or read) from the usual cache first: the start below compiles nothing
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARK_CACHE_DIR", str(cache))
        mp.setattr(weights, "CpuContention", QuietMachine)  # the measurements kept, whatever the other worker does
        engine = _start(None)
        assert engine.model.kernels is not None or load_cpu_kernels() is None
        assert engine.packed_cache is None or engine.packed_cache.wait(60), "the packed weights never reached the disk"
        del engine
    return cache, _files(cache)


def _assert_no_copy(cache_files: dict[str, int], model: Path, share: float) -> None:
    """No file written larger than the model's, and at most ``share`` of its size in all (the packed
    projections where they are kept, the config, the tokenizer, content digests and kernel measurements: a
    tiny model's file is not much larger than its tokenizer)."""
    size = model.stat().st_size
    assert cache_files, "nothing cached at all"
    largest = max(cache_files, key=lambda name: cache_files[name])
    assert cache_files[largest] <= size, f"{largest}: {cache_files[largest]} bytes, the GGUF file {size}"
    assert sum(cache_files.values()) <= share * size, cache_files
    assert not [f for f in cache_files if f.endswith((".safetensors", ".bin"))]


def test_serving_the_embedded_gguf_writes_no_copy_of_it(cold_cache):
    _, files = cold_cache
    _assert_no_copy(files, embedded_gguf_path(), 1.1)
    packed = sum(size for name, size in files.items() if "/packed-v" in name)
    if load_cpu_kernels() is not None:
        assert 0.9 * embedded_gguf_path().stat().st_size <= packed <= embedded_gguf_path().stat().st_size, files
    assert not [name for name in files if "/.packed" in name], "a staging directory was left behind"


def test_without_the_packed_cache_nothing_of_the_weights_is_written(tmp_path, monkeypatch):
    load_cpu_kernels()
    monkeypatch.setenv("SPARK_CACHE_DIR", str(tmp_path))
    engine = _start(None, packed_weights_cache=False)
    assert engine.packed_cache is None
    _assert_no_copy(_files(tmp_path), embedded_gguf_path(), 0.1)


def test_a_warm_start_converts_parses_and_measures_nothing(cold_cache, monkeypatch):
    """The second start reads the kept config, tokenizer and kernel measurements, and the file's blocks in
    place: transformers' GGUF reader, the conversion and the kernel probes are never called."""
    cache, before = cold_cache
    monkeypatch.setenv("SPARK_CACHE_DIR", str(cache))

    def refuse(what):
        def call(*args, **kwargs):
            raise AssertionError(f"a warm start called {what}")
        return call

    import engine.gguf_metadata
    import engine.model_loader

    monkeypatch.setattr(gguf, "GGUFReader", refuse("gguf.GGUFReader (a full metadata parse)"))
    monkeypatch.setattr(engine.gguf_metadata, "write_metadata", refuse("the metadata conversion"))
    monkeypatch.setattr(engine.model_loader, "convert_gguf", refuse("the de-quantizing conversion"))
    for probe in ("choose_linear_path", "_stream_rate", "_batch_rate", "_kernel_row_limit", "_activation_times"):
        monkeypatch.setattr(weights, probe, refuse(f"the kernel probe {probe}"))
    monkeypatch.setattr(CpuKernels, "repack_gguf_blocks", refuse("the repack (the packed projections are kept)"))
    engine = _start(None)
    assert "measured at an earlier start" in engine.model.linears_summary or engine.model.kernels is None
    assert engine.model.kernels is None or engine.packed_cache.mapped_bytes > 0
    assert _files(cache) == before  # nothing new written


@pytest.mark.slow
def test_the_remeasure_flag_times_the_kernels_again(cold_cache, monkeypatch):
    cache, _ = cold_cache
    monkeypatch.setenv("SPARK_CACHE_DIR", str(cache))
    if load_cpu_kernels() is None:
        pytest.skip("no fused kernels here")
    engine = _start(None, remeasure_kernels=True)
    assert "measured at an earlier start" not in engine.model.linears_summary


@pytest.mark.slow
def test_serving_a_generated_gguf_writes_no_copy_of_it(tmp_path, monkeypatch):
    """A GGUF of another shape, written by the peers' make_model.py (Q4_1 projections, a Q8_0 embedding)."""
    if not MAKE_MODEL.exists():
        pytest.skip(f"{MAKE_MODEL} is not here")
    model = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, str(MAKE_MODEL), "--shape", "128,256,2,2,1", "--out", str(model)], check=True,
                   capture_output=True, timeout=300)
    load_cpu_kernels()
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPARK_CACHE_DIR", str(cache))
    engine = _start(str(model))
    assert engine.model.num_layers == 2 and engine.model.num_kv_heads == 1
    _assert_no_copy(_files(cache), model, 1.1)


def test_a_kv_cache_over_the_available_memory_is_refused_at_start():
    available = loader._available_memory_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    too_much = 1.5 * available / (1 << 30)
    with pytest.raises(ValueError, match="--kv-cache-space") as refused:
        llm_engine.LLMEngine(EngineConfig(device="cpu", kv_cache_space_gib=too_much, kv_cache_prefault=False))
    assert "available memory" in str(refused.value)


def test_the_weights_count_beside_the_kv_cache(monkeypatch):
    """A KV budget that fits alone but not beside the weights is refused, naming both."""
    monkeypatch.setattr(loader, "_available_memory_bytes", lambda: 3 << 30)
    loader._check_kv_fits(2 << 30, torch.device("cpu"), weight_bytes=512 << 20)
    with pytest.raises(ValueError, match=r"the weights .*--kv-cache-space"):
        loader._check_kv_fits(2 << 30, torch.device("cpu"), weight_bytes=2 << 30)


def test_the_file_reader_matches_gguf_s_own(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", 7)
    writer.add_array("test.words", ["a", "bc", "日本"])
    writer.add_array("test.numbers", [1.5, 2.5])
    weights = np.random.default_rng(0).standard_normal((4, 64), dtype=np.float32)
    writer.add_tensor("q8", gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = GgufFile(path), gguf.GGUFReader(path)
    assert ours.field("test.value") == 7 and ours.field("test.words") == ["a", "bc", "日本"]
    assert ours.field("test.numbers") == [1.5, 2.5] and ours.architecture == "llama"
    for t in theirs.tensors:
        assert np.array_equal(ours.raw(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))
    assert ours.tensors["q8"].shape == (4, 64) and ours.tensors["f32"].shape == (2, 3)
    assert np.allclose(ours.dequantized("q8"), weights, atol=0.02)
    assert np.array_equal(ours.dequantized("f32"), np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize("rows", [16, 40])
def test_a_packed_weight_unpacks_to_its_codes(rows):
    """Packed linears keep no plain copy of their codes: unpacking gives back exactly what was packed."""
    w = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    for q in (quantize_int4(w), quantize_int8(w)):
        back = unpack_quantized(pack_quantized(q), q.source)
        assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
        assert (back.mins is None) == (q.mins is None) and (q.mins is None or torch.equal(back.mins, q.mins))
        # a few rows (across tiles, repeated, out of order) unpacked alone: the same rows
        index = torch.tensor([rows - 1, 0, 17 % rows, 0, 5])
        assert torch.equal(unpack_rows(pack_quantized(q), q.source, index).dequantize(), q.rows(index))
