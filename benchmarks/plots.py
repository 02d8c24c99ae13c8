"""PNG pictures of serving benchmarks: throughput against concurrency, and TTFT / TPOT percentiles.

Two inputs are understood:
- `../shared/peers/compare.py` output (a list of servers, each with per-concurrency figures), so the
  project is drawn beside llama.cpp and vLLM from the same run;
- this project's own `bench_online` results (`{"results": {concurrency: {...}}}`).

    python -m benchmarks.plots benchmarks/results/peers-compare-*.json   # writes <name>-*.png beside it
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    """matplotlib's pyplot drawing to files only (no display on servers or in CI), imported when a picture is
    drawn: reading the figures needs none of it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class ServerSeries:
    """One server's figures per concurrency; latencies in milliseconds."""

    name: str
    concurrency: list[int] = field(default_factory=list)
    tok_s: list[float] = field(default_factory=list)
    latency_ms: dict[str, list[float]] = field(default_factory=dict)  # "TTFT p50" -> one value per concurrency


_COMPARE_KEYS = {"TTFT p50": "ttft_ms_p50", "TTFT p99": "ttft_ms_p99", "TPOT p50": "tpot_ms_p50",
                 "TPOT p99": "tpot_ms_p99"}
_ONLINE_KEYS = {"TTFT p50": "ttft_p50", "TTFT p99": "ttft_p99", "TPOT p50": "tpot_p50", "TPOT p99": "tpot_p99"}


def _levels(entry: dict[str, Any]) -> list[int]:
    return sorted(int(k) for k in entry if str(k).isdigit())


def series_from_compare(data: list[dict[str, Any]]) -> list[ServerSeries]:
    """compare.py writes one object per server with its figures under each concurrency as a key."""
    out = []
    for entry in data:
        s = ServerSeries(entry.get("tag") or entry["server"])
        for c in _levels(entry):
            row = entry[str(c)]
            if not row.get("completed"):
                continue
            s.concurrency.append(c)
            s.tok_s.append(float(row["output_tok_s"]))
            for label, key in _COMPARE_KEYS.items():
                s.latency_ms.setdefault(label, []).append(float(row.get(key, float("nan"))))
        out.append(s)
    return out


def series_from_online(data: dict[str, Any], name: str = "this project") -> list[ServerSeries]:
    """bench_online keeps seconds; the pictures show milliseconds like compare.py."""
    s = ServerSeries(name)
    results = data["results"]
    for c in _levels(results):
        row = results[str(c)]
        s.concurrency.append(c)
        s.tok_s.append(float(row["tok_s"]))
        for label, key in _ONLINE_KEYS.items():
            s.latency_ms.setdefault(label, []).append(float(row[key]) * 1e3)
    return [s]


def load_series(path: Path) -> list[ServerSeries]:
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return series_from_compare(data)
    if isinstance(data, dict) and "results" in data:
        return series_from_online(data)
    raise ValueError(f"{path}: neither compare.py output nor bench_online results")


def plot_throughput(series: list[ServerSeries], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for s in series:
        ax.plot(s.concurrency, s.tok_s, marker="o", label=s.name)
    ax.set_xscale("log", base=2)
    levels = sorted({c for s in series for c in s.concurrency})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_latency(series: list[ServerSeries], path: Path, title: str) -> Path:
    plt = _pyplot()
    """TTFT and TPOT side by side; grouped bars per concurrency, one bar per (server, percentile)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=100)
    levels = sorted({c for s in series for c in s.concurrency})
    for ax, metric in zip(axes, ("TTFT", "TPOT")):
        bars = [(k, s, p) for k, s in enumerate(series) for p in ("p50", "p99") if f"{metric} {p}" in s.latency_ms]
        width = 0.8 / max(len(bars), 1)
        for i, (k, s, p) in enumerate(bars):
            values = dict(zip(s.concurrency, s.latency_ms[f"{metric} {p}"]))
            xs = [j + (i - (len(bars) - 1) / 2) * width for j, c in enumerate(levels) if c in values]
            # one colour per server; its p99 bar is the lighter, hatched one
            ax.bar(xs, [values[c] for c in levels if c in values], width, label=f"{s.name} {p}",
                   color=f"C{k}", alpha=1.0 if p == "p50" else 0.45, hatch=None if p == "p50" else "//")
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(f"{metric} ms")
        ax.set_yscale("log")
        ax.set_title(f"{metric} percentiles", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_file(path: Path, title: str | None = None) -> list[Path]:
    """Both pictures for one results file, written beside it as <stem>-throughput.png / -latency.png."""
    series = load_series(path)
    title = title or path.stem
    return [plot_throughput(series, path.with_name(f"{path.stem}-throughput.png"), title),
            plot_latency(series, path.with_name(f"{path.stem}-latency.png"), title)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="compare.py JSON or benchmarks/results/online.json")
    parser.add_argument("--title", help="picture title (default: the file's name)")
    args = parser.parse_args()
    for path in args.results:
        for written in plot_file(path, args.title):
            print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
