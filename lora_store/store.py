"""LoraStore.fetch(url, md5): download, verify, unpack and cache LoRA packs.

- URL policy (``url_policy.py``): http/https only, scheme, host and port equal to an allowed
  prefix's and the normalised path under its path segments (nothing is allowed until configured);
  the canonical URL the check produced is what is fetched; every redirect hop is checked the same way.
- Streaming download with httpx: connect and total timeouts, a size cap, md5 checked before
  anything is unpacked, a progress line in the log for large packs.
- Cache entries are keyed by url and md5 together and written atomically (staged, then renamed);
  nothing half-written survives a failure. Many sessions asking for one pack share one download.
- Least recently used packs are evicted to stay under a disk budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin

import httpx

from engine.errors import LoraUnavailableError
from lora_store.pack import UnpackLimits, dir_size, find_adapter_dir, unpack
from lora_store.url_policy import UrlPolicy

logger = logging.getLogger(__name__)

Validator = Callable[[Path, str], Awaitable[None]]
_PROGRESS_MIN_BYTES = 8 << 20
_MAX_REDIRECTS = 5


@dataclass(slots=True)
class StoreLimits:
    max_pack_bytes: int = 512 << 20
    connect_timeout_s: float = 10.0
    total_timeout_s: float = 300.0
    disk_budget_bytes: int = 4 << 30
    unpack: UnpackLimits = field(default_factory=UnpackLimits)


def pack_key(url: str, md5: str) -> str:
    return hashlib.sha256(f"{url}\0{md5.lower()}".encode()).hexdigest()[:32]


class LoraStore:
    def __init__(self, cache_dir: Path, allowed_prefixes: list[str], limits: StoreLimits | None = None,
                 validator: Validator | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 refuse_private: bool = False) -> None:
        self.root = Path(cache_dir)
        self.packs = self.root / "packs"
        self.staging = self.root / ".staging"
        self.policy = UrlPolicy(allowed_prefixes, refuse_private=refuse_private)
        self.limits = limits or StoreLimits()
        self.validator = validator
        self.transport = transport
        self._inflight: dict[str, asyncio.Future] = {}
        self.num_downloads = 0
        self.num_hits = 0
        self.packs.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)  # leftovers of a crash are never trusted
        self.staging.mkdir(parents=True, exist_ok=True)

    # ---- policy --------------------------------------------------------------------------------

    def check_url(self, url: str) -> str:
        """The canonical URL to fetch, or LoraUnavailableError(host_not_allowed)."""
        return self.policy.check(url)

    # ---- fetch ---------------------------------------------------------------------------------

    async def fetch(self, url: str, md5: str) -> tuple[str, Path]:
        """(cache key, adapter directory) for the pack at ``url`` whose bytes have md5 ``md5``."""
        md5 = md5.lower()
        url = self.check_url(url)
        key = pack_key(url, md5)
        entry = self.packs / key
        if (entry / "READY").exists():
            os.utime(entry / "READY")  # LRU
            self.num_hits += 1
            return key, find_adapter_dir(entry / "adapter")
        future = self._inflight.get(key)
        if future is None:
            future = asyncio.ensure_future(self._download_and_install(url, md5, key))
            self._inflight[key] = future
            future.add_done_callback(lambda _: self._inflight.pop(key, None))
        return key, await asyncio.shield(future)

    async def _download_and_install(self, url: str, md5: str, key: str) -> Path:
        stage = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=self.staging))
        try:
            pack = stage / "pack"
            try:
                await asyncio.wait_for(self._download(url, md5, pack), timeout=self.limits.total_timeout_s)
            except TimeoutError:
                raise LoraUnavailableError(f"lora.url {url!r}: download timed out after "
                                           f"{self.limits.total_timeout_s:g}s", code="download_timeout") from None
            adapter = await asyncio.to_thread(unpack, pack, stage / "adapter", self.limits.unpack)
            if self.validator is not None:
                await self.validator(adapter, key)
            pack.unlink()
            (stage / "READY").write_text(f"{url}\n{md5}\n")
            entry = self.packs / key
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(stage, entry)  # atomic: the entry appears complete or not at all
            self.num_downloads += 1
            self._evict(keep=key)
            return find_adapter_dir(entry / "adapter")
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    async def _download(self, url: str, md5: str, dest: Path) -> None:
        timeout = httpx.Timeout(self.limits.total_timeout_s, connect=self.limits.connect_timeout_s)
        cap = self.limits.max_pack_bytes
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, transport=self.transport) as client:
            target = url
            for _ in range(_MAX_REDIRECTS + 1):
                await self.policy.check_address(target)
                try:
                    async with client.stream("GET", target) as resp:
                        if resp.is_redirect:
                            # a redirect may not leave the allowed prefixes: checked, then fetched canonical
                            target = self.check_url(urljoin(target, resp.headers.get("location", "")))
                            continue
                        if resp.status_code != 200:
                            raise LoraUnavailableError(f"lora.url {url!r}: the server answered HTTP "
                                                       f"{resp.status_code}", code="download_failed")
                        declared = int(resp.headers.get("content-length") or 0)
                        if declared > cap:
                            raise self._too_large(url, declared)
                        await self._save(resp, url, md5, dest, declared)
                        return
                except httpx.TimeoutException:
                    raise LoraUnavailableError(f"lora.url {url!r}: download timed out",
                                               code="download_timeout") from None
                except httpx.HTTPError as exc:
                    raise LoraUnavailableError(f"lora.url {url!r}: download failed: {exc}",
                                               code="download_failed") from None
            raise LoraUnavailableError(f"lora.url {url!r}: more than {_MAX_REDIRECTS} redirects",
                                       code="download_failed")

    def _too_large(self, url: str, size: int) -> LoraUnavailableError:
        return LoraUnavailableError(f"lora.url {url!r}: the pack is over the {self.limits.max_pack_bytes} byte limit "
                                    f"({size} bytes)", code="too_large")

    async def _save(self, resp: httpx.Response, url: str, md5: str, dest: Path, declared: int) -> None:
        h = hashlib.md5()
        received = 0
        last_log = time.monotonic()
        # a local file written in 1 MB chunks: page-cache writes, too short to hand to a thread
        with open(dest, "wb") as out:  # noqa: ASYNC230
            async for chunk in resp.aiter_bytes(1 << 20):
                received += len(chunk)
                if received > self.limits.max_pack_bytes:
                    raise self._too_large(url, received)
                h.update(chunk)
                out.write(chunk)
                if declared >= _PROGRESS_MIN_BYTES and time.monotonic() - last_log > 2.0:
                    last_log = time.monotonic()
                    logger.info("LoRA pack %s: %.0f%% (%d of %d bytes)", url, 100 * received / declared,
                                received, declared)
        got = h.hexdigest()
        if got != md5:
            raise LoraUnavailableError(f"lora.md5: the pack at {url!r} has md5 {got}, the request says {md5}",
                                       code="md5_mismatch")
        if declared >= _PROGRESS_MIN_BYTES:
            logger.info("LoRA pack %s: downloaded %d bytes, md5 verified", url, received)

    # ---- eviction ------------------------------------------------------------------------------

    def entries(self) -> list[Path]:
        return [p for p in self.packs.iterdir() if (p / "READY").exists()]

    def _evict(self, keep: str) -> None:
        entries = sorted(self.entries(), key=lambda p: (p / "READY").stat().st_mtime)
        sizes = {p: dir_size(p) for p in entries}
        total = sum(sizes.values())
        for p in entries:
            if total <= self.limits.disk_budget_bytes:
                break
            if p.name == keep:
                continue
            shutil.rmtree(p, ignore_errors=True)
            total -= sizes[p]
            logger.info("LoRA pack cache: evicted %s to stay under %d bytes", p.name, self.limits.disk_budget_bytes)
