"""The LoRA pack format: a tar, tar.gz or zip holding a PEFT adapter (adapter_config.json +
adapter_model.safetensors), at the root or in one top-level folder. The md5 is of the pack's bytes.

Unpacking is defensive: regular files only (no links, devices or absolute / `..` paths), bounded
file count and sizes, and no pickled weights (.bin / .pt / .pth / .pkl / .ckpt) at all."""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from engine.errors import LoraUnavailableError

REQUIRED = ("adapter_config.json", "adapter_model.safetensors")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


# A pack unpacks to at most this many times its own size (safetensors of trained weights barely
# compress; a higher ratio is a bomb).
UNPACK_RATIO = 4


@dataclass(slots=True)
class UnpackLimits:
    max_files: int = 64  # every entry counts: files and directories
    max_file_bytes: int = 1 << 30
    max_total_bytes: int = 2 << 30

    @classmethod
    def for_pack_limit(cls, max_pack_bytes: int, disk_budget_bytes: int) -> "UnpackLimits":
        total = min(UNPACK_RATIO * max_pack_bytes, disk_budget_bytes)
        return cls(max_file_bytes=total, max_total_bytes=total)


def invalid(message: str) -> LoraUnavailableError:
    return LoraUnavailableError(message, code="invalid_pack")


def md5_of(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_pack(adapter_dir: Path, out: Path) -> str:
    """Write a tar.gz pack of a PEFT adapter directory; returns its md5."""
    adapter_dir = Path(adapter_dir)
    missing = [f for f in REQUIRED if not (adapter_dir / f).is_file()]
    if missing:
        raise invalid(f"{adapter_dir} lacks {', '.join(missing)} (save the adapter with PEFT's "
                      "save_pretrained, safetensors format)")
    with tarfile.open(out, "w:gz") as tar:
        for name in REQUIRED:
            tar.add(adapter_dir / name, arcname=name)
    return md5_of(out)


def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise invalid(f"unsafe path in pack: {name!r}")
    if p.suffix.lower() in PICKLE_SUFFIXES:
        raise invalid(f"pack contains {name!r}: pickled weights are refused, use adapter_model.safetensors")
    return p


class _Budget:
    def __init__(self, limits: UnpackLimits) -> None:
        self.limits = limits
        self.files = 0
        self.total = 0

    def add(self, name: str, size: int) -> None:
        """Count one entry (a file, or a directory with size 0) before anything is written for it."""
        self.files += 1
        self.total += size
        if self.files > self.limits.max_files:
            raise invalid(f"pack holds more than {self.limits.max_files} entries (files and directories)")
        if size > self.limits.max_file_bytes:
            raise invalid(f"{name} is larger than {self.limits.max_file_bytes} bytes")
        if self.total > self.limits.max_total_bytes:
            raise invalid(f"pack unpacks to more than {self.limits.max_total_bytes} bytes")


def _copy_bounded(src: io.BufferedIOBase, dest: Path, declared: int, name: str) -> None:
    written = 0
    with open(dest, "wb") as out:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            written += len(chunk)
            if written > declared:
                raise invalid(f"{name} is larger than its header says")
            out.write(chunk)


def unpack(pack: Path, dest: Path, limits: UnpackLimits | None = None) -> Path:
    """Safely unpack into ``dest`` (which must not exist); returns the adapter directory inside."""
    limits = limits or UnpackLimits()
    budget = _Budget(limits)
    dest.mkdir(parents=True)
    with open(pack, "rb") as fh:
        head = fh.read(512)
    if head.startswith(b"PK\x03\x04"):
        _unpack_zip(pack, dest, budget)
    elif head.startswith(b"\x1f\x8b") or (len(head) >= 262 and head[257:262] == b"ustar"):
        _unpack_tar(pack, dest, budget)
    else:
        raise invalid("not a tar, tar.gz or zip file")
    return find_adapter_dir(dest)


def _unpack_tar(pack: Path, dest: Path, budget: _Budget) -> None:
    try:
        with tarfile.open(pack, "r:*") as tar:
            for member in tar:
                name = _safe_name(member.name)
                if member.isdir():
                    budget.add(member.name, 0)
                    (dest / name).mkdir(parents=True, exist_ok=True)
                    continue
                if not member.isfile():
                    raise invalid(f"{member.name!r} is a link or special file; packs hold regular files only")
                budget.add(member.name, member.size)
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None
                _copy_bounded(src, target, member.size, member.name)
    except tarfile.TarError as exc:
        raise invalid(f"broken tar archive: {exc}") from None
    except (EOFError, zlib.error, lzma.LZMAError) as exc:
        raise invalid(f"broken or truncated archive: {exc}") from None
    except OSError as exc:
        if exc.errno is not None:  # the disk, not the pack
            raise
        raise invalid(f"broken or truncated archive: {exc}") from None


def _unpack_zip(pack: Path, dest: Path, budget: _Budget) -> None:
    try:
        with zipfile.ZipFile(pack) as zf:
            for info in zf.infolist():
                name = _safe_name(info.filename.rstrip("/") or info.filename)
                file_type = stat.S_IFMT(info.external_attr >> 16)  # 0: not recorded (many zip tools)
                if info.is_dir():
                    budget.add(info.filename, 0)
                    (dest / name).mkdir(parents=True, exist_ok=True)
                    continue
                if file_type and file_type != stat.S_IFREG:
                    raise invalid(f"{info.filename!r} is a link or special file; packs hold regular files only")
                budget.add(info.filename, info.file_size)
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src:
                    _copy_bounded(src, target, info.file_size, info.filename)
    except (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, NotImplementedError) as exc:
        raise invalid(f"broken zip archive: {exc}") from None
    except RuntimeError as exc:  # encrypted members
        raise invalid(f"unreadable zip archive: {exc}") from None


def find_adapter_dir(root: Path) -> Path:
    candidates = [root] + [p for p in root.iterdir() if p.is_dir()]
    for c in candidates:
        if all((c / f).is_file() for f in REQUIRED):
            return c
    raise invalid("no adapter_config.json + adapter_model.safetensors at the pack's root or in one folder")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
