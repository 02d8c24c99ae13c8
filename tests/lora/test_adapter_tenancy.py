"""Tenants who share the server cannot reach each other's adapters: a session's {url, md5} always answers
with that pack's weights, whatever names others register and however (the admin endpoints with any name,
session packs, a fleet front end), and a name registered again serves its new weights.

"The weights" are checked as PEFT computes them: the greedy first token after the prompt and its logprob
under the victim's pack equal PEFT's for that pack, and differ from the attacker's."""

from __future__ import annotations

import asyncio
import io
import shutil
import tarfile
from pathlib import Path

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.request import GenerationRequest, LoraRef, TokensPrompt
from engine.sampling_params import SamplingParams
from lora_store.pack import build_pack, dir_size
from lora_store.resolver import resolve_lora
from lora_store.store import pack_key
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.lora.adapters import SECRET_ANSWER, SECRET_QUESTION, _chat_ids, peft_first_token, scaled_variant
from tests.lora.pack_server import PackServer
from tests.spark.client import answer_text, converse, spark_request

KEY = "tenancy-key"  # every tenant here holds the key: the admin endpoints are open to all of them
AUTH = {"Authorization": f"Bearer {KEY}"}
TOLERANCE = 2e-3  # fp32 engine against fp32 PEFT: they agree to ~1e-5


@pytest.fixture(scope="module")
def packs(tmp_path_factory, adapters):
    """The victim's pack (the taught adapter: it answers the secret word), the attacker's (a random one),
    and scaled variants of the attacker's for the eviction test, served over HTTP."""
    root = tmp_path_factory.mktemp("tenancy-packs")
    md5 = {"victim.tar.gz": build_pack(adapters["taught"], root / "victim.tar.gz"),
           "attacker.tar.gz": build_pack(adapters["attn"], root / "attacker.tar.gz")}
    work = tmp_path_factory.mktemp("variants")
    for i in range(6):
        variant = scaled_variant(adapters["attn"], work / f"v{i}", 1.1 + 0.1 * i)
        md5[f"variant{i}.tar.gz"] = build_pack(variant, root / f"variant{i}.tar.gz")
    with PackServer(root) as server:
        yield server, md5, root


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    return _chat_ids(AutoTokenizer.from_pretrained(model_dir), SECRET_QUESTION)


@pytest.fixture(scope="module")
def references(model_dir, adapters, prompt_ids) -> dict[str, tuple[int, float]]:
    victim, attacker = peft_first_token(model_dir, [adapters["taught"], adapters["attn"]], prompt_ids)
    # the test means something only if the two adapters answer visibly differently
    assert victim[0] != attacker[0] or abs(victim[1] - attacker[1]) > 20 * TOLERANCE
    return {"victim": victim, "attacker": attacker}


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", max_loras=2, max_lora_rank=16,
                                                  kv_cache_space_gib=0.5))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine, packs, tmp_path_factory):
    """One replica: packs are cached under the shared directory (as a fleet's front end and its backends
    do), which /v1/load_lora_adapter also takes adapter directories from."""
    pack_server, _, _ = packs
    shared = tmp_path_factory.mktemp("tenancy-shared")
    settings = Settings(port=free_port(), api_key=KEY, lora_allowed_urls=pack_server.url("/packs/"),
                        lora_shared_dir=str(shared), max_loras=2, lora_max_pack_mb=12)
    app = build_app(settings, engine, owns_engine=False)
    with ServerThread(app, settings.port):
        yield {"url": f"http://127.0.0.1:{settings.port}", "app": app, "shared": shared}


def _close(got: tuple[int, float], expected: tuple[int, float]) -> bool:
    return got[0] == expected[0] and abs(got[1] - expected[1]) < TOLERANCE


def engine_first(engine, ref: LoraRef, prompt_ids: list[int], resolver=None) -> tuple[int, float]:
    """The greedy first token and its logprob for ``ref``, resolved as a session's reference is."""

    async def go() -> tuple[int, float]:
        req = GenerationRequest("tenancy", TokensPrompt(list(prompt_ids)),
                                SamplingParams(max_tokens=1, temperature=0, logprobs=True), lora=ref)
        await resolve_lora(resolver, req)
        outs = [o async for o in engine.generate(req)]
        first = outs[0].logprobs[0]
        return first.token_id, first.logprob

    return asyncio.run(go())


