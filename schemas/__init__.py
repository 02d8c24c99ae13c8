"""JSON Schemas (draft 2020-12) for every request body: the single source for validation and OpenAPI."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from importlib import resources
from typing import Any, TypeVar

import jsonschema_rs
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry, Resource

T = TypeVar("T")
URN_PREFIX = "urn:spark-server:"
MAX_ERRORS_CONSIDERED = 8


@cache
def load_schema(name: str) -> dict[str, Any]:
    text = resources.files(__name__).joinpath(f"{name}.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


@cache
def registry() -> Registry:
    """Every schema by its ``$id`` (``urn:spark-server:NAME``), so bodies can share definitions."""
    resources = [(load_schema(n)["$id"], Resource.from_contents(load_schema(n))) for n in available()]
    return Registry().with_resources(resources)


@cache
def _ecma_regex(pattern: str) -> re.Pattern[str]:
    """A schema's ``pattern`` as ECMA-262 reads it, where the schemas are written for: a final ``$`` is the
    end of the string. Python's ``$`` also matches before a trailing newline, so ``^[a-z]{1,64}$`` let 64
    letters and a newline through (65 characters) where the compiled validator and other JSON Schema tools
    refuse them."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + "\\Z"
    return re.compile(pattern)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _ecma_regex(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = validators.extend(Draft202012Validator, {"pattern": _pattern})


@cache
def validator(name: str) -> Draft202012Validator:
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    return _Validator(schema, registry=registry())


@cache
def _fast_registry() -> jsonschema_rs.Registry:
    """``registry()``'s schemas, for jsonschema-rs."""
    return jsonschema_rs.Registry([(load_schema(n)["$id"], load_schema(n)) for n in available()])


@cache
def fast_validator(name: str) -> jsonschema_rs.Validator:
    """Schema ``name`` compiled by jsonschema-rs (the same schemas and registry; Rust, no Python per node)."""
    return jsonschema_rs.Draft202012Validator(load_schema(name), registry=_fast_registry())


def is_valid(name: str, instance: Any) -> bool:
    """Whether the instance is valid against schema ``name``, judged by the compiled validator: a few
    hundred times faster than jsonschema, so a large valid body costs milliseconds. False also where it
    cannot judge (a value it cannot take, such as a lone surrogate); where it finds a body invalid,
    jsonschema has the last word and the message (``first_error``), so it can only ever be stricter, and
    tests/test_schemas_agree.py holds it to never accepting a body jsonschema refuses."""
    try:
        return fast_validator(name).is_valid(instance)
    except Exception:  # its conversion of a Python value: leave the body to jsonschema
        return False


def first_error(name: str, instance: Any) -> ValidationError | None:
    """The most relevant violation of schema ``name``, or None when the instance is valid.

    A field that fails its own rule also counts as "unevaluated" for ``unevaluatedProperties``;
    the rule it broke is the useful message, so that one wins. Only the first few violations are
    looked at: a body with 100,000 bad items must not cost 100,000 error objects."""
    if is_valid(name, instance):
        return None
    errors = list(itertools.islice(validator(name).iter_errors(instance), MAX_ERRORS_CONSIDERED))
    specific = [e for e in errors if e.validator != "unevaluatedProperties"]
    return best_match(specific or errors)


# The validator's message quotes the offending value whole ("[...12,000 items...] is too long"): kept to
# this many characters, its start and its end, so a refusal is never larger than a line.
MAX_MESSAGE_CHARS = 300

# Bodies larger than this are parsed and validated on a worker thread: validating a list of thousands of
# items takes a tenth of a second, which on the event loop would pause every other client's stream. One
# thread for all of them: validation is Python holding the GIL, and several such threads at once would
# starve the event loop and the engine thread of it as surely as the loop itself.
OFF_LOOP_BYTES = 64 << 10
_VALIDATION = ThreadPoolExecutor(1, thread_name_prefix="body-validation")


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` on the one body-validation thread."""
    return await asyncio.get_running_loop().run_in_executor(_VALIDATION, work, *args)


def describe(error: ValidationError) -> str:
    """A message that names the JSON path of the offending field (the quoted value shortened)."""
    message = error.message
    if len(message) > MAX_MESSAGE_CHARS:
        half = MAX_MESSAGE_CHARS // 2
        message = f"{message[:half]} ... {message[-half:]}"
    return f"{error.json_path}: {message}"


def available() -> list[str]:
    return sorted(p.name.removesuffix(".schema.json") for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".schema.json"))
