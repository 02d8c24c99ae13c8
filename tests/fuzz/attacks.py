"""The attack corpus: one request (or a small burst) per way a tenant could harm the others, each with
what the server must answer. ``tests/fuzz/test_attacks.py`` runs it against a real server process beside
a steady victim stream, and ``python -m benchmarks.bench_abuse`` reports each row's figures.

Each attack names the budget it meets; the documented answer is the protocol's own error naming the
field (or the flag), or a bounded answer."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import websockets

from tests.plain_http import TLS

MODEL = "SmolLM2-135M-Instruct"

# The server the corpus runs against: a few running slots, so the slot budget is reachable, and a Host
# allow-list, so DNS rebinding is.
SERVER_ARGS = ["--max-num-seqs", "16", "--allowed-hosts", "127.0.0.1,localhost"]


@dataclass
class Reply:
    status: int  # HTTP status, or the Spark frame's code
    text: str  # the body (or the Spark message), shortened
    seconds: float = 0.0


@dataclass(frozen=True)
class Attack:
    name: str
    budget: str  # which budget meets it (the README's security table)
    send: Callable[[str, str], Awaitable[Reply]]  # (http base, ws url) -> the answer
    expect_status: tuple[int, ...]
    expect_text: str = ""  # a substring the answer must hold: the field or flag it names


# ---- ways to send ---------------------------------------------------------------------------------


def client_for(timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout, verify=TLS)  # one shared context (tests/plain_http.py)


def post(path: str, body: Any, *, content_type: str = "application/json", host: str | None = None,
         timeout: float = 60.0) -> Callable[[str, str], Awaitable[Reply]]:
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()

    async def send(base: str, _: str) -> Reply:
        headers = {"Content-Type": content_type, **({"Host": host} if host else {})}
        async with client_for(timeout=timeout) as client:
            resp = await client.post(base + path, content=raw, headers=headers)
        return Reply(resp.status_code, resp.text[:400])
    return send


def get(path: str, *, host: str | None = None) -> Callable[[str, str], Awaitable[Reply]]:
    async def send(base: str, _: str) -> Reply:
        async with client_for(timeout=30) as client:
            resp = await client.get(base + path, headers={"Host": host} if host else {})
        return Reply(resp.status_code, resp.text[:400])
    return send


def announced_upload(path: str, content_length: int) -> Callable[[str, str], Awaitable[Reply]]:
    """Headers announcing a large body, and none of it: the answer must come without the body (the server
    refuses before reading a body it would not keep)."""
    async def send(base: str, _: str) -> Reply:
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/octet-stream\r\n"
                      f"Content-Length: {content_length}\r\n\r\n").encode())
        await writer.drain()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = await asyncio.wait_for(reader.readexactly(length), 5)
        finally:
            writer.close()
        return Reply(int(head.split()[1]), body.decode("utf-8", "replace")[:400])
    return send


def burst(bodies: list[dict[str, Any]], path: str) -> Callable[[str, str], Awaitable[Reply]]:
    """Send ``bodies`` at once; the reply is the first answer whose status differs from the first's,
    else the first (so a single odd answer is never hidden)."""
    async def send(base: str, _: str) -> Reply:
        async with client_for(timeout=120) as client:
            answers = await asyncio.gather(*(client.post(base + path, json=b) for b in bodies))
        odd = next((a for a in answers if a.status_code != answers[0].status_code), answers[0])
        return Reply(odd.status_code, odd.text[:400])
    return send


def spark(chat: dict[str, Any], question: str = "Hi") -> Callable[[str, str], Awaitable[Reply]]:
    frame = json.dumps({"header": {"traceId": "attack"}, "parameter": {"chat": {"max_tokens": 8, **chat}},
                        "payload": {"message": {"text": [{"role": "user", "content": question}]}}})

    async def send(_: str, ws_url: str) -> Reply:
        async with websockets.connect(ws_url, max_size=None) as ws:
            await ws.send(frame)
            last = json.loads([m async for m in ws][-1])
        return Reply(last["header"]["code"], last["header"]["message"][:400])
    return send


def abandoned(bodies: list[dict[str, Any]], path: str, then: dict[str, Any],
              leave_after_s: float = 0.3) -> Callable[[str, str], Awaitable[Reply]]:
    """Send ``bodies`` at once, leave them all after ``leave_after_s``, then send ``then``: its answer
    (and how long it took) is the reply."""
    async def send(base: str, ws_url: str) -> Reply:
        async with client_for(timeout=120) as client:
            tasks = [asyncio.create_task(client.post(base + path, json=b)) for b in bodies]
            await asyncio.sleep(leave_after_s)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            start = time.perf_counter()
            resp = await client.post(base + path, json=then)
            return Reply(resp.status_code, resp.text[:400], time.perf_counter() - start)
    return send


# ---- what they carry ------------------------------------------------------------------------------


def ref_chain(n: int = 3000) -> dict[str, Any]:
    """A schema of depth 4 as JSON whose $defs refer to each other n long: a recursive compiler's end."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(n: int = 3000, gbnf: bool = False) -> str:
    if gbnf:
        return "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(n)) + f'\nr{n} ::= "a"'
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"'


