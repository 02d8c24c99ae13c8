"""The benchmark pictures: compare.py output and bench_online results become PNG plots beside them."""

from __future__ import annotations

import json
import struct

import pytest

from benchmarks.plots import load_series, plot_file


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _compare_entry(name: str, rates: dict[int, float]) -> dict:
    entry = {"server": name, "cmd": "x", "startup_s": 1.0}
    for c, rate in rates.items():
        entry[str(c)] = {"concurrency": c, "completed": 4, "output_tok_s": rate, "ttft_ms_p50": 100.0 * c,
                         "ttft_ms_p99": 150.0 * c, "tpot_ms_p50": 10.0 + c, "tpot_ms_p99": 12.0 + c}
    return entry


def test_compare_output_gives_one_series_per_server(tmp_path):
    path = tmp_path / "peers.json"
    path.write_text(json.dumps([_compare_entry("project", {1: 60.0, 8: 200.0, 32: 250.0}),
                                _compare_entry("llama.cpp", {1: 70.0, 8: 80.0, 32: 90.0})]))
    series = load_series(path)
    assert [s.name for s in series] == ["project", "llama.cpp"]
    assert series[0].concurrency == [1, 8, 32] and series[0].tok_s == [60.0, 200.0, 250.0]
    assert series[1].latency_ms["TTFT p99"] == [150.0, 1200.0, 4800.0]
    written = plot_file(path, "test")
    assert [p.name for p in written] == ["peers-throughput.png", "peers-latency.png"]
    for p in written:
        width, height = _png_size(p.read_bytes())
        assert width >= 600 and height >= 400


def test_online_results_are_drawn_in_milliseconds(tmp_path):
    path = tmp_path / "online.json"
    path.write_text(json.dumps({"results": {
        str(c): {"tok_s": 10.0 * c, "ttft_p50": 0.1, "ttft_p99": 0.2, "tpot_p50": 0.02, "tpot_p99": 0.03, "tokens": 5}
        for c in (1, 8, 32)}}))
    (series,) = load_series(path)
    assert series.latency_ms["TPOT p50"] == pytest.approx([20.0] * 3)
    assert all(p.exists() for p in plot_file(path))


def test_other_json_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        load_series(path)
