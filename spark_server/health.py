"""Liveness and readiness."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse


async def health(request: Request) -> JSONResponse:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    healthy = engine.is_healthy()
    body = {"status": "ok" if healthy else "unhealthy", "model": engine.model_info.name}
    core = getattr(engine, "engine", None)
    if core is not None:
        body.update(num_requests_running=core.num_running, num_requests_waiting=core.num_waiting,
                    kv_cache_usage=round(core.kv_cache_usage(), 6),
                    kv_cache_blocks_used=core.block_manager.num_used_blocks)
    return JSONResponse(body, status_code=200 if healthy else 503)
