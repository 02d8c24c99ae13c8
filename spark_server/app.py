"""The app factory: Spark endpoints (and, later, every bridge) on one Starlette app."""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.routing import Route, WebSocketRoute

from bridges import all_routes
from engine.protocol import EngineClient
from spark_server.health import health
from spark_server.settings import Settings
from spark_server.spark_http import spark_http
from spark_server.spark_service import SparkService
from spark_server.spark_ws import spark_websocket

logger = logging.getLogger(__name__)

SPARK_WS_PATH = "/turing/v3/gpt"
SPARK_HTTP_PATH = "/turing/v3/func/gpt"


def build_app(settings: Settings, engine: EngineClient, owns_engine: bool = True) -> Starlette:
    """``engine`` is started/stopped with the app when ``owns_engine``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if owns_engine and hasattr(engine, "start"):
            engine.start()
        try:
            yield
        finally:
            if owns_engine and hasattr(engine, "shutdown"):
                engine.shutdown()

    routes = [
        WebSocketRoute(SPARK_WS_PATH, spark_websocket),
        Route(SPARK_HTTP_PATH, spark_http, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        *all_routes(settings),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.spark = SparkService(engine, history_limit=settings.max_history_tokens)
    return app
