"""Every endpoint the corpus attacks: its path, a small valid body, where its text, number and
token-id fields are, and the code it documents for each kind of bad input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

M = "SmolLM2-135M-Instruct"
SPARK_CODES = {"syntax": 4, "not_object": 10000, "json_content": 10000, "content": 10000, "too_long": 10003,
               "no_content": 10002, "lora_off": 12000, "ok": 0}
BRIDGE_STATUS = {"syntax": 400, "not_object": 400, "json_content": 400, "content": 400, "too_large": 413,
                 "too_long": 400, "ok": 200}


@dataclass(frozen=True)
class Target:
    path: str  # "ws" for the Spark WebSocket
    base: dict[str, Any]
    text_path: tuple
    number_path: tuple | None
    ids_path: tuple | None = None
    statuses: dict[str, int] = field(default_factory=dict)  # where this endpoint differs from BRIDGE_STATUS
    overrides: dict[str, str] = field(default_factory=dict)  # case label -> kind, where the spec says so
    skip: frozenset[str] = frozenset()  # case labels that do not apply to this endpoint

    def expect(self, kind: str) -> dict[str, int]:
        if self.path == "ws":
            return {"spark": SPARK_CODES[kind]}
        if self.path == "/turing/v3/func/gpt":
            if kind == "too_large":
                return {"status": 413}
            code = SPARK_CODES[kind]
            return {"spark": code, "status": 200 if code == 0 else 400}
        return {"status": self.statuses.get(kind, BRIDGE_STATUS[kind])}


def _spark() -> dict[str, Any]:
    return {"header": {"traceId": "fuzz"}, "parameter": {"chat": {"max_tokens": 2, "top_k": 1}},
            "payload": {"message": {"text": [{"role": "user", "content": "Hi"}]}}}


# /generate is shared: the router answers a non-object 422 and bad JSON 400 itself; TGI answers 422
# for a body that parses but is invalid.
_ROUTED = {"not_object": 422}
_TGI = {"not_object": 422, "content": 422, "json_content": 422, "too_long": 422}

TARGETS: dict[str, Target] = {
    "spark_ws": Target("ws", _spark(), ("payload", "message", "text", 0, "content"),
                       ("parameter", "chat", "max_tokens"),  # frames over --max-frame-mb are closed with 1009
                       skip=frozenset({"over the body limit", "over the body limit, chunked"})),
    "spark_http": Target("/turing/v3/func/gpt", _spark(), ("payload", "message", "text", 0, "content"),
                         ("parameter", "chat", "max_tokens")),
    "openai_completions": Target("/v1/completions", {"model": M, "prompt": "Hi", "max_tokens": 2}, ("prompt",),
                                 ("max_tokens",), ("stop_token_ids",)),
    "openai_chat": Target("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 2}, ("messages", 0, "content"), ("max_tokens",),
                          ("stop_token_ids",), overrides={"text field null": "ok"}),  # content may be null
    "openai_chat_stream": Target("/v1/chat/completions", {"model": M, "stream": True, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]},
                                 ("messages", 0, "content"), ("temperature",), ("stop_token_ids",),
                                 overrides={"fraction": "ok", "text field null": "ok"}),
    "tgi_generate": Target("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, ("inputs",),
                           ("parameters", "max_new_tokens"), statuses={**_TGI, "json_content": 400}),
    "tgi_stream": Target("/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, ("inputs",),
                         ("parameters", "temperature"), statuses=_TGI, overrides={"fraction": "ok"}),
    "vllm_generate": Target("/generate", {"prompt": "Hi", "max_tokens": 2}, ("prompt",), ("max_tokens",),
                            ("stop_token_ids",), statuses=_ROUTED,
                            overrides={"negative": "ok"}),  # the spec: ids outside int32 are ignored
    "sglang_generate": Target("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}, ("text",),
                              ("sampling_params", "max_new_tokens"), ("sampling_params", "stop_token_ids"),
                              statuses=_ROUTED),
    "sglang_input_ids": Target("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                               ("sampling_params", "stop"), ("sampling_params", "temperature"), ("input_ids",),
                               statuses=_ROUTED, overrides={"fraction": "ok", "text field null": "ok"},
                               skip=frozenset({"over the context, by size"})),
    "triton_generate": Target(f"/v2/models/{M}/generate", {"text_input": "Hi", "parameters": {"max_new_tokens": 2}},
                              ("text_input",), ("parameters", "max_new_tokens"), statuses={"too_large": 413}),
    "triton_stream": Target(f"/v2/models/{M}/generate_stream", {"text_input": "Hi", "parameters": {
        "max_new_tokens": 2}}, ("text_input",), ("parameters", "top_k")),
    "triton_infer": Target(f"/v2/models/{M}/infer", {"inputs": [{"name": "input0", "shape": [1, 2],
                                                                 "datatype": "UINT32", "data": [1, 2]}],
                                                     "outputs": [{"name": "output0"}],
                                                     "parameters": {"max_new_tokens": 2}},
                           ("outputs", 0, "name"), ("parameters", "max_new_tokens"), ("inputs", 0, "data"),
                           skip=frozenset({"over the context, by size"})),
    "mindie_infer": Target("/infer", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, ("inputs",),
                           ("parameters", "max_new_tokens")),
    # tokenizers have no context limit: a long text is simply counted
    "tokenize": Target("/tokenize", {"prompt": "Hi"}, ("prompt",), None, skip=frozenset({"over the context, by size"})),
    "mindie_tokenizer": Target("/v1/tokenizer", {"inputs": "Hi"}, ("inputs",), None,
                               skip=frozenset({"over the context, by size"})),
}
