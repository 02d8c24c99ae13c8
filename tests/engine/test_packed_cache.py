"""The packed-weights cache (engine/packed_cache.py): a later start maps exactly the bytes the first start
packed and answers the same; what is mapped is private; a full disk, a dead start's staging directory, a
damaged manifest, two starts on an empty cache and two publishing at once each leave a working engine and a
consistent cache."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine import packed_cache
from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.llm_engine import LLMEngine
from engine.models.linear import PackedLinear
from engine.packed_cache import PackedCache
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from tests.engine.helpers import run_all, tokens_of


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", num_kv_blocks=16, kv_cache_prefault=False))


def _packed(engine: LLMEngine) -> list[torch.Tensor]:
    linears = [lin for layer in engine.model.layers for lin in layer.linears()] + [engine.model.lm_head]
    return [lin.packed.data for lin in linears if isinstance(lin, PackedLinear)]


def _greedy(engine: LLMEngine) -> list[int]:
    request = GenerationRequest("r", TokensPrompt([1, 5, 900, 300, 42, 7, 1000]),
                                SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return tokens_of(run_all(engine, [request])["r"])


def test_a_later_start_maps_the_bytes_the_first_packed_and_answers_the_same(tmp_path, monkeypatch):
    if load_cpu_kernels() is None:
        pytest.skip("no fused kernels here: nothing is packed by the kernels")
    monkeypatch.setenv("SPARK_CACHE_DIR", str(tmp_path))
    first = _engine()
    assert first.packed_cache is not None and first.packed_cache.written_bytes > 0
    # the disk-room check was made for what the files hold (Q8_0's fp32 scales included), known before
    # packing: exactly, as every projection of this model fills whole tiles
    assert first.packed_cache.expected_bytes == first.packed_cache.written_bytes
    assert first.packed_cache.wait(60)
    second = _engine()
    assert second.packed_cache is not None
    assert second.packed_cache.mapped_bytes == first.packed_cache.written_bytes
    assert second.packed_cache.written_bytes == 0
    first_packed, second_packed = _packed(first), _packed(second)
    assert len(first_packed) == len(second_packed) > 0
    assert all(torch.equal(a, b) for a, b in zip(first_packed, second_packed, strict=True))
    assert _greedy(second) == _greedy(first)


def test_a_mapped_projection_is_private_to_the_process(tmp_path):
    pattern = (torch.arange(8192) % 251).to(torch.uint8)
    cache = PackedCache(tmp_path / "packed-v1")
    cache.fresh("w", 8192).copy_(pattern)
    cache.commit_in_background()
    assert cache.wait(30)
    mapped = PackedCache(tmp_path / "packed-v1").mapped("w", 8192)
    assert mapped is not None and torch.equal(mapped, pattern)
    mapped.zero_()  # a write stays in this process's copy of the page
    again = PackedCache(tmp_path / "packed-v1").mapped("w", 8192)
    assert again is not None and torch.equal(again, pattern)


def test_nothing_is_published_before_the_commit_and_the_staging_goes_after(tmp_path):
    cache = PackedCache(tmp_path / "packed-v1")
    cache.fresh("a", 4096).fill_(3)
    assert not (tmp_path / "packed-v1").exists()
    assert PackedCache(tmp_path / "packed-v1").mapped("a", 4096) is None
    cache.commit_in_background()
    assert cache.wait(30)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["packed-v1"]
    assert PackedCache(tmp_path / "packed-v1").mapped("a", 4096) is not None
    assert PackedCache(tmp_path / "packed-v1").mapped("a", 8192) is None  # another size: not this entry


def test_a_full_disk_packs_into_memory_and_keeps_nothing(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    cache = PackedCache(tmp_path / "packed-v1")
    out = cache.fresh("a", 4096)
    out.fill_(1)  # anonymous memory: writable, nothing behind it on disk
    assert cache.written_bytes == 0 and cache.commit_in_background() is None
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size]  # the empty lock file alone


def test_a_damaged_manifest_or_file_is_packed_again(tmp_path):
    cache = PackedCache(tmp_path / "packed-v1")
    cache.fresh("a", 4096).fill_(5)
    cache.fresh("b", 4096).fill_(6)
    cache.commit_in_background()
    assert cache.wait(30)
    directory = tmp_path / "packed-v1"
    manifest = json.loads((directory / packed_cache.MANIFEST).read_text())
    os.truncate(directory / manifest["entries"]["b"][0], 100)  # a file cut short
    reread = PackedCache(directory)
    assert reread.mapped("a", 4096) is not None and reread.mapped("b", 4096) is None
    (directory / packed_cache.MANIFEST).write_text("{not json")
    repaired = PackedCache(directory)
    assert repaired.mapped("a", 4096) is None and not directory.exists()  # removed, so this start keeps its own
    repaired.fresh("a", 4096).fill_(7)
    repaired.commit_in_background()
    assert repaired.wait(30)
    again = PackedCache(directory).mapped("a", 4096)
    assert again is not None and int(again[0]) == 7


def test_a_dead_starts_staging_is_removed_and_a_live_ones_kept(tmp_path):
    """A start keeping the files holds a lock, which the OS drops when its process dies: staging directories
    are removed only where no live start holds it (a process id would not say, in a container whose every
    server is process 1)."""
    name = f"packed-v{packed_cache.LAYOUT_VERSION}"
    dies_while_keeping = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
                          "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); os.mkdir(sys.argv[2]); os._exit(0)")
    subprocess.run([sys.executable, "-c", dies_while_keeping, str(tmp_path / f".keeping-{name}.lock"),
                    str(tmp_path / f".{name}.1.abc")], check=True)
    live = PackedCache(tmp_path / name)
    live.fresh("a", 4096).fill_(1)  # the dead start's lock is gone: this one keeps, and removed its staging
    assert live.written_bytes == 4096
    (tmp_path / f".{name}.1.def").mkdir()  # another dead start's, seen while the live one keeps its files
    PackedCache.beside(tmp_path)
    assert live._staging is not None
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted([f".{name}.1.def", live._staging.name])


def test_starts_on_an_empty_cache_at_once_write_one_copy(tmp_path):
    """Replicas started together: one keeps the files, the others pack into memory and write nothing; the
    next start maps the one copy."""
    keeper, other = PackedCache(tmp_path / "packed-v1"), PackedCache(tmp_path / "packed-v1")
    keeper.fresh("a", 4096).fill_(1)
    other.fresh("a", 4096).fill_(2)  # anonymous memory, writable
    assert keeper.written_bytes == 4096 and other.written_bytes == 0
    assert other.commit_in_background() is None
    keeper.commit_in_background()
    assert keeper.wait(30)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["packed-v1"]
    mapped = PackedCache(tmp_path / "packed-v1").mapped("a", 4096)
    assert mapped is not None and bool((mapped == 1).all())
    after = PackedCache(tmp_path / "packed-v2")  # the lock went with the publish: another model can keep its own
    after.fresh("b", 4096)
    assert after.written_bytes == 4096


def test_two_starts_publishing_at_once_leave_one_whole_cache(tmp_path, monkeypatch):
    """Where the lock does not hold (a file system without flock), two starts that both kept the files
    publish one whole cache."""
    monkeypatch.setattr(packed_cache.fcntl, "flock", lambda fd, how: None)
    caches = [PackedCache(tmp_path / "packed-v1") for _ in range(2)]
    for value, cache in enumerate(caches):
        cache.fresh("a", 4096).fill_(value + 1)
    assert all(cache.written_bytes == 4096 for cache in caches)
    for cache in caches:
        cache.commit_in_background()
    assert all(cache.wait(30) for cache in caches)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["packed-v1"]
    mapped = PackedCache(tmp_path / "packed-v1").mapped("a", 4096)
    assert mapped is not None and int(mapped[0]) in (1, 2) and bool((mapped == mapped[0]).all())


@pytest.mark.parametrize("entry", [["../escape", 4096], ["0" * 24 + ".packed", "4096"], ["0" * 24 + ".packed", None],
                                   ["0" * 24 + ".packed", True], "not a pair"])
def test_a_manifest_naming_other_files_or_sizes_is_not_read(tmp_path, entry):
    directory = tmp_path / "packed-v1"
    directory.mkdir()
    (directory / packed_cache.MANIFEST).write_text(json.dumps({"layout": packed_cache.LAYOUT_VERSION,
                                                               "entries": {"a": entry}}))
    cache = PackedCache(directory)
    assert cache.mapped("a", 4096) is None and not directory.exists()


def test_a_link_in_the_cache_is_not_followed(tmp_path):
    cache = PackedCache(tmp_path / "packed-v1")
    cache.fresh("a", 4096).fill_(5)
    cache.commit_in_background()
    assert cache.wait(30)
    directory = tmp_path / "packed-v1"
    name = json.loads((directory / packed_cache.MANIFEST).read_text())["entries"]["a"][0]
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(4096))
    (directory / name).unlink()
    (directory / name).symlink_to(target)
    assert PackedCache(directory).mapped("a", 4096) is None


def test_the_first_starts_packed_files_are_sealed_read_only(tmp_path):
    """A write into a projection this start packed into a kept file faults, rather than changing the file
    (and so every later start's weights)."""
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from engine.packed_cache import PackedCache\n"
        f"cache = PackedCache(Path({str(tmp_path / 'packed-v1')!r}))\n"
        "out = cache.packed('a', 8192, lambda fresh: fresh.fill_(3))\n"
        "assert cache.written_bytes == 8192\n"  # packed into a kept file, not into memory
        "print(int(out[100]), flush=True)\n"
        "out[100] = 7\n"
        "print('written', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["3"] and done.returncode != 0, (done.stdout, done.stderr[-500:])


def test_publishing_removes_the_files_of_other_layouts(tmp_path):
    """A layout version's files are removed once the current layout's are whole (never before: a start that
    dies while packing leaves the older files as they were)."""
    old = tmp_path / "packed-v0"
    (tmp_path / "packed-v9").mkdir()  # a newer server's: kept
    old.mkdir()
    (old / ("0" * 24 + ".packed")).write_bytes(b"x" * 4096)
    (tmp_path / "packed-vault").mkdir()  # not a layout directory: left alone
    cache = PackedCache(tmp_path / "packed-v1")
    cache.fresh("a", 4096).fill_(1)
    assert old.exists()
    cache.commit_in_background()
    assert cache.wait(30)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["packed-v1", "packed-v9", "packed-vault"]


def test_a_disk_without_room_to_spare_keeps_nothing(tmp_path, monkeypatch, caplog):
    """The files are not started where they would leave the disk with less than DISK_LEFT_FREE: the weights
    are packed into memory and the log says how much room there was."""
    free = packed_cache.DISK_LEFT_FREE + (1 << 20)
    monkeypatch.setattr(packed_cache.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    tight = PackedCache(tmp_path / "packed-v1", expected_bytes=2 << 20)
    tight.fresh("a", 4096).fill_(1)
    assert tight.written_bytes == 0 and tight.commit_in_background() is None
    assert "GiB free" in caplog.text
    roomy = PackedCache(tmp_path / "packed-v1", expected_bytes=1 << 19)
    roomy.fresh("a", 4096)
    assert roomy.written_bytes == 4096



def _publish(directory, entries: dict[str, int]) -> None:
    cache = PackedCache(directory)
    for key, value in entries.items():
        cache.fresh(key, 4096).fill_(value)
    cache.commit_in_background()
    assert cache.wait(30)


def test_a_start_that_read_a_cache_never_keeps_a_part_of_one(tmp_path):
    """The kept directory removed while a start maps it: the projections it still lacks are packed into
    memory, and nothing is published (the set would lack the projections that were mapped)."""
    directory = tmp_path / "packed-v1"
    _publish(directory, {"a": 1, "b": 2})
    reader = PackedCache(directory)
    assert reader.mapped("a", 4096) is not None
    packed_cache.shutil.rmtree(directory)
    assert reader.mapped("b", 4096) is None
    reader.fresh("b", 4096).fill_(3)
    assert reader.written_bytes == 0 and reader.commit_in_background() is None
    assert not directory.exists() and not list(tmp_path.glob(".packed-v1.*"))


def test_a_cache_published_while_the_lock_was_taken_is_kept_as_is(tmp_path, monkeypatch):
    directory = tmp_path / "packed-v1"
    late = PackedCache(directory)
    take_lock = late._keep

    def another_start_publishes_first(report: bool) -> bool:
        _publish(directory, {"a": 1})
        return take_lock(report)

    monkeypatch.setattr(late, "_keep", another_start_publishes_first)
    late.fresh("a", 4096).fill_(2)
    assert late.written_bytes == 0 and late.commit_in_background() is None
    mapped = PackedCache(directory).mapped("a", 4096)
    assert mapped is not None and bool((mapped == 1).all())
    assert PackedCache(tmp_path / "packed-v1")._keep(report=False)  # the lock was let go


def test_an_older_layouts_files_make_room_when_the_disk_has_none_without_them(tmp_path, monkeypatch):
    """Removed first where only they stand in the way, and the room measured again: a process still mapping
    them keeps their blocks, and then nothing is kept."""
    old = tmp_path / "packed-v0"
    old_bytes, base = 2 << 20, packed_cache.DISK_LEFT_FREE + (1 << 20)
    freed = {"on removal": True}

    def disk_usage(path):
        return SimpleNamespace(free=base + (old_bytes if freed["on removal"] and not old.exists() else 0))

    monkeypatch.setattr(packed_cache.shutil, "disk_usage", disk_usage)

    def make_old() -> None:
        old.mkdir()
        (old / ("0" * 24 + ".packed")).write_bytes(b"x" * old_bytes)

    make_old()
    fits_with_the_old_files = PackedCache(tmp_path / "packed-v1", expected_bytes=2 << 20)
    fits_with_the_old_files.fresh("a", 4096)
    assert fits_with_the_old_files.written_bytes == 4096 and not old.exists()
    fits_with_the_old_files.abandon()
    make_old()
    freed["on removal"] = False  # another process still maps them: removing them frees nothing yet
    still_mapped = PackedCache(tmp_path / "packed-v1", expected_bytes=2 << 20)
    still_mapped.fresh("a", 4096)
    assert still_mapped.written_bytes == 0
    make_old()
    too_big = PackedCache(tmp_path / "packed-v1", expected_bytes=4 << 20)  # no room even without them: kept
    too_big.fresh("a", 4096)
    assert too_big.written_bytes == 0 and old.exists()


def test_a_lock_file_made_by_another_user_is_opened_to_read(tmp_path, monkeypatch):
    """In a cache shared between users the lock file may not be writable by this one: a lock needs only a
    read open."""
    lock = tmp_path / f".keeping-packed-v{packed_cache.LAYOUT_VERSION}.lock"
    lock.touch()
    real_open = os.open

    def not_writable(path, flags, *args):
        if os.fspath(path) == str(lock) and flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied", str(lock))
        return real_open(path, flags, *args)

    monkeypatch.setattr(packed_cache.os, "open", not_writable)
    first = PackedCache.beside(tmp_path)
    first.fresh("a", 4096)
    assert first.written_bytes == 4096
    second = PackedCache.beside(tmp_path)
    second.fresh("a", 4096)
    assert second.written_bytes == 0  # the read-open lock still holds the other start off


def test_a_cache_directory_this_user_cannot_write_says_so(tmp_path, monkeypatch, caplog):
    """No lock file and no right to make one: nothing kept, and the log names the refusal (not the missing
    file that the read-only attempt found)."""
    real_open = os.open

    def read_only_directory(path, flags, *args):
        if os.fspath(path).endswith(".lock") and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(packed_cache.os, "open", read_only_directory)
    cache = PackedCache.beside(tmp_path)
    cache.fresh("a", 4096)
    assert cache.written_bytes == 0
    assert "Permission denied" in caplog.text and "No such file" not in caplog.text


@pytest.mark.parametrize("error", [errno.ENOLCK, errno.EBADF])
def test_a_cache_that_cannot_be_locked_keeps_nothing(tmp_path, monkeypatch, caplog, error):
    """Only a lock held by another start is contention; where the directory cannot be locked at all (no
    locks on the file system; NFS refusing one on a read-only open, EBADF) nothing is kept, as no start
    could tell a dead start's staging from a live one's, and no staging is judged dead."""
    def no_locks(fd, how):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(packed_cache.fcntl, "flock", no_locks)
    other = tmp_path / f".packed-v{packed_cache.LAYOUT_VERSION}.7.abc"
    other.mkdir()
    cache = PackedCache.beside(tmp_path)
    cache.fresh("a", 4096).fill_(4)
    assert cache.written_bytes == 0 and other.exists()
    assert "cannot be locked" in caplog.text
    assert cache.commit_in_background() is None


def test_the_packed_sizes_are_the_kernels_layout():
    """The disk-room check and the memory estimate count what the packed files hold: the layout's tile
    group sizes as the kernels compute them, rows rounded up to whole tiles, Q4_0 and Q8_0 grown by their
    widened scales."""
    from engine.gguf_file import TensorInfo
    from engine.gguf_weights import _packed_size
    from engine.quant.packing import tile_group_bytes

    kernels = load_cpu_kernels()
    if kernels is not None:
        for fmt in ("bf16", "u4", "i8"):
            for group in (32, 64, 576):
                assert tile_group_bytes(fmt, group) == kernels.packed_tile_group_bytes(fmt, group), (fmt, group)
    for kind, file_block, packed_block in (("Q4_0", 18, 20), ("Q4_1", 20, 20), ("Q8_0", 34, 36)):
        info = TensorInfo("w", (64, 96), kind, 0, 0, 64 * 3 * file_block)  # 64 rows of 3 blocks
        assert _packed_size(info) == 64 * 3 * packed_block, kind
        ragged = TensorInfo("w", (40, 96), kind, 0, 0, 40 * 3 * file_block)  # rows padded to 48
        assert _packed_size(ragged) == 48 * 3 * packed_block, kind


def test_a_failed_load_lets_go_of_its_staging_and_lock(tmp_path, monkeypatch):
    if load_cpu_kernels() is None:
        pytest.skip("no fused kernels here: nothing is packed by the kernels")
    from engine import loader

    monkeypatch.setenv("SPARK_CACHE_DIR", str(tmp_path))
    failed = []

    def fails_after_the_weights(model):
        failed.append([p for p in tmp_path.rglob(".packed-v*") if p.is_dir()])  # the staging, while it is
        raise RuntimeError("the load failed after the weights")

    monkeypatch.setattr(loader, "_cost_model", fails_after_the_weights)
    with pytest.raises(RuntimeError, match="after the weights"):
        _engine()
    assert failed and failed[0]  # the weights were being kept
    assert not [p for p in tmp_path.rglob(".packed-v*") if p.is_dir()]  # no staging left
    lock = next(tmp_path.rglob(".keeping-packed-v*.lock"))
    fd = os.open(lock, os.O_RDONLY)
    try:
        packed_cache.fcntl.flock(fd, packed_cache.fcntl.LOCK_EX | packed_cache.fcntl.LOCK_NB)  # free
    finally:
        os.close(fd)
