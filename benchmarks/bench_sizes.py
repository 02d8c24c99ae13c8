"""Start, disk and memory at a model's real size, against llama.cpp's llama-server on the same GGUF.

For each server, one at a time, on the same file and the same context size (KV cache for ``--context``
tokens in both):

- cold start: this project with an empty cache directory (what a first start writes is measured: the
  bytes under that directory afterwards), llama-server's only start;
- warm start: the project again on the cache the cold start left;
- peak RSS (the server's whole process tree, sampled every 50 ms) from launch through a short load of
  ``--requests`` streamed answers at ``--concurrency``.

Bars (the sizes acceptance): warm start <= 2x llama.cpp's + 3 s, cold start <= 3x that; disk written
<= 1.1x the GGUF's size; peak RSS <= 1.25x llama.cpp's. Speed is compare.py's job; this is the footprint.

    python -m benchmarks.bench_sizes --gguf ~/.cache/spark-peers/models/smollm2-1.7b-random.Q4_1.gguf

llama-server comes from ``../shared/peers/setup.sh`` (``~/.cache/spark-peers/llama-server``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.common import print_table, save, verdict

PEERS = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "spark-peers"))
BLOCK_TOKENS = 16  # the engine's KV block size: --num-kv-blocks is the context over this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeakRss:
    """The largest resident set of a process and all its children, sampled on a thread."""

    def __init__(self, pid: int, every_s: float = 0.05):
        self.peak = 0
        self._root = psutil.Process(pid)
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self._root, *self._root.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            self._stop.wait(self._every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _wait_ready(port: int, proc: subprocess.Popen, limit_s: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the server was not ready in {limit_s:.0f} s")


def _load(port: int, requests: int, concurrency: int, max_tokens: int) -> None:
    """``requests`` streamed chat answers, ``concurrency`` at a time, sampled (as chat clients send)."""
    base = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]  # the name each server serves
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea. " * 20}],
            "max_tokens": max_tokens, "temperature": 0.7, "stream": True}
    left = list(range(requests))
    failures: list[BaseException] = []

    def worker() -> None:
        try:
            while left:
                try:
                    left.pop()
                except IndexError:
                    return
                # a connection per answer: llama-server may close a kept-alive one after a stream
                with httpx.Client(timeout=600) as client, \
                        client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    for _ in r.iter_lines():
                        pass
        except BaseException as exc:  # a figure measured without its load would be no figure: fail the run
            failures.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"the load failed: {failures[0]!r}") from failures[0]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _read_through(path: Path) -> None:
    """Every byte of the file read once, so that each server starts with it in the page cache: a machine
    that reclaims idle pages (DAMON, memory pressure) would otherwise time the disk for whichever server
    comes after a pause."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def run_server(cmd: list[str], env: dict[str, str], args) -> dict[str, float]:
    _read_through(args.gguf.expanduser())
    port = _free_port()
    cmd = [part.replace("{port}", str(port)) for part in cmd]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    rss = PeakRss(proc.pid)
    try:
        ready = _wait_ready(port, proc, 900)
        _load(port, args.requests, args.concurrency, args.max_tokens)
        return {"start_s": round(ready, 2), "peak_rss_gib": round(rss.stop() / (1 << 30), 3),
                "wall_s": round(time.perf_counter() - started, 1)}
    finally:
        rss.stop()
        _stop(proc)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, type=Path)
    parser.add_argument("--context", type=int, default=4096, help="KV cache tokens, the same for both servers")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--project-args", default="", help="extra flags for spark-server serve")
    args = parser.parse_args(argv)
    gguf = args.gguf.expanduser().resolve()
    threads = str(os.cpu_count())
    project = [sys.executable, "-m", "spark_server", "serve", "--port", "{port}", "--log-level", "warning",
               "--model", str(gguf), "--num-kv-blocks", str(args.context // BLOCK_TOKENS), *args.project_args.split()]
    llama_bin = PEERS / "llama-server" / "bin"
    llama = [str(llama_bin / "llama-server"), "-m", str(gguf), "-t", threads, "-tb", threads, "-c", str(args.context),
             "-np", str(args.concurrency), "--host", "127.0.0.1", "--port", "{port}"]

    cache = Path(tempfile.mkdtemp(prefix="bench-sizes-cache-"))
    try:
        env = dict(os.environ, SPARK_CACHE_DIR=str(cache))
        cold = run_server(project, env, args)
        written = _tree_bytes(cache)
        warm = run_server(project, env, args)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    peer = run_server(llama, dict(os.environ, LD_LIBRARY_PATH=str(llama_bin)), args)

    size = gguf.stat().st_size
    print_table(f"{gguf.name} ({size / (1 << 30):.2f} GiB), KV for {args.context} tokens, "
                f"{args.requests} answers at c={args.concurrency}",
                ["", "start s", "peak RSS GiB", "disk written GiB"],
                [["project, cold", cold["start_s"], cold["peak_rss_gib"], round(written / (1 << 30), 3)],
                 ["project, warm", warm["start_s"], warm["peak_rss_gib"], "-"],
                 ["llama-server", peer["start_s"], peer["peak_rss_gib"], 0]])
    limit = 2 * peer["start_s"] + 3
    checks = {
        f"warm start {warm['start_s']} s <= 2x llama.cpp + 3 s ({limit:.1f})": warm["start_s"] <= limit,
        f"cold start {cold['start_s']} s <= 3x that ({3 * limit:.1f})": cold["start_s"] <= 3 * limit,
        f"disk written {written / size:.2f}x the GGUF <= 1.1x": written <= 1.1 * size,
        f"peak RSS {warm['peak_rss_gib'] / peer['peak_rss_gib']:.2f}x llama.cpp's <= 1.25x":
            warm["peak_rss_gib"] <= 1.25 * peer["peak_rss_gib"],
    }
    save("sizes", {"gguf": str(gguf), "gguf_bytes": size, "context": args.context, "cold": cold, "warm": warm,
                   "written_bytes": written, "llama.cpp": peer, "checks": checks})
    return verdict(checks)


if __name__ == "__main__":
    sys.exit(main())