def enum_schema(approx_bytes: int, tag: str = "e") -> dict[str, Any]:
    n = approx_bytes // 100  # long values: under the body's item limit, at the constraint's byte limit
    return {"enum": [f"{tag}{i:06d}-{(i * 7919) % 1000003:07d}-" + "v" * 80 for i in range(n)]}


def slow_choices(tag: str, n: int = 1000) -> list[str]:
    """A choice list, distinct per tag."""
    return [f"{tag}{i:05d}x{(i * 7919) % 100003}" for i in range(n)]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 8, **extra}


def deep_json_text(depth: int = 10_000) -> str:
    return "[" * depth + "]" * depth


def tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "lookup", "parameters": parameters}}


# ---- the corpus ----------------------------------------------------------------------------------


# Every protocol's way to send a JSON schema constraint: (name, schema -> sender, answer codes, field named)
SCHEMA_CARRIERS: list[tuple[str, Callable[[Any], Callable[[str, str], Awaitable[Reply]]], tuple[int, ...], str]] = [
    ("openai response_format", lambda s: post("/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": s}})), (400,), "response_format"),
    ("openai guided_json", lambda s: post("/v1/completions", completion(guided_json=s)), (400,), "guided_json"),
    ("openai tools required", lambda s: post("/v1/chat/completions", chat(tools=[tool(s)], tool_choice="required")),
     (400,), "tool_choice"),
    ("sglang json_schema", lambda s: post("/generate", {"text": "Hi", "sampling_params": {
        "max_new_tokens": 8, "json_schema": json.dumps(s)}}), (400,), "json_schema"),
    ("tgi grammar", lambda s: post("/generate", {"inputs": "Hi", "parameters": {
        "max_new_tokens": 8, "grammar": {"type": "json", "value": s}}}), (400, 422), "grammar"),
    ("triton generate grammar", lambda s: post(f"/v2/models/{MODEL}/generate", {"text_input": "Hi", "parameters": {
        "max_new_tokens": 8, "grammar": {"type": "json", "value": s}}}), (400, 422), "grammar"),
    ("mindie infer grammar", lambda s: post("/infer", {"inputs": "Hi", "parameters": {
        "max_new_tokens": 8, "grammar": {"type": "json", "value": s}}}), (400, 422), "grammar"),
    ("ollama format", lambda s: post("/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False, "format": s,
                                                       "options": {"num_predict": 8}}), (400,), "format"),
    ("spark response_format", lambda s: spark({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": s}}}), (10000,), "response_format"),
    ("responses text.format", lambda s: post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 8,
                                                               "text": {"format": {"type": "json_schema", "name": "x",
                                                                                   "schema": s}}}),
     (400,), "text.format.schema"),
    ("anthropic tools any", lambda s: post("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": "Hi"}], "tools": [{"name": "lookup", "input_schema": s}],
        "tool_choice": {"type": "any"}}), (400,), "tool_choice"),
]

