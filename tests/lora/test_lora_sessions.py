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
from tests.lora.adapters import SECRET_ANSWER, SECRET_QUESTION, write_tar
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
    from engine.model_loader import resolve_model_dir
    from tests.lora.adapters import make_random_adapter
    make_random_adapter(str(resolve_model_dir(None)), root / "wide" / "a", ["q_proj"], rank=32, seed=3)
    md5["wide.tar.gz"] = build_pack(root / "wide" / "a", root / "wide.tar.gz")
    md5.update(_hostile_packs(root, adapters["attn"]))
    with PackServer(root) as server:
        yield server, md5


def _variant(root, source, name: str, config=None, tensors=None) -> str:
    """A pack of ``source`` with its config replaced by ``config`` (any JSON text) or its tensors
    changed by ``tensors(dict) -> dict``; returns its md5."""
    import json

    from safetensors.torch import load_file, save_file

    work = root / f"{name}.d"
    shutil.copytree(source, work)
    if config is not None:
        (work / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        weights = work / "adapter_model.safetensors"
        save_file(tensors(load_file(str(weights))), str(weights))
    return build_pack(work, root / name)


def _hostile_packs(root, source) -> dict[str, str]:
    import gzip
    import io
    import json

    import torch

    cfg = json.loads((source / "adapter_config.json").read_text())
    md5 = {}
    for name, field, value in [("r-nan", "r", float("nan")), ("r-null", "r", None), ("r-string", "r", "8"),
                               ("r-list", "r", [8]), ("alpha-string", "lora_alpha", "16"),
                               ("alpha-huge", "lora_alpha", 1e300)]:
        md5[f"{name}.tar.gz"] = _variant(root, source, f"{name}.tar.gz", config=json.dumps({**cfg, field: value}))
    md5["config-list.tar.gz"] = _variant(root, source, "config-list.tar.gz", config="[1, 2]")
    md5["config-string.tar.gz"] = _variant(root, source, "config-string.tar.gz", config='"lora"')
    md5["nan-weights.tar.gz"] = _variant(root, source, "nan-weights.tar.gz", tensors=lambda t: {
        k: (v.fill_(float("nan")) if i == 0 else v) for i, (k, v) in enumerate(t.items())})
    # random, not constant: a constant tensor packs so small that its ratio alone refuses it
    md5["huge-weights.tar.gz"] = _variant(root, source, "huge-weights.tar.gz", tensors=lambda t: {
        k: v.uniform_(1e38, 3e38) for k, v in t.items()})
    md5["int8-weights.tar.gz"] = _variant(root, source, "int8-weights.tar.gz", tensors=lambda t: {
        k: v.to(torch.int8) for k, v in t.items()})
    whole = (root / "attn.tar.gz").read_bytes()
    (root / "truncated.tar.gz").write_bytes(whole[: len(whole) // 2])
    md5["truncated.tar.gz"] = md5_of(root / "truncated.tar.gz")
    # 20,000 empty directories in under a megabyte
    with tarfile.open(root / "dirs.tar.gz", "w:gz") as tar:
        for i in range(20000):
            info = tarfile.TarInfo(f"d{i}")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
    md5["dirs.tar.gz"] = md5_of(root / "dirs.tar.gz")
    # a bomb: 100 MiB of zeros, about 100 KiB packed (the test server allows 12 MiB packs, 48 MiB unpacked)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = 100 << 20
        tar.addfile(info, io.BytesIO(bytes(100 << 20)))
    (root / "bomb.tar.gz").write_bytes(gzip.compress(raw.getvalue(), compresslevel=9))
    md5["bomb.tar.gz"] = md5_of(root / "bomb.tar.gz")
    # a high ratio within the server's limits: 16 MiB of zeros in a ~16 KiB pack (the server allows 48 MiB
    # unpacked for its largest pack, but this pack's own size allows 4x 16 KiB + 1 MiB)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = 16 << 20
        tar.addfile(info, io.BytesIO(bytes(16 << 20)))
    (root / "ratio.tar.gz").write_bytes(gzip.compress(raw.getvalue(), compresslevel=9))
    md5["ratio.tar.gz"] = md5_of(root / "ratio.tar.gz")
    # layouts the filesystem refuses: a directory and a file of one name, a path through a file, a long name
    layouts: list[tuple[str, list[tuple[str, bytes | None]]]] = [
        ("dir-and-file.tar", [("a", None), ("a", b"x")]), ("through-file.tar", [("a", b"x"), ("a/b", b"y")]),
        ("long-name.tar", [("n" * 300, b"x")])]
    for name, entries in layouts:
        write_tar(root / name, entries)
        md5[name] = md5_of(root / name)
    return md5


@pytest.fixture(scope="module")
def lora_server(packs, tmp_path_factory):
    server, _ = packs
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", max_loras=4, max_lora_rank=16,
                                                  kv_cache_space_gib=0.5))
    engine.start()
    settings = Settings(port=free_port(), lora_allowed_urls=server.url("/packs/"), max_loras=4,
                        lora_cache_dir=str(tmp_path_factory.mktemp("lora-cache")), lora_max_pack_mb=12,
                        lora_download_timeout=60.0, ws_request_timeout=5)
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
    ("r NaN", lambda s: s.url("/packs/r-nan.tar.gz"), "r-nan.tar.gz", 12006, "'r' must be an integer"),
    ("r null", lambda s: s.url("/packs/r-null.tar.gz"), "r-null.tar.gz", 12006, "'r' must be an integer"),
    ("r a string", lambda s: s.url("/packs/r-string.tar.gz"), "r-string.tar.gz", 12006, "'r' must be an integer"),
    ("r a list", lambda s: s.url("/packs/r-list.tar.gz"), "r-list.tar.gz", 12006, "'r' must be an integer"),
    ("lora_alpha a string", lambda s: s.url("/packs/alpha-string.tar.gz"), "alpha-string.tar.gz", 12006,
     "'lora_alpha'"),
    ("lora_alpha 1e300", lambda s: s.url("/packs/alpha-huge.tar.gz"), "alpha-huge.tar.gz", 12006,
     "scales the update"),
    ("config a list", lambda s: s.url("/packs/config-list.tar.gz"), "config-list.tar.gz", 12006, "JSON object"),
    ("config a string", lambda s: s.url("/packs/config-string.tar.gz"), "config-string.tar.gz", 12006,
     "JSON object"),
    ("truncated gzip", lambda s: s.url("/packs/truncated.tar.gz"), "truncated.tar.gz", 12006, "truncated"),
    ("NaN weights", lambda s: s.url("/packs/nan-weights.tar.gz"), "nan-weights.tar.gz", 12006, "NaN"),
    ("3e38 weights", lambda s: s.url("/packs/huge-weights.tar.gz"), "huge-weights.tar.gz", 12006, "magnitude"),
    ("int8 weights", lambda s: s.url("/packs/int8-weights.tar.gz"), "int8-weights.tar.gz", 12007, "int8"),
    ("20000 directories", lambda s: s.url("/packs/dirs.tar.gz"), "dirs.tar.gz", 12006, "more than 64 entries"),
    ("tar bomb", lambda s: s.url("/packs/bomb.tar.gz"), "bomb.tar.gz", 12006, "larger than"),
    ("high ratio", lambda s: s.url("/packs/ratio.tar.gz"), "ratio.tar.gz", 12006, "4x its own"),
    ("dir and file", lambda s: s.url("/packs/dir-and-file.tar"), "dir-and-file.tar", 12006,
     "'a' is both a file and a directory"),
    ("path through a file", lambda s: s.url("/packs/through-file.tar"), "through-file.tar", 12006,
     "'a/b' goes through 'a'"),
    ("300-character name", lambda s: s.url("/packs/long-name.tar"), "long-name.tar", 12006, "over 255 bytes"),
]


