"""The Spark HTTP form ``POST /turing/v3/func/gpt``: the same body, one JSON answer."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges.common import client_identity, unless_disconnected
from spark_server import spark_protocol as sp
from spark_server.errors import SparkCode, SparkError, http_status_for, spark_error_from
from spark_server.spark_service import SparkService

RET_MARKER = "<ret>"


def _error_body(err: SparkError, trace_id: str | None, sid: str) -> dict[str, Any]:
    return {"header": {"code": int(err.code), "message": err.message, "traceId": trace_id, "sid": sid}}


async def spark_http(request: Request) -> Response:
    # a client that hangs up before the answer is complete aborts it
    return await unless_disconnected(request, _answer(request))


async def _answer(request: Request) -> JSONResponse:
    service: SparkService = request.app.state.spark
    sid = sp.new_sid()
    raw = await request.body()
    trace_id = None
    try:
        session = await service.open_session(raw, sid, client=client_identity(request))
        trace_id = session.trace_id
        text: list[str] = []
        usage = None
        async for frame in service.frames(session):
            choices = frame["payload"]["choices"]
            text.append(choices["text"][0]["content"])
            usage = frame["payload"].get("usage", usage)
    except Exception as exc:
        err = spark_error_from(exc)
        return JSONResponse(_error_body(err, trace_id or err.trace_id, sid), status_code=http_status_for(err.code))
    content = "".join(text)
    if request.app.state.settings.spark_http_markers:  # the document's example: <ret> for newlines, then <end>
        content = content.replace("\n", RET_MARKER) + sp.END_MARKER
    return JSONResponse({
        "header": {"code": int(SparkCode.SUCCESS), "message": "success", "traceId": trace_id, "sid": sid},
        "payload": {
            "choices": {"seq": 0, "status": 2,
                        "text": [{"content": content, "role": "assistant", "index": 0}]},
            "usage": usage,
        },
    })
