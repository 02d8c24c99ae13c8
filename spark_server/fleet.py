"""What a fleet's router and its operators ask an engine replica: who it is, and which adapters it serves.

- ``GET /version`` (vLLM's): with it, smg recognises the replica as vLLM-compatible and reads its load
  from the ``vllm:`` gauges in ``/metrics``;
- ``GET /server_info`` and ``GET /model_info`` in SGLang's shapes (the fields smg reads);
- ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` (vLLM's), behind ``--api-key``:
  an adapter directory under ``--lora-shared-dir``, or a pack ``{url, md5}`` under ``--lora-allowed-urls``,
  registered under ``lora_name`` so every bridge can name it as its model;
- the pack shelf: ``POST /v1/lora/packs`` (a pack's bytes, behind ``--api-key``) checks and keeps a pack
  and answers ``{url, md5}``; ``GET /lora/packs/<md5>.<ext>`` serves it to sessions and replicas.

The adapter endpoints answer 403 without ``--api-key`` unless ``--allow-unauthenticated-admin``, and take
only their own Content-Type (spark_server/auth.py ``AdminGate``, before any of the body is read).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response

from bridges.common import error_response
from bridges.errors import KIND_OF_STATUS, ErrorInfo, error_info
from bridges.openai import render_error as openai_error
from engine.errors import LoraUnavailableError
from engine.protocol import EngineClient
from fleet.names import content_named
from lora_store.pack import find_adapter_dir
from lora_store.resolver import (
    RESERVED_PREFIXES,
    AlreadyRegistered,
    LoraResolver,
    directory_identity,
    pack_identity,
    reserved,
)
from lora_store.store import pack_key
from schemas.json_body import JsonBodyError, parse_json
from spark_server.auth import carries_api_key

if TYPE_CHECKING:
    from lora_store.shelf import PackShelf
    from spark_server.settings import Settings


@dataclass
class Replica:
    """What these endpoints read, made once by the app factory and bound to each of them: the settings,
    the engine and the LoRA resolver (None without LoRA); the pack shelf is made on its first use."""

    settings: Settings
    engine: EngineClient
    resolver: LoraResolver | None
    _shelf: PackShelf | None = field(default=None, repr=False)

    def shelf(self) -> PackShelf:
        if self._shelf is None:
            from engine.model_loader import default_cache_dir
            from lora_store.pack import UnpackLimits
            from lora_store.shelf import PackShelf

            settings = self.settings
            root = Path(settings.lora_pack_dir) if settings.lora_pack_dir else default_cache_dir() / "lora-packs"
            max_bytes = settings.lora_max_pack_mb << 20
            self._shelf = PackShelf(root, max_bytes, UnpackLimits.for_pack_limit(
                max_bytes, int(settings.lora_disk_budget_gb * (1 << 30))))
        return self._shelf


_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def _version() -> str:
    from spark_server.cli import version

    return version()


async def version_endpoint(request: Request) -> JSONResponse:
    return JSONResponse({"version": _version(), "server": "spark-server"})


def _model_path(request: Request, replica: Replica) -> str:
    """The model's path for the open info endpoints (routers read them before they hold any key): under
    --api-key, only a caller that sends the key sees where the model lies on disk; others see its name."""
    info, api_key = replica.engine.model_info, replica.settings.api_key
    if api_key and not carries_api_key({k.lower(): v for k, v in request.headers.raw}, api_key.encode()):
        return info.name
    return info.path


async def server_info(request: Request, replica: Replica) -> JSONResponse:
    engine, settings = replica.engine, replica.settings
    info = engine.model_info
    path = _model_path(request, replica)
    return JSONResponse({
        "model_path": path, "served_model_name": info.name, "tokenizer_path": path,
        "context_length": info.max_model_len, "max_running_requests": settings.max_num_seqs,
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "is_embedding": False, "version": _version(),
        "disaggregation_mode": "null", "device": info.device, "dtype": info.dtype,
        "max_loras": settings.max_loras if engine.lora_enabled else 0,
    })


async def model_info(request: Request, replica: Replica) -> JSONResponse:
    info = replica.engine.model_info
    path = _model_path(request, replica)
    return JSONResponse({"model_path": path, "tokenizer_path": path, "is_generation": True,
                         "has_image_understanding": False, "has_audio_understanding": False,
                         "model_type": info.model_type, "architectures": None, "served_model_name": info.name})


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return _refusal(ErrorInfo.of(KIND_OF_STATUS[status], message, param))


def _refusal(info: ErrorInfo, headers: dict[str, str] | None = None) -> JSONResponse:
    return error_response(info, openai_error, headers)


async def _body(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = parse_json(await request.body() or b"{}")  # the bounded parser: no depth or size bombs
    except JsonBodyError as exc:
        return _error(400, f"the body is not usable JSON: {exc.message}")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name or len(name) > 128 or not set(name) <= _NAME_CHARS:
        return _error(400, "'lora_name' must be 1-128 characters of letters, digits, - _ . :", "lora_name")
    return body


def _under(path: str, root: str) -> Path | None:
    """``path`` resolved, when it lies inside ``root`` (links resolved first: no way out through them)."""
    real, base = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return real if real == base or base in real.parents else None


def _pack_verified(path: Path, md5: str, roots: list[str]) -> bool:
    """Whether ``path`` (resolved) is the adapter of a pack entry that a LoRA store on this server's
    ``roots`` downloaded with md5 ``md5``: ``<root>/packs/<key>/adapter[/<folder>]``, where the store wrote
    ``READY`` (url, md5) only after checking the bytes' md5, and ``key`` is that url's and md5's. Only
    ``<root>/packs/<key>`` itself counts, never a folder inside a pack (a pack's files cannot forge READY)."""
    for root in roots:
        packs = Path(os.path.realpath(root)) / "packs"
        try:
            rel = path.relative_to(packs).parts
        except ValueError:
            continue
        if len(rel) not in (2, 3) or rel[1] != "adapter":
            continue
        entry = packs / rel[0]
        try:
            url, ready_md5 = (entry / "READY").read_text().splitlines()[:2]
            found = Path(os.path.realpath(find_adapter_dir(entry / "adapter")))
        except (OSError, ValueError, LoraUnavailableError):
            continue
        if ready_md5.lower() == md5 and pack_key(url, ready_md5) == rel[0] and found == path:
            return True
    return False


def _named_md5(name: str) -> str | None:
    """The md5 a ``lora-<md5>`` name states (None for any other name)."""
    return name.removeprefix("lora-") if content_named(name) else None


async def load_lora_adapter(request: Request, replica: Replica) -> Response:
    # the permission, the key and the JSON Content-Type were checked (AdminGate) before the body was read
    body = await _body(request)
    if isinstance(body, Response):
        return body
    resolver, settings = replica.resolver, replica.settings
    if resolver is None:
        return _error(400, "LoRA adapters are not enabled on this server (--lora-shared-dir or "
                           "--lora-allowed-urls)")
    name = body["lora_name"]
    # pack-<key> and lora-<md5> are the names the server gives packs itself. lora-<md5> is how a fleet's
    # front end names a pack on its backends, so it is taken, but only for a pack of that md5: then every
    # adapter under such a name is the pack its name says, and "already loaded" can be believed.
    named_md5 = _named_md5(name)
    if reserved(name) and named_md5 is None:
        return _error(400, f"'lora_name' {name!r}: names starting with {' or '.join(RESERVED_PREFIXES)} are the "
                           "server's own (lora-<md5> is taken only for the pack of that md5)", "lora_name")
    if name in resolver.registered:  # vLLM's answer, word for word in its meaning
        return _error(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
    try:
        if body.get("lora_path") is not None:
            path = body["lora_path"]
            if not isinstance(path, str) or not settings.lora_shared_dir:
                return _error(400, "'lora_path' is taken only under --lora-shared-dir, which is not set",
                              "lora_path")
            inside = _under(path, settings.lora_shared_dir)
            if inside is None or not inside.is_dir():
                return _error(400, f"'lora_path' must be an adapter directory under --lora-shared-dir "
                                   f"({settings.lora_shared_dir})", "lora_path")
            if named_md5 is None:
                identity = directory_identity()
            else:
                roots = [settings.lora_shared_dir] + ([str(resolver.store.root)] if resolver.store else [])
                if not _pack_verified(inside, named_md5, roots):
                    return _error(400, f"'lora_name' {name!r} names the pack of md5 {named_md5}; 'lora_path' is "
                                       "not a pack of that md5 that this server's LoRA store verified", "lora_name")
                identity = pack_identity(named_md5)
            await resolver.add(name, str(inside), identity)
        elif body.get("url") is not None:
            url, md5 = body.get("url"), body.get("md5")
            if not isinstance(url, str) or not isinstance(md5, str) or resolver.store is None:
                return _error(400, "a pack needs 'url' and 'md5' and --lora-allowed-urls", "url")
            if named_md5 is not None and md5.lower() != named_md5:
                return _error(400, f"'lora_name' {name!r} names the pack of md5 {named_md5}, not {md5}", "lora_name")
            _, path = await resolver.store.fetch(url, md5)  # the allow-list, size and md5 checks apply
            await resolver.add(name, str(path), pack_identity(md5))
        else:
            return _error(400, "name the adapter: 'lora_path' (under --lora-shared-dir) or 'url' and 'md5'",
                          "lora_path")
    except AlreadyRegistered:
        return _error(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
    except LoraUnavailableError as exc:
        return _error(400, str(exc), "lora_path")
    except ValueError as exc:
        return _error(400, str(exc), "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request, replica: Replica) -> Response:
    body = await _body(request)
    if isinstance(body, Response):
        return body
    resolver = replica.resolver
    name = body["lora_name"]
    # forgotten at once; the engine drops the weights (requests already admitted keep the adapter they
    # were admitted with), and a later load under this name reads the new ones
    if resolver is None or not resolver.remove(name):
        return _error(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


RATE_GRACE_S = 2.0  # as BodySizeLimit: the first seconds of a body are not held to --body-min-rate-kb


def _too_slow(why: str) -> JSONResponse:
    return _refusal(ErrorInfo.of("body_timeout", f"the pack {why}"), {"Connection": "close"})


async def _receive_pack(request: Request, settings: Settings, dest: Path) -> tuple[str, int] | Response:
    """Stream the body into ``dest`` while hashing it: (md5, bytes), or the refusal. The pack is never
    held in memory. Past --lora-max-pack-mb it is refused at once (413); 408 when no byte arrives for
    --body-timeout, when it averages under --body-min-rate-kb, or when it is not in within
    --lora-download-timeout (a pack's transfer either way has that long)."""
    limit = settings.lora_max_pack_mb << 20
    stall = settings.body_timeout
    total = max(settings.body_timeout, settings.lora_download_timeout)
    min_rate = settings.body_min_rate_kb * 1024
    loop = asyncio.get_running_loop()
    started = loop.time()
    digest, received = hashlib.md5(), 0
    chunks = request.stream().__aiter__()
    # a local file written chunk by chunk: page-cache writes, too short to hand to a thread
    with open(dest, "wb") as out:  # noqa: ASYNC230
        while True:
            left = started + total - loop.time()
            try:
                async with asyncio.timeout(max(0.0, min(stall, left))):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except TimeoutError:
                return _too_slow(f"did not arrive in full within {total:g} s (--lora-download-timeout)"
                                 if left <= stall else f"stopped arriving for {stall:g} s (--body-timeout)")
            except ClientDisconnect:
                return _error(400, "the client left before the pack arrived in full")
            received += len(chunk)
            if received > limit:
                return _refusal(ErrorInfo.of("body_too_large", f"the pack is over the {settings.lora_max_pack_mb} "
                                             "MiB limit (--lora-max-pack-mb)", "pack"), {"Connection": "close"})
            digest.update(chunk)
            out.write(chunk)
            elapsed = loop.time() - started
            if min_rate and elapsed > RATE_GRACE_S and received / elapsed < min_rate:
                return _too_slow(f"arrives at {received / elapsed:.0f} bytes/s; at least {min_rate:.0f} are "
                                 "required (--body-min-rate-kb)")
    return digest.hexdigest(), received


async def publish_pack(request: Request, replica: Replica) -> Response:
    """POST /v1/lora/packs: the body is the pack file itself (tar.gz, tar or zip)."""
    # The permission, the key and the Content-Type were checked (AdminGate) before any of the body was
    # read; the body is not buffered ahead of this handler (BodySizeLimit's large_bodies).
    shelf = replica.shelf()
    staged = shelf.incoming()
    try:
        received = await _receive_pack(request, replica.settings, staged)
        if isinstance(received, Response):
            return received
        md5, size = received
        if not size:
            return _error(400, "the body must be the pack file (tar.gz, tar or zip)")
        md5, name = await asyncio.to_thread(shelf.publish_file, staged, replica.engine.check_adapter, md5)
    except LoraUnavailableError as exc:
        return _refusal(replace(error_info(exc), param="pack"))
    finally:
        staged.unlink(missing_ok=True)
    url = str(request.base_url).rstrip("/") + f"/lora/packs/{name}"
    return JSONResponse({"url": url, "md5": md5, "bytes": size}, status_code=201)


async def get_pack(request: Request, replica: Replica) -> Response:
    path = replica.shelf().path_of(request.path_params["name"])
    if path is None:
        return _error(404, "no such pack")
    return FileResponse(path, media_type="application/octet-stream")
