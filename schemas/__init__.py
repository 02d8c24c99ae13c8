"""JSON Schemas (draft 2020-12) for every request body: the single source for validation and OpenAPI."""

from __future__ import annotations

import itertools
import json
from functools import lru_cache
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry, Resource

URN_PREFIX = "urn:spark-server:"
MAX_ERRORS_CONSIDERED = 8


@lru_cache(maxsize=None)
def load_schema(name: str) -> dict[str, Any]:
    text = resources.files(__name__).joinpath(f"{name}.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


@lru_cache(maxsize=None)
def registry() -> Registry:
    """Every schema by its ``$id`` (``urn:spark-server:NAME``), so bodies can share definitions."""
    resources = [(load_schema(n)["$id"], Resource.from_contents(load_schema(n))) for n in available()]
    return Registry().with_resources(resources)


@lru_cache(maxsize=None)
def validator(name: str) -> Draft202012Validator:
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, registry=registry())


def first_error(name: str, instance: Any) -> ValidationError | None:
    """The most relevant violation of schema ``name``, or None when the instance is valid.

    A field that fails its own rule also counts as "unevaluated" for ``unevaluatedProperties``;
    the rule it broke is the useful message, so that one wins. Only the first few violations are
    looked at: a body with 100,000 bad items must not cost 100,000 error objects."""
    errors = list(itertools.islice(validator(name).iter_errors(instance), MAX_ERRORS_CONSIDERED))
    specific = [e for e in errors if e.validator != "unevaluatedProperties"]
    return best_match(specific or errors)


def describe(error: ValidationError) -> str:
    """A message that names the JSON path of the offending field."""
    return f"{error.json_path}: {error.message}"


def available() -> list[str]:
    return sorted(p.name.removesuffix(".schema.json") for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".schema.json"))
