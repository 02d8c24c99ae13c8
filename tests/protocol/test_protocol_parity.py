"""Cross-protocol parity: one scripted conversation (tests/parity/conversation.py) through every protocol
(tests/parity/protocols.py), checking that text, token counts, finish reasons, tool calls and error
classes agree, each read in its protocol's own words, and that every protocol sent the engine the same
request (prompt tokens and sampling); and that every kind of error the engine raises reaches each client as
the one error table (bridges/errors.py) says, in that protocol's words. On the scripted engine for every case;
on the real model for the greedy and the seeded sampled answers (a few short requests, sent at once)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from bridges import tools
from bridges.errors import KINDS, ErrorInfo, error_info
from engine.errors import (
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
    InferenceError,
    InvalidRequestError,
    LoraUnavailableError,
    PromptTooLongError,
    RequestTimeoutError,
)
from spark_server.spark_public import PublicForm, PublicSettings
from tests.fake_engine import Script
from tests.parity.conversation import ASK, CASES, SAMPLING, TOOLS_REFUSED, Case
from tests.parity.protocols import ADAPTERS, Adapter, Ask, Outcome
from tests.parity.table import DOC, ERRORS_DOC, errors_markdown, markdown


def _prompt_text(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The conversation as the chat template writes it: the prompt of the protocols that take text."""
    plain = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


def _can(adapter: Adapter, case: Case) -> bool:
    return all(getattr(adapter.caps, need) for need in case.needs) and (adapter.caps.chat or not case.ask.tools)


def _engine_view(engine: Any, request: Any) -> dict[str, Any]:
    """What reached the engine, in the terms every protocol must agree on."""
    p = request.params
    return {"prompt": list(engine.encode_prompt_sync(request.prompt)), "greedy": p.is_greedy,
            "sampling": None if p.is_greedy else (p.temperature, p.top_p, p.top_k, p.seed),
            "max_tokens": p.max_tokens, "stop": [s for s in p.stop if s != tools.CALL_CLOSE],
            "repetition_penalty": p.repetition_penalty,
            "constraint": None if p.constraint is None else p.constraint.kind}


def _check(adapter: Adapter, case: Case, got: Outcome, expected_completion: int | None) -> list[str]:
    """Where ``got`` disagrees with the case's expected outcome (empty: it agrees)."""
    caps, problems = adapter.caps, []
    if case.error is not None:
        if got.error != case.error or not re.search(case.error_names, got.message):
            problems.append(f"error {got.error!r} ({got.message!r}); "
                            f"expected {case.error!r} naming {case.error_names!r}")
        return problems
    if got.error is not None:
        return [f"failed: {got.error} {got.message!r}"]
    if case.text is not None and got.text != case.text:
        problems.append(f"text {got.text!r} != {case.text!r}")
    if caps.finish != "none" and case.finish is not None:
        agrees = got.finish == case.finish or (caps.finish == "coarse" and got.finish == "stop"
                                                and case.finish in ("end", "stop_string"))
        if not agrees:
            problems.append(f"finish {got.finish!r} != {case.finish!r}")
    if caps.usage != "none" and expected_completion is not None and got.completion_tokens != expected_completion:
        problems.append(f"completion tokens {got.completion_tokens} != {expected_completion}")
    if list(got.calls) != list(case.calls):
        problems.append(f"tool calls {got.calls} != {list(case.calls)}")
    return problems


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_protocol_agrees_on_the_scripted_engine(fake, case):
    engine = fake.engine
    tokenizer = engine.tokenizer
    prompt = _prompt_text(tokenizer, case.ask.messages)
    expected_completion = None
    if case.text is not None and not case.calls:
        expected_completion = len(tokenizer.encode(case.text, add_special_tokens=False))
    elif case.finish == "length":
        expected_completion = case.ask.max_tokens
    elif case.calls:
        expected_completion = len(tokenizer.encode(case.script.answer, add_special_tokens=False))
    problems: dict[str, list[str]] = {}
    views: dict[str, dict[str, Any]] = {}
    prompt_counts: dict[str, int] = {}
    expressed = [a for a in ADAPTERS if _can(a, case)]
    for adapter in expressed:
        engine.script = case.script
        engine.requests.clear()
        got = adapter.send(fake.url, case.ask, prompt)
        problems[adapter.name] = _check(adapter, case, got, expected_completion)
        if case.error != "invalid" and engine.requests:
            views[adapter.name] = _engine_view(engine, engine.requests[-1])
        if case.error is None and adapter.caps.usage == "both":
            prompt_counts[adapter.name] = got.prompt_tokens
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}
    if case.error == "invalid":  # refused before any engine work
        assert not engine.requests
    else:  # one request, the same for every protocol
        reference = views["OpenAI chat"]
        differing = {name: {k: v for k, v in view.items() if v != reference[k]} for name, view in views.items()}
        assert not any(differing.values()), {k: v for k, v in differing.items() if v}
        assert set(views) == {a.name for a in expressed}
    if prompt_counts:
        assert set(prompt_counts.values()) == {len(views["OpenAI chat"]["prompt"])}, prompt_counts


