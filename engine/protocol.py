"""The engine's face as protocol code sees it; tests can put a scripted fake behind it."""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from engine.request import GenerationRequest, Prompt, RequestOutput


class EngineClient(Protocol):
    model_info: Any
    tokenizer: Any

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def encode_prompt(self, prompt: Prompt) -> list[int]: ...

    def encode_prompt_sync(self, prompt: Prompt) -> list[int]: ...

    def min_num_tokens(self, texts: list[str]) -> int: ...

    def is_healthy(self) -> bool: ...
