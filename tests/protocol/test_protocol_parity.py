"""Cross-protocol parity: one scripted conversation (tests/parity/conversation.py) through every protocol
(tests/parity/protocols.py), checking that text, token counts, finish reasons, tool calls and error
classes agree, each read in its protocol's own words, and that every protocol sent the engine the same
request (prompt tokens and sampling). On the scripted engine for every case; on the real model for the
greedy and the seeded sampled answers (a few short requests, sent at once)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from bridges import tools
from tests.parity.conversation import ASK, CASES, SAMPLING, TOOLS_REFUSED, Case
from tests.parity.protocols import ADAPTERS, Adapter, Ask, Outcome
from tests.parity.table import DOC, markdown


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
