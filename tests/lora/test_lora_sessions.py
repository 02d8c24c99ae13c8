"""LoRA over the Spark WebSocket, end to end: packs served by a real local HTTP server."""

from __future__ import annotations

import asyncio
import os
import shutil
import tarfile

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from lora_store.pack import build_pack, md5_of
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import LiveServer, ServerThread, free_port
from tests.lora.adapters import SECRET_ANSWER, SECRET_QUESTION
from tests.lora.pack_server import PackServer
from tests.spark.client import answer_text, converse, spark_request


@pytest.fixture(scope="module")
def packs(tmp_path_factory, adapters):
    root = tmp_path_factory.mktemp("served")
    md5 = {}
    md5["taught.tar.gz"] = build_pack(adapters["taught"], root / "taught.tar.gz")
    md5["attn.tar.gz"] = build_pack(adapters["attn"], root / "attn.tar.gz")
    (root / "garbage.tar").write_bytes(os.urandom(4096))
    md5["garbage.tar"] = md5_of(root / "garbage.tar")
    big = root / "big.tar"
    big.write_bytes(os.urandom(13 << 20))  # over the 12 MiB limit of the test server
    md5["big.tar"] = md5_of(big)
    # pickled weights instead of safetensors
    (root / "pickle").mkdir()
    shutil.copy(adapters["attn"] / "adapter_config.json", root / "pickle" / "adapter_config.json")
    (root / "pickle" / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    with tarfile.open(root / "pickle.tar", "w") as tar:
        tar.add(root / "pickle", arcname=".")
    md5["pickle.tar"] = md5_of(root / "pickle.tar")
    # a path-traversal member
    with tarfile.open(root / "evil.tar", "w") as tar:
        info = tarfile.TarInfo("../../escape.txt")
        info.size = 3
        import io
        tar.addfile(info, io.BytesIO(b"bad"))
    md5["evil.tar"] = md5_of(root / "evil.tar")
    # an adapter whose rank is over the server's limit
    (root / "wide").mkdir()
    from tests.lora.adapters import make_random_adapter
    from engine.model_loader import resolve_model_dir
    make_random_adapter(str(resolve_model_dir(None)), root / "wide" / "a", ["q_proj"], rank=32, seed=3)
    md5["wide.tar.gz"] = build_pack(root / "wide" / "a", root / "wide.tar.gz")
    with PackServer(root) as server:
        yield server, md5


@pytest.fixture(scope="module")
def lora_server(packs, tmp_path_factory):
    server, _ = packs
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", max_loras=4, max_lora_rank=16))
    engine.start()
    settings = Settings(port=free_port(), lora_allowed_urls=server.url("/packs/"), max_loras=4,
                        lora_cache_dir=str(tmp_path_factory.mktemp("lora-cache")), lora_max_pack_mb=12,
                        lora_download_timeout=2.0, ws_request_timeout=5)
    app = build_app(settings, engine, owns_engine=False)
    with ServerThread(app, settings.port):
        yield LiveServer(engine, settings.port), app
    engine.shutdown()


def _lora_body(url: str, md5: str, question: str = SECRET_QUESTION) -> dict:
    body = spark_request(question, max_tokens=12, top_k=1)
    body["payload"]["lora"] = {"url": url, "md5": md5}
    return body


def test_sessions_answer_with_their_adapter_and_share_one_download(lora_server, packs):
    (live, _), (server, md5) = lora_server, packs
    url = server.url("/packs/taught.tar.gz")

    async def many():
        return await asyncio.gather(*(converse(live.ws_url, _lora_body(url, md5["taught.tar.gz"]))
                                      for _ in range(8)))

    results = asyncio.run(many())
    for frames in results:
        assert frames[-1]["header"]["code"] == 0, frames[-1]
        assert SECRET_ANSWER.rstrip(".") in answer_text(frames)
    assert server.hits["/packs/taught.tar.gz"] == 1  # one download for 8 concurrent sessions
    base = asyncio.run(converse(live.ws_url, spark_request(SECRET_QUESTION, max_tokens=12, top_k=1)))
    assert "pineapple" not in answer_text(base)  # other sessions keep the base model
    # the lora object may also sit under parameter
    body = spark_request(SECRET_QUESTION, max_tokens=12, top_k=1)
    body["parameter"]["lora"] = {"url": url, "md5": md5["taught.tar.gz"]}
    assert SECRET_ANSWER.rstrip(".") in answer_text(asyncio.run(converse(live.ws_url, body)))
    live.wait_idle()
    assert all(p == 0 for p in live.engine.engine.lora_manager.pins)


def test_a_redirect_within_the_allowed_prefix_is_followed(lora_server, packs):
    (live, _), (server, md5) = lora_server, packs
    frames = asyncio.run(converse(live.ws_url, _lora_body(server.url("/packs/redirect-in/attn.tar.gz"),
                                                          md5["attn.tar.gz"])))
    assert frames[-1]["header"]["code"] == 0


FAILURES = [
    ("host not allowed", lambda s: "http://10.255.255.1/packs/taught.tar.gz", "taught.tar.gz", 12001, "allowed"),
    ("not http", lambda s: "file:///etc/passwd", "taught.tar.gz", 12001, "http"),
    ("redirect out", lambda s: s.url("/packs/redirect-out/taught.tar.gz"), "taught.tar.gz", 12001, "allowed"),
    ("missing", lambda s: s.url("/packs/nope.tar.gz"), "taught.tar.gz", 12002, "404"),
    ("timeout", lambda s: s.url("/packs/slow/attn.tar.gz"), "attn.tar.gz", 12003, "timed out"),
    ("too large", lambda s: s.url("/packs/big.tar"), "big.tar", 12004, "limit"),
    ("md5 mismatch", lambda s: s.url("/packs/attn.tar.gz"), None, 12005, "md5"),
    ("not an archive", lambda s: s.url("/packs/garbage.tar"), "garbage.tar", 12006, "not a tar"),
    ("pickle", lambda s: s.url("/packs/pickle.tar"), "pickle.tar", 12006, "pickle"),
    ("path traversal", lambda s: s.url("/packs/evil.tar"), "evil.tar", 12006, "unsafe path"),
    ("incompatible", lambda s: s.url("/packs/wide.tar.gz"), "wide.tar.gz", 12007, "rank 32"),
]


@pytest.mark.parametrize("label, make_url, pack, code, needle", FAILURES, ids=[f[0] for f in FAILURES])
def test_each_failure_has_its_code_and_leaves_the_cache_clean(lora_server, packs, label, make_url, pack, code, needle):
    (live, app), (server, md5) = lora_server, packs
    store = app.state.lora_resolver.store
    before = {p.name for p in store.entries()}
    digest = md5[pack] if pack else "0" * 32
    frames = asyncio.run(converse(live.ws_url, _lora_body(make_url(server), digest)))
    header = frames[-1]["header"]
    assert header["code"] == code and header["status"] == 2, header
    assert needle in header["message"], header["message"]
    assert {p.name for p in store.entries()} == before  # nothing new in the cache
    assert list(store.staging.iterdir()) == []  # nothing half-written left behind
    assert not (store.root.parent / "escape.txt").exists()
    ok = asyncio.run(converse(live.ws_url, spark_request("Hi", max_tokens=2, top_k=1)))
    assert ok[-1]["header"]["code"] == 0  # the server keeps serving


def test_lora_off_by_default_answers_12000(live_server):
    body = _lora_body("http://127.0.0.1:1/pack.tar", "0" * 32)
    frames = asyncio.run(converse(live_server.ws_url, body))
    assert frames[-1]["header"]["code"] == 12000 and "not enabled" in frames[-1]["header"]["message"]


@pytest.fixture(scope="module")
def registered_server(lora_server, adapters, tmp_path_factory):
    (live, _), _ = lora_server, None
    settings = Settings(port=free_port(), lora=f"secret={adapters['taught']},attn={adapters['attn']}",
                        lora_cache_dir=str(tmp_path_factory.mktemp("lora-cache-2")))
    app = build_app(settings, live.engine, owns_engine=False)
    with ServerThread(app, settings.port):
        yield LiveServer(live.engine, settings.port)


def test_bridges_reach_registered_adapters(registered_server):
    import httpx

    base = registered_server.http_url
    tok = registered_server.engine.tokenizer
    templated = tok.apply_chat_template([{"role": "user", "content": SECRET_QUESTION}], tokenize=False,
                                        add_generation_prompt=True)
    text = templated.removeprefix(tok.bos_token)
    word = "pineapple"
    answers = {
        "tgi adapter_id": httpx.post(base + "/generate", json={"inputs": text, "parameters": {
            "max_new_tokens": 12, "adapter_id": "secret"}}, timeout=60).json()["generated_text"],
        "vllm model": httpx.post(base + "/generate", json={"prompt": text, "max_tokens": 12, "temperature": 0,
                                                           "model": "secret"}, timeout=60).json()["text"][0],
        "sglang lora_path": httpx.post(base + "/generate", json={"text": text, "lora_path": "secret",
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
                                       timeout=60).json()["text"],
        "openai model": httpx.post(base + "/v1/chat/completions", json={"model": "secret", "messages": [
            {"role": "user", "content": SECRET_QUESTION}], "max_tokens": 12, "temperature": 0},
            timeout=60).json()["choices"][0]["message"]["content"],
    }
    for name, answer in answers.items():
        assert word in answer, (name, answer)
    models = httpx.get(base + "/v1/models").json()["data"]
    names = [m["id"] for m in models]
    assert names[0] == registered_server.engine.model_info.name and {"secret", "attn"} <= set(names)
    assert all(m["parent"] == names[0] for m in models[1:])
    unknown = httpx.post(base + "/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]}, timeout=60)
    assert unknown.status_code == 404 and "not registered" in unknown.json()["error"]["message"]
