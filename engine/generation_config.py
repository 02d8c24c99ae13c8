"""The sampling a model's authors recommend, from its ``generation_config.json`` (transformers' file).

A model directory may say how it is best sampled (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05). vLLM takes those values as the defaults of its OpenAI-compatible endpoints
(``--generation-config auto``, its default); this module reads them in the engine's knob names, and the
server decides where they apply (spark_server/sampling_defaults.py).

Only the knobs vLLM reads are taken: every one the file spells out (transformers 5 keeps each value a file
sets, as vLLM on it reads them; files written by transformers 4 hold only values that differ from its
defaults). ``do_sample`` is not read: vLLM samples whenever the temperature is above 0.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
# the file's name -> the engine's knob (transformers' max_new_tokens is the engine's max_tokens)
KNOBS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
         "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def knob_value(name: str, value: Any) -> float | int:
    """A recommended value in the engine's form; ValueError naming ``name`` where it is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if KNOBS.get(name, name) in ("top_k", "max_tokens"):
        if value != int(value):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        return int(value)
    return float(value)


def json_object(text: str, where: str) -> dict[str, Any]:
    """``text`` as a JSON object; ValueError naming ``where`` (a file or a flag) otherwise."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    return data


def recommended_sampling_or_none(directory: str | Path) -> dict[str, float | int]:
    """``recommended_sampling``, with a file that cannot be read logged and taken as recommending nothing
    (the model still serves; the protocols' own defaults apply)."""
    try:
        return recommended_sampling(directory)
    except ValueError as exc:
        logger.warning("the model's sampling recommendation is not used: %s", exc)
        return {}


def recommended_sampling(directory: str | Path) -> dict[str, float | int]:
    """The knobs ``directory``'s generation_config.json recommends, in the engine's names; {} where there is
    no such file or it recommends none. ValueError for a file that is not JSON or a value that is not a
    number (the loader logs it and serves the model without a recommendation; a --generation-config
    directory's is refused at start)."""
    path = Path(directory) / FILE
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    data = json_object(text, str(path))
    out: dict[str, float | int] = {}
    for name, knob in KNOBS.items():
        value = data.get(name)
        if value is None:
            continue
        try:
            out[knob] = knob_value(name, value)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return out
