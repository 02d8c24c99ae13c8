"""Warm start: `spark-server serve` with the model already converted in the cache, until /health
answers 200. Bar: under 10 s.

    python -m benchmarks.bench_startup
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

from benchmarks.common import print_table, save, verdict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once() -> float:
    port = _free_port()
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ))
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
    first = start_once()  # converts the model if the cache is empty
    warm = [start_once() for _ in range(3)]
    print_table("Start-up: `spark-server serve` until /health is 200",
                ["first start s (may convert)", "warm start s (best of 3)", "warm start s (worst of 3)"],
                [[first, min(warm), max(warm)]])
    save("startup", {"first_s": first, "warm_s": warm})
    return verdict({"warm start under 10 s": max(warm) < 10})


if __name__ == "__main__":
    sys.exit(main())
