"""One module per foreign protocol; each maps its requests onto GenerationRequests and renders the
engine's outputs in its own wire format."""

from __future__ import annotations

from typing import Any

from starlette.routing import BaseRoute, Route


def all_routes(settings: Any) -> list[BaseRoute]:
    from bridges import generate_router, mindie, openai, openapi, sglang, tgi, tokenizer, triton

    return [
        *openai.ROUTES,
        Route("/generate", generate_router.generate, methods=["POST"]),
        *tgi.routes(settings),
        Route("/get_model_info", sglang.get_model_info, methods=["GET"]),
        *triton.ROUTES,
        *mindie.ROUTES,
        *tokenizer.ROUTES,
        Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
    ]
