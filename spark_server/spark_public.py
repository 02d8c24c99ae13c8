"""iFlytek's public Spark WebSocket form beside the seed document's ``/turing/v3/gpt``.

What the public SDKs (``spark-ai-python``, LangChain's ``ChatSparkLLM``, the Java and JS demos) send and
read, mapped onto the same session machinery:

- paths ``/v1.1/chat`` ... ``/v4.0/chat``, ``/chat/max-32k``, ``/chat/pro-128k``, signed with the same
  HMAC URL scheme (spark_server/auth.py) when ``--spark-auth`` is on;
- ``header.app_id`` (checked against ``--spark-app-ids``) and ``header.uid`` in place of ``traceId``;
- ``parameter.chat.domain``: iFlytek's model names, the served model's name, an adapter's name, or a
  ``--spark-domains`` entry; anything else is refused naming the field;
- ``payload.functions.text`` -> tool calling, answered as ``function_call`` in ``payload.choices.text[]``;
- iFlytek's error codes where they differ from the seed document's (its 10002 and 10003 mean other
  things there): the table's public column (bridges/errors.py).

A form of the Spark protocol (``PublicForm``): the pipeline and the WebSocket transport are the seed
form's (spark_protocol.py, spark_endpoints.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from bridges import tools
from bridges.constraints import response_format
from bridges.context import ServingContext
from bridges.errors import BridgeError, ErrorInfo, SparkCode, SparkError
from bridges.sampling_table import sampling_kwargs
from engine.request import ChatPrompt, GenerationRequest, LoraRef, RequestOutput
from engine.sampling_params import SamplingParams
from spark_server import spark_protocol as sp
from spark_server.settings import parse_pairs

SCHEMA = "spark-public-request"

# The public API's WebSocket paths, and the domain each one's documentation names.
PATH_DOMAINS: dict[str, str] = {
    "/v1.1/chat": "lite",
    "/v2.1/chat": "generalv2",
    "/v3.1/chat": "generalv3",
    "/chat/pro-128k": "pro-128k",
    "/v3.5/chat": "generalv3.5",
    "/chat/max-32k": "max-32k",
    "/v4.0/chat": "4.0Ultra",
}
PUBLIC_PATHS = tuple(PATH_DOMAINS)
# iFlytek's domain names (and the older "general" of v1.1): each is the served model unless
# --spark-domains says otherwise.
IFLYTEK_DOMAINS = ("general", *PATH_DOMAINS.values())


@dataclass(frozen=True)
class PublicSettings:
    """The operator's choices for the public form: which app_ids may call (per signing key), and what
    each domain means."""

    app_ids: dict[str, frozenset[str] | None] = field(default_factory=dict)  # app_id -> keys (None: any)
    domains: dict[str, str] = field(default_factory=dict)  # domain -> served model or adapter name

    @classmethod
    def from_flags(cls, app_ids: str | None, domains: str | None, signing: bool) -> PublicSettings:
        """``--spark-app-ids`` (APP_ID or APP_ID:KEY items, comma-joined) and ``--spark-domains``
        (DOMAIN=NAME items). An allow-list without ``--spark-auth`` would trust whatever app_id a client
        writes, so it is refused."""
        allowed: dict[str, set[str] | None] = {}
        for item in (app_ids or "").split(","):
            app_id, _, key = item.strip().partition(":")
            if not app_id:
                if item.strip():
                    raise ValueError(f"--spark-app-ids {item.strip()!r}: expected APP_ID or APP_ID:KEY")
                continue
            if not key:
                allowed[app_id] = None
            elif allowed.get(app_id, set()) is not None:
                allowed.setdefault(app_id, set()).add(key)  # type: ignore[union-attr]
        if allowed and not signing:
            raise ValueError("--spark-app-ids needs --spark-auth: without signed URLs any client can write any "
                             "app_id")
        frozen = {a: (frozenset(k) if k is not None else None) for a, k in allowed.items()}
        return cls(app_ids=frozen, domains=parse_pairs(domains, "=", "--spark-domains", "DOMAIN=NAME"))

    def check_app_id(self, app_id: str, key: str | None) -> None:
        if not self.app_ids:
            return
        keys = self.app_ids.get(app_id, frozenset())
        if keys is None or (key is not None and key in keys):
            return
        raise SparkError(SparkCode.AUTH_FAILED, f"header.app_id {app_id!r} is not allowed on this server"
                                          f"{'' if app_id not in self.app_ids else ' with this api_key'} "
                                          "(--spark-app-ids)")

    def target(self, domain: str, served: str, adapters: set[str]) -> LoraRef | None:
        """The adapter ``parameter.chat.domain`` selects (None: the served model)."""
        name = self.domains.get(domain)
        if name is None and (domain in IFLYTEK_DOMAINS or domain == served):
            return None
        name = name if name is not None else domain
        if name == served:
            return None
        if name in adapters:
            return LoraRef(name=name)
        known = sorted({*IFLYTEK_DOMAINS, *self.domains, served, *adapters})
        raise SparkError(SparkCode.SCHEMA_ERROR, f"parameter.chat.domain: {domain!r} is not served here "
                                                 f"(served: {', '.join(known)})")


def trace_of(body: Any) -> str | None:
    """``app_id/uid`` for logs, when the header has them (also for an invalid request)."""
    header = body.get("header") if isinstance(body, dict) else None
    if not isinstance(header, dict) or not isinstance(header.get("app_id"), str):
        return None
    uid = header.get("uid")
    return f"{header['app_id']}/{uid}" if isinstance(uid, str) and uid else header["app_id"]


def check_form(body: Any) -> None:
    """A seed-document body (``header.traceId``, no ``app_id``) sent to a public path: say where it goes."""
    header = body.get("header") if isinstance(body, dict) else None
    if isinstance(header, dict) and "traceId" in header and "app_id" not in header:
        raise SparkError(SparkCode.SCHEMA_ERROR, "header.app_id is required: this path takes iFlytek's public form "
                                                 "(header.app_id, parameter.chat.domain); the seed document's "
                                                 "header.traceId form is served at /turing/v3/gpt")


def _openai_messages(text: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dialogue in the shape tools.plan reads: an assistant turn's function_call as a tool call."""
    out = []
    for i, item in enumerate(text):
        message: dict[str, Any] = {"role": item["role"], "content": item.get("content") or ""}
        call = item.get("function_call")
        if call is not None:
            if item["role"] != "assistant":
                raise SparkError(SparkCode.SCHEMA_ERROR,
                                 f"payload.message.text[{i}].function_call: only an assistant turn makes calls")
            arguments = call.get("arguments", "{}")
            message["tool_calls"] = [{"type": "function", "function": {
                "name": call["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}}]
        elif item.get("content") is None:
            raise SparkError(SparkCode.SCHEMA_ERROR, f"payload.message.text[{i}].content: null is only allowed "
                                                     "in an assistant turn that has a function_call")
        out.append(message)
    return out


def lower(body: dict[str, Any], sid: str, public: PublicSettings, key: str | None, served: str,
          adapters: set[str], native_tools: bool) -> tuple[GenerationRequest, bool, set[str] | None]:
    """The public body as a GenerationRequest (before the token-limit check), adjustTokens, and the
    function names whose calls the answer is parsed for (None without functions)."""
    public.check_app_id(body["header"]["app_id"], key)
    chat = body["parameter"]["chat"]
    lora = public.target(chat["domain"], served, adapters)
    text = body["payload"]["message"]["text"]
    if not text:
        raise SparkError(SparkCode.NO_DIALOGUE_CONTENT, "payload.message.text is empty: no dialogue content")
    functions = ((body["payload"].get("functions") or {}).get("text")) or []
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise SparkError(SparkCode.SCHEMA_ERROR, "payload.functions.text: two functions have one name")
    messages = _openai_messages(text)  # its refusals name their own fields
    try:
        plan = tools.plan({"tools": [{"type": "function", "function": f} for f in functions],
                           "tool_choice": "auto" if functions else None}, messages, native_tools)
    except BridgeError as exc:
        raise SparkError(SparkCode.SCHEMA_ERROR, f"payload.functions: {exc.message}") from None
    last = text[-1]
    if last["role"] != "user" or not (last.get("content") or "").strip():
        raise SparkError(SparkCode.NO_DIALOGUE_CONTENT,
                         f"payload.message.text[{len(text) - 1}]: the latest turn must be a non-empty user question")
    params = SamplingParams(**sampling_kwargs("spark", chat),
                            constraint=response_format(chat.get("response_format"), "parameter.chat.response_format"))
    request = GenerationRequest(request_id=sid, prompt=ChatPrompt(plan.messages, tools=plan.template_tools),
                                params=params, lora=lora)
    return request, bool(chat.get("adjustTokens", False)), (plan.names if plan.parse else None)


class FunctionFrameBuilder(sp.FrameBuilder):
    """Frames of an answer that may call the request's functions: text streams as usual (held back only
    while a call may be starting); the calls go in the last frame, each as a ``function_call`` item of
    ``payload.choices.text``, as iFlytek answers them."""

    def __init__(self, sid: str, question_tokens: int, names: set[str]) -> None:
        super().__init__(sid, question_tokens)
        self.parser = tools.StreamParser(names)
        self.calls: list[tools.ToolCall] = []

    def frames_for(self, out: RequestOutput) -> list[dict[str, Any]]:
        content, calls = self.parser.feed(out.text_delta, final=out.finished)
        self.calls.extend(calls)
        if not out.finished:
            return super().frames_for(_with_text(out, content))
        frame = sp.content_frame(self.sid, 2, self.seq, content, sp.usage_block(self.question_tokens, out))
        self.seq += 1
        items = frame["payload"]["choices"]["text"]
        for k, call in enumerate(self.calls):
            item = items[0] if k == 0 else {"content": "", "role": "assistant", "index": 0}
            item["content_type"] = "text"
            item["function_call"] = {"arguments": call.arguments, "name": call.name}
            if k:
                items.append(item)
        return [frame]


def _with_text(out: RequestOutput, text: str) -> RequestOutput:
    return replace(out, text_delta=text)


class PublicForm(sp.Form):
    """iFlytek's public form of a Spark request, for the operator's ``PublicSettings``."""

    schema = SCHEMA

    def __init__(self, settings: PublicSettings) -> None:
        self.settings = settings

    def trace_of(self, body: Any) -> str | None:
        return trace_of(body)

    def check(self, body: Any) -> None:
        check_form(body)

    def lower(self, body: dict[str, Any], sid: str, ctx: ServingContext,
              key: str | None) -> tuple[GenerationRequest, bool, set[str] | None]:
        return lower(body, sid, self.settings, key, ctx.model.name, set(ctx.adapters.registered),
                     ctx.model.chat_template_tools)

    def code(self, info: ErrorInfo) -> int:
        return info.public_code

    def frames(self, session: sp.SparkSession) -> sp.FrameBuilder:
        if session.function_names is None:
            return super().frames(session)
        return FunctionFrameBuilder(session.sid, session.question_tokens, session.function_names)
