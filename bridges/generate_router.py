"""One POST /generate for three protocols, told apart by the body's shape:
`inputs` -> TGI, `prompt` -> vLLM, `text` or `input_ids` -> SGLang."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bridges import sglang, tgi, vllm
from bridges.common import BridgeError, parse_body


async def generate(request: Request) -> Response:
    try:
        body = parse_body(await request.body(), request.app.state.settings.max_request_items)
    except BridgeError as err:
        return JSONResponse({"error": err.message, "error_type": "validation"}, status_code=400)
    keys = set(body) if isinstance(body, dict) else set()
    if "inputs" in keys:
        return await tgi.generate(request)
    if "prompt" in keys:
        return await vllm.generate(request)
    if keys & {"text", "input_ids"}:
        return await sglang.generate(request)
    return JSONResponse({"error": "cannot tell the protocol: send `inputs` (TGI), `prompt` (vLLM) or "
                                  "`text` / `input_ids` (SGLang)", "error_type": "validation"}, status_code=422)