@pytest.mark.parametrize("adapter", [a for a in ADAPTERS if not a.caps.tools], ids=lambda a: a.name)
def test_a_protocol_without_tools_refuses_them_with_its_own_error(fake, adapter):
    got = adapter.send(fake.url, TOOLS_REFUSED.ask, _prompt_text(fake.engine.tokenizer, ASK))
    # named in the protocol's own word (Spark's is "functions")
    assert got.error == "invalid" and re.search(TOOLS_REFUSED.error_names, got.message), got
    assert not fake.engine.requests


# ---- one error table ------------------------------------------------------------------------------

# Each kind of error the engine raises, as every protocol must say it: (the engine's exception, HTTP status,
# Spark code, OpenAI type, OpenAI code, Anthropic type). Written out here, not read from bridges/errors.py:
# this is the wire contract the table must keep.
ERROR_KINDS: dict[str, tuple[Exception, int, int, str, str | int, str]] = {
    "prompt_too_long": (PromptTooLongError("the prompt has 9 tokens", 9, 8), 400, 10003, "invalid_request_error",
                        "context_length_exceeded", "invalid_request_error"),
    "invalid_request": (InvalidRequestError("temperature must be >= 0", "temperature"), 400, 10000,
                        "invalid_request_error", 400, "invalid_request_error"),
    "model_not_found": (LoraUnavailableError("adapter 'x' is not registered", "unknown_adapter"), 404, 12000,
                        "NotFoundError", "model_not_found", "not_found_error"),
    "lora_disabled": (LoraUnavailableError("LoRA packs are not enabled", "packs_disabled"), 400, 12000,
                      "invalid_request_error", "lora_disabled", "invalid_request_error"),
    "lora_host_not_allowed": (LoraUnavailableError("lora.url: not allowed", "host_not_allowed"), 400, 12001,
                              "invalid_request_error", "lora_host_not_allowed", "invalid_request_error"),
    "lora_download_failed": (LoraUnavailableError("lora.url: HTTP 404", "download_failed"), 502, 12002,
                             "bad_gateway", "lora_download_failed", "api_error"),
    "lora_download_timeout": (LoraUnavailableError("lora.url: timed out", "download_timeout"), 504, 12003,
                              "timeout_error", "lora_download_timeout", "timeout_error"),
    "lora_too_large": (LoraUnavailableError("over the limit", "too_large"), 400, 12004, "invalid_request_error",
                       "lora_too_large", "invalid_request_error"),
    "lora_md5_mismatch": (LoraUnavailableError("lora.md5 differs", "md5_mismatch"), 400, 12005,
                          "invalid_request_error", "lora_md5_mismatch", "invalid_request_error"),
    "lora_invalid_pack": (LoraUnavailableError("not a tar", "invalid_pack"), 400, 12006, "invalid_request_error",
                          "lora_invalid_pack", "invalid_request_error"),
    "lora_incompatible": (LoraUnavailableError("rank 32", "incompatible"), 400, 12007, "invalid_request_error",
                          "lora_incompatible", "invalid_request_error"),
    "overloaded": (EngineOverloadedError("the wait queue is full"), 429, 10110, "rate_limit_error", "server_busy",
                   "overloaded_error"),
    "timeout": (RequestTimeoutError("the deadline passed"), 504, 12100, "timeout_error", "timeout", "timeout_error"),
    "shutting_down": (EngineShutdownError("the server is shutting down"), 503, 12101, "service_unavailable",
                      "shutting_down", "overloaded_error"),
    "engine_unavailable": (EngineUnavailableError("no backend"), 503, 12102, "service_unavailable",
                           "engine_unavailable", "overloaded_error"),
    "inference_error": (InferenceError("the step failed"), 500, 11000, "internal_server_error", "inference_error",
                        "api_error"),
    "internal": (KeyError("boom"), 500, -1, "internal_server_error", 500, "api_error"),
}
_TGI_TYPES = {400: "validation", 404: "validation", 422: "validation", 429: "overloaded", 503: "overloaded"}


