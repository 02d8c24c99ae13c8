"""Golden lowering tests on the fake engine: each protocol field the documents name reaches the
engine as the GenerationRequest it means (or is refused with a 4xx naming the field)."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.request import ChatPrompt, TextPrompt, TokensPrompt

MSGS = [{"role": "user", "content": "hi"}]


def post(fake, path: str, body: dict, status: int = 200) -> httpx.Response:
    r = httpx.post(fake.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    return r


def chat(fake, status: int = 200, **fields):
    r = post(fake, "/v1/chat/completions", {"messages": MSGS, **fields}, status)
    return r, (fake.last_request() if status == 200 else None)


# ---- OpenAI chat: every sampling field, vLLM's and FastDeploy's extras ----------------------------

@pytest.mark.parametrize("fields, expect", [
    ({"max_tokens": 5}, {"max_tokens": 5}),
    ({"max_completion_tokens": 7, "max_tokens": 5}, {"max_tokens": 7}),
    ({"temperature": 0}, {"temperature": 0.0}),
    ({"top_p": 0.5, "top_k": 3, "min_p": 0.1}, {"top_p": 0.5, "top_k": 3, "min_p": 0.1}),
    ({"n": 2}, {"n": 2}),
    ({"stop": "x"}, {"stop": ["x"]}),
    ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}),
    ({"seed": 46997.0}, {"seed": 46997}),
    ({"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2},
     {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2}),
    ({"min_tokens": 2, "stop_token_ids": [5.0], "include_stop_str_in_output": True, "ignore_eos": True},
     {"min_tokens": 2, "stop_token_ids": [5], "include_stop_str_in_output": True, "ignore_eos": True}),
    ({"skip_special_tokens": False, "spaces_between_special_tokens": False},
     {"skip_special_tokens": False, "spaces_between_special_tokens": False}),
    ({"bad_words_token_ids": [11], "allowed_token_ids": [12, 13]},
     {"banned_token_ids": [11], "allowed_token_ids": [12, 13]}),
    ({"truncate_prompt_tokens": 4}, {"truncate_prompt_tokens": 4}),
    ({"truncate_prompt_tokens": -1}, {"truncate_prompt_tokens": 8191}),
    ({"prompt_logprobs": 2}, {"prompt_logprobs": 2}),
    ({"logprobs": True, "top_logprobs": 3}, {"logprobs": True, "top_logprobs": 3}),
])
def test_openai_chat_sampling_fields(fake, fields, expect):
    _, req = chat(fake, **fields)
    for name, value in expect.items():
        assert getattr(req.params, name) == value, name
        assert type(getattr(req.params, name)) is type(value), name


def test_openai_defaults_come_from_one_place(fake):
    _, req = chat(fake)
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.n, p.max_tokens) == (1.0, 1.0, 0, 1, 8192)
    post(fake, "/v1/completions", {"prompt": "hi"})
    assert fake.last_request().params.max_tokens == 16  # OpenAI's legacy completions default


@pytest.mark.parametrize("priority, engine_priority", [(None, 5), (0, 5), (-2, 3), (-9, 1), (7, 5)])
def test_openai_priority(fake, priority, engine_priority):
    _, req = chat(fake, priority=priority)
    assert req.priority == engine_priority


@pytest.mark.parametrize("model", [None, "", "default", "null", "fake-model"])
def test_openai_model_may_be_omitted_or_default(fake, model):
    fields = {} if model is None else {"model": model}
    _, req = chat(fake, **fields)
    assert req.lora is None


def test_openai_unknown_model_is_not_found(fake):
    r, _ = chat(fake, 404, model="gpt-9")
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"] and "does not exist" in err["message"]
    assert "LoRA" not in err["message"]


def test_openai_chat_template_switches(fake):
    _, req = chat(fake, add_generation_prompt=False, add_special_tokens=True, chat_template_kwargs={"x": 1},
                  documents=[{"title": "t", "text": "d"}])
    assert isinstance(req.prompt, ChatPrompt)
    assert (req.prompt.add_generation_prompt, req.prompt.add_special_tokens) == (False, True)
    assert req.prompt.chat_template_kwargs == {"x": 1, "documents": [{"title": "t", "text": "d"}]}
    _, req = chat(fake, messages=[*MSGS, {"role": "assistant", "content": "Sure"}], continue_final_message=True)
    assert req.prompt.continue_final_message and not req.prompt.add_generation_prompt


def test_openai_request_chat_template_is_accepted_without_a_flag(fake):
    # FastDeploy accepts it; the engine renders it in the bounded sandbox (tests/engine/test_template_sandbox.py)
    _, req = chat(fake, chat_template="{{ messages }}")
    assert req.prompt.chat_template == "{{ messages }}"


def test_fastdeploy_prompt_token_ids_and_disable_chat_template(fake):
    _, req = chat(fake, prompt_token_ids=[1, 2, 3], metadata={"trace": "x"})
    assert isinstance(req.prompt, TokensPrompt) and req.prompt.token_ids == [1, 2, 3]
    _, req = chat(fake, messages=[{"role": "user", "content": "raw text"}], disable_chat_template=True)
    assert isinstance(req.prompt, TextPrompt) and req.prompt.text == "raw text"
    post(fake, "/v1/completions", {"prompt_token_ids": [4, 5]})
    assert fake.last_request().prompt.token_ids == [4, 5]


def test_openai_request_id_names_the_answer(fake):
    r, _ = chat(fake, request_id="abc-123")
    assert r.json()["id"] == "chatcmpl-abc-123"


def test_openai_parallel_tool_calls_is_accepted(fake):
    chat(fake, parallel_tool_calls=False)


def test_best_of_generates_more_and_returns_the_n_best(fake):
    r = post(fake, "/v1/completions", {"prompt": "hi", "best_of": 5, "n": 3, "max_tokens": 3})
    assert fake.last_request().params.n == 5 and fake.last_request().params.logprobs
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["logprobs"] is None for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 15  # every generated sample counts
    r = post(fake, "/v1/completions", {"prompt": "hi", "best_of": 2, "n": 3}, 400)
    assert r.json()["error"]["param"] == "best_of"
    r = post(fake, "/v1/completions", {"prompt": "hi", "best_of": 3, "stream": True}, 400)
    assert r.json()["error"]["param"] == "best_of"
    r, _ = chat(fake, 400, use_beam_search=True)
    assert r.json()["error"]["param"] == "use_beam_search"


def test_an_empty_allowed_token_ids_is_refused_not_ignored(fake):
    """An empty list would allow no token at all: refused naming the field (vLLM refuses it too), where it
    used to mean "no restriction"."""
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = post(fake, path, {**body, "allowed_token_ids": []}, 400)
        assert r.json()["error"]["param"] == "allowed_token_ids"


def test_completions_prompt_forms(fake):
    post(fake, "/v1/completions", {"prompt": "hi", "add_special_tokens": False})
    assert fake.last_request().prompt == TextPrompt("hi", add_special_tokens=False)
    post(fake, "/v1/completions", {"prompt": [1, 2.0]})
    assert fake.last_request().prompt.token_ids == [1, 2]


# ---- the other protocols -----------------------------------------------------------------------

def test_vllm_generate_fields(fake):
    post(fake, "/generate", {"prompt": "hi", "max_tokens": 3, "temperature": 0.2, "top_k": 5, "seed": 7.0,
                             "stop_token_ids": [3, 2**32], "min_tokens": 1, "ignore_eos": True})
    p = fake.last_request().params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop_token_ids, p.min_tokens, p.ignore_eos) == \
        (3, 0.2, 5, 7, [3], 1, True)


def test_sglang_fields(fake):
    post(fake, "/generate", {"text": ["a", "b"], "rid": "r1", "sampling_params": {
        "max_new_tokens": 4, "min_new_tokens": 1, "no_stop_trim": True, "n": 1, "stop": "z", "seed": 3.0}})
    reqs = fake.engine.requests[-2:]
    assert [r.request_id for r in reqs] == ["r1-0", "r1-1"]
    p = reqs[0].params
    assert (p.max_tokens, p.min_tokens, p.include_stop_str_in_output, p.stop, p.seed) == (4, 1, True, ["z"], 3)
    post(fake, "/generate", {"input_ids": [1, 2]})
    assert fake.last_request().params.max_tokens == 128  # SGLang's default


@pytest.mark.parametrize("parameters, expect", [
    ({}, {"temperature": 0.0, "max_tokens": 20}),  # TGI: no sampling knob means greedy
    ({"temperature": 0.7}, {"temperature": 0.7}),
    ({"do_sample": True}, {"temperature": 1.0}),
    ({"do_sample": False, "temperature": 0.7}, {"temperature": 0.0}),
    ({"truncate": 3}, {"truncate_prompt_tokens": 3}),
    ({"seed": 9.0, "top_n_tokens": 2}, {"seed": 9, "top_logprobs": 2, "logprobs": True}),
])
def test_textgen_parameters(fake, parameters, expect):
    post(fake, "/generate", {"inputs": "hi", "parameters": parameters})
    for name, value in expect.items():
        assert getattr(fake.last_request().params, name) == value, name


def test_textgen_priority_timeout_and_adapter(fake):
    post(fake, "/v2/models/fake-model/generate", {"text_input": "hi", "parameters": {"priority": 2, "timeout": 9}})
    req = fake.last_request()
    assert req.priority == 2 and req.deadline is not None and 8 < req.deadline - req.arrival_time <= 9


def test_ollama_options(fake):
    post(fake, "/api/chat", {"model": "fake-model", "messages": MSGS, "stream": False,
                             "options": {"num_predict": 5, "temperature": 0.1, "top_k": 2, "top_p": 0.3,
                                         "repeat_penalty": 1.3, "seed": 11, "stop": ["q"]}})
    p = fake.last_request().params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed, p.stop) == \
        (5, 0.1, 2, 0.3, 1.3, 11, ["q"])
    post(fake, "/api/generate", {"model": "fake-model:latest", "prompt": "hi", "stream": False,
                                 "options": {"seed": -1}})
    p = fake.last_request().params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed) == \
        (8192, 0.8, 40, 0.9, 1.1, None)


def test_ollama_prompt_forms(fake):
    post(fake, "/api/generate", {"model": "fake-model", "prompt": "hi", "system": "be brief", "stream": False})
    prompt = fake.last_request().prompt
    assert [(m.role, m.content) for m in prompt.messages] == [("system", "be brief"), ("user", "hi")]
    post(fake, "/api/generate", {"model": "fake-model", "prompt": "hi", "raw": True, "context": [1, 2],
                                 "stream": False})
    ids = fake.last_request().prompt.token_ids
    assert ids[:2] == [1, 2] and ids[2:] == fake.engine.tokenizer.encode("hi", add_special_tokens=False)
    post(fake, "/api/generate", {"model": "fake-model", "prompt": "hi", "format": "json", "stream": False})
    assert fake.last_request().params.constraint.kind == "json_object"
    for field, value in (("images", ["x"]), ("suffix", "s"), ("template", "t")):
        r = post(fake, "/api/generate", {"model": "fake-model", "prompt": "hi", field: value}, 400)
        assert field in r.json()["error"]


def test_spark_parameters(fake):
    import asyncio

    from tests.spark.client import converse, spark_request

    asyncio.run(converse(fake.ws_url, spark_request("hi", temperature=0.2, max_tokens=9, top_k=2, punish=1.5)))
    p = fake.last_request().params
    assert (p.temperature, p.max_tokens, p.top_k, p.repetition_penalty) == (0.2, 9, 2, 1.5)
    asyncio.run(converse(fake.ws_url, spark_request("hi")))
    p = fake.last_request().params
    assert (p.temperature, p.max_tokens, p.top_k) == (0.5, 2048, 4)  # the spec's defaults


def test_spark_prompt_is_templated_once(fake):
    """fit_history templates and tokenizes the dialogue to check it fits; the engine takes those ids
    instead of templating it a second time."""
    import asyncio

    from tests.spark.client import converse, spark_request

    asyncio.run(converse(fake.ws_url, spark_request("hi")))
    prompt = fake.last_request().prompt
    messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
    expected = fake.engine.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert prompt.token_ids == list(expected)


def test_best_samples_rank_by_cumulative_logprob_and_length_penalty():
    from bridges.common import Completion
    from bridges.openai import best_samples
    from engine.request import TokenLogprob

    def sample(index: int, logprobs: list[float]) -> Completion:
        return Completion(index, token_ids=list(range(len(logprobs))),
                          logprobs=[TokenLogprob(0, lp) for lp in logprobs])

    # cumulative -1.0 vs -1.2; per token -1.0 vs -0.6
    (best,) = best_samples([sample(0, [-1.0]), sample(1, [-0.6, -0.6])], 1, None)  # vLLM: cumulative
    assert best.token_ids == [0] and best.index == 0
    (best,) = best_samples([sample(0, [-1.0]), sample(1, [-0.6, -0.6])], 1, 1.0)  # length_penalty 1: per token
    assert best.token_ids == [0, 1] and best.index == 0


# ---- structured output: each protocol's fields onto the one Constraint -------------------------------

@pytest.mark.parametrize("path, body, kind, field", [
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_object"}}, "json_object",
     "response_format"),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "json", "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": MSGS, "guided_json": '{"type": "object"}'}, "json", "guided_json"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a+"}, "regex", "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a", "b"]}, "choice", "guided_choice"),
    ("/v1/chat/completions", {"messages": MSGS, "guided_grammar": "root ::= \"a\""}, "grammar", "guided_grammar"),
    ("/v1/chat/completions", {"messages": MSGS, "structural_tag": json.dumps({
        "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f>"]})}, "structural_tag",
     "structural_tag"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": '{"type": "object"}'}}, "json",
     "sampling_params.json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": 'root ::= "a"'}}, "grammar", "sampling_params.ebnf"),
    ("/generate", {"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "a+"}}}, "regex",
     "parameters.grammar.value"),
    ("/infer", {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": {"type": "object"}}}}, "json",
     "parameters.grammar.value"),
    ("/api/chat", {"model": "fake-model", "messages": MSGS, "stream": False, "format": {"type": "object"}}, "json",
     "format"),
])
def test_structured_output_fields(fake, path, body, kind, field):
    post(fake, path, body)
    c = fake.last_request().params.constraint
    assert (c.kind, c.field) == (kind, field)


def test_structured_output_whitespace_and_backend(fake):
    chat(fake, guided_json={"type": "object"}, guided_whitespace_pattern="[ ]?", guided_decoding_backend="guidance")
    assert fake.last_request().params.constraint.whitespace_pattern == "[ ]?"
    r, _ = chat(fake, 400, guided_json={"type": "object"}, guided_decoding_backend="nonesuch")
    assert r.json()["error"]["param"] == "guided_decoding_backend"
    r, _ = chat(fake, 400, guided_regex="a", guided_choice=["a"])
    assert "only one" in r.json()["error"]["message"]


def test_structural_tag_text_that_is_not_json_is_a_400(fake):
    """Found by the schemathesis run: FastDeploy's structural_tag as text that is not JSON was a 500."""
    r, _ = chat(fake, 400, structural_tag="W&not json")
    assert r.json()["error"]["param"] == "structural_tag"