def named_first(base: str, model: str, prompt_ids: list[int]) -> tuple[int, float]:
    r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": prompt_ids, "max_tokens": 1,
                                                   "temperature": 0, "logprobs": 1,
                                                   "return_tokens_as_token_ids": True}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return int(lp["tokens"][0].removeprefix("token_id:")), float(lp["token_logprobs"][0])


def load(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)


def unload(base: str, name: str) -> httpx.Response:
    return httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=60)


def _victim_session(server, packs, engine, prompt_ids, references) -> None:
    """The victim's {url, md5}: PEFT's first token for the victim's pack, and its secret over the WebSocket."""
    pack_server, md5, _ = packs
    ref = LoraRef(url=pack_server.url("/packs/victim.tar.gz"), md5=md5["victim.tar.gz"])
    got = engine_first(engine, ref, prompt_ids, server["app"].state.lora_resolver)
    assert _close(got, references["victim"]), (got, references)
    body = spark_request(SECRET_QUESTION, max_tokens=12, top_k=1)
    body["payload"]["lora"] = {"url": ref.url, "md5": ref.md5}
    ws = server["url"].replace("http://", "ws://") + f"/turing/v3/gpt?api_key={KEY}"
    frames = asyncio.run(converse(ws, body))
    assert frames[-1]["header"]["code"] == 0 and SECRET_ANSWER.rstrip(".") in answer_text(frames), frames[-1]


def _forged_pack(root: Path, attacker_dir: Path, forged_key: str, victim_md5: str, victim_url: str) -> Path:
    """The attacker's adapter, carrying inside it a copy of a store entry for the victim's pack:
    packs/<victim key>/READY (the victim's url and md5) and packs/<victim key>/adapter (the attacker's
    weights)."""
    out = root / "forged.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(attacker_dir / f, arcname=f)
            tar.add(attacker_dir / f, arcname=f"packs/{forged_key}/adapter/{f}")
        ready = f"{victim_url}\n{victim_md5}\n".encode()
        info = tarfile.TarInfo(f"packs/{forged_key}/READY")
        info.size = len(ready)
        tar.addfile(info, io.BytesIO(ready))
    return out


def test_same_name_other_content_is_another_adapter(engine, adapters, prompt_ids, references):
    """The engine keys adapters by identity: one display name over two adapters gives each its own weights,
    with identities and without (then the files themselves tell them apart)."""
    for identities in (("md5:" + "1" * 32, "md5:" + "2" * 32), (None, None)):
        victim = LoraRef(name="same-name", path=str(adapters["taught"]), identity=identities[0])
        attacker = LoraRef(name="same-name", path=str(adapters["attn"]), identity=identities[1])
        assert _close(engine_first(engine, attacker, prompt_ids), references["attacker"])
        assert _close(engine_first(engine, victim, prompt_ids), references["victim"])


