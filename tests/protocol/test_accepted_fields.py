"""Fields of the vLLM, FastDeploy and SGLang documents for features this server has another way or not at
all: each accepted at its no-op value (200, and the engine gets what it means), refused with a 400 naming
the field for a value that cannot be honoured, reported in X-Ignored-Parameters where it changes nothing;
FastDeploy's answer field names beside vLLM's."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.request import TokensPrompt

MSGS = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"


def post(fake, path: str, body: dict, status: int = 200) -> httpx.Response:
    r = httpx.post(fake.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    return r


def chat(fake, status: int = 200, **fields) -> httpx.Response:
    return post(fake, CHAT, {"messages": MSGS, **fields}, status)


def events(r: httpx.Response) -> list[dict]:
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def refused(r: httpx.Response, field: str) -> None:
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


# ---- vLLM ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("fields", [{"logits_processors": None, "mm_processor_kwargs": None},
                                    {"logits_processors": [], "mm_processor_kwargs": {}, "use_beam_search": False}])
def test_vllm_fields_at_their_no_op_value_are_accepted(fake, path, fields):
    body = {"messages": MSGS} if path == CHAT else {"prompt": "hi"}
    r = post(fake, path, {**body, **fields})
    assert "X-Ignored-Parameters" not in r.headers
    assert fake.last_request().params.n == 1  # it reached the engine as a plain request


@pytest.mark.parametrize("fields, field, named", [
    ({"logits_processors": ["my_pkg.MyProcessor"]}, "logits_processors", "my_pkg.MyProcessor"),
    ({"logits_processors": [{"qualname": "my_pkg.Other", "args": [1]}]}, "logits_processors", "my_pkg.Other"),
    ({"mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs", "multimodal"),
    ({"use_beam_search": True}, "use_beam_search", "beam search"),
])
def test_vllm_values_that_cannot_be_honoured_are_refused_naming_the_field(fake, fields, field, named):
    r = chat(fake, 400, **fields)
    refused(r, field)
    assert named in r.json()["error"]["message"]
    assert not fake.engine.requests  # refused before any engine work


# ---- FastDeploy ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_fastdeploy_logprob_options_reach_the_engine(fake, path):
    body = {"messages": MSGS, "logprobs": True} if path == CHAT else {"prompt": "hi", "logprobs": 1}
    post(fake, path, body)
    p = fake.last_request().params
    assert (p.temp_scaled_logprobs, p.top_p_normalized_logprobs) == (False, False)  # FastDeploy's defaults
    post(fake, path, {**body, "temp_scaled_logprobs": True, "top_p_normalized_logprobs": True, "top_p": 0.5})
    p = fake.last_request().params
    assert (p.temp_scaled_logprobs, p.top_p_normalized_logprobs, p.top_p) == (True, True, 0.5)


@pytest.mark.parametrize("fields", [{"include_draft_logprobs": False, "logits_processors_args": {}, "mm_hashes": []},
                                    {"include_draft_logprobs": None, "logits_processors_args": None,
                                     "mm_hashes": None}])
def test_fastdeploy_fields_at_their_no_op_value_are_accepted(fake, fields):
    r = chat(fake, **fields)
    assert "X-Ignored-Parameters" not in r.headers and fake.engine.requests


@pytest.mark.parametrize("fields, ignored", [
    ({"include_draft_logprobs": True, "logprobs": True}, "include_draft_logprobs"),
    ({"logits_processors_args": {"think_stop_sentence": "ok"}}, "logits_processors_args"),
])
def test_fastdeploy_fields_with_no_effect_here_are_named_in_the_header(fake, fields, ignored):
    r = chat(fake, **fields)
    assert r.headers["X-Ignored-Parameters"] == ignored
    r = chat(fake, stream=True, **fields)
    assert r.headers["X-Ignored-Parameters"] == ignored


def test_fastdeploy_mm_hashes_for_inputs_that_cannot_exist_are_refused(fake):
    refused(chat(fake, 400, mm_hashes=["9f2c"]), "mm_hashes")


def test_fastdeploy_messages_as_token_ids_are_the_prompt(fake):
    chat(fake, messages=[1, 2, 3])
    assert fake.last_request().prompt == TokensPrompt([1, 2, 3])
    refused(chat(fake, 400, messages=[1, {"role": "user", "content": "hi"}]), "messages")
    chat(fake, 400, messages=[-1])  # the schema: token ids are non-negative


# ---- SGLang -------------------------------------------------------------------------------------------

def generate(fake, status: int = 200, **fields) -> httpx.Response:
    return post(fake, GENERATE, {"text": "hi", **fields}, status)


@pytest.mark.parametrize("fields", [{"return_hidden_states": False, "custom_logit_processor": None,
                                     "sampling_params": {"custom_params": None}},
                                    {"sampling_params": {"custom_params": {}}}])
def test_sglang_fields_at_their_no_op_value_are_accepted(fake, fields):
    r = generate(fake, **fields)
    assert "X-Ignored-Parameters" not in r.headers and fake.engine.requests


@pytest.mark.parametrize("fields, field", [
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"custom_logit_processor": "{\"callable\": \"...\"}"}, "custom_logit_processor"),
    ({"text": ["a", "b"], "custom_logit_processor": [None, "x"]}, "custom_logit_processor"),
])
def test_sglang_values_that_cannot_be_honoured_are_refused(fake, fields, field):
    refused(generate(fake, 400, **fields), field)


def test_sglang_custom_params_are_named_in_the_header(fake):
    r = generate(fake, sampling_params={"custom_params": {"token_id": 5}})
    assert r.headers["X-Ignored-Parameters"] == "sampling_params.custom_params"


def test_sglang_spaces_between_special_tokens_false_reaches_the_engine(fake):
    generate(fake, sampling_params={"spaces_between_special_tokens": False})
    assert fake.last_request().params.spaces_between_special_tokens is False
    generate(fake)
    assert fake.last_request().params.spaces_between_special_tokens is True


def test_sglang_logprob_start_len_returns_the_prompt_logprobs_from_that_position(fake):
    ids = fake.engine.tokenizer.encode("one two three four five", add_special_tokens=False)
    r = post(fake, GENERATE, {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                              "logprob_start_len": 2})
    assert fake.last_request().params.prompt_logprobs == 2
    meta = r.json()["meta_info"]
    # the fake engine's prompt logprob at position p is -p / 10
    assert meta["input_token_logprobs"] == [[-p / 10, ids[p], None] for p in range(2, len(ids))]
    assert meta["input_top_logprobs"] == [[[-p / 10, ids[p], None]] * 2 for p in range(2, len(ids))]
    meta = post(fake, GENERATE, {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0}).json()["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, ids[0], None] and len(meta["input_token_logprobs"]) == len(ids)
    # past the end: the last token's, as SGLang clamps it
    meta = post(fake, GENERATE, {"input_ids": ids, "return_logprob": True, "logprob_start_len": 99}).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[-(len(ids) - 1) / 10, ids[-1], None]]


def test_sglang_logprob_start_len_streamed(fake):
    ids = fake.engine.tokenizer.encode("one two three", add_special_tokens=False)
    r = post(fake, GENERATE, {"input_ids": ids, "return_logprob": True, "logprob_start_len": 1, "stream": True})
    metas = [e["meta_info"] for e in events(r)]
    assert metas[0]["input_token_logprobs"] == [[-p / 10, ids[p], None] for p in range(1, len(ids))]
    assert all("input_token_logprobs" not in m for m in metas[1:])


def test_sglang_return_text_in_logprobs_names_each_token(fake):
    """The third item of every logprob entry, input and output, top candidates too: the token's text."""
    tok = fake.engine.tokenizer
    ids = tok.encode("one two three", add_special_tokens=False)
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 1, "logprob_start_len": 0,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3}}
    for meta in (post(fake, GENERATE, body).json()["meta_info"],
                 events(post(fake, GENERATE, {**body, "stream": True}))[0]["meta_info"]):
        entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
        entries += [e for top in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"] for e in top]
        assert entries and all(e[2] == tok.decode([e[1]]) for e in entries)


def test_sglang_default_logprob_start_len_asks_for_no_prompt_logprobs(fake):
    meta = generate(fake, return_logprob=True).json()["meta_info"]
    assert fake.last_request().params.prompt_logprobs is None and "input_token_logprobs" not in meta
    generate(fake, logprob_start_len=0)  # without return_logprob: nothing asked
    assert fake.last_request().params.prompt_logprobs is None


def test_sglang_per_prompt_lists(fake):
    r = generate(fake, text=["a", "b"], return_logprob=[True, False], top_logprobs_num=[3, 0],
                 logprob_start_len=[0, -1], lora_path=[None, None])
    first, second = fake.engine.requests[-2:]
    assert (first.params.logprobs, first.params.top_logprobs, first.params.prompt_logprobs) == (True, 3, 3)
    assert (second.params.logprobs, second.params.top_logprobs, second.params.prompt_logprobs) == (False, 0, None)
    assert first.lora is None and second.lora is None
    answers = r.json()
    assert "output_token_logprobs" in answers[0]["meta_info"] and "output_token_logprobs" not in answers[1]["meta_info"]
    assert "input_token_logprobs" in answers[0]["meta_info"]


@pytest.mark.parametrize("field, value", [("return_logprob", [True]), ("top_logprobs_num", [1, 2, 3]),
                                          ("lora_path", [None]), ("logprob_start_len", [0, 0, 0])])
def test_sglang_a_per_prompt_list_of_the_wrong_length_is_refused(fake, field, value):
    refused(generate(fake, 400, text=["a", "b"], **{field: value}), field)


# ---- grammar backends ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["xgrammar", "outlines", "lm-format-enforcer"])
def test_other_grammar_backends_are_served_by_llguidance_and_reported(fake, backend):
    r = chat(fake, guided_json={"type": "object"}, guided_decoding_backend=backend)
    assert fake.last_request().params.constraint.kind == "json"
    assert r.headers["X-Ignored-Parameters"] == "guided_decoding_backend"
    r = chat(fake, guided_decoding_backend="guidance")
    assert "X-Ignored-Parameters" not in r.headers


def test_the_launch_flag_naming_xgrammar_is_accepted():
    from spark_server.settings import resolve_with_sources

    settings, _ = resolve_with_sources({"guided_decoding_backend": "xgrammar"})
    assert settings is not None


# ---- FastDeploy's answer fields -----------------------------------------------------------------------

def test_completions_return_fastdeploy_and_vllm_token_id_names(fake):
    choice = post(fake, COMPLETIONS, {"prompt": "hi", "return_token_ids": True}).json()["choices"][0]
    assert choice["completion_token_ids"] == choice["token_ids"] and choice["token_ids"]
    assert choice["prompt_token_ids"] == fake.engine.tokenizer.encode("hi")
    choice = post(fake, COMPLETIONS, {"prompt": "hi"}).json()["choices"][0]
    assert "completion_token_ids" not in choice and "token_ids" not in choice


def test_completions_stream_chunks_carry_fastdeploy_fields(fake):
    r = post(fake, COMPLETIONS, {"prompt": ["hi", "yo"], "return_token_ids": True, "stream": True})
    chunks = [e["choices"][0] for e in events(r)]
    for index, prompt in ((0, "hi"), (1, "yo")):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["prompt_token_ids"] == fake.engine.tokenizer.encode(prompt)
        assert all("prompt_token_ids" not in c for c in mine[1:])  # once, with the first
        assert all(c["completion_token_ids"] == c["token_ids"] for c in mine)
        times = [c["arrival_time"] for c in mine]
        assert all(isinstance(t, float) for t in times) and times == sorted(times)
    plain = [e["choices"][0] for e in events(post(fake, COMPLETIONS, {"prompt": "hi", "stream": True}))]
    assert all("arrival_time" in c and "completion_token_ids" not in c for c in plain)


def test_chat_stream_chunks_carry_fastdeploy_fields(fake):
    r = chat(fake, stream=True, return_token_ids=True)
    chunks = [e["choices"][0] for e in events(r)]
    assert chunks[0]["delta"]["prompt_token_ids"]
    content = chunks[1:]
    assert all(c["delta"]["completion_token_ids"] for c in content)
    times = [c["arrival_time"] for c in content]
    assert all(isinstance(t, float) for t in times) and times == sorted(times)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_usage_has_completion_tokens_details(fake, path):
    body = {"messages": MSGS} if path == CHAT else {"prompt": "hi"}
    assert post(fake, path, body).json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    last = events(post(fake, path, {**body, "stream": True, "stream_options": {"include_usage": True}}))[-1]
    assert "completion_tokens_details" in last["usage"]
