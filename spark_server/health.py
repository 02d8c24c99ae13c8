"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from bridges.context import ServingContext, with_context


@with_context
async def health(request: Request, ctx: ServingContext) -> JSONResponse:
    engine = ctx.engine
    healthy = engine.is_healthy()
    body: dict[str, Any] = {"status": "ok" if healthy else "unhealthy", "model": engine.model_info.name}
    stats = engine.stats()
    body.update(num_requests_running=stats.num_requests_running, num_requests_waiting=stats.num_requests_waiting,
                kv_cache_usage=round(stats.kv_cache_usage, 6), kv_cache_blocks_used=stats.kv_cache_blocks_used)
    if stats.backends:  # a front end over a fleet: ready while one backend is; "degraded" names the rest
        body["backends"] = [{"url": url, "healthy": ok, **({"note": why} if why else {})}
                            for url, ok, why in stats.backends]
        if healthy and not all(ok for _, ok, _ in stats.backends):
            body["status"] = "degraded"
    return JSONResponse(body, status_code=200 if healthy else 503)