# ... and a grammar or regex: (name, text -> sender, answer codes, field named)
GRAMMAR_CARRIERS: list[tuple[str, Callable[[str], Callable[[str, str], Awaitable[Reply]]], tuple[int, ...], str]] = [
    ("openai guided_grammar", lambda g: post("/v1/completions", completion(guided_grammar=g)), (400,),
     "guided_grammar"),
    ("sglang ebnf", lambda g: post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 8, "ebnf": g}}),
     (400,), "ebnf"),
]


def corpus() -> list[Attack]:
    chain, huge = ref_chain(), enum_schema(1 << 20)
    crashes = [Attack(f"{name}: $ref chain", "constraint depth", carrier(chain), codes, field)
               for name, carrier, codes, field in SCHEMA_CARRIERS]
    crashes += [Attack(f"{name}: enum of 1 MiB", "constraint bytes", carrier(huge), codes, "--max-constraint-kb")
                for name, carrier, codes, _ in SCHEMA_CARRIERS]
    crashes += [Attack(f"{name}: rule chain{' (GBNF)' if gbnf else ''}", "constraint depth",
                       carrier(rule_chain(gbnf=gbnf)), codes, field)
                for name, carrier, codes, field in GRAMMAR_CARRIERS for gbnf in (False, True)]
    return crashes + [
        Attack("openai guided_regex: 400 nested groups", "constraint depth", post("/v1/completions", completion(
            guided_regex="(" * 400 + "a" + ")" * 400)), (400,), "guided_regex"),
        Attack("tgi grammar regex: 400 nested groups", "constraint depth", post("/generate", {
            "inputs": "Hi", "parameters": {"max_new_tokens": 8, "grammar": {
                "type": "regex", "value": "(" * 400 + "a" + ")" * 400}}}), (400, 422), "grammar"),
        Attack("an ambiguous grammar whose masks grow costlier", "constraint step time", post("/v1/completions", {
            "model": MODEL, "prompt": "x", "max_tokens": 300, "temperature": 0, "n": 8, "allowed_token_ids": [81],
            "guided_grammar": 'start: s\ns: s s s s | s s s | s s | "a" | "b"\n'}), (400,),
            "--max-constraint-step-ms"),
        Attack("guided_json: percent-encoded $ref chain", "constraint depth", post("/v1/completions", completion(
            guided_json={"$defs": {**{f"d {i}": {"$ref": f"#/$defs/d%20{i + 1}"} for i in range(3000)},
                                   "d 3000": {"type": "string"}}, "$ref": "#/$defs/d%200"})), (400,),
            "--max-constraint-depth"),
        # memory: a huge enum, and one just inside the budget (compiled in the worker, kept within the cache)
        Attack("openai guided_json enum of 200 KiB (served)", "compiled bytes",
               post("/v1/completions", completion(guided_json=enum_schema(200 << 10))), (200,)),
        # memory: answer volume
        Attack("prompt_logprobs x logprobs x echo x n x prompts", "answer volume", post("/v1/completions", {
            "model": MODEL, "prompt": ["word " * 3000] * 4, "max_tokens": 5000, "n": 2, "logprobs": 20, "echo": True,
            "prompt_logprobs": 20}), (400,), "logprob"),
        # the refusal names the field the body set: logprobs asks for the echoed prompt's logprobs too
        Attack("echo x logprobs (the prompt's logprobs with them) x n x prompts", "answer volume",
               post("/v1/completions", {"model": MODEL, "prompt": ["word " * 6000] * 4, "max_tokens": 2, "n": 2,
                                        "logprobs": 20, "echo": True}), (400,), '"param":"logprobs"'),
        # time: stop strings
        Attack("1,000 stop strings of 200 characters", "stop strings", post("/v1/completions", completion(
            stop=[f"{i:04d}" + "z" * 196 for i in range(1000)])), (400,), "stop"),
        Attack("64 stop strings of 64 characters (served)", "stop strings", post("/v1/completions", completion(
            max_tokens=64, stop=[f"{i:02d}" + "q" * 62 for i in range(64)])), (200,)),
        # time: abandoned compiles must not delay the next structured request
        Attack("24 abandoned compiles, then a new one", "compile pool", abandoned(
            [completion(guided_choice=slow_choices(f"a{i}")) for i in range(24)], "/v1/completions",
            completion(guided_choice=["yes", "no"])), (200,)),
        Attack("24 bodies with 12,000-item lists (schema errors)", "validation off the event loop", burst(
            [completion(guided_choice=[f"b{j}-{i}" for i in range(12000)]) for j in range(24)], "/v1/completions"),
            (400,), "guided_choice"),
        # items: the pooling endpoints' lists meet the same per-array bound as every other body
        Attack("embeddings of 20,000 inputs", "request items", post("/v1/embeddings", {
            "model": MODEL, "input": ["word"] * 20_000}), (400,), "--max-request-items"),
        Attack("rerank of 20,000 documents", "request items", post("/rerank", {
            "model": MODEL, "query": "q", "documents": ["d"] * 20_000}), (400,), "--max-request-items"),
        # slots: one request may not take every running slot
        Attack("4 prompts x n=16", "slots per request", post("/v1/completions", {
            "model": MODEL, "prompt": ["Hi"] * 4, "n": 16, "max_tokens": 8}), (400,), "max-seqs-per-request"),
        # admin surface
        Attack("load_lora_adapter without a key", "admin key", post("/v1/load_lora_adapter", {
            "lora_name": "pack-x", "lora_path": "/tmp"}), (403,), "--api-key"),
        Attack("load_lora_adapter as text/plain", "admin key", post("/v1/load_lora_adapter", b'{"lora_name": "x"}',
                                                                   content_type="text/plain"), (403, 415)),
        Attack("pack upload without a key (512 MiB announced)", "admin key",
               announced_upload("/v1/lora/packs", 512 << 20), (401, 403), "--api-key"),
        Attack("a foreign Host header (DNS rebinding)", "allowed hosts", get("/v1/models", host="attacker.example"),
               (400, 403), "host"),
        # smaller: JSON text inside JSON strings
        Attack("guided_json as 10,000-deep JSON text", "body depth",
               post("/v1/completions", completion(guided_json=deep_json_text())), (400,), "guided_json"),
        Attack("tool arguments as 10,000-deep JSON text", "body depth", post("/v1/chat/completions", chat(messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "lookup", "arguments": deep_json_text()}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}])), (400,), "arguments"),
    ]


