"""The inference engine: protocol-free. Protocol code talks to ``EngineClient`` only."""

from engine.config import EngineConfig
from engine.errors import (EngineError, EngineOverloadedError, EngineShutdownError, InferenceError,
                           InvalidRequestError, LoraUnavailableError, PromptTooLongError, RequestTimeoutError)
from engine.request import (ChatMessage, ChatPrompt, GenerationRequest, LoraRef, Prompt, RequestOutput,
                            RequestTimings, TextPrompt, TokenLogprob, TokensPrompt)
from engine.sampling_params import SamplingParams

__all__ = [
    "ChatMessage", "ChatPrompt", "EngineConfig", "EngineError", "EngineOverloadedError", "EngineShutdownError",
    "GenerationRequest", "InferenceError", "InvalidRequestError", "LoraRef", "LoraUnavailableError", "Prompt",
    "PromptTooLongError", "RequestOutput", "RequestTimeoutError", "RequestTimings", "SamplingParams",
    "TextPrompt", "TokenLogprob", "TokensPrompt",
]
