"""Content identity of model files, the key of the caches made from them.

A key made of a file's path and mtime changes on every reinstall of the same bytes (a new virtual
environment, a wheel upgraded in place), so each reinstall left another converted model and another
quantized copy behind (hundreds of MB each). The SHA-256 of the contents does not change; it is read
once per (path, size, mtime, inode) and remembered under the cache directory, so later starts pay one
stat and one small read.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

_DIGEST = re.compile(r"[0-9a-f]{64}")
_in_flight: dict[Path, Future[str]] = {}  # memo path -> the digest being read on a thread of this process
_in_flight_lock = threading.Lock()


def content_digest(path: Path, cache_dir: Path) -> str:
    """The hex SHA-256 of the file's bytes, remembered for as long as the file's stat stays the same.
    Where ``digest_in_background`` is reading it already, waits for that read rather than reading again."""
    claimed = _claim(path, cache_dir)
    if isinstance(claimed, str):
        return claimed
    future, mine, memo = claimed
    if mine:
        _read_digest(path, memo, future)
    return future.result()


def digest_in_background(path: Path, cache_dir: Path) -> None:
    """Start reading the file's digest on a thread where it is not remembered: a process that will need it
    (every cache of the model is keyed by it) calls this before its own seconds of imports, which the
    read (I/O and hashing, without the GIL) then overlaps."""
    try:
        claimed = _claim(path, cache_dir)
    except OSError:
        return  # no such file: the load names the problem
    if not isinstance(claimed, str) and claimed[1]:
        threading.Thread(target=_read_digest, args=(path, claimed[2], claimed[0]), name="file-digest",
                         daemon=True).start()


def _claim(path: Path, cache_dir: Path) -> str | tuple[Future[str], bool, Path]:
    """The remembered digest; else (the read of it in flight, whether the caller must do that read, the
    memo it is remembered in)."""
    memo = _memo(path, cache_dir)
    with _in_flight_lock:
        remembered = remembered_digest(path, cache_dir)  # under the lock: a read that just ended is not redone
        if remembered is not None:
            return remembered
        if memo in _in_flight:
            return _in_flight[memo], False, memo
        future = _in_flight[memo] = Future()
        return future, True, memo


def _read_digest(path: Path, memo: Path, future: Future[str]) -> None:
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()  # hashlib lets go of the GIL as it reads
        _write_atomically(memo, digest)
        future.set_result(digest)
    except BaseException as exc:  # the waiters meet it (a file gone or unreadable)
        future.set_exception(exc)
    finally:
        with _in_flight_lock:
            _in_flight.pop(memo, None)


def remembered_digest(path: Path, cache_dir: Path) -> str | None:
    """``content_digest`` where it is remembered for the file's current stat; None where it would read the file."""
    try:
        remembered = _memo(path, cache_dir).read_text().strip()
    except OSError:
        return None
    return remembered if _DIGEST.fullmatch(remembered) else None


def _memo(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    # ctime cannot be set by the tools that copy or unpack files (mtime can, and a freed inode number is
    # handed out again): a file replaced in place by one of the same size is read again
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"
    return cache_dir / "digests" / hashlib.sha1(stamp.encode()).hexdigest()[:24]


def _write_atomically(path: Path, text: str) -> None:
    """Concurrent starts may both hash a file: each writes a whole memo, the last rename wins."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".memo-", dir=path.parent)
    except OSError:
        return  # a read-only cache directory: the digest is still right, only not remembered
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(staging, path)
    except OSError:
        Path(staging).unlink(missing_ok=True)  # a full disk: no half-written memo left behind