# ---- the victim and the measures ------------------------------------------------------------------


class Victim:
    """A steady streamed completion, one after another, recording when each chunk arrives."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.times: list[float] = []
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        while len(self.times) < 20:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task

    async def _run(self) -> None:
        body = {"model": MODEL, "prompt": "Count from one to a thousand:", "max_tokens": 1000, "ignore_eos": True,
                "stream": True, "temperature": 0}
        async with client_for(timeout=120) as client:
            while not self._stop.is_set():
                async with client.stream("POST", self.base + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        self.failures.append(f"victim answered {resp.status_code}")
                        await asyncio.sleep(0.1)
                        continue
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            self.times.append(time.perf_counter())
                        if self._stop.is_set():
                            break

    def largest_gap(self, start: float, end: float) -> float:
        """The longest wait between chunks over [start, end], the chunks on either side included."""
        first = max((i for i, t in enumerate(self.times) if t <= start), default=0)
        last = next((i for i, t in enumerate(self.times) if t >= end), len(self.times) - 1)
        window = self.times[first:last + 1]
        return max((b - a for a, b in itertools.pairwise(window)), default=float("inf"))


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its children (the server and its grammar worker)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            kids = [int(k) for k in fh.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


async def settled_rss(pid: int, limit_s: float = 60.0, step_bytes: int = 4 << 20, every_s: float = 1.0) -> int:
    """The tree's RSS once two readings ``every_s`` apart differ by less than ``step_bytes``."""
    deadline = time.monotonic() + limit_s
    last = tree_rss(pid)
    while time.monotonic() < deadline:
        await asyncio.sleep(every_s)
        now = tree_rss(pid)
        if abs(now - last) < step_bytes:
            return now
        last = now
    return last


