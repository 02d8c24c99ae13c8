"""Reasoning on the scripted engine with a Qwen3 tokenizer and Qwen3's real chat template: the thinking
is split into reasoning_content at every token boundary, streamed and whole; enable_thinking false
gives no reasoning; reasoning_tokens are counted; the engine is told where structured output starts
and FastDeploy's reasoning_max_tokens is lowered onto the thinking's budget."""

from __future__ import annotations

import json

import httpx
import pytest

from bridges.reasoning import PARSERS, get_parser
from engine.prompts import PromptEncoder
from engine.request import ChatMessage, ChatPrompt
from engine.sampling_params import LeadingSection
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import FakeEngine, Script
from tests.protocol.reasoning_fixtures import qwen3_tokenizer

THINKING = "<think>\nI add 1 and 2: that makes 3.\n</think>\n\n"
ANSWER = "The sum is 3."
ASK = {"messages": [{"role": "user", "content": "1+2?"}]}


@pytest.fixture(scope="module")
def qwen_engine():
    engine = FakeEngine()
    engine.tokenizer = qwen3_tokenizer()
    return engine


def _serve(engine, **settings):
    s = Settings(port=free_port(), **settings)
    return ServerThread(build_app(s, engine, owns_engine=False), s.port), f"http://127.0.0.1:{s.port}"


@pytest.fixture(scope="module")
def servers(qwen_engine):
    (qwen, qurl), (r1, rurl) = _serve(qwen_engine, reasoning_parser="qwen3"), _serve(
        qwen_engine, reasoning_parser="deepseek_r1", enable_reasoning=True)
    with qwen, r1:
        yield {"qwen3": qurl, "deepseek_r1": rurl}


