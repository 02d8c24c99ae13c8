"""The adapter endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter, POST /v1/lora/packs) are closed
unless the operator opens them, take only their own Content-Type, and a pack upload is checked before a
byte of it is read, then streamed to disk within its size and time limits. --allowed-hosts refuses other
Host headers on every request and WebSocket handshake."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from spark_server.app import build_app
from spark_server.settings import Settings
from tests import plain_http as http
from tests.conftest import ServerThread, free_port
from tests.fake_engine import FakeEngine

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
PACK = {"Content-Type": "application/octet-stream"}


@contextlib.contextmanager
def serve(tmp_path: Path, **options):
    shared = tmp_path / "shared"
    (shared / "good").mkdir(parents=True, exist_ok=True)
    shelf = tmp_path / "shelf"
    settings = Settings(port=free_port(), lora_shared_dir=str(shared), lora_pack_dir=str(shelf), **options)
    with ServerThread(build_app(settings, FakeEngine(lora_enabled=True)), settings.port):
        yield {"url": f"http://127.0.0.1:{settings.port}", "port": settings.port, "shared": shared, "shelf": shelf}


def _pack(tmp_path: Path) -> bytes:
    """A pack file holding a (fake) adapter: the scripted engine's adapter check takes anything."""
    from lora_store.pack import build_pack

    adapter = tmp_path / "adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    build_pack(adapter, tmp_path / "pack.tar.gz")
    return (tmp_path / "pack.tar.gz").read_bytes()


