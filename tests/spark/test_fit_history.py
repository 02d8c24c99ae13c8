"""Spark's token limit on a scripted engine (whitespace tokens, 5 template tokens per turn): sizes are
judged before any tokenizing, and adjustTokens drops the fewest oldest turns that make it fit."""

from __future__ import annotations

import pytest

from bridges.errors import SparkCode, SparkError
from engine.errors import PromptTooLongError
from engine.request import ChatMessage, ChatPrompt, GenerationRequest
from engine.sampling_params import SamplingParams
from spark_server.spark_protocol import fit_history

BYTES_PER_TOKEN = 16  # no scripted token is longer


class ScriptedEngine:
    def __init__(self, context: int) -> None:
        self.context = context
        self.model_info = type("Info", (), {"max_model_len": context})()
        self.tokenized_bytes = 0
        self.templated = 0

    def min_num_tokens(self, texts: list[str]) -> int:
        return sum(len(t.encode()) for t in texts) // BYTES_PER_TOKEN

    def tokenizer(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        self.tokenized_bytes += sum(len(t) for t in texts)
        return {"input_ids": [t.split() for t in texts]}

    def encode_prompt_sync(self, prompt: ChatPrompt) -> list[int]:
        self.templated += 1
        n = sum(len(m.content.split()) + 5 for m in prompt.messages)
        if n >= self.context:
            raise PromptTooLongError(f"the prompt has {n} tokens", n, self.context - 1)
        return [0] * n


def _request(contents: list[str], max_tokens: int = 1) -> GenerationRequest:
    roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(contents))]
    if len(contents) % 2 == 0:
        roles = ["system"] + roles[:-1]
    return GenerationRequest("s", ChatPrompt([ChatMessage(r, c) for r, c in zip(roles, contents)]),
                             SamplingParams(max_tokens=max_tokens))


def test_a_4mb_content_is_refused_by_its_size_alone():
    engine = ScriptedEngine(context=8192)
    with pytest.raises(SparkError) as err:
        fit_history(_request(["x" * (4 << 20)]), False, engine, history_limit=8192)
    assert err.value.code == SparkCode.TOKEN_LIMIT_EXCEEDED and "at least" in err.value.message
    assert engine.tokenized_bytes == 0 and engine.templated == 0


def test_oversized_old_turns_are_dropped_by_size_before_tokenizing():
    engine = ScriptedEngine(context=8192)
    req = _request(["old " * (1 << 20), "a reply", "the question?"])
    question, dropped = fit_history(req, True, engine, history_limit=8192)
    assert dropped == 1 and question == 2
    assert engine.tokenized_bytes < 100  # the 4 MB turn went before anything was tokenized


@pytest.mark.parametrize("context, limit", [(60, 10_000), (10_000, 40), (45, 45)])
def test_adjust_drops_the_fewest_oldest_turns(context, limit):
    contents = [f"turn {i} " + "word " * (i % 4) for i in range(41)]
    req = _request(contents)
    _, dropped = fit_history(req, True, ScriptedEngine(context), history_limit=limit)
    # reference: drop the oldest droppable turns one by one until both limits hold
    messages = list(_request(contents).prompt.messages)
    droppable = [i for i, m in enumerate(messages[:-1]) if m.role != "system"]
    for k in range(len(droppable) + 1):
        kept = [m for i, m in enumerate(messages) if i not in set(droppable[:k])]
        history = sum(len(m.content.split()) for m in kept)
        prompt = sum(len(m.content.split()) + 5 for m in kept)
        if history <= limit and prompt < context:
            break
    assert dropped == k
    assert len(req.prompt.messages) == len(messages) - k


def test_without_adjust_nothing_is_dropped():
    with pytest.raises(SparkError) as err:
        fit_history(_request(["word " * 50, "ok", "q"]), False, ScriptedEngine(8192), history_limit=20)
    assert err.value.code == SparkCode.TOKEN_LIMIT_EXCEEDED and "adjustTokens" in err.value.message


def test_adjust_leaves_room_for_the_answer():
    """A history that fills the context would leave a 1-token answer: trimming keeps max_tokens free."""
    contents = [f"turn {i} " + "word " * 10 for i in range(41)]
    engine = ScriptedEngine(context=400)
    req = _request(contents, max_tokens=120)
    fit_history(req, True, engine, history_limit=10_000)
    prompt = sum(len(m.content.split()) + 5 for m in req.prompt.messages)
    assert prompt + 120 <= 400
    one_more = prompt + len(contents[0].split()) + 5  # the fewest turns were dropped
    assert one_more + 120 > 400


def test_a_question_too_long_for_its_answer_is_refused_with_adjust():
    with pytest.raises(SparkError) as err:
        fit_history(_request(["word " * 300], max_tokens=150), True, ScriptedEngine(400), history_limit=10_000)
    assert err.value.code == SparkCode.TOKEN_LIMIT_EXCEEDED and "max_tokens=150" in err.value.message
