"""Slow: the front end over a real vLLM CPU server (vLLM's CPU build in its own venv, as
`../shared/peers/setup.sh` installs it under ~/.cache/spark-peers/vllm), with --enable-lora.

A Spark session naming a LoRA pack answers through vLLM, and vLLM lists the adapter as `lora-<md5>`.
vLLM takes ~2 minutes to start on two cores."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from engine.model_loader import resolve_model_dir
from lora_store.pack import build_pack
from tests.conftest import free_port, wait_healthy
from tests.fleet.test_fleet import Proc, _serve
from tests.lora.adapters import make_random_adapter
from tests.lora.pack_server import PackServer
from tests.spark.client import answer_text, converse, spark_request

VLLM_PYTHON = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "spark-peers")) / "vllm" / "bin" / "python"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU build is not installed "
                                 "(bash ../shared/peers/setup.sh)")]


def test_a_spark_session_with_a_pack_over_vllm(tmp_path):
    shared = tmp_path / "shared"
    packs = tmp_path / "packs"
    shared.mkdir()
    packs.mkdir()
    adapter = make_random_adapter(str(resolve_model_dir(None)), tmp_path / "adapter",
                                  ["q_proj", "v_proj", "o_proj", "down_proj"], rank=16, seed=3)
    md5 = build_pack(adapter, packs / "a.tar.gz")
    vllm_port, front_port = free_port(), free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    vllm = Proc([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_dir(None)),
                 "--served-model-name", "SmolLM2-135M-Instruct", "--host", "127.0.0.1", "--port", str(vllm_port),
                 "--max-model-len", "2048", "--dtype", "bfloat16", "--enable-lora", "--max-lora-rank", "16"],
                tmp_path / "vllm.log", env)
    front = None
    try:
        with PackServer(packs) as server:
            wait_healthy(f"http://127.0.0.1:{vllm_port}", timeout=420)
            front = _serve(front_port, tmp_path / "front.log", "--engine-url", f"http://127.0.0.1:{vllm_port}",
                           "--lora-shared-dir", str(shared), "--lora-allowed-urls", server.url("/packs/"))
            wait_healthy(f"http://127.0.0.1:{front_port}", timeout=120)
            body = spark_request("Describe the sea in one sentence.", top_k=1, max_tokens=16)
            body["payload"]["lora"] = {"url": server.url("/packs/a.tar.gz"), "md5": md5}
            frames = asyncio.run(converse(f"ws://127.0.0.1:{front_port}/turing/v3/gpt", body))
            assert frames[-1]["header"]["code"] == 0, frames[-1]
            assert answer_text(frames).strip()
        models = httpx.get(f"http://127.0.0.1:{vllm_port}/v1/models").json()["data"]
        assert f"lora-{md5}" in {m["id"] for m in models}, models
    finally:
        for p in (front, vllm):
            if p is not None:
                p.stop(signal.SIGTERM)
