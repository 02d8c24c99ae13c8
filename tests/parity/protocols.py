"""One adapter per protocol for the parity harness: what the protocol can express (``Caps``), how a
protocol-neutral ``Ask`` is written in its words, and how its answer, finish reason, usage, tool calls
and errors read back as a protocol-neutral ``Outcome``. Adding a protocol is one entry in ``ADAPTERS``.

Finish reasons are mapped to four words: ``end`` (the model ended), ``stop_string`` (a stop string
matched), ``length`` (the token limit) and ``tool_call``; a protocol that says one word for the first
two reads as ``stop``. Errors are mapped to two classes: ``invalid`` (the request was refused before any
work) and ``engine`` (the engine failed once the answer had begun); a refusal also keeps its HTTP status
and the protocol's own words for it (``Outcome.words``: OpenAI's type and code, Anthropic's type, a Spark
header's code, TGI's error_type), which the error table's test reads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from spark_server.app import SPARK_HTTP_PATH, SPARK_WS_PATH

TIMEOUT = 120.0


@dataclass(frozen=True)
class Ask:
    """One request of the conversation in neutral words: OpenAI-chat-shaped messages (tool calls as an
    assistant's ``tool_calls``, results as ``tool`` messages) and tools as OpenAI function tools."""

    messages: list[dict[str, Any]]
    max_tokens: int
    sampling: dict[str, Any] | None = None  # None: greedy; else temperature, top_p, top_k, seed
    stop: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    invalid: bool = False  # send temperature -1, which every protocol refuses
    stream: bool = False  # streamed where the protocol streams (the engine-failure case)


@dataclass
class Outcome:
    text: str = ""
    prompt_tokens: int | None = None  # None: the protocol does not report it
    completion_tokens: int | None = None
    finish: str | None = None  # end | stop_string | stop (either) | length | tool_call; None: not reported
    calls: list[tuple[str, dict]] = field(default_factory=list)
    error: str | None = None  # invalid | engine
    message: str = ""  # the error's message
    status: int | None = None  # a refusal's HTTP status (None: none, as on a WebSocket)
    words: dict[str, Any] = field(default_factory=dict)  # the protocol's own words for the error


@dataclass(frozen=True)
class Caps:
    """What a protocol can say; the harness skips (and the table shows) what it cannot."""

    chat: bool  # takes a conversation (else a prompt text: the conversation rendered by the chat template)
    tools: bool
    seed: bool
    stop: bool
    usage: str  # which token counts it reports: "both", "output", "none"
    finish: str  # how it tells the answer's end: "full" (end, stop string, length), "coarse" (stop, length), "none"
    streams: bool
    note: str = ""


@dataclass(frozen=True)
class Adapter:
    name: str  # as the table names it
    endpoint: str
    caps: Caps
    send: Callable[[str, Ask, str], Outcome]  # (server URL, ask, the conversation as prompt text)


_CLIENT: httpx.Client | None = None


def _http(method: str, url: str, **kw: Any) -> httpx.Response:
    """One shared client: a fresh one per request costs ~0.1 s (its TLS context), more than the answer."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=TIMEOUT)
    return _CLIENT.request(method, url, **kw)


def _sse(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def _with_temperature(ask: Ask) -> float:
    return -1.0 if ask.invalid else ((ask.sampling or {}).get("temperature", 0.0))


# ---- Spark ----------------------------------------------------------------------------------------


def _spark_body(ask: Ask) -> dict[str, Any]:
    chat: dict[str, Any] = {"max_tokens": ask.max_tokens, "temperature": _with_temperature(ask)}
    if ask.sampling:
        chat["top_k"] = ask.sampling["top_k"]
    body: dict[str, Any] = {"header": {"traceId": "parity"}, "parameter": {"chat": chat},
                            "payload": {"message": {"text": ask.messages}}}
    if ask.tools:  # where iFlytek's public form carries them
        body["payload"]["functions"] = {"text": [t["function"] for t in ask.tools]}
    return body


def _spark_outcome(frames: list[dict[str, Any]]) -> Outcome:
    out = Outcome()
    for frame in frames:
        header = frame["header"]
        if header["code"] != 0:
            out.error = "invalid" if 10000 <= header["code"] < 11000 else "engine"
            out.message = header["message"]
            out.words = {"code": header["code"]}
            return out
        out.text += "".join(t["content"] for t in frame["payload"]["choices"]["text"])
        usage = (frame["payload"].get("usage") or {}).get("text")
        if usage:
            out.prompt_tokens, out.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    return out


def spark_ws(url: str, ask: Ask, prompt: str) -> Outcome:
    import websockets

    async def converse() -> list[dict[str, Any]]:
        frames = []
        async with websockets.connect(url.replace("http", "ws", 1) + SPARK_WS_PATH, max_size=None) as ws:
            await ws.send(json.dumps(_spark_body(ask)))
            async for message in ws:
                frames.append(json.loads(message))
        return frames

    return _spark_outcome(asyncio.run(converse()))


def spark_http(url: str, ask: Ask, prompt: str) -> Outcome:
    r = _http("POST", url + SPARK_HTTP_PATH, json=_spark_body(ask))
    out = _spark_outcome([r.json()])
    if out.error is not None:
        out.status = r.status_code
    # the document's markers: <ret> for a newline, <end> after the answer
    out.text = out.text.replace("<ret>", "\n").removesuffix("<end>")
    return out


# ---- OpenAI ---------------------------------------------------------------------------------------


def _openai_sampling(ask: Ask) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": ask.max_tokens, "temperature": _with_temperature(ask)}
    body.update({k: v for k, v in (ask.sampling or {}).items() if k != "temperature"})
    if ask.stop:
        body["stop"] = ask.stop
    return body


def _openai_finish(reason: str | None, stop_reason: Any) -> str | None:
    if reason == "stop":
        return "stop_string" if isinstance(stop_reason, str) else "end"
    return {"length": "length", "tool_calls": "tool_call"}.get(reason or "", reason)


def _openai_error(r: httpx.Response) -> Outcome:
    error = r.json()["error"]
    return Outcome(error="invalid" if r.status_code < 500 else "engine", message=error["message"],
                   status=r.status_code, words={"type": error["type"], "code": error["code"]})


def _openai_stream_error(events: list[str]) -> Outcome | None:
    for e in events:
        if e != "[DONE]" and "error" in json.loads(e):
            return Outcome(error="engine", message=json.loads(e)["error"]["message"])
    return None


def openai_chat(url: str, ask: Ask, prompt: str) -> Outcome:
    body = {"messages": ask.messages, **_openai_sampling(ask)}
    if ask.tools:
        body["tools"] = ask.tools
    if ask.stream:
        r = _http("POST", url + "/v1/chat/completions", json={**body, "stream": True})
        if r.status_code != 200:
            return _openai_error(r)
        events = _sse(r.text)
        failed = _openai_stream_error(events)
        if failed:
            return failed
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        return Outcome(text="".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]))
    r = _http("POST", url + "/v1/chat/completions", json=body)
    if r.status_code != 200:
        return _openai_error(r)
    data = r.json()
    choice, usage = data["choices"][0], data["usage"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in choice["message"].get("tool_calls") or []]
    return Outcome(choice["message"]["content"] or "", usage["prompt_tokens"], usage["completion_tokens"],
                   _openai_finish(choice["finish_reason"], choice.get("stop_reason")), calls)


def openai_completions(url: str, ask: Ask, prompt: str) -> Outcome:
    body: dict[str, Any] = {"prompt": prompt, **_openai_sampling(ask)}
    if ask.tools:
        body["tools"] = ask.tools
    r = _http("POST", url + "/v1/completions", json={**body, "stream": ask.stream})
    if r.status_code != 200:
        return _openai_error(r)
    if ask.stream:
        events = _sse(r.text)
        failed = _openai_stream_error(events)
        if failed:
            return failed
        return Outcome(text="".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]"))
    data = r.json()
    choice, usage = data["choices"][0], data["usage"]
    return Outcome(choice["text"], usage["prompt_tokens"], usage["completion_tokens"],
                   _openai_finish(choice["finish_reason"], choice.get("stop_reason")))


# ---- OpenAI Responses -----------------------------------------------------------------------------


def _responses_input(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        elif m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


def openai_responses(url: str, ask: Ask, prompt: str) -> Outcome:
    body: dict[str, Any] = {"input": _responses_input(ask.messages), "max_output_tokens": ask.max_tokens,
                            "temperature": _with_temperature(ask), "stream": ask.stream}
    if ask.sampling:
        body["top_p"] = ask.sampling["top_p"]
    if ask.tools:
        body["tools"] = [{"type": "function", **t["function"]} for t in ask.tools]
    r = _http("POST", url + "/v1/responses", json=body)
    if r.status_code != 200:
        return _openai_error(r)
    if ask.stream:
        out = Outcome()
        for e in _sse(r.text):
            data = json.loads(e)
            if data["type"] == "error":
                return Outcome(error="engine", message=data["message"])
            if data["type"] == "response.output_text.delta":
                out.text += data["delta"]
        return out
    data = r.json()
    text = "".join(part["text"] for item in data["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    calls = [(item["name"], json.loads(item["arguments"]))
             for item in data["output"] if item["type"] == "function_call"]
    finish = "tool_call" if calls else {"completed": "stop", "incomplete": "length"}.get(data["status"])
    usage = data["usage"]
    return Outcome(text, usage["input_tokens"], usage["output_tokens"], finish, calls)


# ---- Anthropic Messages ---------------------------------------------------------------------------


def _anthropic_messages(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    system, out = None, []
    for m in messages:
        if m["role"] == "system":
            system = m["content"]
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                     "content": m["content"]}]})
        elif m.get("tool_calls"):
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return system, out


def anthropic_messages(url: str, ask: Ask, prompt: str) -> Outcome:
    system, messages = _anthropic_messages(ask.messages)
    body: dict[str, Any] = {"model": _model(url), "messages": messages, "max_tokens": ask.max_tokens,
                            "temperature": _with_temperature(ask)}
    if system:
        body["system"] = system
    body.update({k: v for k, v in (ask.sampling or {}).items() if k != "temperature"})
    if ask.stop:
        body["stop_sequences"] = ask.stop
    if ask.tools:
        body["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                          "input_schema": t["function"]["parameters"]} for t in ask.tools]
    r = _http("POST", url + "/v1/messages", json={**body, "stream": ask.stream})
    if r.status_code != 200:
        error = r.json()["error"]
        return Outcome(error="invalid" if r.status_code < 500 else "engine", message=error["message"],
                       status=r.status_code, words={"type": error["type"]})
    if ask.stream:
        out = Outcome()
        for chunk in r.text.strip().split("\n\n"):
            name, data = (line.split(": ", 1)[1] for line in chunk.splitlines())
            if name == "error":
                return Outcome(error="engine", message=json.loads(data)["error"]["message"])
            delta = json.loads(data).get("delta") or {}
            out.text += delta.get("text", "")
        return out
    data = r.json()
    finish = {"end_turn": "end", "stop_sequence": "stop_string", "max_tokens": "length", "tool_use": "tool_call"}
    usage = data["usage"]
    return Outcome("".join(b["text"] for b in data["content"] if b["type"] == "text"),
                   usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"],
                   finish[data["stop_reason"]], [(b["name"], b["input"]) for b in data["content"]
                                                 if b["type"] == "tool_use"])


_MODELS: dict[str, str] = {}


def _model(url: str) -> str:
    """The served model's name (Anthropic's and Triton's requests name it)."""
    if url not in _MODELS:
        _MODELS[url] = _http("GET", url + "/v1/models").json()["data"][0]["id"]
    return _MODELS[url]


# ---- Ollama ---------------------------------------------------------------------------------------


def ollama_chat(url: str, ask: Ask, prompt: str) -> Outcome:
    # Ollama's own defaults (top_k 40, top_p 0.9, repeat_penalty 1.1) are set to the neutral values
    options: dict[str, Any] = {"num_predict": ask.max_tokens, "temperature": _with_temperature(ask),
                               "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0}
    options.update({k: v for k, v in (ask.sampling or {}).items() if k != "temperature"})
    if ask.stop:
        options["stop"] = ask.stop
    body: dict[str, Any] = {"model": _model(url), "messages": ask.messages, "options": options, "stream": ask.stream}
    if ask.tools:
        body["tools"] = ask.tools
    r = _http("POST", url + "/api/chat", json=body)
    if r.status_code != 200:
        return Outcome(error="invalid" if r.status_code < 500 else "engine", message=r.json()["error"],
                       status=r.status_code)
    lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    out = Outcome()
    for line in lines:
        if "error" in line:
            return Outcome(error="engine", message=line["error"])
        out.text += line["message"]["content"]
    last = lines[-1]
    out.prompt_tokens, out.completion_tokens = last.get("prompt_eval_count"), last.get("eval_count")
    out.finish = {"stop": "stop", "length": "length"}.get(last.get("done_reason"))
    return out


# ---- the text-generation family: TGI, Triton, MindIE ---------------------------------------------


def _textgen_parameters(ask: Ask) -> dict[str, Any]:
    p: dict[str, Any] = {"max_new_tokens": ask.max_tokens, "details": True}
    if ask.invalid:
        p["temperature"] = -1.0
    elif ask.sampling:
        p.update(do_sample=True, **ask.sampling)
    else:
        p["do_sample"] = False
    if ask.stop:
        p["stop"] = ask.stop
    return p


def _textgen_finish(details: dict[str, Any] | None) -> str | None:
    reason = (details or {}).get("finish_reason")
    return {"eos_token": "end", "stop_sequence": "stop_string", "length": "length"}.get(reason or "", reason)


def _textgen_error(r: httpx.Response, kinds: tuple[str, ...] = ("validation",)) -> Outcome:
    body = r.json()
    invalid = r.status_code < 500 if "error_type" not in body else body["error_type"] in kinds
    return Outcome(error="invalid" if invalid else "engine", message=body["error"], status=r.status_code,
                   words={"error_type": body["error_type"]} if "error_type" in body else {})


def _textgen_stream(r: httpx.Response, text_of: Callable[[dict], str]) -> Outcome:
    out = Outcome()
    for e in _sse(r.text):
        event = json.loads(e)
        if "error" in event:
            return Outcome(error="engine", message=event["error"])
        out.text += text_of(event)
    return out


def tgi(url: str, ask: Ask, prompt: str) -> Outcome:
    body: dict[str, Any] = {"inputs": prompt, "parameters": _textgen_parameters(ask)}
    if ask.tools:
        body["tools"] = ask.tools
    if ask.stream:
        r = _http("POST", url + "/generate_stream", json=body)
        return _textgen_error(r) if r.status_code != 200 else _textgen_stream(r, lambda e: e["token"]["text"])
    r = _http("POST", url + "/generate", json=body)
    if r.status_code != 200:
        return _textgen_error(r)
    data = r.json()
    details = data.get("details") or {}
    return Outcome(data["generated_text"], None, details.get("generated_tokens"), _textgen_finish(details))


def triton(url: str, ask: Ask, prompt: str) -> Outcome:
    body: dict[str, Any] = {"text_input": prompt, "parameters": _textgen_parameters(ask)}
    if ask.tools:
        body["tools"] = ask.tools
    base = f"{url}/v2/models/{_model(url)}"
    if ask.stream:
        r = _http("POST", base + "/generate_stream", json=body)
        return _textgen_error(r) if r.status_code != 200 else _textgen_stream(r, lambda e: e["text_output"])
    r = _http("POST", base + "/generate", json=body)
    if r.status_code != 200:
        return _textgen_error(r)
    data = r.json()
    details = data.get("details") or {}
    return Outcome(data["text_output"], None, details.get("generated_tokens"), _textgen_finish(details))


def mindie(url: str, ask: Ask, prompt: str) -> Outcome:
    body: dict[str, Any] = {"inputs": prompt, "parameters": _textgen_parameters(ask), "stream": ask.stream}
    if ask.tools:
        body["tools"] = ask.tools
    r = _http("POST", url + "/infer", json=body)
    if r.status_code != 200:
        return _textgen_error(r, ("validation", "invalid_request_error"))
    if ask.stream:
        return _textgen_stream(r, lambda e: e["token"]["text"])
    data = r.json()
    details = data.get("details") or {}
    return Outcome(data["generated_text"], None, details.get("generated_tokens"), _textgen_finish(details))


# ---- vLLM and SGLang native -----------------------------------------------------------------------


def vllm(url: str, ask: Ask, prompt: str) -> Outcome:
    body: dict[str, Any] = {"prompt": prompt, **_openai_sampling(ask), "stream": ask.stream}
    if ask.tools:
        body["tools"] = ask.tools
    r = _http("POST", url + "/generate", json=body)
    if r.status_code != 200:
        error = r.json()
        return Outcome(error="invalid" if r.status_code < 500 else "engine", message=error["error"],
                       status=r.status_code, words={"type": error["type"], "code": error["code"]})
    if ask.stream:
        out = Outcome()
        for chunk in (c for c in r.content.split(b"\0") if c):
            data = json.loads(chunk)
            if "error" in data:
                return Outcome(error="engine", message=data["error"])
            out.text += data["text"][0]
        return out
    return Outcome(r.json()["text"][0][len(prompt):])


def sglang(url: str, ask: Ask, prompt: str) -> Outcome:
    sp: dict[str, Any] = {"max_new_tokens": ask.max_tokens, "temperature": _with_temperature(ask)}
    sp.update({k: v for k, v in (ask.sampling or {}).items() if k != "temperature"})
    if ask.stop:
        sp["stop"] = ask.stop
    body: dict[str, Any] = {"text": prompt, "sampling_params": sp, "stream": ask.stream}
    if ask.tools:
        body["tools"] = ask.tools
    r = _http("POST", url + "/generate", json=body)
    if r.status_code != 200:
        error = r.json()["error"]
        return Outcome(error="invalid" if r.status_code < 500 else "engine", message=error["message"],
                       status=r.status_code, words={"type": error["type"], "code": error["code"]})
    if ask.stream:
        out = Outcome()
        for e in _sse(r.text):
            if e == "[DONE]":
                continue
            data = json.loads(e)
            if "error" in data:
                return Outcome(error="engine", message=data["error"]["message"])
            out.text += data["text"][len(out.text):]  # SGLang streams the text so far
        return out
    data = r.json()
    meta = data["meta_info"]
    finish = meta.get("finish_reason") or {}
    word = {"length": "length"}.get(str(finish.get("type")), "stop_string" if isinstance(finish.get("matched"), str)
                                    else "end")
    return Outcome(data["text"], meta["prompt_tokens"], meta["completion_tokens"], word)


BOTH, COARSE, FULL = "both", "coarse", "full"
ADAPTERS: tuple[Adapter, ...] = (
    Adapter("Spark WebSocket", SPARK_WS_PATH, Caps(chat=True, tools=False, seed=False, stop=False, usage=BOTH,
                                                   finish="none", streams=True,
                                                   note="greedy is temperature 0; top_k at most 6"), spark_ws),
    Adapter("Spark HTTP", SPARK_HTTP_PATH, Caps(chat=True, tools=False, seed=False, stop=False, usage=BOTH,
                                                finish="none", streams=False), spark_http),
    Adapter("OpenAI chat", "/v1/chat/completions", Caps(chat=True, tools=True, seed=True, stop=True, usage=BOTH,
                                                        finish=FULL, streams=True), openai_chat),
    Adapter("OpenAI completions", "/v1/completions", Caps(chat=False, tools=False, seed=True, stop=True, usage=BOTH,
                                                          finish=FULL, streams=True), openai_completions),
    Adapter("OpenAI Responses", "/v1/responses", Caps(chat=True, tools=True, seed=False, stop=False, usage=BOTH,
                                                      finish=COARSE, streams=True,
                                                      note="finish is the status: completed or incomplete"),
            openai_responses),
    Adapter("Anthropic Messages", "/v1/messages", Caps(chat=True, tools=True, seed=True, stop=True, usage=BOTH,
                                                       finish=FULL, streams=True,
                                                       note="seed, top_k, top_p as body extensions"),
            anthropic_messages),
    Adapter("Ollama", "/api/chat", Caps(chat=True, tools=False, seed=True, stop=True, usage=BOTH, finish=COARSE,
                                        streams=True), ollama_chat),
    Adapter("TGI", "/generate", Caps(chat=False, tools=False, seed=True, stop=True, usage="output", finish=FULL,
                                     streams=True, note="greedy is do_sample false"), tgi),
    Adapter("vLLM", "/generate", Caps(chat=False, tools=False, seed=True, stop=True, usage="none", finish="none",
                                      streams=True), vllm),
    Adapter("SGLang", "/generate", Caps(chat=False, tools=False, seed=True, stop=True, usage=BOTH, finish=FULL,
                                        streams=True), sglang),
    Adapter("Triton", "/v2/models/{model}/generate", Caps(chat=False, tools=False, seed=True, stop=True,
                                                          usage="output", finish=FULL, streams=True), triton),
    Adapter("MindIE", "/infer", Caps(chat=False, tools=False, seed=True, stop=True, usage="output", finish=FULL,
                                     streams=True), mindie),
)
