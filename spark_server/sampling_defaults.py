"""The OpenAI-compatible endpoints' sampling defaults, as vLLM settles them (``--generation-config``,
``--override-generation-config``): a knob a request leaves out takes the model's recommendation
(its generation_config.json, engine/generation_config.py), or another directory's, with the override laid
over it; a knob none of them names keeps OpenAI's default. The other protocols keep their own documented
defaults (a Spark, TGI or Ollama client never meets a model's recommendation it did not ask for)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from engine.generation_config import KNOBS, knob_value, recommended_sampling

if TYPE_CHECKING:  # the settings import this module, and parsing the command line loads no torch
    from engine.protocol import ModelInfo

logger = logging.getLogger(__name__)

# the knobs' names an override may use: transformers' (as vLLM reads them) and the engine's
_NAMES = {**KNOBS, **{knob: knob for knob in KNOBS.values()}}


def parse_override(text: str | None) -> dict[str, float | int]:
    """--override-generation-config's JSON object in the engine's knob names; ValueError naming the key
    that is not one of the knobs (vLLM drops it without a word; here the start is refused)."""
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--override-generation-config: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("--override-generation-config: expected a JSON object of sampling knobs")
    out: dict[str, float | int] = {}
    for name, value in data.items():
        knob = _NAMES.get(name)
        if knob is None:
            raise ValueError(f"--override-generation-config: {name!r} is not a sampling default this server "
                             f"takes (one of: {', '.join(KNOBS)})")
        try:
            out[knob] = knob_value(name, value)
        except ValueError as exc:
            raise ValueError(f"--override-generation-config: {exc}") from None
    return out


def openai_sampling_defaults(generation_config: str, override: str | None, model: ModelInfo) -> dict[str, float | int]:
    """The defaults the OpenAI-compatible endpoints give a knob a request leaves out, logged once where they
    are not OpenAI's own (as vLLM warns at start)."""
    if generation_config == "vllm":
        base: dict[str, float | int] = {}
        source = ""
    elif generation_config == "auto":
        base = dict(model.recommended_sampling)
        source = "the model's generation_config.json"
    else:  # a directory (Settings checked that it holds the file)
        directory = Path(generation_config)
        base = recommended_sampling(directory)
        source = str(directory / "generation_config.json")
    merged = base | parse_override(override)
    if merged:
        given = " and ".join(s for s in (source if base else "", "--override-generation-config" if override else "")
                             if s)
        logger.warning("sampling defaults of the OpenAI-compatible endpoints from %s: %s (a request's own values "
                       "win; --generation-config vllm keeps OpenAI's)", given,
                       ", ".join(f"{k}={v}" for k, v in merged.items()))
    return merged
