"""A request's ``SamplingParams`` spelled as OpenAI /v1/completions fields: the inverse of this server's
OpenAI completions lowering, derived from the sampling table's openai column (names, defaults,
conversions) plus the two things the table does not hold: logprobs in the completions form and the
structured-output constraint as ``response_format`` / ``guided_*``.

The fleet client (``fleet/client.py``) sends it to its backends, so a front end and a replica read one
vocabulary: tests/protocol/test_openai_fields.py checks ``lower(openai_fields(p)) == p`` for random ``p``
through the real completions endpoint. A parameter these fields cannot carry is refused, never dropped.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from bridges.sampling_table import TABLE
from engine.errors import InvalidRequestError
from engine.sampling_params import BAN_BIAS, SamplingParams
from engine.structured import Constraint

# SamplingParams fields no /v1/completions body can carry, and why: a request that sets one is refused
# with the field's name (serving it without would answer another question).
NOT_EXPRESSIBLE: dict[str, str] = {
    "leading_section": "a constraint or budget that starts after the thinking has no completions field",
}
# SamplingParams fields outside the table, spelled below: (logprobs, top_logprobs) as completions'
# ``logprobs`` count, the constraint as its OpenAI / vLLM field.
OUTSIDE_TABLE = ("logprobs", "top_logprobs", "constraint")
# Knobs sent even at their default: vLLM, SGLang and this server's replicas take a knob the body leaves out
# from the model's generation_config (the penalties too), and max_tokens' OpenAI default differs per
# endpoint; naming them keeps the answer the one the front end asked for, its defaults applied once.
ALWAYS_SENT = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty")
# Knobs sent together as OpenAI's ``logit_bias``, the one token-level field vLLM, SGLang and this server
# all read: each banned id as BAN_BIAS (this server's replicas read -100 as a ban; vLLM and SGLang add it,
# which leaves the token out in practice), then the request's other biases. (bad_words_token_ids, the
# table's field for bans, is read by this server and FastDeploy only: on vLLM the ban was dropped.)
SENT_AS_LOGIT_BIAS = ("banned_token_ids", "logit_bias")
# Knobs whose openai column lists several fields: the one a completions body carries
# (max_completion_tokens exists on chat only).
WIRE_NAME = {"max_tokens": "max_tokens"}
# A knob's value where the engine's form and the wire's differ: no top-k cut is 0 in the engine and -1
# on every OpenAI-compatible server (vLLM releases before 0.8 refuse 0); the lowering reads -1 as 0.
WIRE_VALUE: dict[str, Callable[[Any], Any]] = {"top_k": lambda k: -1 if k == 0 else k}


def _engine_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


ENGINE_DEFAULTS = _engine_defaults()


def _wire_name(knob_name: str, names: str | tuple[str, ...]) -> str:
    if isinstance(names, str):
        return names
    chosen = WIRE_NAME[knob_name]  # a new multi-field knob must say which field a completions body carries
    assert chosen in names, (knob_name, chosen, names)
    return chosen


def _constraint_fields(c: Constraint) -> dict[str, Any]:
    """The constraint as the OpenAI lowering (bridges/constraints.py ``openai_constraint``) reads it."""
    if c.kind == "json_object":
        out: dict[str, Any] = {"response_format": {"type": "json_object"}}
    elif c.kind == "json":
        out = {"guided_json": json.loads(c.value)}
    elif c.kind == "choice":
        out = {"guided_choice": json.loads(c.value)}
    elif c.kind == "regex":
        out = {"guided_regex": c.value}
    elif c.kind == "grammar":
        out = {"guided_grammar": c.value}
    elif c.kind == "structural_tag":
        out = {"structural_tag": c.value}  # JSON text of {structures, triggers}, as FastDeploy sends it
    else:
        raise InvalidRequestError(f"a {c.kind!r} constraint has no completions field", parameter=c.field)
    if c.whitespace_pattern is not None:
        out["guided_whitespace_pattern"] = c.whitespace_pattern
    return out


def openai_fields(params: SamplingParams) -> dict[str, Any]:
    """``params`` as /v1/completions sampling fields; a knob at the value the lowering would give it
    anyway is left out (except ``ALWAYS_SENT``). Raises ``InvalidRequestError`` naming the request's
    field for anything in ``NOT_EXPRESSIBLE``."""
    for name, why in NOT_EXPRESSIBLE.items():
        value = getattr(params, name)
        if value != ENGINE_DEFAULTS[name]:
            field = getattr(value, "field", name)
            raise InvalidRequestError(f"'{field}' cannot be carried to the --engine-url backends ({why}); "
                                      "serve the model locally to use it", parameter=field)
    body: dict[str, Any] = {}
    for knob in TABLE:
        names = knob.fields.get("openai")
        if names is None or knob.name in SENT_AS_LOGIT_BIAS:
            continue
        value = getattr(params, knob.name)
        lowered_default = knob.defaults.get("openai", ENGINE_DEFAULTS[knob.name])
        if knob.name in ALWAYS_SENT or value != lowered_default:
            body[_wire_name(knob.name, names)] = WIRE_VALUE.get(knob.name, _same)(value)
    bans, bias = params.bans_and_bias()
    if bans or bias:
        body["logit_bias"] = {str(t): BAN_BIAS for t in bans} | {str(t): b for t, b in bias}
    if params.logprobs:  # completions' logprobs: the number of top candidates; present means "return them"
        body["logprobs"] = params.top_logprobs
    if params.constraint is not None:
        body.update(_constraint_fields(params.constraint))
    return body


def _same(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value  # the body never shares a list with params
