"""A Spark session from request bytes to frames, shared by the WebSocket and HTTP endpoints."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import schemas
from bridges.log_safety import protect
from engine.protocol import EngineClient
from lora_store.resolver import LoraResolver, resolve_lora
from schemas.json_body import MAX_ITEMS
from spark_server import spark_protocol as sp
from spark_server import spark_public
from spark_server.errors import SparkCode, spark_error_from
from spark_server.spark_public import PublicSettings

ABORTED = "aborted"  # the result label of a session whose client left mid-answer
logger = protect(logging.getLogger("spark_server.sessions"))


class SparkService:
    def __init__(self, engine: EngineClient, history_limit: int = 8192,
                 on_result: Callable[[str, int | str], None] | None = None, max_items: int = MAX_ITEMS,
                 lora_resolver: LoraResolver | None = None) -> None:
        self.engine = engine
        self.lora_resolver = lora_resolver
        self.history_limit = history_limit
        self.max_items = max_items  # --max-request-items
        self.on_result = on_result  # (protocol, code or "aborted") of every finished session, for metrics

    async def open_session(self, raw: str | bytes, sid: str, client: str | None = None,
                           public: PublicSettings | None = None, key: str | None = None) -> sp.SparkSession:
        """Parse, validate and lower one request; raises SparkError with the protocol's code. ``client``: who
        sent it (``bridges.common.client_identity``), for the engine's fair share between clients;
        ``public``: the request is in iFlytek's public form (spark_public.py), signed by ``key`` if any."""
        try:
            return await self._open_session(raw, sid, client, public, key)
        except Exception as exc:
            if self.on_result is not None:
                self.on_result("spark", int(spark_error_from(exc).code))
            raise

    async def _open_session(self, raw: str | bytes, sid: str, client: str | None, public: PublicSettings | None,
                            key: str | None) -> sp.SparkSession:
        off_loop = len(raw) > schemas.OFF_LOOP_BYTES  # see schemas.OFF_LOOP_BYTES
        body = await schemas.off_loop(sp.decode_body, raw, self.max_items) if off_loop else \
            sp.decode_body(raw, self.max_items)
        trace_id = sp.trace_id_of(body) if public is None else spark_public.trace_of(body)
        schema = sp.SCHEMA if public is None else spark_public.SCHEMA
        names = None
        try:
            if public is not None:
                spark_public.check_form(body)
            if off_loop:
                await schemas.off_loop(sp.validate_body, body, schema)
            else:
                sp.validate_body(body, schema)
            if public is None:
                request, adjust = sp.lower(body, sid)
            else:
                info = self.engine.model_info
                adapters = set(self.lora_resolver.registered) if self.lora_resolver is not None else set()
                request, adjust, names = spark_public.lower(body, sid, public, key, info.name, adapters,
                                                            info.chat_template_tools)
            request.client = client
            question_tokens, dropped = await asyncio.to_thread(
                sp.fit_history, request, adjust, self.engine, self.history_limit)
            await resolve_lora(self.lora_resolver, request)  # before admission, with the session's own code
        except Exception as exc:
            err = spark_error_from(exc)
            if err.code == SparkCode.UNKNOWN:
                logger.error("session sid=%s: unexpected failure before generating", sid, exc_info=exc)
            err.trace_id = trace_id
            raise err from None
        return sp.SparkSession(sid=sid, trace_id=trace_id or "", request=request, question_tokens=question_tokens,
                               num_dropped_messages=dropped, function_names=names)

    async def frames(self, session: sp.SparkSession) -> AsyncGenerator[dict[str, Any], None]:
        """The session's frames; engine failures surface as SparkError. Closing early aborts."""
        builder = sp.FrameBuilder(session.sid, session.question_tokens) if session.function_names is None else \
            spark_public.FunctionFrameBuilder(session.sid, session.question_tokens, session.function_names)
        started = time.monotonic()
        last = None
        code: int | str = int(SparkCode.SUCCESS)
        try:
            async with aclosing(self.engine.generate(session.request)) as outputs:
                async for out in outputs:
                    last = out
                    for frame in builder.frames_for(out):
                        yield frame
        except Exception as exc:
            err = spark_error_from(exc)
            code = int(err.code)
            raise err from None
        except (GeneratorExit, asyncio.CancelledError):
            if last is None or not last.finished:
                code = ABORTED  # the client left before the answer was complete: not a success
            raise
        finally:
            if self.on_result is not None:
                self.on_result("spark", code)
            ttft = last.timings.first_token_s if last is not None else None
            logger.info("session sid=%s traceId=%s protocol=spark prompt_tokens=%s completion_tokens=%s "
                        "ttft=%s duration=%.3f code=%s", session.sid, session.trace_id,
                        last.num_prompt_tokens if last else 0, last.num_output_tokens if last else 0,
                        f"{ttft:.3f}" if ttft is not None else "-", time.monotonic() - started, code)

