"""The OpenAI-compatible endpoints' sampling defaults, as vLLM settles them (``--generation-config``,
``--override-generation-config``): a knob a request leaves out takes the model's recommendation
(its generation_config.json, engine/generation_config.py), or another directory's, with the override laid
over it; a knob none of them names keeps OpenAI's default. The other protocols keep their own documented
defaults (a Spark, TGI or Ollama client never meets a model's recommendation it did not ask for)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.generation_config import KNOBS, json_object, knob_value, recommended_sampling

if TYPE_CHECKING:  # the settings import this module, and parsing the command line loads no torch
    from engine.protocol import ModelInfo

logger = logging.getLogger(__name__)

# the knobs' names an override may use: transformers' (as vLLM reads them) and the engine's
_NAMES = {**KNOBS, **{knob: knob for knob in KNOBS.values()}}


# transformers' generation settings that are no sampling default here: accepted in an override and named in the
# start-up log as ignored (vLLM reads none of them either; do_sample: it samples whenever temperature > 0)
NOT_SAMPLING_DEFAULTS = frozenset({"do_sample", "bos_token_id", "eos_token_id", "pad_token_id",
                                   "decoder_start_token_id", "transformers_version", "_from_model_config"})


def parse_override(text: str | None) -> tuple[dict[str, float | int | None], list[str]]:
    """--override-generation-config's JSON object in the engine's knob names (None: the knob's recommendation
    dropped, as vLLM reads a null), and the keys it names that are no sampling default (ignored); ValueError
    naming a key that is neither (vLLM drops it without a word; here the start is refused)."""
    if not text:
        return {}, []
    data = json_object(text, "--override-generation-config")
    out: dict[str, float | int | None] = {}
    ignored: list[str] = []
    for name, value in data.items():
        if name in NOT_SAMPLING_DEFAULTS:
            ignored.append(name)
            continue
        knob = _NAMES.get(name)
        if knob is None:
            raise ValueError(f"--override-generation-config: {name!r} is not a sampling default this server "
                             f"takes (one of: {', '.join(KNOBS)})")
        try:
            out[knob] = None if value is None else knob_value(name, value)
        except ValueError as exc:
            raise ValueError(f"--override-generation-config: {exc}") from None
    return out, ignored


def _checked(knobs: dict[str, float | int], source: str, strict: bool) -> dict[str, float | int]:
    """The knobs the engine takes as they are: one it refuses (out of its range) stops the start when the
    operator gave it (``strict``), and is logged and left out when the model's file did."""
    from engine.errors import InvalidRequestError
    from engine.sampling_params import SamplingParams

    kept: dict[str, float | int] = {}
    for knob, value in knobs.items():
        try:
            one: dict[str, Any] = {knob: value}
            SamplingParams(**one)
        except InvalidRequestError as exc:
            if strict:
                raise ValueError(f"{source}: {exc}") from None
            logger.warning("%s: %s: not used", source, exc)
            continue
        kept[knob] = value
    return kept


@dataclass(frozen=True)
class OpenAIDefaults:
    """What --generation-config and --override-generation-config settle for the OpenAI-compatible endpoints."""

    knobs: dict[str, float | int]  # a knob a request leaves out takes this (the engine's names)
    # vLLM's override_max_tokens: a cap on every request's max_tokens, its own value included. A directory's
    # max_new_tokens (with the override laid over it), or under auto / vllm the override's alone.
    max_tokens_cap: int | None = None


def openai_sampling_defaults(generation_config: str, override: str | None, model: ModelInfo) -> OpenAIDefaults:
    """The defaults the OpenAI-compatible endpoints give a knob a request leaves out, logged once where they
    are not OpenAI's own (as vLLM warns at start). ValueError for an override the engine would refuse."""
    laid, ignored = parse_override(override)
    if ignored:
        logger.warning("--override-generation-config: %s ignored: no sampling default (temperature > 0 samples)",
                       ", ".join(sorted(ignored)))
    if generation_config == "vllm":
        base: dict[str, float | int] = {}
        source = ""
    elif generation_config == "auto":
        base = _checked(dict(model.recommended_sampling), "the model's generation_config.json", strict=False)
        source = "the model's generation_config.json"
    else:  # a directory (Settings checked that it holds the file)
        source = str(Path(generation_config) / "generation_config.json")
        base = _checked(recommended_sampling(generation_config), source, strict=True)
    given = {k: v for k, v in laid.items() if v is not None}
    merged = {k: v for k, v in base.items() if k not in laid} | _checked(given, "--override-generation-config",
                                                                          strict=True)
    in_dir = generation_config not in ("auto", "vllm")
    cap = merged.get("max_tokens") if in_dir else given.get("max_tokens")
    if merged:
        sources = " and ".join(s for s in (source if base else "", "--override-generation-config" if given else "")
                               if s)
        capped = f"; every request's max_tokens at most {cap}" if cap is not None else ""
        logger.warning("sampling defaults of the OpenAI-compatible endpoints from %s: %s (for the knobs a request "
                       "leaves out%s)", sources, ", ".join(f"{k}={v}" for k, v in merged.items()), capped)
    return OpenAIDefaults(merged, int(cap) if cap is not None else None)