def raw_request(port: int, head: str, body: bytes = b"", wait_s: float = 5.0) -> tuple[str, float]:
    """Send ``head`` (request line and headers) and ``body``, then wait for the answer's status line
    without sending anything more: (status line, seconds it took)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        started = time.monotonic()
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n", 1)[0].decode(), time.monotonic() - started


def test_admin_endpoints_answer_403_without_a_key(tmp_path):
    with serve(tmp_path) as srv:
        base = srv["url"]
        for path, body, headers in (
                ("/v1/load_lora_adapter", json.dumps({"lora_name": "a", "lora_path": str(srv["shared"] / "good")}),
                 JSON),
                ("/v1/unload_lora_adapter", json.dumps({"lora_name": "a"}), JSON),
                ("/v1/lora/packs", _pack(tmp_path), PACK)):
            r = http.post(base + path, content=body, headers=headers)
            assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"], (path, r.text)
        assert http.get(base + "/v1/models").status_code == 200  # the rest stays as open as it was
        assert "a" not in [m["id"] for m in http.get(base + "/v1/models").json()["data"]]


def test_allow_unauthenticated_admin_opens_them(tmp_path):
    with serve(tmp_path, allow_unauthenticated_admin=True) as srv:
        base = srv["url"]
        r = http.post(base + "/v1/load_lora_adapter",
                       json={"lora_name": "a", "lora_path": str(srv["shared"] / "good")})
        assert r.status_code == 200, r.text
        assert http.post(base + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        data = _pack(tmp_path)
        r = http.post(base + "/v1/lora/packs", content=data, headers=PACK)
        assert r.status_code == 201 and r.json()["md5"] == hashlib.md5(data).hexdigest(), r.text


@pytest.mark.parametrize("open_admin", [False, True])
def test_only_their_own_content_type_is_taken(tmp_path, open_admin):
    """text/plain, form bodies and bodies without a Content-Type are what any web page may send across
    origins without a preflight: refused with 415, keyed or not."""
    options = {"allow_unauthenticated_admin": True} if open_admin else {"api_key": KEY}
    with serve(tmp_path, **options) as srv:
        base = srv["url"]
        body = json.dumps({"lora_name": "a", "lora_path": str(srv["shared"] / "good")})
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
            for path, content in (("/v1/load_lora_adapter", body), ("/v1/unload_lora_adapter", body),
                                  ("/v1/lora/packs", _pack(tmp_path))):
                r = http.post(base + path, content=content, headers=headers)
                assert r.status_code == 415, (path, kind, r.text)
        r = http.post(base + "/v1/load_lora_adapter", content=body,
                       headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text
        r = http.post(base + "/v1/lora/packs", content=_pack(tmp_path), headers={**AUTH, **PACK})
        assert r.status_code == 201, r.text


def test_the_allowed_hosts_alone_are_answered(tmp_path):
    with serve(tmp_path, allowed_hosts="allowed.test, 127.0.0.1, *.fleet.test") as srv:
        base, port = srv["url"], srv["port"]
        assert http.get(base + "/health").status_code == 200  # Host: 127.0.0.1:<port>
        for host in ("allowed.test", "allowed.test:8080", "a.fleet.test", "ALLOWED.test"):
            assert http.get(base + "/health", headers={"Host": host}).status_code == 200, host
        for host in ("evil.test", "allowed.test.evil.test", "fleet.test", "localhost", "127.0.0.2"):
            r = http.get(base + "/v1/models", headers={"Host": host})
            assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"], host
        handshake = ("GET /turing/v3/gpt HTTP/1.1\nHost: {host}\nUpgrade: websocket\nConnection: Upgrade\n"
                     "Sec-WebSocket-Key: " + base64.b64encode(os.urandom(16)).decode() +
                     "\nSec-WebSocket-Version: 13\n")
        status, _ = raw_request(port, handshake.format(host="evil.test"))
        assert " 101 " not in status + " " and status.split()[1] in ("400", "403"), status
        status, _ = raw_request(port, handshake.format(host="allowed.test"))
        assert status.split()[1] == "101", status


def test_any_host_by_default(tmp_path):
    with serve(tmp_path) as srv:
        assert http.get(srv["url"] + "/health", headers={"Host": "anything.test"}).status_code == 200


@pytest.mark.parametrize("options, credential, status", [
    ({"api_key": KEY}, "Authorization: Bearer wrong\n", "401"),
    ({"api_key": KEY}, "", "401"),
    ({}, "", "403"),
])
def test_a_refused_upload_is_answered_before_its_body(tmp_path, options, credential, status):
    """Headers announcing 100 MB, then nothing: the refusal comes at once (the body is never awaited)."""
    with serve(tmp_path, **options) as srv:
        head = (f"POST /v1/lora/packs HTTP/1.1\nHost: 127.0.0.1\n{credential}"
                "Content-Type: application/octet-stream\nContent-Length: 100000000\n")
        line, took = raw_request(srv["port"], head)
        assert line.split()[1] == status and took < 2.0, (line, took)


def _rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) << 10 for ln in fh if ln.startswith("VmRSS:"))


def test_an_oversize_upload_is_cut_off_at_the_limit_without_being_held(tmp_path):
    """A chunked upload (no Content-Length to refuse it by) of more than --lora-max-pack-mb: answered 413
    as soon as it passes the limit, the body streamed to disk (the server's memory does not grow by it)
    and the partial file removed."""
    limit_mb = 64
    with serve(tmp_path, api_key=KEY, lora_max_pack_mb=limit_mb) as srv:
        peak, stop = [_rss()], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak.append(_rss())
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        # the process's RSS is measured: a real engine of an earlier test in this worker may still be
        # faulting its KV cache in on idle CPU (engine/resident.py), which would count as this upload's
        from engine import resident

        for prefault in list(resident._passes):
            prefault.wait(timeout=120)
        base_rss = _rss()
        sampler.start()
        chunk = os.urandom(1 << 20)
        frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        with socket.create_connection(("127.0.0.1", srv["port"]), timeout=30) as s:
            s.sendall(f"POST /v1/lora/packs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
            for _ in range(limit_mb + 1):  # one MiB past the limit, and the body is never finished
                s.sendall(frame)
            answer = b""
            while b"\r\n\r\n" not in answer:
                got = s.recv(65536)
                if not got:
                    break
                answer += got
        stop.set()
        sampler.join()
        assert answer.split(b"\r\n", 1)[0].split()[1] == b"413", answer[:300]
        assert b"--lora-max-pack-mb" in answer or b"limit" in answer
        grown = max(peak) - base_rss
        assert grown < (limit_mb << 20) // 3, f"the server's memory grew by {grown >> 20} MiB"
        deadline = time.monotonic() + 5
        while list(srv["shelf"].glob(".upload-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not list(srv["shelf"].glob(".upload-*")) and not list(srv["shelf"].glob("*.tar*"))
        # a declared length over the limit: refused before any of it is read
        line, took = raw_request(srv["port"], f"POST /v1/lora/packs HTTP/1.1\nHost: 127.0.0.1\n"
                                              f"Authorization: Bearer {KEY}\nContent-Type: application/octet-stream\n"
                                              f"Content-Length: {(limit_mb << 20) + 1}\n")
        assert line.split()[1] == "413" and took < 2.0, line


def test_a_stalled_upload_is_answered_408(tmp_path):
    with serve(tmp_path, api_key=KEY, body_timeout=0.5) as srv:
        head = (f"POST /v1/lora/packs HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {KEY}\n"
                "Content-Type: application/octet-stream\nContent-Length: 100000\n")
        line, took = raw_request(srv["port"], head, body=b"\x1f\x8b" + bytes(1000))
        assert line.split()[1] == "408" and 0.45 < took < 3.5, (line, took)
        time.sleep(0.2)
        assert not list(srv["shelf"].glob(".upload-*"))


def test_a_pack_streamed_in_chunks_is_published(tmp_path):
    data = _pack(tmp_path)

    def chunks():
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    with serve(tmp_path, api_key=KEY) as srv:
        r = http.post(srv["url"] + "/v1/lora/packs", content=chunks(), headers={**AUTH, **PACK})
        assert r.status_code == 201, r.text
        assert r.json()["md5"] == hashlib.md5(data).hexdigest() and r.json()["bytes"] == len(data)
        assert http.get(r.json()["url"]).content == data


@pytest.mark.parametrize("flag", ["lora", "lora_modules"])
@pytest.mark.parametrize("name", ["pack-mine", "lora-0123456789abcdef0123456789abcdef"])
def test_the_servers_own_names_are_refused_at_start(tmp_path, flag, name):
    settings = Settings(port=free_port(), **{flag: f"{name}={tmp_path}"})
    with pytest.raises(ValueError, match="server's own"):
        build_app(settings, FakeEngine(lora_enabled=True))


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_a_deeply_nested_admin_body_is_a_400_not_a_crash(tmp_path, path):
    with serve(tmp_path, api_key=KEY) as srv:
        resp = http.post(srv["url"] + path, content=b"[" * 100_000 + b"]" * 100_000, headers={**AUTH, **JSON})
        assert resp.status_code == 400, resp.text
        assert "nest" in resp.json()["error"]["message"].lower() or "deep" in resp.json()["error"]["message"].lower()
        assert http.get(srv["url"] + "/health").status_code == 200