@pytest.mark.parametrize("label, make_url, pack, code, needle", FAILURES, ids=[f[0] for f in FAILURES])
def test_each_failure_has_its_code_and_leaves_the_cache_clean(lora_server, packs, label, make_url, pack, code, needle,
                                                             monkeypatch):
    (live, app), (server, md5) = lora_server, packs
    store = app.state.lora_resolver.store
    if label == "timeout":  # the slow pack trickles 1 KiB per 0.5 s; every other pack arrives within the
        # fixture's 60 s on however busy a machine
        monkeypatch.setattr(store.limits, "total_timeout_s", 1.0)
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


@pytest.fixture(scope="module")
def other_pack_server(packs):
    """A second pack server, on a port the allow-list does not name: it must never be reached."""
    server, _ = packs
    with PackServer(server.root) as other:
        yield other


def _tricks(a: str, o: str) -> list[tuple[str, str, int]]:
    """(label, URL, expected code) with ``a`` the allowed server's host:port and ``o`` another's."""
    port = a.rsplit(":", 1)[1]
    return [
        ("dot segments", f"http://{a}/packs/../evil/taught.tar.gz", 12001),
        ("userinfo to another port", f"http://{a}@{o}/packs/taught.tar.gz", 12001),
        ("user and password", f"http://u:p@{a}/packs/taught.tar.gz", 12001),
        ("prefix as text", f"http://{a}/packs-evil/taught.tar.gz", 12001),
        ("port as text", f"http://127.0.0.1:{port}0/packs/taught.tar.gz", 12001),
        ("CR LF", f"http://{a}/packs/taught.tar.gz\r\nX: y", 12001),
        ("NUL", f"http://{a}/packs/taught\x00.tar.gz", 12001),
        ("encoded dots", f"http://{a}/packs/%2e%2e/evil/taught.tar.gz", 12001),
        ("encoded slash", f"http://{a}/packs/..%2fevil/taught.tar.gz", 12001),
        ("backslash", f"http://{a}/packs/..\\evil/taught.tar.gz", 12001),
        ("double slash", f"http://{a}//packs/taught.tar.gz", 12001),
        ("localhost for 127.0.0.1", f"http://localhost:{port}/packs/taught.tar.gz", 12001),
        ("short IPv4", f"http://127.1:{port}/packs/taught.tar.gz", 12001),
        ("decimal IPv4", f"http://2130706433:{port}/packs/taught.tar.gz", 12001),
        ("other scheme", f"https://{a}/packs/taught.tar.gz", 12001),
        ("other port", f"http://{o}/packs/taught.tar.gz", 12001),
        ("redirect with dots", f"http://{a}/packs/r/dots/taught.tar.gz", 12001),
        ("redirect with userinfo", f"http://{a}/packs/r/userinfo/taught.tar.gz", 12001),
        ("redirect to another port", f"http://{a}/packs/r/port/taught.tar.gz", 12001),
        ("allowed, with a dot segment", f"http://{a}/packs/./taught.tar.gz", 0),
        ("allowed, upper-case scheme", f"HTTP://{a}/packs/x/../taught.tar.gz", 0),
    ]