def _chat(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={**ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, **body) -> tuple[str | None, str | None, dict]:
    r = httpx.post(url + "/v1/chat/completions", json={**ASK, **body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")
              and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning or None, content or None, events[-1]["usage"]


def test_the_thinking_is_split_at_every_token_boundary(servers, qwen_engine):
    tok = qwen_engine.tokenizer
    ids = tok.encode(THINKING + ANSWER, add_special_tokens=False)
    end = ids.index(tok.convert_tokens_to_ids("</think>"))
    expected = ("\nI add 1 and 2: that makes 3.\n", "\n\n" + ANSWER)
    for name, url in servers.items():
        # every way the tokens can be grouped into outputs (one by one puts a boundary between every two)
        for burst in range(1, len(ids) + 1) if name == "qwen3" else (1, 3):
            qwen_engine.script = Script(answer=THINKING + ANSWER, burst=burst)
            whole = _chat(url)
            message = whole["choices"][0]["message"]
            assert (message["reasoning_content"], message["content"]) == expected, (url, burst)
            assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == end + 1
            reasoning, content, usage = _stream(url)
            assert (reasoning, content) == expected, (url, burst)
            assert usage["completion_tokens_details"]["reasoning_tokens"] == end + 1


def test_the_splitter_agrees_with_itself_at_every_character():
    text = "<think>\nsee </thi and <think> too\n</think>\n\nok </think>"
    for name in PARSERS:
        parser = get_parser(name)
        whole = parser.split(text)
        for cut in range(len(text) + 1):
            for cut2 in range(cut, len(text) + 1, 7):
                s = parser.splitter()
                parts = [s.feed(text[:cut]), s.feed(text[cut:cut2]), s.feed(text[cut2:]), s.finish()]
                reasoning = "".join(p[0] for p in parts)
                content = "".join(p[1] for p in parts)
                assert ((reasoning if s.thought else None), content or None) == whole, (name, cut, cut2)
    assert get_parser("qwen3").split(text) == ("\nsee </thi and <think> too\n", "\n\nok </think>")


def test_vllm_rules_for_an_answer_without_an_opening_tag():
    r1, qwen3 = get_parser("deepseek_r1"), get_parser("qwen3")
    assert r1.split("thinking</think>answer") == ("thinking", "answer")  # the template opened <think>
    assert r1.split("still thinking") == ("still thinking", None)
    assert qwen3.split("plain answer") == (None, "plain answer")
    assert qwen3.split("a</think>b", qwen3.start_state("<|im_start|>assistant\n<think>\n")) == ("a", "b")
    assert r1.split("answer", r1.start_state("<think>\n\n</think>\n\n")) == (None, "answer")
    granite = get_parser("granite")
    assert granite.split("Here's my thought process: x Here is my response: y") == (" x ", " y")


def test_enable_thinking_false_gives_no_reasoning(servers, qwen_engine):
    qwen_engine.script = Script(answer=ANSWER)
    for url in servers.values():
        body = {"chat_template_kwargs": {"enable_thinking": False}}
        message = _chat(url, **body)["choices"][0]["message"]
        assert message["reasoning_content"] is None and message["content"] == ANSWER
        assert _stream(url, **body)[:2] == (None, ANSWER)
        prompt = qwen_engine.tokenizer.decode(qwen_engine.requests[-1].prompt.token_ids)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3's template wrote it
    # thinking on, the Qwen3 parser with an answer that does not open with <think>: all content
    whole = _chat(servers["qwen3"])
    assert whole["choices"][0]["message"]["reasoning_content"] is None
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_earlier_reasoning_content_is_accepted_and_left_to_the_template(servers, qwen_engine):
    qwen_engine.script = Script(answer=ANSWER)
    history = [{"role": "user", "content": "1+1?"},
               {"role": "assistant", "content": "2", "reasoning_content": "OLD THOUGHT"},
               {"role": "user", "content": "1+2?"}]
    _chat(servers["qwen3"], messages=history)
    prompt = qwen_engine.tokenizer.decode(qwen_engine.requests[-1].prompt.token_ids)
    assert "OLD THOUGHT" not in prompt and "<|im_start|>assistant\n2<|im_end|>" in prompt
    # a turn after the last user message (a tool loop) keeps its thinking, as Qwen3's template does: the
    # engine's own renderer hands it over
    messages = qwen_engine.requests[-1].prompt.messages
    assert messages[1].reasoning_content == "OLD THOUGHT"
    encoder = PromptEncoder(qwen_engine.tokenizer, 4096, len(qwen_engine.tokenizer))
    loop = ChatPrompt(messages[:2] + [ChatMessage("tool", "4")])
    assert "<think>\nOLD THOUGHT\n</think>" in encoder.render_chat(loop)


def test_structured_output_and_the_budget_start_after_the_thinking(servers, qwen_engine):
    qwen_engine.script = Script(answer=THINKING + '"yes"')
    end = (qwen_engine.tokenizer.convert_tokens_to_ids("</think>"),)
    _chat(servers["qwen3"], guided_choice=["yes", "no"])
    assert qwen_engine.requests[-1].params.leading_section == LeadingSection(end, None, "guided_choice")
    _chat(servers["deepseek_r1"], reasoning_max_tokens=5)
    assert qwen_engine.requests[-1].params.leading_section == LeadingSection(end, 5, "reasoning_max_tokens")
    _chat(servers["qwen3"], guided_choice=["yes", "no"], chat_template_kwargs={"enable_thinking": False})
    assert qwen_engine.requests[-1].params.leading_section is None  # no thinking: the constraint applies at once
    _chat(servers["qwen3"])
    assert qwen_engine.requests[-1].params.leading_section is None  # nothing to place


def test_reasoning_max_tokens_needs_a_reasoning_parser(fake):
    r = httpx.post(fake.url + "/v1/chat/completions", json={**ASK, "reasoning_max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_max_tokens"
    r = httpx.post(fake.url + "/v1/chat/completions", json={**ASK, "reasoning_max_tokens": 0})
    assert r.status_code == 400 and "reasoning_max_tokens" in r.text
    message = httpx.post(fake.url + "/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
    assert "reasoning_content" not in message  # no parser: vLLM's plain message


def test_reasoning_settings_are_checked_at_start(fake):
    with pytest.raises(ValueError, match="--enable-reasoning requires --reasoning-parser"):
        Settings(enable_reasoning=True)
    # the embedded model's vocabulary has no <think> token: vLLM refuses the parser too
    with pytest.raises(ValueError, match="--reasoning-parser qwen3"):
        build_app(Settings(port=free_port(), reasoning_parser="qwen3"), fake.engine, owns_engine=False)
    build_app(Settings(port=free_port(), reasoning_parser="granite"), fake.engine, owns_engine=False)  # text markers
