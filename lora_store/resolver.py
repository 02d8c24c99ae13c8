"""Turns a LoraRef (pack url + md5, or a registered name) into a local adapter the engine can load. The
engine calls it before a request enters the batch.

Every resolved reference carries an identity the engine caches the adapter under: ``md5:<md5>`` for a
pack (its bytes were checked against that md5), ``dir:<uuid>`` fresh for each registration of a
directory. Names are only what people call adapters: two adapters sharing a name never share weights,
and a name registered again (after an unload) serves the new weights."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from engine.errors import LoraUnavailableError
from engine.request import GenerationRequest, LoraRef
from lora_store.store import LoraStore

# Names the server gives adapters itself: ``pack-<key>`` a session's pack, ``lora-<md5>`` a pack loaded on
# a fleet's backends. Nobody may register another adapter under them (fleet.py lets ``lora-<md5>`` in only
# with a pack of that md5).
RESERVED_PREFIXES = ("pack-", "lora-")


class AlreadyRegistered(ValueError):
    """The name is registered: unload it first (the first registration stands)."""


def pack_identity(md5: str) -> str:
    return f"md5:{md5.lower()}"


def directory_identity() -> str:
    """A directory's contents can change between registrations: each registration is its own adapter."""
    return f"dir:{uuid.uuid4().hex}"


def reserved(name: str) -> bool:
    return name.startswith(RESERVED_PREFIXES)


class LoraResolver:
    def __init__(self, store: LoraStore | None, check: Callable[[str, str], None],
                 pin: Callable[[str, str, str], None] | None = None,
                 unpin: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.check = check  # validates an adapter directory against the served model (raises)
        self.pin = pin  # keeps a registered adapter in the engine (path, name, identity); raises as check
        self.unpin = unpin  # ends a registration (identity)
        self.registered: dict[str, str] = {}  # name -> adapter directory (what the bridges list)
        self.identities: dict[str, str] = {}  # name -> identity

    async def register(self, name: str, source: str) -> None:
        """The operator's ``--lora NAME=SOURCE``: a local PEFT adapter directory, or ``URL#md5`` of a pack
        (fetched now)."""
        if reserved(name):
            raise ValueError(f"--lora {name}=...: names starting with {' or '.join(RESERVED_PREFIXES)} are the "
                             "server's own; choose another")
        if "://" in source:
            url, _, md5 = source.partition("#")
            if not md5:
                raise ValueError(f"--lora {name}={source}: a pack URL needs its md5 as URL#md5")
            if self.store is None:
                raise ValueError("--lora with a URL needs the LoRA store")
            self.store.policy.allow(url)  # the operator named it: trusted
            _, path = await self.store.fetch(url, md5)
            await self.add(name, str(path), pack_identity(md5))
        else:
            # one look at an operator's flag, at start: nothing to hand to a thread
            path = Path(source).expanduser()  # noqa: ASYNC240
            if not path.is_dir():
                raise ValueError(f"--lora {name}={source}: not a directory")
            await self.add(name, str(path), directory_identity())

    async def add(self, name: str, path: str, identity: str) -> None:
        """Register ``name`` (not registered yet) for the checked adapter at ``path``; the engine keeps it
        until ``remove``."""
        if name in self.registered:
            raise AlreadyRegistered(f"adapter {name!r} is already registered")
        if self.pin is not None:
            await asyncio.to_thread(self.pin, path, name, identity)
        else:
            await asyncio.to_thread(self.check, path, name)
        if name in self.registered:  # registered meanwhile: the first registration stands
            if self.unpin is not None:
                self.unpin(identity)
            raise AlreadyRegistered(f"adapter {name!r} is already registered")
        self.registered[name] = path
        self.identities[name] = identity

    def remove(self, name: str) -> bool:
        """Forget ``name``: later requests naming it are refused, and the engine drops its weights (running
        requests keep the adapter they were admitted with). False when it was not registered."""
        if name not in self.registered:
            return False
        del self.registered[name]
        identity = self.identities.pop(name)
        if self.unpin is not None:
            self.unpin(identity)
        return True

    async def __call__(self, ref: LoraRef) -> LoraRef:
        if ref.path:
            return ref
        if ref.url:
            if self.store is None:
                raise LoraUnavailableError("LoRA packs are not enabled on this server", code="packs_disabled")
            md5 = (ref.md5 or "").lower()
            key, path = await self.store.fetch(ref.url, md5)
            return LoraRef(url=ref.url, md5=md5, name=f"pack-{key}", path=str(path), identity=pack_identity(md5))
        if ref.name in self.registered:
            return LoraRef(name=ref.name, path=self.registered[ref.name], identity=self.identities[ref.name])
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
            # a pack by URL asks for a feature that is off (the request's field is refused); a name is an
            # adapter this server does not have
            which = req.lora.name or req.lora.url
            raise LoraUnavailableError(f"adapter {which!r}: LoRA adapters are not enabled on this server",
                                       code="packs_disabled" if req.lora.url else "disabled")
        req.lora = await resolver(req.lora)
