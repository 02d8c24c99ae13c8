"""A fleet on one machine: two `spark-server serve` replicas, a real `smg` router (cache_aware) in front of
them, and a model-less `spark-server serve --engine-url` front end in front of that.

Everything goes through the front end: Spark WebSocket and HTTP, OpenAI (the openai client), TGI and
SGLang. Greedy answers must equal a single server's; a multi-turn conversation must keep landing on the
replica that holds its history; a stopped router means refusals with a code, and recovery after."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests import plain_http as http
from tests.conftest import free_port, wait_healthy
from tests.plain_http import TLS
from tests.spark.client import answer_text, converse, spark_request

MODEL = "SmolLM2-135M-Instruct"
KEY = "fleet-key"  # the front end runs with --api-key (its pack shelf needs one); replicas accept it unasked
AUTH = {"Authorization": f"Bearer {KEY}"}
SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg router is not installed (pip install smg)")


class Proc:
    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.args, self.log = args, log
        self.proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "SPARK_KV_CACHE_SPACE": "0.25", **(env or {})},
                                     start_new_session=True)

    def send(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.send(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _serve(port: int, log: Path, *extra: str) -> Proc:
    return Proc([sys.executable, "-m", "spark_server", "serve", "--port", str(port), "--log-level", "warning",
                 *extra], log)


def _router(port: int, workers: list[str], log: Path) -> Proc:
    return Proc([str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                 "--worker-urls", *workers, "--health-check-interval-secs", "1", "--log-level", "warn",
                 # a stopped router waits out the front end's idle keep-alive connections (5 s) up to its
                 # grace period; none of its requests is in flight when a test stops it
                 "--shutdown-grace-period-secs", "1",
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())], log)


def _wait_router(url: str, workers: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            listed = http.get(url + "/workers", timeout=2).json().get("workers", [])
            if len(listed) == workers and all(w.get("is_healthy", w.get("healthy", True)) for w in listed):
                return
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"router at {url} did not list {workers} healthy workers")


def start_replicas() -> dict:
    """Two replicas reading one shared adapter directory, starting (not yet ready)."""
    logs = Path(tempfile.mkdtemp(prefix="fleet-logs-"))
    shared = Path(tempfile.mkdtemp(prefix="lora-shared-"))  # the adapter directory every engine reads
    ports = {k: free_port() for k in ("a", "b")}
    # the replicas are reached only by the front end here: their adapter endpoints open without a key
    procs = {k: _serve(ports[k], logs / f"{k}.log", "--lora-shared-dir", str(shared),
                       "--allow-unauthenticated-admin") for k in ("a", "b")}
    return {"logs": logs, "shared": shared, "ports": ports, "procs": procs}


@pytest.fixture(scope="module")
def fleet(request, tmp_path_factory):
    from tests.fleet.conftest import EARLY_REPLICAS

    started = request.config.stash.get(EARLY_REPLICAS, None) or start_replicas()  # early, from collection
    logs, shared = started["logs"], started["shared"]
    ports = {**started["ports"], "router": free_port(), "front": free_port()}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    procs = started["procs"]
    try:
        wait_healthy(url["a"], verify=TLS)
        wait_healthy(url["b"], verify=TLS)
        procs["router"] = _router(ports["router"], [url["a"], url["b"]], logs / "router.log")
        _wait_router(url["router"], 2)
        procs["front"] = _serve(ports["front"], logs / "front.log", "--engine-url", url["router"], "--api-key", KEY,
                                "--lora-shared-dir", str(shared), "--lora-allowed-urls", url["front"] + "/lora/packs/",
                                "--lora-pack-dir", str(tmp_path_factory.mktemp("shelf")))
        wait_healthy(url["front"], verify=TLS)
        yield {"url": url, "procs": procs, "ports": ports, "logs": logs, "shared": shared}
    finally:
        if "router" in procs:
            procs["router"].stop(signal.SIGKILL)  # its keep-alive connections would hold the replicas' drain
        for p in procs.values():  # all at once: each drains on its own
            p.send()
        for p in procs.values():
            p.stop()
        shutil.rmtree(shared, ignore_errors=True)  # mkdtemp'd at collection, outside pytest's own tmp dirs
        shutil.rmtree(logs, ignore_errors=True)


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + f"/turing/v3/gpt?api_key={KEY}"


def spark_answer(base: str, question, lora: dict | None = None, **chat) -> tuple[str, list[dict]]:
    body = spark_request(question, top_k=1, **chat)
    if lora:
        body["payload"]["lora"] = lora
    frames = asyncio.run(converse(ws_url(base), body))
    return answer_text(frames), frames


def counter(base: str, name: str) -> float:
    text = http.get(base + "/metrics", timeout=5).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def prefix_hits(base: str) -> float:
    text = http.get(base + "/metrics", timeout=5).text
    line = next(ln for ln in text.splitlines() if ln.startswith("spark:prefix_cache_hits_total"))
    return float(line.rsplit(" ", 1)[1])


def test_every_protocol_through_the_front_end_equals_a_single_server(fleet):
    from openai import OpenAI

    front, single = fleet["url"]["front"], fleet["url"]["a"]
    question = "What is the capital of France?"
    got, frames = spark_answer(front, question, max_tokens=24)
    want, want_frames = spark_answer(single, question, max_tokens=24)
    assert got == want and "Paris" in got
    assert frames[-1]["payload"]["usage"]["text"] == want_frames[-1]["payload"]["usage"]["text"]

    r = http.post(front + "/turing/v3/func/gpt", json=spark_request(question, top_k=1, max_tokens=24), timeout=60,
                   headers=AUTH)
    assert r.status_code == 200 and r.json()["header"]["code"] == 0

    def chat(base: str) -> str:
        client = OpenAI(base_url=base + "/v1", api_key=KEY, http_client=httpx.Client(verify=TLS))
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                             max_tokens=16, temperature=0)
        return out.choices[0].message.content or ""

    def stream(base: str) -> str:
        client = OpenAI(base_url=base + "/v1", api_key=KEY, http_client=httpx.Client(verify=TLS))
        parts = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0,
                                          stream=True)
        return "".join(p.choices[0].text for p in parts if p.choices)

    assert chat(front) == chat(single)
    assert stream(front) == stream(single)
    tgi = {"inputs": "The sea is", "parameters": {"max_new_tokens": 12, "details": True}}
    ours, theirs = (http.post(b + "/generate", json=tgi, timeout=60, headers=AUTH).json() for b in (front, single))
    assert ours["generated_text"] == theirs["generated_text"]
    assert ours["details"]["generated_tokens"] == theirs["details"]["generated_tokens"]
    sgl = {"text": "One, two,", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    ours, theirs = (http.post(b + "/generate", json=sgl, timeout=60, headers=AUTH).json() for b in (front, single))
    assert ours["text"] == theirs["text"] and ours["meta_info"]["completion_tokens"] == 10


def test_a_conversation_keeps_landing_on_the_replica_with_its_history(fleet):
    url = fleet["url"]
    before = {k: prefix_hits(url[k]) for k in ("a", "b")}
    history = [{"role": "system", "content": "You are a helpful travel guide who answers briefly."}]
    for question in (["Name a city in Italy.", "What is it famous for?", "Name a dish from there.",
                                     "How is it cooked?", "What wine goes with it?", "Thanks, and goodbye."]):
        history.append({"role": "user", "content": question})
        answer, frames = spark_answer(url["front"], history, max_tokens=24)
        assert frames[-1]["header"]["code"] == 0, frames[-1]
        history.append({"role": "assistant", "content": answer})
    gained = {k: prefix_hits(url[k]) - before[k] for k in ("a", "b")}
    # turns 2-6 reuse the cached history, all on one replica
    assert max(gained.values()) >= 5 and min(gained.values()) == 0, gained


def test_the_replicas_speak_what_the_router_reads(fleet):
    a = fleet["url"]["a"]
    assert http.get(a + "/version").json()["version"]
    info = http.get(a + "/server_info").json()
    assert info["served_model_name"] == MODEL and info["context_length"] == 8192
    assert http.get(a + "/model_info").json()["is_generation"] is True
    metrics = http.get(a + "/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f"\n{name}{{" in metrics, name
    router_log = (fleet["logs"] / "router.log").read_text()
    assert "Could not identify backend" not in router_log and "returned 404" not in router_log, router_log[-2000:]


def test_a_stopped_router_means_a_coded_refusal_then_recovery(fleet):
    url, procs = fleet["url"], fleet["procs"]
    procs["router"].stop()
    try:
        started = time.monotonic()
        text, frames = spark_answer(url["front"], "Hello?", max_tokens=4)
        assert frames[-1]["header"]["code"] == 12102, frames[-1]
        assert time.monotonic() - started < 15  # refused, not hung
        r = http.post(url["front"] + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=30,
            headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        deadline = time.monotonic() + 10
        while http.get(url["front"] + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http.get(url["front"] + "/health").status_code == 503
    finally:
        procs["router"] = _router(fleet["ports"]["router"], [url["a"], url["b"]], fleet["logs"] / "router2.log")
        _wait_router(url["router"], 2)
    wait_healthy(url["front"], timeout=15, verify=TLS)
    text, frames = spark_answer(url["front"], "What is the capital of France?", max_tokens=12)
    assert frames[-1]["header"]["code"] == 0 and "Paris" in text


def random_adapter(out: Path, rank: int = 16, seed: int = 3) -> Path:
    """A rank-``rank`` LoRA adapter in PEFT's layout (adapter_config.json, adapter_model.safetensors) on
    q/v/o/down of every layer of the embedded model, random A and small random B: written directly from
    the model's config.json, which spares this test PEFT's import and a model load (~2-3 s); PEFT's own
    adapters are the LoRA tests' subject."""
    import torch
    from safetensors.torch import save_file

    from engine.model_loader import resolve_model_dir

    cfg = json.loads((resolve_model_dir(None) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q),
              "mlp.down_proj": (hidden, inter)}  # (out, in)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (out_f, in_f) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
            tensors[f"{key}.lora_B.weight"] = 0.05 * torch.randn(out_f, rank, generator=gen) / rank ** 0.5
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [m.split(".")[1] for m in shapes], "task_type": "CAUSAL_LM"}))
    return out


