"""The llama3_json, mistral and pythonic tool-call formats on the scripted engine: tools written into the
prompt in each model's own form, calls read back from whole and streamed answers (the engine scripts
the model's text), and each format's `required` grammar accepting its calls and refusing unnamed
arguments."""

from __future__ import annotations

import functools
import json

import httpx
import llguidance
import pytest

from bridges.tool_formats import FORMATS, PARSERS
from bridges.tools import rebased_refs, strict_parameters
from engine.grammar_worker import grammar_text
from engine.structured import grammar_tokenizer
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import Script, shared_tokenizer

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": ADD}},
         {"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}],
       "tools": TOOLS}
# what each model family writes for two calls, and where its prompt shows the tools
ANSWERS = {
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                   '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
               '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "pythonic": "[add(a=1, b=2), get_weather(city='Paris')]",
}
CONTENT = {"llama3_json": None, "mistral": "Sure.", "pythonic": None}


@pytest.fixture(scope="module")
def servers(fake_server):
    urls, threads = {}, []
    for name in ANSWERS:
        settings = Settings(port=free_port(), tool_call_parser=name)
        threads.append(ServerThread(build_app(settings, fake_server.engine, owns_engine=False), settings.port))
        urls[name] = f"http://127.0.0.1:{settings.port}"
    for t in threads:
        t.__enter__()
    yield urls
    for t in threads:
        t.__exit__(None, None, None)


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


EXPECTED = [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_calls_are_read_back_whole_and_streamed(servers, fake, name):
    url = servers[name] + "/v1/chat/completions"
    for burst in (1, 4):
        fake.engine.script = Script(answer=ANSWERS[name], burst=burst)
        choice = httpx.post(url, json=ASK).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == CONTENT[name]
        assert _calls(choice["message"]["tool_calls"]) == EXPECTED
        if name == "mistral":  # Mistral's templates need 9-character alphanumeric ids
            assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in choice["message"]["tool_calls"])
        events = [json.loads(line[6:]) for line in httpx.post(url, json={**ASK, "stream": True}).text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls") or []]
        heads = [d for d in deltas if d.get("id")]
        args = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in range(len(heads))]
        assert [(h["function"]["name"], json.loads(a)) for h, a in zip(heads, args)] == EXPECTED
        assert content.strip() == (CONTENT[name] or "") and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert fake.last_request().params.skip_special_tokens is (name == "pythonic")  # markers kept in the text


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_plain_answers_stay_content(servers, fake, name):
    for text in ("The answer is 3.", "[1, 2] are numbers", "{not json"):
        fake.engine.script = Script(answer=text)
        choice = httpx.post(servers[name] + "/v1/chat/completions", json=ASK).json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"
        events = httpx.post(servers[name] + "/v1/chat/completions", json={**ASK, "stream": True}).text
        assert "tool_calls" not in events


def test_each_prompt_shows_the_tools_in_its_models_form(servers, fake):
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "abcdefghi", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "abcdefghi", "content": "3"}]
    seen = {}
    for name, url in servers.items():
        httpx.post(url + "/v1/chat/completions", json={**ASK, "messages": ASK["messages"] + history[1:]})
        seen[name] = [(m.role, m.content) for m in fake.last_request().prompt.messages]
    llama = seen["llama3_json"]
    assert llama[1][0] == "user" and llama[1][1].startswith("Given the following functions")
    assert '"name": "add"' in llama[1][1] and llama[1][1].endswith("1+2?")
    assert llama[2] == ("assistant", '{"name": "add", "parameters": {"a": 1, "b": 2}}') and llama[3] == ("tool", "3")
    mistral = seen["mistral"]
    assert mistral[1][1].startswith("[AVAILABLE_TOOLS] [{") and "[/AVAILABLE_TOOLS]\n1+2?" in mistral[1][1]
    assert mistral[2][1] == '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    assert mistral[3] == ("tool", '[TOOL_RESULTS] {"content": "3"}[/TOOL_RESULTS]')
    pythonic = seen["pythonic"]
    assert pythonic[0][0] == "system" and pythonic[0][1].startswith("Be brief.\n\nYou are an expert in composing")
    assert "[func_name1(params_name1=params_value1" in pythonic[0][1] and '"name": "add"' in pythonic[0][1]
    assert pythonic[2] == ("assistant", "[add(a=1, b=2)]")


@functools.cache
def _grammar_tokenizer():
    tok = shared_tokenizer()
    return grammar_tokenizer(tok, [tok.eos_token_id])


