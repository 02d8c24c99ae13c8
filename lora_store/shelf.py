"""Where LoRA authors publish packs: content-addressed files a fleet downloads from.

``publish_file`` takes a pack the server streamed to a file under the shelf (``incoming``), checks it
exactly as a session's pack is checked (safe unpacking, then the served model's own adapter check), and
moves it into place as ``<md5>.<ext>``; the server answers ``{url, md5}`` and serves the file at
``GET /lora/packs/<md5>.<ext>``. Same bytes, same name: publishing twice is harmless."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from lora_store.pack import UnpackLimits, invalid, md5_of, unpack

PACK_NAME = re.compile(r"^[0-9a-f]{32}\.(tar\.gz|tar|zip)$")


def pack_extension(head: bytes) -> str:
    """tar.gz, tar or zip, from the file's first bytes (what `unpack` accepts)."""
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head.startswith(b"\x1f\x8b"):
        return "tar.gz"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    raise invalid("not a tar, tar.gz or zip file")


class PackShelf:
    def __init__(self, root: Path, max_pack_bytes: int, unpack_limits: UnpackLimits | None = None) -> None:
        self.root = Path(root)
        self.max_pack_bytes = max_pack_bytes
        self.unpack_limits = unpack_limits or UnpackLimits()
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(".publish-*"):  # a crash's half-done work is never trusted
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in self.root.glob(".upload-*"):
            leftover.unlink(missing_ok=True)

    def incoming(self) -> Path:
        """A new empty file under the shelf for an upload to be streamed into (same file system: the
        checked pack is moved into place, not copied)."""
        fd, path = tempfile.mkstemp(prefix=".upload-", dir=self.root)
        os.close(fd)
        return Path(path)

    def publish(self, data: bytes, check: Callable[[str, str], None]) -> tuple[str, str]:
        """``publish_file`` for a pack in memory."""
        if len(data) > self.max_pack_bytes:
            raise invalid(f"the pack is over the {self.max_pack_bytes >> 20} MiB limit (--lora-max-pack-mb)")
        staged = self.incoming()
        try:
            staged.write_bytes(data)
            return self.publish_file(staged, check, hashlib.md5(data).hexdigest())
        finally:
            staged.unlink(missing_ok=True)

    def publish_file(self, staged: Path, check: Callable[[str, str], None],
                     md5: str | None = None) -> tuple[str, str]:
        """(md5, file name) of the checked pack in the file ``staged`` (under the shelf), which is moved into
        place or removed; ``md5``: its md5 when already known (hashed while it arrived). ``check(adapter_dir,
        name)`` raises LoraUnavailableError."""
        staged = Path(staged)
        try:
            if staged.stat().st_size > self.max_pack_bytes:
                raise invalid(f"the pack is over the {self.max_pack_bytes >> 20} MiB limit (--lora-max-pack-mb)")
            with open(staged, "rb") as fh:
                ext = pack_extension(fh.read(512))
            md5 = md5 or md5_of(staged)
            name = f"{md5}.{ext}"
            final = self.root / name
            if final.is_file():
                return md5, name
            work = Path(tempfile.mkdtemp(prefix=".publish-", dir=self.root))
            try:
                pack = work / name
                shutil.move(staged, pack)
                adapter = unpack(pack, work / "adapter", self.unpack_limits)
                check(str(adapter), f"lora-{md5}")
                os.replace(pack, final)  # atomic: a reader sees the whole pack or none
            finally:
                shutil.rmtree(work, ignore_errors=True)
            return md5, name
        finally:
            staged.unlink(missing_ok=True)

    def path_of(self, name: str) -> Path | None:
        """The stored pack called ``name`` (``<md5>.<ext>`` only: no other path is ever served)."""
        if not PACK_NAME.match(name):
            return None
        path = self.root / name
        return path if path.is_file() else None
