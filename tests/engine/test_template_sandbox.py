"""A request's own chat template: rendered as transformers renders the same template, in a worker that
bounds its time, memory and output and keeps the sandbox's refusals (engine/template_sandbox.py)."""

from __future__ import annotations

import time

import pytest

from engine.errors import InvalidRequestError
from engine.prompts import PromptEncoder
from engine.request import ChatMessage, ChatPrompt
from engine.template_sandbox import TemplateSandbox, render_request_template
from tests.fake_engine import shared_tokenizer

CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ extra | default('') }}")
MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]


@pytest.fixture(scope="module")
def sandbox():
    box = TemplateSandbox(workers=1, timeout_s=1.0)
    yield box
    box.close()


def render(sandbox, source: str, messages=MSGS, max_chars: int = 10_000, **kw) -> str:
    return render_request_template(sandbox, source, messages, special_tokens={"bos_token": "<s>"},
                                   add_generation_prompt=kw.get("add_generation_prompt", True),
                                   continue_final_message=kw.get("continue_final_message", False), tools=None,
                                   kwargs=kw.get("kwargs", {}), max_chars=max_chars)


def test_renders_as_transformers_does_through_the_prompt_encoder():
    tokenizer = shared_tokenizer()
    encoder = PromptEncoder(tokenizer, 8192, len(tokenizer))
    messages = [ChatMessage("user", "hi"), ChatMessage("assistant", "Sure, ")]
    for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": False, "continue_final_message": True}):
        ours = encoder.render_chat(ChatPrompt(messages, chat_template=CHATML, chat_template_kwargs={"extra": "!"},
                                              **kw))
        theirs = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                               chat_template=CHATML, tokenize=False, extra="!", **kw)
        assert ours == theirs
    assert ours.endswith("Sure, ")  # continued where the final message ends


def test_a_template_error_names_the_field(sandbox):
    with pytest.raises(InvalidRequestError, match="nope") as err:
        render(sandbox, "{{ raise_exception('nope') }}")
    assert err.value.parameter == "chat_template"
    with pytest.raises(InvalidRequestError):
        render(sandbox, "{% for x in %}")


def test_the_sandbox_keeps_python_internals_out(sandbox):
    with pytest.raises(InvalidRequestError, match=r"SecurityError|unsafe"):
        render(sandbox, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError, match=r"SecurityError|unsafe"):
        render(sandbox, "{{ messages.append(1) }}")  # the immutable sandbox: no changes to the variables


def test_time_is_bounded_and_the_worker_replaced(sandbox):
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match="longer than 1 s") as err:
        render(sandbox, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    assert err.value.parameter == "chat_template" and time.monotonic() - started < 5
    assert render(sandbox, "ok") == "ok"  # a fresh worker serves the next render


def test_memory_is_bounded(sandbox):
    with pytest.raises(InvalidRequestError) as err:
        render(sandbox, "{% set s = 'x' * 200000 %}{% set t = s ~ s ~ s ~ s ~ s ~ s ~ s ~ s %}"
                        "{% set u = t ~ t ~ t ~ t ~ t ~ t ~ t ~ t %}{% set v = u ~ u ~ u ~ u ~ u ~ u ~ u ~ u %}"
                        "{% set w = v ~ v ~ v %}{{ w | length }}")  # 300 MiB of text in the end
    assert err.value.parameter == "chat_template"
    assert render(sandbox, "ok") == "ok"


def test_output_is_bounded(sandbox):
    with pytest.raises(InvalidRequestError, match="more than 100 characters"):
        render(sandbox, "{% for i in range(1000) %}xy{% endfor %}", max_chars=100)


def test_the_workers_yield_the_cpu_to_the_engine(sandbox):
    """A template may loop for its whole time: its worker runs at a lower priority than the server's threads."""
    import os

    from engine.template_sandbox import WORKER_NICENESS

    assert render(sandbox, "ok") == "ok"
    worker = sandbox._free[0].proc
    assert worker is not None and worker.poll() is None
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, worker.pid) == min(19, own + WORKER_NICENESS)


def test_a_conversation_of_more_tiny_messages_than_the_context_holds_is_refused_before_rendering(monkeypatch):
    """Each message costs its role markers and separators in the model's template (SmolLM2's ChatML: 5 tokens
    around its content): 16,384 one-letter messages cannot fit 8,192 tokens, and are refused from their count
    before the template renders them (seconds of CPU); a conversation that fits still renders."""
    from engine.errors import PromptTooLongError

    tokenizer = shared_tokenizer()
    encoder = PromptEncoder(tokenizer, 8192, len(tokenizer))
    floors = encoder.message_floor_by_role
    assert all(3 <= floors[role] <= 5 for role in ("system", "user", "assistant", "tool"))
    roles = ("system", "user", "assistant", "tool", "user", "assistant")
    fits = ChatPrompt([ChatMessage(roles[i % len(roles)], ("a", "", "\n")[i % 3]) for i in range(300)])
    rendered = encoder.encode(fits)
    assert len(rendered) >= sum(floors[m.role] for m in fits.messages)  # the floor is a floor

    def no_render(*args, **kwargs):
        raise AssertionError("rendered")

    monkeypatch.setattr(tokenizer, "apply_chat_template", no_render)
    flood = ChatPrompt([ChatMessage(("user", "assistant")[i % 2], "a") for i in range(16_384)])
    with pytest.raises(PromptTooLongError, match="16384 messages"):
        encoder.encode(flood)


def test_a_role_the_template_drops_is_charged_nothing(monkeypatch):
    """A template that renders only some roles (Zephyr-like: tool messages dropped) charges the others
    nothing: a conversation of many such messages that fits is rendered, not refused from its count."""
    tokenizer = shared_tokenizer()
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>"
                        "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}")
    encoder = PromptEncoder(tokenizer, 1024, len(tokenizer))
    assert encoder.message_floor_by_role["tool"] == 0 and encoder.message_floor_by_role["user"] >= 3
    tools_heavy = ChatPrompt([ChatMessage("user", "hi")] + [ChatMessage("tool", "x") for _ in range(300)])
    assert len(encoder.encode(tools_heavy)) < 1024
