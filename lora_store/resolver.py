"""Turns a LoraRef (pack url + md5, or a name registered at start) into a local adapter the engine
can load. The engine calls it before a request enters the batch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Awaitable, Callable

from engine.errors import LoraUnavailableError
from engine.request import GenerationRequest, LoraRef
from lora_store.store import LoraStore


class LoraResolver:
    def __init__(self, store: LoraStore | None, check: Callable[[str, str], None]) -> None:
        self.store = store
        self.check = check  # validates an adapter directory against the served model (raises)
        self.registered: dict[str, str] = {}

    async def register(self, name: str, source: str) -> None:
        """``source``: a local PEFT adapter directory, or ``URL#md5`` of a pack (fetched now)."""
        if "://" in source:
            url, _, md5 = source.partition("#")
            if not md5:
                raise ValueError(f"--lora {name}={source}: a pack URL needs its md5 as URL#md5")
            if self.store is None:
                raise ValueError("--lora with a URL needs the LoRA store")
            self.store.policy.allow(url)  # the operator named it: trusted
            _, path = await self.store.fetch(url, md5)
        else:
            path = Path(source).expanduser()
            if not path.is_dir():
                raise ValueError(f"--lora {name}={source}: not a directory")
            await asyncio.to_thread(self.check, str(path), name)
        self.registered[name] = str(path)

    async def __call__(self, ref: LoraRef) -> LoraRef:
        if ref.path:
            return ref
        if ref.url:
            if self.store is None:
                raise LoraUnavailableError("LoRA packs are not enabled on this server", code="disabled")
            key, path = await self.store.fetch(ref.url, ref.md5 or "")
            return LoraRef(url=ref.url, md5=ref.md5, name=f"pack-{key}", path=str(path))
        if ref.name in self.registered:
            return LoraRef(name=ref.name, path=self.registered[ref.name])
        known = ", ".join(sorted(self.registered)) or "none"
        raise LoraUnavailableError(f"adapter {ref.name!r} is not registered (registered: {known})",
                                   code="unknown_adapter")


def store_validator(check: Callable[[str, str], None]) -> Callable[[Path, str], Awaitable[None]]:
    async def validate(path: Path, key: str) -> None:
        await asyncio.to_thread(check, str(path), f"pack-{key}")
    return validate


async def resolve_lora(resolver: LoraResolver | None, req: GenerationRequest) -> None:
    """Resolve the request's adapter completely (download, verify, unpack, check against the model)
    before it goes to the engine, which only takes local adapters."""
    if req.lora is not None and req.lora.path is None:
        if resolver is None:
            which = req.lora.name or req.lora.url
            raise LoraUnavailableError(f"adapter {which!r}: LoRA adapters are not enabled on this server",
                                       code="disabled")
        req.lora = await resolver(req.lora)
