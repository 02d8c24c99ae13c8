"""The caches made from model files are keyed by the files' contents, not by where or when they were installed."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import threading
import time

from engine import file_identity
from engine.file_identity import content_digest
from engine.model_loader import converted_dir_path
from engine.quant.cache import cache_path


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_the_digest_is_the_contents_sha256_and_is_remembered(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    model = _write(tmp_path / "m.gguf", b"GGUF" + os.urandom(50_000))
    assert content_digest(model, cache) == hashlib.sha256(model.read_bytes()).hexdigest()

    reads = []
    real = file_identity.hashlib.file_digest
    monkeypatch.setattr(file_identity.hashlib, "file_digest", lambda f, name: reads.append(1) or real(f, name))
    assert content_digest(model, cache) == hashlib.sha256(model.read_bytes()).hexdigest()
    assert reads == []  # the memo answered

    # rewritten in place (new bytes, new mtime): read again, never the stale memo
    _write(model, b"GGUF" + os.urandom(50_000))
    os.utime(model, ns=(1, 1))
    assert content_digest(model, cache) == hashlib.sha256(model.read_bytes()).hexdigest()
    assert reads == [1]


def test_a_digest_begun_in_the_background_is_read_once_and_waited_for(tmp_path, monkeypatch):
    """The server starts hashing the model before its imports; the load's own content_digest then waits for
    that read instead of reading the file a second time, and gets the same digest."""
    cache = tmp_path / "cache"
    model = _write(tmp_path / "m.gguf", b"GGUF" + os.urandom(50_000))
    reads, release = [], threading.Event()
    real = file_identity.hashlib.file_digest

    def slow(f, name):
        reads.append(1)
        release.wait(10)
        return real(f, name)

    monkeypatch.setattr(file_identity.hashlib, "file_digest", slow)
    file_identity.digest_in_background(model, cache)
    waiter = concurrent.futures.ThreadPoolExecutor(1).submit(content_digest, model, cache)
    time.sleep(0.2)
    assert not waiter.done() and reads == [1]  # waiting on the read in flight, not reading again
    release.set()
    assert waiter.result(10) == hashlib.sha256(model.read_bytes()).hexdigest()
    assert reads == [1] and file_identity.remembered_digest(model, cache) == waiter.result()
    file_identity.digest_in_background(model, cache)  # remembered now: nothing read
    assert reads == [1]
    file_identity.digest_in_background(tmp_path / "gone.gguf", cache)  # no file: nothing, the load reports it


def test_a_failed_background_read_fails_its_waiters_and_is_not_left_in_flight(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    model = _write(tmp_path / "m.gguf", b"GGUF" + os.urandom(1000))

    def broken(f, name):
        raise OSError("read error")

    monkeypatch.setattr(file_identity.hashlib, "file_digest", broken)
    file_identity.digest_in_background(model, cache)
    try:
        content_digest(model, cache)
    except OSError:
        pass
    monkeypatch.undo()
    assert content_digest(model, cache) == hashlib.sha256(model.read_bytes()).hexdigest()
    assert not file_identity._in_flight


def test_a_reinstall_of_the_same_bytes_reuses_the_converted_and_quantized_copies(tmp_path):
    cache = tmp_path / "cache"
    (tmp_path / "env1").mkdir()
    (tmp_path / "env2").mkdir()
    first = _write(tmp_path / "env1" / "m.gguf", os.urandom(4096))
    second = tmp_path / "env2" / "m.gguf"
    shutil.copyfile(first, second)
    os.utime(second, ns=(10**18, 10**18))  # a later install: another path, another mtime, the same bytes
    assert converted_dir_path(first, cache, "m") == converted_dir_path(second, cache, "m")
    assert cache_path([first], "gguf", cache) == cache_path([second], "gguf", cache)

    different = _write(tmp_path / "env2" / "other.gguf", os.urandom(4096))
    assert converted_dir_path(different, cache, "m") != converted_dir_path(first, cache, "m")
    assert cache_path([different], "gguf", cache) != cache_path([first], "gguf", cache)
    assert cache_path([first], "int8", cache) != cache_path([first], "gguf", cache)


def test_an_unwritable_cache_still_gives_the_digest(tmp_path):
    blocker = _write(tmp_path / "not-a-dir", b"x")  # the memo's directory cannot be made under a file
    model = _write(tmp_path / "m.gguf", b"weights")
    assert content_digest(model, blocker) == hashlib.sha256(b"weights").hexdigest()


def test_a_first_start_reads_the_metadata_while_hashing_and_a_copy_reuses_it(tmp_path, monkeypatch):
    """A file never seen: its metadata is made in a staging directory while its digest is read, then lands
    under the digest's key, the digest remembered. A copy of it (another path and mtime, the same name and
    bytes) is hashed first and finds that directory: nothing is made again."""
    from engine import gguf_metadata
    from engine.model_loader import embedded_gguf_path

    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = tmp_path / "a" / "m.gguf"
    shutil.copyfile(embedded_gguf_path(), first)
    made = []
    fill = gguf_metadata._fill_metadata
    monkeypatch.setattr(gguf_metadata, "_fill_metadata", lambda g, d: made.append(g) or fill(g, d))
    target = gguf_metadata.metadata_dir(first, cache, "m")
    assert made == [first] and gguf_metadata._is_complete(target)
    assert file_identity.remembered_digest(first, cache) == hashlib.sha256(first.read_bytes()).hexdigest()
    assert target == gguf_metadata.metadata_dir_path(first, cache, "m")
    assert [p.name for p in (cache / "gguf").iterdir() if p.is_dir()] == [target.name]  # no staging left

    second = tmp_path / "b" / "m.gguf"
    shutil.copyfile(first, second)
    os.utime(second, ns=(10**18, 10**18))
    assert file_identity.remembered_digest(second, cache) is None
    assert gguf_metadata.metadata_dir(second, cache, "m") == target
    assert made == [first]