def _expected(adapter: str, status: int, spark: int, openai_type: str, openai_code: str | int,
              anthropic_type: str) -> tuple[int | None, dict[str, Any]]:
    """(HTTP status, the protocol's own words) the adapter must read back for an error of this row."""
    if adapter.startswith("Spark"):
        return (None if adapter == "Spark WebSocket" else status), {"code": spark}
    if adapter.startswith("OpenAI"):
        return status, {"type": openai_type, "code": openai_code}
    if adapter == "Anthropic Messages":  # a busy or unavailable server is 529 "overloaded" to its clients
        return {429: 529, 503: 529}.get(status, status), {"type": anthropic_type}
    if adapter == "TGI":  # an invalid request is 422 there
        status = 422 if status == 400 else status
        return status, {"error_type": _TGI_TYPES.get(status, "generation")}
    if adapter in ("vLLM", "SGLang"):
        return status, {"type": openai_type, "code": status}
    if adapter == "MindIE":
        return status, {"error_type": openai_type}
    return status, {}  # Ollama, Triton: a message only


@pytest.mark.parametrize("kind", sorted(ERROR_KINDS))
def test_every_protocol_renders_each_error_kind_from_the_one_table(fake, kind):
    exc, *row = ERROR_KINDS[kind]
    assert error_info(exc).kind == kind
    prompt = _prompt_text(fake.engine.tokenizer, ASK)
    wrong = {}
    for adapter in ADAPTERS:
        fake.engine.script = Script(fail_before=exc)
        got = adapter.send(fake.url, Ask(ASK, 8), prompt)
        expected = _expected(adapter.name, *row)
        if (got.status, got.words) != expected:
            wrong[adapter.name] = {"got": (got.status, got.words), "expected": expected}
    fake.engine.script = Script()
    assert not wrong, wrong


def test_the_public_spark_form_says_iflyteks_codes_where_they_differ():
    # the seed form's code -> iFlytek's public form's, where its seed-document code means something else there
    public = {-1: 10012, 4: 10003, 10000: 10163, 10002: 10163, 10003: 10907, 11000: 10012}
    form = PublicForm(PublicSettings())
    for kind in KINDS:
        info = ErrorInfo.of(kind, "x")
        assert form.code(info) == public.get(info.spark_code, info.spark_code), kind


def test_the_error_table_in_the_docs_is_the_table():
    assert errors_markdown() in ERRORS_DOC.read_text(encoding="utf-8"), \
        f"regenerate it: python -m tests.parity.table errors > {ERRORS_DOC}"


def test_the_table_in_the_docs_is_the_harness_own():
    assert markdown() in DOC.read_text(encoding="utf-8"), f"regenerate it: python -m tests.parity.table > {DOC}"


# ---- the real model -------------------------------------------------------------------------------

REAL_ASKS = {"greedy": Ask(ASK, 6), "seeded sample": Ask(ASK, 6, sampling=SAMPLING)}


@pytest.mark.parametrize("name", sorted(REAL_ASKS))
def test_every_protocol_gives_the_real_model_same_answer(live_server, name):
    ask = REAL_ASKS[name]
    prompt = _prompt_text(live_server.engine.tokenizer, ask.messages)
    adapters = [a for a in ADAPTERS if a.caps.seed or ask.sampling is None]
    with ThreadPoolExecutor(len(adapters)) as pool:  # one batch: a handful of short answers at once
        outcomes = dict(zip([a.name for a in adapters],
                            pool.map(lambda a: a.send(live_server.http_url, ask, prompt), adapters)))
    reference = outcomes["OpenAI chat"]
    assert reference.text and reference.completion_tokens and reference.error is None
    for adapter in adapters:
        got = outcomes[adapter.name]
        assert got.error is None and got.text == reference.text, (adapter.name, got, reference)
        if adapter.caps.usage != "none":
            assert got.completion_tokens == reference.completion_tokens, (adapter.name, got)
        if adapter.caps.usage == "both":
            assert got.prompt_tokens == reference.prompt_tokens, (adapter.name, got)
        if adapter.caps.finish == "full":
            assert got.finish == reference.finish, (adapter.name, got)
