"""The LoRA pack format: a tar, tar.gz or zip holding a PEFT adapter (adapter_config.json +
adapter_model.safetensors), at the root or in one top-level folder. The md5 is of the pack's bytes.

Unpacking is defensive: regular files only (no links, devices or absolute / `..` paths), bounded
file count, a size bounded by the pack's own (UNPACK_RATIO x its bytes + UNPACK_SLACK, within the
server's limits), a tree the filesystem can hold as written (no name both a file and a directory, no
path through a file, no over-long names), and no pickled weights (.bin / .pt / .pth / .pkl / .ckpt) at
all. Everything is checked before the entry's first byte is written; a pack that breaks a rule is the
invalid-pack error naming the entry (Spark 12006, HTTP 400)."""

from __future__ import annotations

import errno
import hashlib
import lzma
import os
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import IO

from engine.errors import LoraUnavailableError

REQUIRED = ("adapter_config.json", "adapter_model.safetensors")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


# A pack unpacks to at most this many times its own size, plus UNPACK_SLACK for tiny packs whose tar
# headers and padding compress away (safetensors of trained weights barely compress; a higher ratio
# is a bomb). Checked against each entry's declared size before a byte of it is written.
UNPACK_RATIO = 4
UNPACK_SLACK = 1 << 20
# Names a pack may hold: each path component at most NAME_MAX bytes (what Linux filesystems take),
# the whole relative path at most MAX_PATH_BYTES (PEFT writes a handful of short names).
NAME_MAX = 255
MAX_PATH_BYTES = 1024
# What extracting an entry can fail with because of the pack's own layout (a file where a directory
# must go, a name too long): the pack is invalid. Any other OSError (a full disk, an I/O error) is the
# server's and is raised as it is.
_LAYOUT_ERRNOS = frozenset({errno.EEXIST, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.EINVAL,
                            errno.EILSEQ, errno.ELOOP})


@dataclass(slots=True)
class UnpackLimits:
    max_files: int = 64  # every entry counts: files and directories
    max_file_bytes: int = 1 << 30
    max_total_bytes: int = 2 << 30

    @classmethod
    def for_pack_limit(cls, max_pack_bytes: int, disk_budget_bytes: int) -> UnpackLimits:
        """The ceiling for any pack the server accepts (the largest pack's ratio, within the disk
        budget); ``unpack`` lowers it to each pack's own size."""
        total = min(UNPACK_RATIO * max_pack_bytes, disk_budget_bytes)
        return cls(max_file_bytes=total, max_total_bytes=total)

    def for_pack(self, pack_bytes: int) -> UnpackLimits:
        """These limits for one pack of ``pack_bytes`` bytes: it unpacks to at most UNPACK_RATIO times
        its own size plus UNPACK_SLACK, and never past these."""
        total = min(self.max_total_bytes, UNPACK_RATIO * pack_bytes + UNPACK_SLACK)
        return replace(self, max_file_bytes=min(self.max_file_bytes, total), max_total_bytes=total)


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
    """Counts the entries and checks the tree they make, each before anything is written for it."""

    def __init__(self, limits: UnpackLimits, pack_bytes: int) -> None:
        self.limits = limits
        self.pack_bytes = pack_bytes
        self.files = 0
        self.total = 0
        self.kinds: dict[PurePosixPath, str] = {}  # every path the entries so far make: "dir" or "file"

    def add(self, name: str, size: int) -> None:
        """Count one entry (a file, or a directory with size 0)."""
        self.files += 1
        self.total += size
        if self.files > self.limits.max_files:
            raise invalid(f"pack holds more than {self.limits.max_files} entries (files and directories)")
        if size > self.limits.max_file_bytes:
            raise invalid(f"{name} is larger than {self.limits.max_file_bytes} bytes{self._why()}")
        if self.total > self.limits.max_total_bytes:
            raise invalid(f"pack unpacks to more than {self.limits.max_total_bytes} bytes{self._why()}")

    def _why(self) -> str:
        return (f" (a pack unpacks to at most {UNPACK_RATIO}x its own {self.pack_bytes} bytes + {UNPACK_SLACK >> 20} "
                "MiB: a higher ratio is a bomb)")

    def claim(self, name: str, path: PurePosixPath, is_dir: bool) -> None:
        """Refuse an entry the pack's own tree cannot hold: a name that is both a file and a directory,
        a path through a file, a file twice, a name over the filesystem's limits."""
        if path == PurePosixPath("."):
            return
        if len(str(path).encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
            raise invalid(f"{name!r}: the path is over {MAX_PATH_BYTES} bytes")
        if any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX for part in path.parts):
            raise invalid(f"{name!r}: a name in the path is over {NAME_MAX} bytes")
        parents = [p for p in path.parents if p != PurePosixPath(".")]
        for parent in parents:
            if self.kinds.get(parent) == "file":
                raise invalid(f"{name!r} goes through {str(parent)!r}, which is a file in the pack")
        kind = self.kinds.get(path)
        if (kind == "file" and is_dir) or (kind == "dir" and not is_dir):
            raise invalid(f"{name!r} is both a file and a directory in the pack")
        if kind == "file":
            raise invalid(f"{name!r} appears twice in the pack")
        for parent in parents:
            self.kinds[parent] = "dir"
        self.kinds[path] = "dir" if is_dir else "file"


@contextmanager
def _writing(name: str) -> Iterator[None]:
    """An entry the filesystem refuses because of the pack's layout is an invalid pack naming it."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _LAYOUT_ERRNOS:
            raise
        raise invalid(f"{name!r} cannot be unpacked: {exc.strerror or exc}") from None


def _copy_bounded(src: IO[bytes], dest: Path, declared: int, name: str) -> None:
    written = 0
    with open(dest, "wb") as out:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            written += len(chunk)
            if written > declared:
                raise invalid(f"{name} is larger than its header says")
            out.write(chunk)


def unpack(pack: Path, dest: Path, limits: UnpackLimits | None = None) -> Path:
    """Safely unpack into ``dest`` (which must not exist); returns the adapter directory inside."""
    pack_bytes = pack.stat().st_size
    budget = _Budget((limits or UnpackLimits()).for_pack(pack_bytes), pack_bytes)
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
                    budget.claim(member.name, name, is_dir=True)
                    with _writing(member.name):
                        (dest / name).mkdir(parents=True, exist_ok=True)
                    continue
                if not member.isfile():
                    raise invalid(f"{member.name!r} is a link or special file; packs hold regular files only")
                budget.add(member.name, member.size)
                budget.claim(member.name, name, is_dir=False)
                target = dest / name
                src = tar.extractfile(member)
                assert src is not None
                with _writing(member.name):
                    target.parent.mkdir(parents=True, exist_ok=True)
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
                    budget.claim(info.filename, name, is_dir=True)
                    with _writing(info.filename):
                        (dest / name).mkdir(parents=True, exist_ok=True)
                    continue
                if file_type and file_type != stat.S_IFREG:
                    raise invalid(f"{info.filename!r} is a link or special file; packs hold regular files only")
                budget.add(info.filename, info.file_size)
                budget.claim(info.filename, name, is_dir=False)
                target = dest / name
                with _writing(info.filename), zf.open(info) as src:
                    target.parent.mkdir(parents=True, exist_ok=True)
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