def _accepts(constraint, text: str) -> bool:
    tok = shared_tokenizer()
    matcher = llguidance.LLMatcher(_grammar_tokenizer(),
                                   grammar_text(constraint.kind, constraint.value, constraint.whitespace_pattern),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


GOOD = {"hermes": '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>',
        "llama3_json": '{"name":"add","parameters":{"a":1,"b":2}}; {"name":"get_weather","parameters":{"city":"P"}}',
        "mistral": '[TOOL_CALLS][{"name":"add","arguments":{"a":1,"b":2}}]',
        "pythonic": "[add(a=1, b=2), get_weather(city='Paris')]"}
EXTRA = {"hermes": '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2,"c":3}}\n</tool_call>',
         "llama3_json": '{"name":"add","parameters":{"a":1,"b":2,"c":3}}',
         "mistral": '[TOOL_CALLS][{"name":"add","arguments":{"a":1,"b":2,"c":3}}]',
         "pythonic": "[add(a=1, c=2)]"}


@pytest.mark.parametrize("name", PARSERS)
def test_required_grammars_take_the_calls_and_no_unnamed_argument(name):
    functions = [t["function"] for t in TOOLS]
    constraint = FORMATS[name].grammar(functions, True)
    assert _accepts(constraint, GOOD[name]) and not _accepts(constraint, EXTRA[name])
    assert FORMATS[name].parse(GOOD[name], {"add", "get_weather"})[1]  # what the grammar makes, the parser reads


def test_strict_parameters_keeps_what_the_schema_says():
    nested = {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {}}},
                                               "q": {"type": "array", "items": {"properties": {"y": {}}}}}}
    strict = strict_parameters(nested)
    assert strict["additionalProperties"] is False and strict["properties"]["p"]["additionalProperties"] is False
    assert strict["properties"]["q"]["items"]["additionalProperties"] is False
    assert strict_parameters({"type": "object", "properties": {}, "additionalProperties": True})[
        "additionalProperties"] is True
    assert "additionalProperties" not in strict_parameters({"type": "object"})  # names nothing: stays open


def test_choices_of_the_settings_are_the_modules():
    from dataclasses import fields

    from bridges.reasoning import PARSERS as REASONING

    choices = {f.name: f.metadata.get("choices") for f in fields(Settings)}
    assert tuple(choices["tool_call_parser"]) == PARSERS and set(choices["reasoning_parser"]) == set(REASONING)


def test_a_functions_references_follow_its_schema_into_the_calls_grammar():
    """pydantic writes a model's nested types as "#/$defs/X"; inside the call's schema the parameters sit at
    /properties/arguments (or /anyOf/i/properties/arguments), and every document-local pointer moves with
    them. Data that looks like a reference (a const, an enum) is left alone, and so is another document's."""
    schema = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "me": {"anyOf": [{"$ref": "#"}]},
                                               "odd": {"$ref": "#/$defs/a%20b"}, "far": {"$ref": "other.json#/x"},
                                               "tag": {"const": {"$ref": "#/not/a/ref"}}},
              "$defs": {"P": {"type": "object", "properties": {"q": {"$ref": "#/$defs/Q"}}}, "Q": {"type": "integer"}}}
    moved = rebased_refs(schema, "/anyOf/1/properties/arguments")
    props = moved["properties"]
    assert props["p"] == {"$ref": "#/anyOf/1/properties/arguments/$defs/P"}
    assert props["me"] == {"anyOf": [{"$ref": "#/anyOf/1/properties/arguments"}]}
    assert props["odd"] == {"$ref": "#/anyOf/1/properties/arguments/$defs/a%20b"}
    assert props["far"] == {"$ref": "other.json#/x"} and props["tag"] == {"const": {"$ref": "#/not/a/ref"}}
    assert moved["$defs"]["P"]["properties"]["q"] == {"$ref": "#/anyOf/1/properties/arguments/$defs/Q"}
    assert rebased_refs(schema, "")["properties"]["p"] == {"$ref": "#/$defs/P"}  # at the root: unchanged


DEFS = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WITH_DEFS_CALL = {"hermes": '<tool_call>\n{"name":"at","arguments":{"place":{"city":"P"}}}\n</tool_call>',
                  "llama3_json": '{"name":"at","parameters":{"place":{"city":"P"}}}',
                  "mistral": '[TOOL_CALLS][{"name":"at","arguments":{"place":{"city":"P"}}}]'}


@pytest.mark.parametrize("alone", [True, False], ids=["one function", "beside another"])
@pytest.mark.parametrize("name", sorted(WITH_DEFS_CALL))
def test_every_json_call_grammar_reads_the_parameters_own_definitions(name, alone):
    """Each JSON call format puts the parameters somewhere else in its grammar's schema (a property, inside
    an anyOf, inside an array's items); their "#/$defs/..." references name their definitions there."""
    functions = [{"name": "at", "parameters": DEFS}] + ([] if alone else [t["function"] for t in TOOLS])
    constraint = FORMATS[name].grammar(functions, False)
    good = WITH_DEFS_CALL[name]
    assert _accepts(constraint, good)
    assert not _accepts(constraint, good.replace('"city":"P"', '"town":"P"'))  # the definition binds
