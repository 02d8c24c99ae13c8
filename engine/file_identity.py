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
from pathlib import Path

_DIGEST = re.compile(r"[0-9a-f]{64}")


def content_digest(path: Path, cache_dir: Path) -> str:
    """The hex SHA-256 of the file's bytes, remembered for as long as the file's stat stays the same."""
    remembered = remembered_digest(path, cache_dir)
    if remembered is not None:
        return remembered
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()  # hashlib lets go of the GIL as it reads
    _write_atomically(_memo(path, cache_dir), digest)
    return digest


def remembered_digest(path: Path, cache_dir: Path) -> str | None:
    """``content_digest`` where it is remembered for the file's current stat; None where it would read the file."""
    try:
        remembered = _memo(path, cache_dir).read_text().strip()
    except OSError:
        return None
    return remembered if _DIGEST.fullmatch(remembered) else None


def _memo(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
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
