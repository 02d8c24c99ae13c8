"""The inference engine: protocol-free. Protocol code talks to ``EngineClient`` only.

The names below are loaded on first use, not at import: ``engine.config`` (all that the command line
needs to parse its flags) must not pull in torch and transformers, or ``spark-server --help`` would
take seconds."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "EngineConfig": "engine.config",
    **dict.fromkeys(("EngineError", "EngineOverloadedError", "EngineShutdownError", "InferenceError",
                     "InvalidRequestError", "LoraUnavailableError", "PromptTooLongError", "RequestTimeoutError"),
                    "engine.errors"),
    **dict.fromkeys(("ChatMessage", "ChatPrompt", "GenerationRequest", "LoraRef", "Prompt", "RequestOutput",
                     "RequestTimings", "TextPrompt", "TokenLogprob", "TokensPrompt"), "engine.request"),
    "SamplingParams": "engine.sampling_params",
}

__all__ = [
    "ChatMessage", "ChatPrompt", "EngineConfig", "EngineError", "EngineOverloadedError", "EngineShutdownError",
    "GenerationRequest", "InferenceError", "InvalidRequestError", "LoraRef", "LoraUnavailableError", "Prompt",
    "PromptTooLongError", "RequestOutput", "RequestTimeoutError", "RequestTimings", "SamplingParams",
    "TextPrompt", "TokenLogprob", "TokensPrompt",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.errors import (
        EngineError,
        EngineOverloadedError,
        EngineShutdownError,
        InferenceError,
        InvalidRequestError,
        LoraUnavailableError,
        PromptTooLongError,
        RequestTimeoutError,
    )
    from engine.request import (
        ChatMessage,
        ChatPrompt,
        GenerationRequest,
        LoraRef,
        Prompt,
        RequestOutput,
        RequestTimings,
        TextPrompt,
        TokenLogprob,
        TokensPrompt,
    )
    from engine.sampling_params import SamplingParams
