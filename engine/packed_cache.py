"""A GGUF file's projections in the kernels' packed layout, kept on disk so that later starts map them.

Packing a file's blocks into the kernels' tiles (engine/gguf_weights.py) writes every byte of the weights
into fresh anonymous memory, and a fresh page costs its first touch: on a virtual machine, where the host
backs the page then too, that is most of a large model's start. A file already in the page cache is mapped
for a small fraction of that. So the first start packs each projection straight into a file of its own
(a shared mapping: each byte is written once, and the kernel writes it back on its own time), and later
starts map those files (a private mapping: nothing can write through to them) instead of packing again;
the first start makes its own shared maps read-only once each projection is packed.

The files live in one directory per model contents and layout version (beside the config and tokenizer
made from the file, engine/gguf_metadata.py). A first start fills a staging directory; once the engine is
ready a thread flushes every file to disk and renames the directory into place, so a later start either
finds every file whole or does not find the directory. A start that dies first leaves its staging
directory, which the next start removes. One start at a time keeps a model's files (a lock beside them,
which the OS drops with a dead process): replicas started together on an empty cache would otherwise each
write a whole copy, all but one of them thrown away; the others pack into memory that once. Where the file
system has no locks, nothing is kept. Each file is about the size of the blocks it was packed from (Q8_0's
fp16 scales become fp32, 36 bytes a block of 32 against 34; Q4_0 gains fp16 mins, 20 against 18), so the
cache holds about the GGUF file's size once, and no file is larger than it.

Mapped weights are file pages: under memory pressure the OS may drop them and read them back on next use,
as it does for llama.cpp's mapped model files. ``--no-packed-weights-cache`` packs into anonymous memory at
every start instead (nothing written), where a start's seconds matter less than that.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import glob
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Bumped whenever the packed layout (engine/quant/packing.py, the kernels' repack) changes, so that files
# packed before are packed again rather than read in a layout the kernels no longer expect.
LAYOUT_VERSION = 1
MANIFEST = "manifest.json"
_FILE_NAME = re.compile(r"[0-9a-f]{24}\.packed")  # what ``fresh`` names a file; nothing else is opened
_LAYOUT_DIR = re.compile(r"packed-v[0-9]+")  # a kept directory of some layout version
PROT_READ = 1  # <sys/mman.h>
MADV_POPULATE_READ = 22  # <linux/mman.h>, Linux 5.14+: map the pages in now, in one call, without copying them
# Kept files are not started where they would leave the disk with less than this free (logs, other
# caches and the server's own downloads still need room); the weights are then packed into memory.
DISK_LEFT_FREE = 1 << 30
EXIT_WAIT_S = 60.0  # how long an exiting process waits for its cache to reach the disk before giving it up


class PackedCache:
    """Where one model's packed projections are read from (``mapped``) or packed into (``fresh``)."""

    def __init__(self, directory: Path, expected_bytes: int = 0) -> None:
        """``expected_bytes``: about what the packed files will hold in all (the GGUF file's size), checked
        against the disk's free space before the first file is reserved."""
        self.directory = directory
        self.expected_bytes = expected_bytes
        self._manifest = _read_manifest(directory)  # key -> (file name, bytes); empty on a first start
        if not self._manifest and directory.exists():  # damaged, or of another layout: packed and kept anew
            shutil.rmtree(directory, ignore_errors=True)
        self._staging: Path | None = None
        self._written: dict[str, tuple[str, int]] = {}
        self.mapped_bytes = 0
        self.written_bytes = 0
        self._commit: threading.Thread | None = None
        self._file_pages: set[int] = set()  # addresses of the maps ``fresh`` made over files
        self._given_up = False  # nothing this start packs is kept (the rest goes into memory)
        self._keeper: int | None = None  # the lock held while this start keeps the files (a descriptor)

    @classmethod
    def beside(cls, metadata_dir: Path, expected_bytes: int = 0) -> PackedCache:
        """The cache of the model whose config and tokenizer are kept in ``metadata_dir``."""
        directory = metadata_dir / f"packed-v{LAYOUT_VERSION}"
        cache = cls(directory, expected_bytes)
        if not directory.exists() and cache._keep(report=False):  # no start keeps it: staging here is dead
            cache._release()
        return cache

    def mapped(self, key: str, nbytes: int) -> torch.Tensor | None:
        """The projection packed under ``key`` at an earlier start, mapped; None where it was not kept (or
        its file is not ``nbytes`` long)."""
        entry = self._manifest.get(key)
        if entry is None or entry[1] != nbytes or nbytes == 0:
            return None
        path = self.directory / entry[0]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a link planted in the cache is not followed
        except OSError as exc:
            logger.warning("packed weights %s unreadable (%s): packing them again", path, exc)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
                return None
            pages = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)  # private: writes never reach the file
        except OSError as exc:
            logger.warning("packed weights %s unreadable (%s): packing them again", path, exc)
            return None
        finally:
            os.close(fd)
        try:
            pages.madvise(MADV_POPULATE_READ)  # one call instead of a fault per page at the first step
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14, the pages come in on first use
                # anything else (the file cut short under the map) would fault at the first step: pack again
                logger.warning("packed weights %s unreadable (%s): packing them again", path, exc)
                return None
        self.mapped_bytes += nbytes
        return torch.frombuffer(pages, dtype=torch.uint8)

    def fresh(self, key: str, nbytes: int) -> torch.Tensor:
        """Memory for the projection ``key`` to be packed into: a file of the staging directory, mapped
        shared, where the disk has room for it; else anonymous memory (nothing kept for it)."""
        if nbytes == 0 or self._given_up:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Only a start that found no cache keeps one: where a cache was read (and a file of it proved
        # unreadable, or the directory went while this start mapped it) or another start has since
        # published one, what this start would write is part of a set, never to be published as whole.
        if self._manifest or self.directory.exists() or (self._staging is None and not self._start_keeping()):
            self._given_up = True
            return torch.empty(nbytes, dtype=torch.uint8)
        path = None
        try:
            if self._staging is None:
                self._staging = Path(tempfile.mkdtemp(prefix=f".{self.directory.name}.{os.getpid()}.",
                                                      dir=self.directory.parent))
            path = self._staging / (hashlib.sha1(key.encode()).hexdigest()[:24] + ".packed")
            if not hasattr(os, "posix_fallocate"):
                raise OSError("the disk's blocks cannot be reserved on this system")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                # Blocks reserved now: a write through the map to a full disk would kill the process (SIGBUS)
                os.posix_fallocate(fd, 0, nbytes)
                pages = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("packed weights not kept for later starts (%s): packing into memory", exc)
            self._given_up = True
            if path is not None:
                path.unlink(missing_ok=True)
            return torch.empty(nbytes, dtype=torch.uint8)
        self._written[key] = (path.name, nbytes)
        self.written_bytes += nbytes
        out = torch.frombuffer(pages, dtype=torch.uint8)
        self._file_pages.add(out.data_ptr())
        return out

    def packed(self, key: str, nbytes: int, pack: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """The projection ``key`` in the packed layout: mapped where an earlier start kept it, else written
        by ``pack`` into ``fresh`` memory, which is made read-only once packed where it is a kept file."""
        out = self.mapped(key, nbytes)
        if out is None:
            out = self.fresh(key, nbytes)
            pack(out)
            if out.numel() and out.data_ptr() in self._file_pages:
                _seal(out)
        return out

    def _start_keeping(self) -> bool:
        """Whether this start keeps the files it packs: it holds the lock, no other start published them
        while it was taken, and the disk has room."""
        if not self._keep(report=True):
            return False
        if self.directory.exists() or not self._room_on_disk():  # published since the check in ``fresh``
            self._release()
            return False
        return True

    def _room_on_disk(self) -> bool:
        """Whether the files fit with DISK_LEFT_FREE to spare; logged where they do not. Where only older
        layouts' files stand in the way they are removed first (before this start has published its own:
        no start of this version reads them), and the room is measured again, as a process still mapping
        them holds their blocks until it exits."""
        free = self._free_bytes()
        needed = self.expected_bytes + DISK_LEFT_FREE
        if free is None or free >= needed:  # unknown: the reservation of each file still refuses a full disk
            return True
        older = self._older_layouts()
        older_bytes = sum(_dir_file_bytes(d) for d in older)
        if older and free + older_bytes >= needed:
            logger.info("packed weights of an older layout (%.2f GiB) removed to make room for this one's",
                        older_bytes / (1 << 30))
            for directory in older:
                shutil.rmtree(directory, ignore_errors=True)
            free = self._free_bytes()
            if free is None or free >= needed:
                return True
        logger.warning("packed weights not kept for later starts: %.2f GiB free in %s, %.2f GiB needed and "
                       "%.1f GiB left free; packing into memory", free / (1 << 30), self.directory.parent,
                       self.expected_bytes / (1 << 30), DISK_LEFT_FREE / (1 << 30))
        return False

    def _free_bytes(self) -> int | None:
        """The free bytes of the cache's disk; None where they cannot be read."""
        try:
            return shutil.disk_usage(self.directory.parent).free
        except OSError:
            return None

    def _keep(self, report: bool) -> bool:
        """Take the lock that lets this start keep the files (without waiting), and remove the staging
        directories of starts that held it and died; False where a live start holds it or the directory
        cannot be written (logged where ``report``)."""
        if self._keeper is not None:
            return True
        lock = self.directory.parent / f".keeping-{self.directory.name}.lock"
        try:
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except PermissionError as refused:  # made by another user of a shared cache: a read open locks too
                try:
                    fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
                except FileNotFoundError:  # no lock file, and no right to make one: the refusal says why
                    raise refused from None
        except OSError as exc:
            if report:
                logger.warning("packed weights not kept for later starts (%s): packing into memory", exc)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if report and isinstance(exc, BlockingIOError):
                logger.info("another start is keeping the packed weights in %s: this start packs into memory",
                            self.directory)
            elif report:
                # No locks here (some network file systems; NFS also refuses one on a read-only open):
                # unlocked, no start could tell a dead start's staging from a live one's.
                logger.warning("packed weights not kept for later starts: the cache directory cannot be "
                               "locked (%s); packing into memory", exc)
            return False
        self._keeper = fd
        for staging in self.directory.parent.glob(f".{glob.escape(self.directory.name)}.*.*"):
            if staging.is_dir() and not staging.is_symlink():
                shutil.rmtree(staging, ignore_errors=True)
        return True

    def _release(self) -> None:
        if self._keeper is not None:
            os.close(self._keeper)  # closing the descriptor drops the lock
            self._keeper = None

    def abandon(self) -> None:
        """After a load that failed: what this start packed is removed and the lock let go now, not at exit
        (the process may go on, and start the model again)."""
        if self._commit is not None:  # the files were whole and are being published: that thread owns them
            return
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)  # the maps keep their files' pages until they go
            self._staging = None
        self._given_up = True
        self._release()

    def commit_in_background(self) -> threading.Thread | None:
        """After the load: flush what this start packed to disk and publish it, on a thread (the engine
        serves meanwhile); an exiting process waits up to EXIT_WAIT_S for it."""
        if self._staging is None or self._given_up:
            if self._staging is not None:  # an incomplete set would be mapped as whole at later starts
                shutil.rmtree(self._staging, ignore_errors=True)
            self._release()
            return None
        logger.info("weights: %.2f GiB of packed projections being kept in %s for later starts "
                    "(--no-packed-weights-cache: nothing kept)", self.written_bytes / (1 << 30), self.directory)
        self._commit = threading.Thread(target=self._publish, name="packed-weights-cache", daemon=True)
        self._commit.start()
        atexit.register(_finish, self._commit)  # the thread, not this cache: the engine's memory may go before exit
        return self._commit

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the cache this start made (if any) is on disk, waiting up to ``timeout`` seconds for it."""
        if self._commit is None:
            return True
        self._commit.join(timeout)
        return not self._commit.is_alive()

    def _publish(self) -> None:
        staging = self._staging
        assert staging is not None
        started = time.monotonic()
        try:
            for name, _ in self._written.values():
                _fsync(staging / name)
            with open(staging / MANIFEST, "w") as f:
                json.dump({"layout": LAYOUT_VERSION, "entries": self._written}, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the cache from the cache directory's other users
            _fsync(staging)
            os.rename(staging, self.directory)  # one step: a reader sees every file or none
            _fsync(self.directory.parent)
            self._remove_other_layouts()
        except OSError as exc:  # another start published first (the target exists), or the disk failed
            if not self.directory.exists():
                logger.warning("packed weights not kept for later starts: %s", exc)
            shutil.rmtree(staging, ignore_errors=True)  # the maps keep their files' pages until they go
            return
        finally:
            self._release()
        logger.info("packed weights: %.2f GiB kept for later starts in %.1fs", self.written_bytes / (1 << 30),
                    time.monotonic() - started)

    def _remove_other_layouts(self) -> None:
        """Files kept in an earlier layout, now that this one's are whole: no start of this version reads
        them, and each is the model's size again. (A process still mapping them keeps their pages until
        it exits.)"""
        for other in self._older_layouts():
            shutil.rmtree(other, ignore_errors=True)

    def _older_layouts(self) -> list[Path]:
        """Kept directories of layout versions before this one (a newer layout belongs to a newer server,
        which may still be running)."""
        return [other for other in self.directory.parent.glob("packed-v*")
                if _LAYOUT_DIR.fullmatch(other.name) and int(other.name[len("packed-v"):]) < LAYOUT_VERSION
                and not other.is_symlink()]


def _finish(commit: threading.Thread) -> None:
    if commit.is_alive():
        logger.info("packed weights: finishing the copy kept for later starts")
        commit.join(EXIT_WAIT_S)


def _read_manifest(directory: Path) -> dict[str, tuple[str, int]]:
    """key -> (file name, bytes) of a published cache; empty where there is none or it is not well formed."""
    try:
        with open(directory / MANIFEST) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or manifest.get("layout") != LAYOUT_VERSION:
            return {}
        entries = manifest["entries"]
        out = {}
        for key, (name, nbytes) in entries.items():
            if not (isinstance(name, str) and _FILE_NAME.fullmatch(name) and type(nbytes) is int and nbytes > 0):
                return {}
            out[str(key)] = (name, nbytes)
        return out
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _dir_file_bytes(directory: Path) -> int:
    """Bytes of the regular files directly in ``directory`` (a kept layout holds nothing deeper)."""
    total = 0
    for entry in directory.glob("*"):
        try:
            st = entry.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def _seal(data: torch.Tensor) -> None:
    """Make a projection packed into a cache file read-only in this process: the first start's shared map
    writes through to the file, and so to every later start's weights, so a stray write must fault here
    rather than change them. Where mprotect is missing, nothing changes."""
    start = data.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = data.data_ptr() + data.numel() - start
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.mprotect(start, length, PROT_READ)
    except (OSError, AttributeError):
        pass


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
