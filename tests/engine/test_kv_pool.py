"""The KV pool is zeros that cost nothing at start (the OS zeroes its pages on first touch), made resident
afterwards at the lowest priority and only while the engine has no work (engine/resident.py)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import threading
import time

import pytest
import torch

from engine.attention import PagedKVCache, lazily_zeroed
from engine.resident import mapping_fields


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, all) pages of the mapping under ``t``, by mincore(2)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() & ~(page - 1)
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, length, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec), pages


def test_a_gigabyte_pool_is_zero_and_untouched_until_used():
    cache = PagedKVCache(num_layers=16, num_blocks=8192, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    assert cache.kv.numel() * cache.kv.element_size() == 2 ** 30
    assert _resident_pages(cache.kv)[0] == 0  # not written at start (torch.zeros would write the whole GiB)
    gc.collect()  # the tensor alone keeps its mapping alive
    assert cache.kv.shape == (16, 4, 8192 * 16, 64) and cache.kv.dtype == torch.bfloat16 and cache.kv.is_contiguous()
    assert cache.kv.data_ptr() % 64 == 0
    cache.kv[2, 1, 77] = 1.5
    assert float(cache.kv[2, 1, 77, 0]) == 1.5 and float(cache.kv[2, 1, 70:90].float().sum()) == 1.5 * 64
    assert _resident_pages(cache.kv)[0] == 1  # writing one slot touched only its page
    assert not cache.kv[3, :, 5000:6000].any() and not cache.kv[-1, -1, -16:].any()


def test_lazily_zeroed_gives_torch_zeros_meaning():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = lazily_zeroed((3, 5, 7), dtype, torch.device("cpu"))
        assert torch.equal(t, torch.zeros(3, 5, 7, dtype=dtype))
    assert lazily_zeroed((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


def test_a_budget_over_the_available_memory_is_refused_at_start(monkeypatch):
    from engine import loader

    monkeypatch.setattr(loader, "_available_memory_bytes", lambda: 4 << 30)
    loader._check_kv_fits(3 << 30, torch.device("cpu"))  # fits
    with pytest.raises(ValueError) as refused:  # a 5 GiB pool on a 4 GiB machine
        loader._check_kv_fits(5 << 30, torch.device("cpu"))
    message = str(refused.value)
    assert "5.0 GiB" in message and "4.0 GiB" in message and "--kv-cache-space" in message
    monkeypatch.setattr(loader, "_available_memory_bytes", lambda: None)  # no /proc/meminfo: no check
    loader._check_kv_fits(5 << 30, torch.device("cpu"))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_the_pool_is_private_memory_not_shmem():
    """A shared anonymous mapping is shmem underneath: its first-touch faults cost ~40% more a KV block."""
    t = lazily_zeroed((4, 1 << 20), torch.bfloat16, torch.device("cpu"))
    start = t.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= start < hi:
                assert perms == "rw-p", line
                return
    pytest.fail("the pool's mapping is not in /proc/self/maps")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux's SCHED_IDLE and MADV_POPULATE_WRITE")
def test_prefault_makes_the_whole_pool_resident_on_idle_time_and_keeps_its_contents():
    # 1,001 blocks: each layer's K/V plane starts mid-page, so spans must round to pages and still cover the end
    cache = PagedKVCache(num_layers=3, num_blocks=1001, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    cache.kv[0, 0, 5] = 2.0
    cache.kv[-1, -1, -1] = -3.0  # the last slot of the last plane
    resident, pages = _resident_pages(cache.kv)
    assert resident < pages // 10
    prefault = cache.prefault_in_background(blocks_per_span=64)
    assert prefault.wait(timeout=120) and prefault.stopped is None
    # it yields to every other thread, yet is never starved while it holds the GIL or the mmap lock
    assert prefault.policy == os.SCHED_OTHER and prefault.nice == 19
    if _resident_pages(cache.kv)[0] != pages:
        pytest.fail(f"{pages - _resident_pages(cache.kv)[0]} of {pages} pages still not resident")
    assert float(cache.kv[0, 0, 5].float().sum()) == 2.0 * 64 and float(cache.kv[-1, -1, -1, 0]) == -3.0
    assert float(cache.kv.float().abs().sum()) == 5.0 * 64  # populating wrote nothing


def test_prefault_waits_while_the_engine_has_work():
    cache = PagedKVCache(num_layers=2, num_blocks=512, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    busy = threading.Event()
    busy.set()
    prefault = cache.prefault_in_background(blocks_per_span=16, busy=busy.is_set)  # as the engine gives it
    time.sleep(0.3)
    done_while_busy = prefault.spans_done
    assert done_while_busy <= 1  # at most the span that was under way when it was told
    assert not prefault.done.is_set() and prefault.running
    busy.clear()  # the engine is idle again: the pass goes on, and finishes
    assert prefault.wait(timeout=60) and prefault.stopped is None
    assert prefault.spans_done > done_while_busy and prefault.paused_s >= 0.2


def test_the_engine_pauses_the_pass_while_it_has_work(async_engine):
    core = async_engine.engine
    assert core.kv_prefault is not None and core.kv_prefault.busy == core._has_work


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux's SCHED_IDLE and MADV_POPULATE_WRITE")
def test_prefault_stops_when_its_pool_is_dropped():
    cache = PagedKVCache(num_layers=16, num_blocks=8192, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))  # 1 GiB
    prefault = cache.prefault_in_background(blocks_per_span=8)
    del cache
    gc.collect()
    assert not prefault.wait(timeout=60)  # it ended without finishing: the thread holds no reference to the pool
    assert not prefault.running


def test_the_pass_starts_once_the_weights_are_loaded(monkeypatch):
    """Loading the weights is page faults on both cores too (the repack's fresh pages): the pass over the
    pool begins after it, and after the cost model's timings, not beside them."""
    from engine import loader
    from engine.config import EngineConfig

    events: list[str] = []
    build, cost, prefault = loader._build_model, loader._cost_model, PagedKVCache.prefault_in_background

    def record(name, fn):
        def wrapped(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(loader, "_build_model", record("weights", build))
    monkeypatch.setattr(loader, "_cost_model", record("cost model", cost))
    monkeypatch.setattr(PagedKVCache, "prefault_in_background", record("prefault", prefault))
    loaded = loader.load(EngineConfig(kv_cache_space_gib=0.25))
    try:
        assert events == ["weights", "cost model", "prefault"]
        assert loaded.kv_prefault is not None
    finally:
        loaded.kv_prefault.cancel()


def test_the_engine_prefaults_its_pool_unless_told_not_to():
    from spark_server import settings as settings_mod

    assert settings_mod.resolve({}, environ={}).engine_config().kv_cache_prefault
    assert not settings_mod.resolve({"kv_cache_prefault": False}, environ={}).engine_config().kv_cache_prefault
    assert not settings_mod.resolve({}, environ={"SPARK_KV_CACHE_PREFAULT": "0"}).engine_config().kv_cache_prefault


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux's SCHED_IDLE and MADV_POPULATE_WRITE")
def test_a_pass_in_progress_is_cancelled_before_the_interpreter_finalizes():
    """A daemon thread still running when Python finalizes is torn down mid-call: a process that exited during
    a pass once died of SIGABRT. The pass is cancelled and joined at exit (this hook runs after that one)."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import atexit\n"
        "state = {}\n"
        "atexit.register(lambda: print('running at exit:', state['pass'].running, flush=True))\n"
        "import torch\n"
        "from engine.attention import PagedKVCache\n"
        "cache = PagedKVCache(num_layers=16, num_blocks=8192, block_size=16, num_kv_heads=2, head_dim=64,\n"
        "                     dtype=torch.bfloat16, device=torch.device('cpu'))\n"
        "state['pass'] = cache.prefault_in_background(blocks_per_span=8)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "running at exit: False" in out.stdout, out.stdout


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (the bracketed word), or None where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


def _thp_eligible(start: int, end: int) -> list[bool]:
    """THPeligible of each mapping inside [start, end)."""
    flags = mapping_fields(start, end, "THPeligible")
    assert flags is not None, "no /proc/self/smaps"
    return [flag == "1" for flag in flags]


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always") or not hasattr(os, "SCHED_IDLE"),
                    reason="needs Linux with transparent huge pages")
def test_the_prefault_pass_asks_for_huge_pages_as_it_goes_and_not_before(caplog):
    """Scattered 2 KB KV blocks on 4 KiB pages miss the TLB nearly every block; the pass marks each span for
    2 MiB pages just before populating it, and never the pool at start (a first request would wait for its
    huge pages to be zeroed)."""
    import logging

    cache = PagedKVCache(num_layers=4, num_blocks=4096, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))  # 64 MiB, 16 planes of 4 MiB
    start = cache.kv.data_ptr()
    end = start + cache.kv.numel() * cache.kv.element_size() + mmap.PAGESIZE
    assert _thp_eligible(start, end) == [False]  # one plain mapping until the pass reaches it, even in mode `always`
    with caplog.at_level(logging.INFO, logger="engine.resident"):
        prefault = cache.prefault_in_background(blocks_per_span=1024)
        assert prefault.wait(timeout=120) and prefault.stopped is None
    flags = _thp_eligible(start, end)
    assert flags and all(flags), flags  # every span marked (the pass covers the whole pool)
    assert "in 2 MiB pages" in caplog.text
    assert not cache.kv.float().abs().sum()  # populating wrote nothing
