"""Loading the corpus and sending one case to a live server; shared by the corpus test and the sweep."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

from tests.fuzz.targets import TARGETS

CORPUS = Path(__file__).parent / "corpus.jsonl"
TIMEOUT_S = 30.0
_FILL = re.compile(r"@(\d+)@")


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """The path (keys and indexes) of every value inside ``node``, for mutating one."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += paths(value, prefix + (i,))
    return out


def load() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def payload(case: dict[str, Any]) -> bytes | str:
    """The exact bytes (or text, for a WebSocket text frame) the case sends."""
    fills = case.get("fill") or []
    text = _FILL.sub(lambda m: fills[int(m.group(1))][0] * fills[int(m.group(1))][1], case["body"]) \
        if fills else case["body"]
    encoding = case.get("encoding", "utf-8")
    if encoding == "utf-8":
        return text if TARGETS[case["target"]].path == "ws" else text.encode("utf-8", "surrogatepass")
    if encoding == "utf-8-surrogatepass":
        return text.encode("utf-8", "surrogatepass")
    return text.encode(encoding)


@dataclass
class Reply:
    status: int | None  # HTTP status; None on the WebSocket
    spark_code: int | None  # header.code of the last Spark frame or answer
    text: str


def send(base_url: str, ws_url: str, case: dict[str, Any], client: httpx.Client) -> Reply:
    target = TARGETS[case["target"]]
    data = payload(case)
    if target.path == "ws":
        with connect(ws_url, open_timeout=TIMEOUT_S, close_timeout=TIMEOUT_S, max_size=None) as ws:
            ws.send(data)
            frames = []
            while True:
                try:
                    frames.append(json.loads(ws.recv(timeout=TIMEOUT_S)))
                except TimeoutError:
                    raise AssertionError(f"{case['id']}: no frame within {TIMEOUT_S:g}s (a hang)") from None
                except Exception:  # closed
                    break
        return Reply(None, frames[-1]["header"]["code"] if frames else None, json.dumps(frames[-1:]))
    content: bytes | Iterator[bytes] = data if isinstance(data, bytes) else data.encode()
    if case.get("chunked"):
        whole = data if isinstance(data, bytes) else data.encode()

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(whole), 1 << 20):
                yield whole[i:i + (1 << 20)]

        content = chunks()
    resp = client.post(base_url + target.path, content=content, headers={"Content-Type": "application/json"},
                       timeout=TIMEOUT_S)
    code = None
    if target.path.startswith("/turing/"):
        try:
            code = resp.json()["header"]["code"]
        except Exception:
            code = None
    return Reply(resp.status_code, code, resp.text)


def check(case: dict[str, Any], reply: Reply) -> None:
    expect = case["expect"]
    where = f"{case['id']}: {reply.text[:300]}"
    assert reply.spark_code != -1 and reply.status != 500, where
    if "status" in expect:
        assert reply.status == expect["status"], (expect, where)
    if "spark" in expect:
        assert reply.spark_code == expect["spark"], (expect, where)
    if reply.status == 200 and "data:" in reply.text:  # a stream that "succeeded" must hold no error event
        assert '"error"' not in reply.text, where