class PeakRss:
    """The tree's peak RSS while it runs, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = tree_rss(pid)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> PeakRss:
        async def sample() -> None:
            while True:
                self.peak = max(self.peak, tree_rss(self.pid))
                await asyncio.sleep(0.01)
        self._task = asyncio.create_task(sample())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()


@dataclass
class Outcome:
    attack: Attack
    reply: Reply
    answer_s: float
    victim_gap_s: float  # over the attack's span (run_corpus): from its sending to the next attack's
    rss_before: int
    rss_peak: int
    rss_after: int
    sent_at: float = 0.0  # time.perf_counter() when it was sent


async def run_attack(attack: Attack, base: str, ws_url: str, pid: int, victim: Victim) -> Outcome:
    """Send one attack beside the running victim; the RSS after is the first reading within 10% of the
    one before (or the last of 15 s of readings). Its victim gap here covers only [sent, answered]:
    run_corpus gives each attack its whole span once the stream after it has arrived."""
    # settled: moving under 16 MiB/s (1.6 MiB over 0.1 s readings), as 4 MiB over 0.25 s was
    before = await settled_rss(pid, limit_s=10, step_bytes=(8 << 20) // 5, every_s=0.1)
    async with PeakRss(pid) as peak:
        sent = time.perf_counter()
        try:
            reply = await attack.send(base, ws_url)
        except (TimeoutError, OSError, httpx.HTTPError, websockets.WebSocketException) as exc:
            reply = Reply(-1, f"no answer: {exc!r}")  # fails this attack's check, not the corpus
        answered = time.perf_counter()
    after = tree_rss(pid)
    deadline = time.monotonic() + 15
    while after > 1.1 * before and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        after = tree_rss(pid)
    return Outcome(attack, reply, answered - sent, victim.largest_gap(sent, answered), before, peak.peak, after,
                   sent)


# The stream just after the last answer that still counts as that attack's.
AFTER_LAST_S = 0.3


async def run_corpus(corpus: list[Attack], base: str, ws_url: str, pid: int, victim: Victim) -> list[Outcome]:
    """Every attack in turn. Each one's victim gap covers its whole span, from its sending to the next
    one's sending (the last: to AFTER_LAST_S after its answer), with no moment of the stream left out; it
    is read once a chunk after the span has arrived, so a stall still running when the next attack goes
    out counts whole (up to 30 s) rather than only as far as it had got."""
    outcomes = [await run_attack(attack, base, ws_url, pid, victim) for attack in corpus]
    if not outcomes:
        return []
    ends = [o.sent_at for o in outcomes[1:]] + [outcomes[-1].sent_at + outcomes[-1].answer_s + AFTER_LAST_S]
    deadline = time.monotonic() + 30
    while (not victim.times or victim.times[-1] < ends[-1]) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    now = time.perf_counter()
    stalled = now - victim.times[-1] if victim.times and victim.times[-1] < ends[-1] else 0.0
    gaps = [victim.largest_gap(o.sent_at, end) for o, end in zip(outcomes, ends)]
    gaps[-1] = max(gaps[-1], stalled)
    return [dataclasses.replace(o, victim_gap_s=gap) for o, gap in zip(outcomes, gaps)]