def test_a_pushed_pack_serves_sessions_across_the_fleet(fleet, tmp_path):
    from lora_store.pack import build_pack

    url = fleet["url"]
    adapter = random_adapter(tmp_path / "adapter")
    pack = tmp_path / "adapter.tar.gz"
    build_pack(adapter, pack)
    pushed = subprocess.run([sys.executable, "-m", "spark_server", "lora", "push", str(pack), "--server", url["front"],
                             "--api-key", KEY], capture_output=True, text=True, timeout=60)
    assert pushed.returncode == 0, pushed.stderr
    ref = json.loads(pushed.stdout)
    assert ref["url"] == f"{url['front']}/lora/packs/{ref['md5']}.tar.gz" and "KiB" in pushed.stderr  # progress bar
    assert http.get(ref["url"]).content == pack.read_bytes()
    # nobody takes the pack's fleet name on a replica first: lora-<md5> is taken only for that pack, as
    # the replica's store verified it (a directory of the shared folder is not one)
    squat = fleet["shared"] / "squat"
    shutil.copytree(adapter, squat, dirs_exist_ok=True)
    r = http.post(url["a"] + "/v1/load_lora_adapter",
                   json={"lora_name": f"lora-{ref['md5']}", "lora_path": str(squat)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text

    # a wrong md5 is refused by the front end before any replica sees the session
    served_before = {k: counter(url[k], "spark:prompt_tokens_total") for k in ("a", "b")}
    _, frames = spark_answer(url["front"], "Hi", lora={"url": ref["url"], "md5": "0" * 32}, max_tokens=4)
    assert frames[-1]["header"]["code"] == 12005, frames[-1]
    assert {k: counter(url[k], "spark:prompt_tokens_total") for k in ("a", "b")} == served_before

    question = "Describe the sea in one sentence."

    async def eight():
        body = spark_request(question, top_k=1, max_tokens=16)
        body["payload"]["lora"] = ref
        return await asyncio.gather(*(converse(ws_url(url["front"]), body) for _ in range(8)))

    results = asyncio.run(eight())
    assert all(r[-1]["header"]["code"] == 0 for r in results), [r[-1]["header"] for r in results]
    answers = {answer_text(r) for r in results}
    assert len(answers) == 1
    assert counter(url["front"], "spark:lora_downloads_total") == 1  # one download for all eight
    name = f"lora-{ref['md5']}"
    # loaded on each replica under lora-<md5>: the same answer as asking a replica for that model directly
    def ask(model: str) -> dict:
        return http.post(url["a"] + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0,
            "logprobs": True}, timeout=60).json()["choices"][0]

    direct, base = ask(name), ask(MODEL)
    assert direct["message"]["content"] == answers.pop()
    # the adapter is applied (a small random one need not flip a greedy token, but it moves every logprob)
    assert abs(direct["logprobs"]["content"][0]["logprob"] - base["logprobs"]["content"][0]["logprob"]) > 1e-4
    for k in ("a", "b"):
        again = http.post(url[k] + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/x"})
        assert again.status_code == 400 and "already been loaded" in again.text  # loaded once, by the front end
    assert max(counter(url[k], "spark:lora_loads_total") for k in ("a", "b")) <= 1


def test_a_client_leaving_ends_the_request_on_the_replica(fleet):
    import websockets

    url = fleet["url"]

    async def leave_after_three_frames():
        async with websockets.connect(ws_url(url["front"])) as ws:
            await ws.send(json.dumps(spark_request("Write a very long story about the sea.", max_tokens=2000,
                                                   temperature=0.8, top_k=6)))
            for _ in range(3):
                await ws.recv()

    asyncio.run(leave_after_three_frames())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum(counter(url[k], "vllm:num_requests_running") for k in ("a", "b")) == 0:
            break
        time.sleep(0.1)
    # the 2,000-token answer would run on for half a minute if the backend stream had stayed open
    assert sum(counter(url[k], "vllm:num_requests_running") for k in ("a", "b")) == 0


def running_on(url: dict) -> dict[str, float]:
    return {k: counter(url[k], "vllm:num_requests_running") for k in ("a", "b")}


@pytest.mark.last_in_module
def test_a_replica_killed_mid_stream(fleet):
    """Last in this module (the mark sees to it, whatever order the tests are named in): it leaves one
    replica dead. Sessions streaming on it end with an error frame
    (or finish); none hangs; sessions started afterwards are answered by the survivor; the front end's
    /health names the dead replica.

    The router is cache_aware, so where the 20 sessions land depends on what earlier tests left in its
    prefix tree: the victim is whichever replica is streaming the most of them once all are running."""
    url, procs = fleet["url"], fleet["procs"]
    victim = {}
    questions = [f"Write a long story about a {thing}." for thing in
                 ("lighthouse", "dragon", "river", "robot", "garden", "storm", "violin", "mountain", "train",
                  "island")]

    async def session(i: int) -> list[dict]:
        body = spark_request(questions[i % len(questions)] + f" ({i})", max_tokens=64, temperature=0.8, top_k=6)
        return await converse(ws_url(url["front"]), body)

    async def scenario() -> list[list[dict]]:
        tasks = [asyncio.create_task(session(i)) for i in range(20)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # everyone is streaming, or the first answer has ended (a sampled
            await asyncio.sleep(0.2)        # one may end early): kill while the others still stream
            running = await asyncio.to_thread(running_on, url)
            if sum(running.values()) >= 20 or (any(t.done() for t in tasks) and sum(running.values()) > 0):
                break
        victim["name"] = max(running, key=lambda name: running[name])
        assert running[victim["name"]] > 0, running
        procs[victim["name"]].send(signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    results = asyncio.run(scenario())
    codes = [frames[-1]["header"]["code"] for frames in results]
    assert all(frames[-1]["header"]["status"] == 2 for frames in results)  # every session was ended properly
    assert set(codes) <= {0, 11000} and 11000 in codes, codes  # some were on the killed replica
    # new sessions go to the surviving replica
    for i in range(4):
        _, frames = spark_answer(url["front"], f"What is {i} plus {i}?", max_tokens=8)
        assert frames[-1]["header"]["code"] == 0, frames[-1]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        health = http.get(url["front"] + "/health").json()
        if health["status"] == "degraded":
            break
        time.sleep(0.3)
    assert health["status"] == "degraded", health
    dead = [b for b in health["backends"] if b["url"] == url[victim["name"]]]
    assert dead and dead[0]["healthy"] is False, health
