"""Each protocol's structured-output fields lowered onto the engine's one ``Constraint``. The engine
compiles it (and names the field in a 400 when it cannot); here only the shapes are read."""

from __future__ import annotations

import json
from typing import Any

from bridges.common import BridgeError, parse_json_field
from engine.structured import Constraint

# what --structured-output-backend / guided_decoding_backend may name: llguidance (vLLM calls it
# "guidance"); "auto" picks it
BACKEND_NAMES = ("auto", "llguidance", "guidance")
# the other libraries vLLM can name (xgrammar is its default): they serve the same JSON schema, regex,
# choice and grammar constraints, so a request or launch line naming one is served by llguidance, and
# the substitution is reported (X-Ignored-Parameters on a request, a start-up line for the flag)
SUBSTITUTED_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")


def _json_text(value: Any, field: str) -> str:
    """A schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        value = parse_json_field(value, field)
    if not isinstance(value, (dict, bool)):
        raise BridgeError(400, f"{field}: a JSON schema must be an object", param=field)
    return json.dumps(value)


def _only_one(found: list[tuple[str, Constraint]]) -> Constraint | None:
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise BridgeError(400, f"only one structured-output constraint per request; got {names}", param=found[1][0])
    return found[0][1] if found else None


def check_backend(name: str | None, field: str = "guided_decoding_backend") -> None:
    if name is not None and name not in BACKEND_NAMES + SUBSTITUTED_BACKENDS:
        raise BridgeError(400, f"{field}: {name!r} is not available; this server's structured-output backend is "
                               "llguidance (names accepted: auto, llguidance, guidance; xgrammar, outlines and "
                               "lm-format-enforcer are served by llguidance)", param=field)


def response_format(fmt: dict[str, Any] | None, field: str = "response_format",
                    whitespace: str | None = None) -> Constraint | None:
    """OpenAI's response_format: text, json_object, json_schema, and vLLM's structural_tag."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", whitespace_pattern=whitespace, field=field)
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise BridgeError(400, f"{field}.json_schema.schema is required", param=f"{field}.json_schema.schema")
        return Constraint("json", _json_text(schema, f"{field}.json_schema.schema"), whitespace,
                          f"{field}.json_schema.schema")
    if kind == "structural_tag":
        if not isinstance(fmt.get("structures"), list):
            raise BridgeError(400, f"{field}.structures: a list of {{begin, schema, end}} is required",
                              param=f"{field}.structures")
        return Constraint("structural_tag", json.dumps({"structures": fmt["structures"],
                                                        "triggers": fmt.get("triggers", [])}), field=field)
    raise BridgeError(400, f"{field}.type: {kind!r} is not one of text, json_object, json_schema, structural_tag",
                      param=f"{field}.type")


def openai_constraint(body: dict[str, Any]) -> Constraint | None:
    """OpenAI / vLLM / FastDeploy: response_format, guided_json / regex / choice / grammar, structural_tag,
    guided_whitespace_pattern, guided_decoding_backend."""
    check_backend(body.get("guided_decoding_backend"))
    ws = body.get("guided_whitespace_pattern")
    found: list[tuple[str, Constraint]] = []
    fmt = response_format(body.get("response_format"), whitespace=ws)
    if fmt is not None:
        found.append(("response_format", fmt))
    if body.get("guided_json") is not None:
        found.append(("guided_json", Constraint("json", _json_text(body["guided_json"], "guided_json"), ws,
                                                "guided_json")))
    if body.get("guided_regex") is not None:
        found.append(("guided_regex", Constraint("regex", body["guided_regex"], field="guided_regex")))
    if body.get("guided_choice") is not None:
        found.append(("guided_choice", Constraint.choice(body["guided_choice"])))
    if body.get("guided_grammar") is not None:
        found.append(("guided_grammar", Constraint("grammar", body["guided_grammar"], field="guided_grammar")))
    if body.get("structural_tag") is not None:  # FastDeploy: the tag as JSON text (or an object)
        tag = body["structural_tag"]
        if isinstance(tag, str):
            tag = parse_json_field(tag, "structural_tag")
        if not isinstance(tag, dict):
            raise BridgeError(400, "structural_tag: expected an object with structures and triggers",
                              param="structural_tag")
        constraint = response_format({"type": "structural_tag", **tag}, "structural_tag")
        assert constraint is not None  # a structural_tag format always makes one (or is refused)
        found.append(("structural_tag", constraint))
    return _only_one(found)


def sglang_constraint(sp: dict[str, Any], field: str = "sampling_params") -> Constraint | None:
    found: list[tuple[str, Constraint]] = []
    if sp.get("json_schema") is not None:
        name = f"{field}.json_schema"
        found.append((name, Constraint("json", _json_text(sp["json_schema"], name), field=name)))
    if sp.get("regex") is not None:
        found.append((f"{field}.regex", Constraint("regex", sp["regex"], field=f"{field}.regex")))
    if sp.get("ebnf") is not None:
        found.append((f"{field}.ebnf", Constraint("grammar", sp["ebnf"], field=f"{field}.ebnf")))
    return _only_one(found)


def tgi_grammar(grammar: dict[str, Any] | None, field: str = "parameters.grammar") -> Constraint | None:
    """TGI's {"type": "json" | "regex", "value": ...} (MindIE and Triton carry the same parameters)."""
    if not grammar:
        return None
    kind, value = grammar.get("type"), grammar.get("value")
    if kind == "json":
        return Constraint("json", _json_text(value, f"{field}.value"), field=f"{field}.value")
    if kind == "regex":
        if not isinstance(value, str):  # the schema allows an object (for json); a regex is text
            raise BridgeError(400, f"{field}.value: a regex must be a string", param=f"{field}.value")
        return Constraint("regex", value, field=f"{field}.value")
    raise BridgeError(400, f"{field}.type: {kind!r} is not json or regex", param=f"{field}.type")


def ollama_format(fmt: Any) -> Constraint | None:
    """Ollama's format: "json" (any JSON), or a JSON schema object."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return Constraint("json_object", field="format")
    return Constraint("json", _json_text(fmt, "format"), field="format")
