"""One module per foreign protocol; each maps its requests onto GenerationRequests and renders the
engine's outputs in its own wire format."""

from __future__ import annotations

from typing import Any

from starlette.routing import BaseRoute


def all_routes(settings: Any) -> list[BaseRoute]:
    from bridges import openai

    return [*openai.ROUTES]
