"""GET /openapi.json: an OpenAPI 3.1 document assembled from the files in schemas/, so the contract
that validates requests is the contract that is published."""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

import schemas
from bridges.context import ServingContext, with_context
from bridges.registry import Operation, Protocol, Registry


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


def build_document(registry: Registry, title: str = "spark-server") -> dict[str, Any]:
    components = {n: _rewrite(schemas.load_schema(n), n) for n in schemas.available()}
    paths: dict[str, Any] = {}
    shared: dict[tuple[str, str], list[Operation]] = {}
    for _, operation in registry.operations:
        if operation.method in ("POST", "GET", "DELETE"):
            shared.setdefault((operation.path, operation.method.lower()), []).append(operation)
    for (path, method), ops in shared.items():
        op: dict[str, Any] = {"summary": " | ".join(o.summary for o in ops)}
        names = [n for o in ops for n in o.schemas]
        if names:
            refs = [{"$ref": f"#/components/schemas/{n}"} for n in names]
            body_schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
            content: dict[str, dict[str, Any]] = {"application/json": {"schema": {}}}
            if any(o.streams for o in ops):
                content["text/event-stream"] = {"schema": {"type": "string"}}
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_schema}}}
            op["responses"] = {"200": {"description": "the answer", "content": content},
                               "400": {"description": "malformed or invalid request"},
                               "404": {"description": "unknown model or adapter"},
                               "422": {"description": "invalid request (TGI)"},
                               "429": {"description": "busy; retry later"}}
        else:
            op["responses"] = {"200": {"description": "ok"}}
        names = re.findall(r"{(\w+)}", path)
        if names:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                for n in names]
            op["responses"].setdefault("404", {"description": f"unknown {names[0].replace('_', ' ')}"})
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": "0.1.0"},
            "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
            "paths": paths, "components": {"schemas": components}}


@with_context
async def openapi_json(request: Request, ctx: ServingContext) -> JSONResponse:
    return JSONResponse(build_document(ctx.registry))


PROTOCOL = Protocol("openapi", (Operation("GET", "/openapi.json", openapi_json, "this document"),))
