"""One exception tree for the engine; protocol layers map it onto their own error forms.

    EngineError
    ├── InvalidRequestError        (bad parameter; ``parameter`` names it)
    │   └── PromptTooLongError     (prompt does not fit the context / limit)
    ├── EngineOverloadedError      (admission refused: too many running / waiting)
    ├── LoraUnavailableError       (adapter cannot be fetched or applied)
    ├── RequestTimeoutError        (deadline passed before the request finished)
    ├── EngineShutdownError        (engine stopping; request ended early)
    ├── EngineUnavailableError     (a remote engine: no backend can take the request now)
    └── InferenceError             (model step failed; the engine keeps serving)
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises to its callers."""


class InvalidRequestError(EngineError):
    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class PromptTooLongError(InvalidRequestError):
    def __init__(self, message: str, num_tokens: int, limit: int) -> None:
        super().__init__(message, parameter="prompt")
        self.num_tokens = num_tokens
        self.limit = limit


class EngineOverloadedError(EngineError):
    pass


class LoraUnavailableError(EngineError):
    def __init__(self, message: str, code: str = "lora_unavailable") -> None:
        super().__init__(message)
        self.code = code


class RequestTimeoutError(EngineError):
    pass


class EngineShutdownError(EngineError):
    pass


class EngineUnavailableError(EngineError):
    pass


class InferenceError(EngineError):
    pass
