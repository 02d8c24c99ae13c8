"""The fleet client's vocabulary cannot drift from the sampling table: for random SamplingParams ``p``,
the /v1/completions body the fleet client sends (``openai_fields(p)`` inside its transport fields),
posted to this server's real completions endpoint (schema, lowering; the fake engine records what
arrives), lowers back to ``p``. Each field of SamplingParams must have a domain below or be refused by
``openai_fields``, so a new knob fails here until it travels."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridges.openai_fields import NOT_EXPRESSIBLE, OUTSIDE_TABLE, openai_fields
from bridges.sampling_table import TABLE
from engine.errors import InvalidRequestError
from engine.sampling_params import LeadingSection, SamplingParams
from engine.structured import Constraint
from fleet.client import completion_body

PROMPT_IDS = [1, 2, 3, 4, 5, 6]


def _floats(lo: float, hi: float, exclude_min: bool = False) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, exclude_min=exclude_min, allow_nan=False, allow_infinity=False)


_ids = st.lists(st.integers(0, 2000), max_size=3)
_schema = st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
    st.text("abcxyz", min_size=1, max_size=4), st.sampled_from([{"type": "string"}, {"type": "integer"}]),
    max_size=3)})
_ws = st.none() | st.sampled_from([r"[ ]?", r"[\n ]*"])
_constraint = st.one_of(
    st.builds(lambda s, ws: Constraint("json", json.dumps(s), ws), _schema, _ws),
    st.builds(lambda ws: Constraint("json_object", whitespace_pattern=ws), _ws),
    st.builds(lambda r: Constraint("regex", r), st.sampled_from([r"\d+", r"(yes|no)", r"[a-z]{1,8}"])),
    st.builds(lambda g: Constraint("grammar", g), st.sampled_from(['start: "a" | "b"', 'root ::= "x"'])),
    st.builds(lambda cs: Constraint.choice(cs), st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4)),
    st.builds(lambda b: Constraint("structural_tag", json.dumps({"structures": [
        {"begin": b, "schema": {"type": "object"}, "end": "</f>"}], "triggers": [b]})),
        st.sampled_from(["<f>", "<call>"])),
)

# Each SamplingParams field's domain: what the OpenAI completions schema admits, bounded to what the
# shared fake server serves quickly (token ids inside its vocabulary, few samples and logprobs).
DOMAINS: dict[str, st.SearchStrategy] = {
    "max_tokens": st.integers(1, 64) | st.just(256),  # 256: the engine's default, not completions' 16
    "temperature": _floats(0, 2),
    "top_k": st.sampled_from([0, 1, 2, 40]),
    "top_p": _floats(0, 1, exclude_min=True),
    "min_p": _floats(0, 1),
    "repetition_penalty": _floats(0.01, 10),
    "presence_penalty": _floats(-2, 2),
    "frequency_penalty": _floats(-2, 2),
    "seed": st.none() | st.integers(0, 2**63),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=3),
    "stop_token_ids": _ids,
    "banned_token_ids": _ids,
    "allowed_token_ids": _ids,
    # the ban (-100) and the bounds often, any bias in [-100, 100] else
    "logit_bias": st.dictionaries(st.integers(0, 2000), st.sampled_from([-100.0, 100.0, 0.0]) | _floats(-100, 100),
                                  max_size=4).map(lambda d: tuple(d.items())),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "n": st.integers(1, 2),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "prompt_logprobs": st.none() | st.integers(0, 5),
    "truncate_prompt_tokens": st.none() | st.integers(1, 16),
    "temp_scaled_logprobs": st.booleans(),
    "top_p_normalized_logprobs": st.booleans(),
    "constraint": st.none() | _constraint,
}


@st.composite
def sampling_params(draw) -> SamplingParams:
    kw = {name: draw(domain) for name, domain in DOMAINS.items()}
    kw["min_tokens"] = draw(st.integers(0, kw["max_tokens"]))
    if kw["banned_token_ids"] and draw(st.booleans()):  # a banned id biased as well: the ban wins
        kw["logit_bias"] = ((kw["banned_token_ids"][0], draw(_floats(-100, 100))),
                            *((t, b) for t, b in kw["logit_bias"] if t != kw["banned_token_ids"][0]))
    if not kw["logprobs"]:
        kw["top_logprobs"] = 0  # without logprobs it selects nothing, and no request field states it
    return SamplingParams(**kw)


def _knobs(p: SamplingParams) -> SamplingParams:
    """``p`` with its constraint's ``field`` (the request field named in errors: where it arrived) set aside,
    and its bans in one form: banned_token_ids and -100 biases mean the same (``bans_and_bias``), and the
    body carries both as logit_bias -100."""
    bans, bias = p.bans_and_bias()
    p = dataclasses.replace(p, banned_token_ids=bans, logit_bias=bias)
    if p.constraint is None:
        return p
    return dataclasses.replace(p, constraint=dataclasses.replace(p.constraint, field="constraint"))


def test_every_sampling_field_travels_or_is_refused():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    in_table = {k.name for k in TABLE if "openai" in k.fields}
    assert names == in_table | set(OUTSIDE_TABLE) | set(NOT_EXPRESSIBLE)
    assert names - set(NOT_EXPRESSIBLE) == set(DOMAINS) | {"min_tokens"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=sampling_params())
def test_the_fleet_body_lowers_back_to_the_same_params(fake_server, p):
    body = completion_body(fake_server.engine.model_info.name, PROMPT_IDS, openai_fields(p))
    fake_server.engine.requests.clear()
    r = httpx.post(fake_server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, (r.text, body)
    assert _knobs(fake_server.last_request().params) == _knobs(p), body


def test_defaults_are_left_out_but_for_the_knobs_backends_would_fill_themselves():
    body = openai_fields(SamplingParams())
    assert body == {"max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def test_a_leading_section_is_refused_naming_its_field():
    p = SamplingParams(leading_section=LeadingSection((7,), max_tokens=5, field="reasoning_max_tokens"))
    with pytest.raises(InvalidRequestError, match="reasoning_max_tokens") as caught:
        openai_fields(p)
    assert caught.value.parameter == "reasoning_max_tokens"