def test_url_tricks_never_reach_outside_the_allowed_prefix(lora_server, packs, other_pack_server):
    (live, _), (server, md5) = lora_server, packs
    a, o = f"127.0.0.1:{server.port}", f"127.0.0.1:{other_pack_server.port}"
    server.redirects.update({
        "/packs/r/dots/taught.tar.gz": "/packs/../evil/taught.tar.gz",
        "/packs/r/userinfo/taught.tar.gz": f"http://{a}@{o}/packs/taught.tar.gz",
        "/packs/r/port/taught.tar.gz": f"http://{o}/packs/taught.tar.gz",
    })
    server.hits.clear()
    for label, url, code in _tricks(a, o):
        frames = asyncio.run(converse(live.ws_url, _lora_body(url, md5["taught.tar.gz"])))
        header = frames[-1]["header"]
        assert header["code"] == code, (label, header)
        if code:
            assert "lora.url" in header["message"], (label, header)
    outside = [p for p in server.hits if not p.startswith("/packs/") or ".." in p or "//" in p]
    assert outside == [] and sum(other_pack_server.hits.values()) == 0, (outside, other_pack_server.hits)
    assert set(server.hits) <= {"/packs/taught.tar.gz", "/packs/r/dots/taught.tar.gz",
                                "/packs/r/userinfo/taught.tar.gz", "/packs/r/port/taught.tar.gz"}
    ok = asyncio.run(converse(live.ws_url, spark_request("Hi", max_tokens=2, top_k=1)))
    assert ok[-1]["header"]["code"] == 0


def test_lora_off_by_default_answers_12000(fake):
    """A server started without LoRA flags (the scripted fake engine: the refusal comes before any engine)."""
    body = _lora_body("http://127.0.0.1:1/pack.tar", "0" * 32)
    frames = asyncio.run(converse(fake.ws_url, body))
    assert frames[-1]["header"]["code"] == 12000 and "not enabled" in frames[-1]["header"]["message"]


# Keep this fixture's tests last: its app installs its own LoRA resolver on the shared engine, so
# pack URLs sent to lora_server after it would be checked against this app's (empty) allow-list.
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
    text = templated  # tokenized as it is: no BOS is added (the GGUF's add_bos_token is false)
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
    message = unknown.json()["error"]["message"]
    assert unknown.status_code == 404 and "does not exist" in message and "secret" in message