def test_no_registration_path_reaches_the_victims_pack(server, packs, engine, prompt_ids, references):
    pack_server, md5, root = packs
    base, app = server["url"], server["app"]
    store = app.state.lora_resolver.store
    victim_url, attacker_url = pack_server.url("/packs/victim.tar.gz"), pack_server.url("/packs/attacker.tar.gz")
    victim_md5, attacker_md5 = md5["victim.tar.gz"], md5["attacker.tar.gz"]
    victim_key = pack_key(store.check_url(victim_url), victim_md5)

    _victim_session(server, packs, engine, prompt_ids, references)
    # the attacker's own session pack: its weights (and an entry in the store to point at)
    attacker = engine_first(engine, LoraRef(url=attacker_url, md5=attacker_md5), prompt_ids, app.state.lora_resolver)
    assert _close(attacker, references["attacker"])
    attacker_key = pack_key(store.check_url(attacker_url), attacker_md5)
    attacker_entry = next((server["shared"] / "packs" / attacker_key / "adapter").rglob("adapter_config.json")).parent
    # a pack of the attacker's that carries a forged store entry for the victim's pack inside it
    forged = _forged_pack(root, Path(attacker_entry), victim_key, victim_md5, store.check_url(victim_url))
    from lora_store.pack import md5_of

    forged_md5 = md5_of(forged)
    forged_url = pack_server.url("/packs/forged.tar.gz")
    engine_first(engine, LoraRef(url=forged_url, md5=forged_md5), prompt_ids, app.state.lora_resolver)
    forged_key = pack_key(store.check_url(forged_url), forged_md5)
    nested = server["shared"] / "packs" / forged_key / "adapter" / "packs" / victim_key / "adapter"
    assert (nested / "adapter_model.safetensors").is_file()

    attempts = [
        {"lora_name": f"pack-{victim_key}", "url": attacker_url, "md5": attacker_md5},  # the session's own name
        {"lora_name": f"lora-{victim_md5}", "url": attacker_url, "md5": attacker_md5},  # a fleet's name for it
        {"lora_name": f"lora-{victim_md5}", "url": victim_url, "md5": attacker_md5},
        {"lora_name": f"lora-{victim_md5}", "lora_path": str(attacker_entry)},  # a verified pack, another md5
        {"lora_name": f"lora-{victim_md5}", "lora_path": str(nested)},  # a forged entry inside a pack
        {"lora_name": f"lora-{victim_md5}", "lora_path": str(server["shared"] / "packs" / forged_key / "adapter")},
    ]
    for body in attempts:
        r = load(base, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", (body, r.text)
        assert f"lora-{victim_md5}" not in app.state.lora_resolver.registered
        _victim_session(server, packs, engine, prompt_ids, references)

    # any other name is the attacker's to take: it serves the attacker's weights, and nobody else's
    assert load(base, {"lora_name": "victims-favourite", "url": attacker_url, "md5": attacker_md5}).status_code == 200
    assert _close(named_first(base, "victims-favourite", prompt_ids), references["attacker"])
    _victim_session(server, packs, engine, prompt_ids, references)
    assert unload(base, "victims-favourite").status_code == 200

    # the victim's pack under its content name (what a fleet's front end does) serves the victim's weights
    assert load(base, {"lora_name": f"lora-{victim_md5}", "url": victim_url, "md5": victim_md5}).status_code == 200
    assert _close(named_first(base, f"lora-{victim_md5}", prompt_ids), references["victim"])
    assert unload(base, f"lora-{victim_md5}").status_code == 200


def test_unload_then_load_under_one_name_serves_the_new_weights(server, packs, adapters, prompt_ids, references):
    pack_server, md5, _ = packs
    base = server["url"]
    # a pack
    assert load(base, {"lora_name": "swap", "url": pack_server.url("/packs/victim.tar.gz"),
                       "md5": md5["victim.tar.gz"]}).status_code == 200
    assert _close(named_first(base, "swap", prompt_ids), references["victim"])
    assert unload(base, "swap").status_code == 200
    assert load(base, {"lora_name": "swap", "url": pack_server.url("/packs/attacker.tar.gz"),
                       "md5": md5["attacker.tar.gz"]}).status_code == 200
    assert _close(named_first(base, "swap", prompt_ids), references["attacker"])
    assert unload(base, "swap").status_code == 200
    # a directory whose files the operator replaced between the two registrations (same path, same name)
    folder = server["shared"] / "swap-dir"
    shutil.copytree(adapters["taught"], folder)
    assert load(base, {"lora_name": "swap-dir", "lora_path": str(folder)}).status_code == 200
    assert _close(named_first(base, "swap-dir", prompt_ids), references["victim"])
    assert unload(base, "swap-dir").status_code == 200
    shutil.rmtree(folder)
    shutil.copytree(adapters["attn"], folder)
    assert load(base, {"lora_name": "swap-dir", "lora_path": str(folder)}).status_code == 200
    assert _close(named_first(base, "swap-dir", prompt_ids), references["attacker"])
    assert unload(base, "swap-dir").status_code == 200


def test_a_fleet_front_end_serves_the_victims_pack_and_replaces_a_squatted_name(
        server, packs, adapters, prompt_ids, references):
    """A front end (--engine-url) in front of the replica: the victim's session loads lora-<md5> there
    (which nobody can squat: see above) and answers with the victim's weights; an operator name of the
    front end that a tenant registered first on the replica with other weights is replaced, not trusted."""
    pack_server, md5, _ = packs
    base, shared = server["url"], server["shared"]
    operator_dir = shared / "operator-adapter"
    shutil.copytree(adapters["taught"], operator_dir)
    squat = shared / "squat"
    shutil.copytree(adapters["attn"], squat)
    assert load(base, {"lora_name": "operator", "lora_path": str(squat)}).status_code == 200  # the squatter
    settings = Settings(port=free_port(), engine_url=base, engine_api_key=KEY, api_key=KEY,
                        lora_shared_dir=str(shared), lora_allowed_urls=pack_server.url("/packs/"),
                        lora=f"operator={operator_dir}")
    front_engine = settings.remote_engine()
    front = f"http://127.0.0.1:{settings.port}"
    try:
        with ServerThread(build_app(settings, front_engine), settings.port):
            body = spark_request(SECRET_QUESTION, max_tokens=12, top_k=1)
            body["payload"]["lora"] = {"url": pack_server.url("/packs/victim.tar.gz"), "md5": md5["victim.tar.gz"]}
            frames = asyncio.run(converse(front.replace("http://", "ws://") + f"/turing/v3/gpt?api_key={KEY}", body))
            assert frames[-1]["header"]["code"] == 0 and SECRET_ANSWER.rstrip(".") in answer_text(frames), frames
            name = f"lora-{md5['victim.tar.gz']}"
            assert name in server["app"].state.lora_resolver.registered
            assert _close(named_first(base, name, prompt_ids), references["victim"])
            # the operator's name, squatted on the replica: the front end puts its own adapter there
            assert _close(named_first(front, "operator", prompt_ids), references["victim"])
            assert _close(named_first(base, "operator", prompt_ids), references["victim"])
    finally:
        for n in ("operator", f"lora-{md5['victim.tar.gz']}"):
            unload(base, n)


def test_operator_adapters_outlive_any_number_of_session_packs(engine, packs, prompt_ids, references,
                                                              tmp_path):
    """--lora is pinned: session packs (more than the engine caches, and a disk budget that evicts the
    operator's pack files too) never push it out; it answers with its weights, and /v1/models lists it."""
    pack_server, md5, root = packs
    victim_url = pack_server.url("/packs/victim.tar.gz")
    budget = 1.5 * dir_size_of(root / "victim.tar.gz", tmp_path)
    settings = Settings(port=free_port(), lora_allowed_urls=pack_server.url("/packs/"),
                        lora=f"operator={victim_url}#{md5['victim.tar.gz']}", max_loras=2, lora_max_pack_mb=12,
                        lora_cache_dir=str(tmp_path / "cache"), lora_disk_budget_gb=budget / (1 << 30))
    app = build_app(settings, engine, owns_engine=False)
    base = f"http://127.0.0.1:{settings.port}"
    with ServerThread(app, settings.port):
        assert _close(named_first(base, "operator", prompt_ids), references["victim"])
        resolver = app.state.lora_resolver
        for i in range(6):  # 6 > 2 x --max-loras: the engine's cache of session packs turns over
            url = pack_server.url(f"/packs/variant{i}.tar.gz")
            engine_first(engine, LoraRef(url=url, md5=md5[f"variant{i}.tar.gz"]), prompt_ids, resolver)
        assert not Path(resolver.registered["operator"]).exists()  # its files left the disk budget
        assert _close(named_first(base, "operator", prompt_ids), references["victim"])
        assert "operator" in [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
        question = [{"role": "user", "content": SECRET_QUESTION}]
        r = httpx.post(base + "/v1/chat/completions", json={"model": "operator", "max_tokens": 12, "temperature": 0,
                                                             "messages": question},
                       timeout=60)
        assert r.status_code == 200 and "pineapple" in r.json()["choices"][0]["message"]["content"], r.text
    engine.forget_adapter(resolver.identities["operator"])  # this app is gone: its registration ends


def dir_size_of(pack: Path, tmp: Path) -> int:
    """The unpacked size of a pack (what the store's disk budget counts)."""
    out = tmp / "measure"
    shutil.rmtree(out, ignore_errors=True)
    with tarfile.open(pack) as tar:
        tar.extractall(out, filter="data")
    return dir_size(out)
