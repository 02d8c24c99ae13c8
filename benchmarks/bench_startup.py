"""Start-up: `spark-server serve` until /health answers 200.

Warm: the model already converted and the kernels built in the cache. Bar: under 10 s.
Cold: a fresh, empty cache directory, as a new user's very first start (the GGUF conversion and the
kernels' compile, side by side). Bar: under 60 s.

    python -m benchmarks.bench_startup
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks.common import print_table, save, verdict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(cache_dir: str | None = None) -> float:
    port = _free_port()
    env = dict(os.environ, **({"SPARK_CACHE_DIR": cache_dir} if cache_dir else {}))
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    try:
        while time.perf_counter() - started < 120:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("server exited during start-up")
            time.sleep(0.05)
        raise RuntimeError("server not ready in 120 s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="spark-cold-cache-") as empty:
        cold = start_once(empty)
    first = start_once()  # the usual cache: converts the model if it is empty there too
    warm = [start_once() for _ in range(3)]
    print_table("Start-up: `spark-server serve` until /health is 200",
                ["cold start s (empty cache)", "first start s (usual cache)", "warm start s (best of 3)",
                 "warm start s (worst of 3)"],
                [[cold, first, min(warm), max(warm)]])
    save("startup", {"cold_s": cold, "first_s": first, "warm_s": warm})
    return verdict({"warm start under 10 s": max(warm) < 10, "cold start under 60 s": cold < 60})


if __name__ == "__main__":
    sys.exit(main())
