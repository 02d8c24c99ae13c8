"""A replica's fleet endpoints on the scripted engine: vLLM's load/unload_lora_adapter take only what the
operator allowed, behind --api-key; the pack shelf serves only <md5>.<ext> names."""

from __future__ import annotations

import os

import httpx
import pytest

from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import FakeEngine

KEY = "replica-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared")
    (shared / "good").mkdir()
    outside = tmp_path_factory.mktemp("outside")
    os.symlink(outside, shared / "escape")  # a link inside the shared directory that leads out of it
    settings = Settings(port=free_port(), api_key=KEY, lora_shared_dir=str(shared),
                        lora_allowed_urls="http://127.0.0.1:9/packs/",
                        lora_pack_dir=str(tmp_path_factory.mktemp("shelf")))
    engine = FakeEngine(lora_enabled=True)
    with ServerThread(build_app(settings, engine), settings.port):
        yield f"http://127.0.0.1:{settings.port}", shared, outside, engine


def load(base: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(base + "/v1/load_lora_adapter", json=body, headers=headers or {})


def test_loading_needs_the_key(replica):
    base, shared, _, _ = replica
    assert load(base, {"lora_name": "a", "lora_path": str(shared / "good")}, headers=None).status_code == 401


@pytest.mark.parametrize("path", ["{outside}", "{shared}/escape", "{shared}/../x", "{shared}/missing", "/etc"])
def test_only_directories_inside_the_shared_dir_are_taken(replica, path):
    base, shared, outside, _ = replica
    r = load(base, {"lora_name": "x", "lora_path": path.format(shared=shared, outside=outside)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text


def test_a_pack_url_outside_the_allow_list_is_refused(replica):
    base, _, _, _ = replica
    r = load(base, {"lora_name": "p", "url": "http://127.0.0.1:9/elsewhere/a.tar.gz", "md5": "0" * 32})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("name", ["", "a b", "../x", "x" * 200, 7])
def test_adapter_names_are_checked(replica, name):
    base, shared, _, _ = replica
    r = load(base, {"lora_name": name, "lora_path": str(shared / "good")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_load_use_and_unload(replica):
    base, shared, _, engine = replica
    r = load(base, {"lora_name": "good-adapter", "lora_path": str(shared / "good")})
    assert r.status_code == 200 and "added successfully" in r.text
    again = load(base, {"lora_name": "good-adapter", "lora_path": str(shared / "good")})
    assert again.status_code == 400 and "already been loaded" in again.text
    identities = set()
    for body in ({"model": "good-adapter"}, {"model": engine.model_info.name, "lora_path": "good-adapter"}):
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert engine.requests[-1].lora.name == "good-adapter"
        assert engine.requests[-1].lora.path == os.path.realpath(shared / "good")
        identities.add(engine.requests[-1].lora.identity)
    assert len(identities) == 1 and identities.pop().startswith("dir:")  # one registration, one identity
    gone = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "good-adapter"}, headers=AUTH)
    assert gone.status_code == 200
    assert httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "good-adapter"},
                      headers=AUTH).status_code == 404
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "good-adapter"},
                   headers=AUTH)
    assert r.status_code == 404


@pytest.mark.parametrize("name", ["pack-0123", "lora-good", "lora-" + "0" * 31, "lora-" + "A" * 32])
def test_the_servers_own_names_are_refused(replica, name):
    base, shared, _, _ = replica
    r = load(base, {"lora_name": name, "lora_path": str(shared / "good")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text


def test_a_content_name_needs_a_verified_pack_of_its_md5(replica):
    """lora-<md5> names only the pack of that md5: a directory of the operator's, a url with another md5
    and a pack-like folder without the store's READY are all refused."""
    base, shared, _, _ = replica
    name = "lora-" + "0123456789abcdef" * 2
    r = load(base, {"lora_name": name, "lora_path": str(shared / "good")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    fake = shared / "packs" / ("f" * 32) / "adapter"
    fake.mkdir(parents=True)
    (fake.parent / "READY").write_text("http://127.0.0.1:9/packs/x.tar\n" + "0123456789abcdef" * 2 + "\n")
    r = load(base, {"lora_name": name, "lora_path": str(fake)})  # READY's url and md5 are not that key's
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    r = load(base, {"lora_name": name, "url": "http://127.0.0.1:9/packs/a.tar.gz", "md5": "f" * 32})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text


def test_the_shelf_serves_only_pack_names_and_refuses_what_is_not_a_pack(replica):
    base, _, _, _ = replica
    for name in ("..%2f..%2fetc%2fpasswd", "x.tar.gz", "0" * 32 + ".exe", "0" * 32 + ".tar.gz"):
        assert httpx.get(base + "/lora/packs/" + name).status_code == 404, name
    r = httpx.post(base + "/v1/lora/packs", content=b"not a pack at all",
                   headers={**AUTH, "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "not a tar" in r.json()["error"]["message"]
    assert httpx.post(base + "/v1/lora/packs", content=b"x").status_code == 401


def test_the_router_reads_who_the_replica_is(replica):
    base, _, _, engine = replica
    assert httpx.get(base + "/version").json()["version"]  # open, as /health: routers probe without keys
    info = httpx.get(base + "/server_info").json()
    assert info["served_model_name"] == engine.model_info.name and info["context_length"] == 8192
    assert httpx.get(base + "/model_info").json()["is_generation"] is True
