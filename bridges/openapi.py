"""GET /openapi.json: an OpenAPI 3.1 document assembled from the files in schemas/, so the contract
that validates requests is the contract that is published."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

import schemas

# (path, method, request schema(s), summary, streams)
OPERATIONS: list[tuple[str, str, list[str], str, bool]] = [
    ("/turing/v3/func/gpt", "post", ["spark-request"], "Spark conversation, one JSON answer "
     "(the WebSocket /turing/v3/gpt takes the same body)", False),
    ("/v1/completions", "post", ["openai-completion"], "OpenAI completions", True),
    ("/v1/chat/completions", "post", ["openai-chat"], "OpenAI chat completions", True),
    ("/generate", "post", ["tgi-generate", "vllm-generate", "sglang-generate"],
     "TGI (`inputs`), vLLM (`prompt`) or SGLang (`text` / `input_ids`), told apart by the body", True),
    ("/generate_stream", "post", ["tgi-generate"], "TGI streaming generation", True),
    ("/v2/models/{model}/generate", "post", ["triton-generate"], "Triton text generation", False),
    ("/v2/models/{model}/generate_stream", "post", ["triton-generate"], "Triton streaming generation", True),
    ("/v2/models/{model}/infer", "post", ["triton-infer"], "Triton token-id inference", False),
    ("/infer", "post", ["mindie-infer"], "MindIE native inference", True),
    ("/v1/tokenizer", "post", ["tokenizer"], "MindIE token count", False),
    ("/tokenize", "post", ["vllm-tokenize"], "vLLM tokenize", False),
    ("/detokenize", "post", ["vllm-detokenize"], "vLLM detokenize", False),
]
GETS = [("/v1/models", "OpenAI model list"), ("/health", "ready when the model is loaded"),
        ("/get_model_info", "SGLang model info"), ("/v2/health/ready", "Triton readiness"),
        ("/v2/health/live", "Triton liveness"), ("/v2/models/{model}", "Triton model metadata")]


def _rewrite(node: Any, name: str) -> Any:
    """URN and local references -> pointers into components/schemas; drop per-file $id/$schema."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key in ("$id", "$schema"):
                continue
            if key == "$ref" and isinstance(value, str):
                if value.startswith(schemas.URN_PREFIX):
                    target, _, pointer = value[len(schemas.URN_PREFIX):].partition("#")
                    value = f"#/components/schemas/{target}{pointer}"
                elif value.startswith("#"):
                    value = f"#/components/schemas/{name}{value[1:]}"
            out[key] = _rewrite(value, name)
        return out
    if isinstance(node, list):
        return [_rewrite(v, name) for v in node]
    return node


def build_document(title: str = "spark-server") -> dict[str, Any]:
    components = {n: _rewrite(schemas.load_schema(n), n) for n in schemas.available()}
    paths: dict[str, Any] = {}
    for path, method, names, summary, streams in OPERATIONS:
        refs = [{"$ref": f"#/components/schemas/{n}"} for n in names]
        body_schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
        content = {"application/json": {"schema": {}}}
        if streams:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        op: dict[str, Any] = {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema}}},
            "responses": {"200": {"description": "the answer", "content": content},
                          "400": {"description": "malformed or invalid request"},
                          "404": {"description": "unknown model or adapter"},
                          "422": {"description": "invalid request (TGI)"},
                          "429": {"description": "busy; retry later"}},
        }
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(path, {})[method] = op
    for path, summary in GETS:
        op = {"summary": summary, "responses": {"200": {"description": "ok"}}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
            op["responses"]["404"] = {"description": "unknown model"}
        paths[path] = {"get": op}
    return {"openapi": "3.1.0", "info": {"title": title, "version": "0.1.0"},
            "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
            "paths": paths, "components": {"schemas": components}}


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(build_document())
