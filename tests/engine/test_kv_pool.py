"""The KV pool is zeros that cost nothing at start: the OS zeroes its pages on first touch."""

from __future__ import annotations

import gc
import os
import resource

import pytest
import torch

from engine.attention import PagedKVCache, lazily_zeroed


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_a_gigabyte_pool_is_zero_and_untouched_until_used():
    before = _rss_bytes()
    cache = PagedKVCache(num_layers=16, num_blocks=8192, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    assert cache.kv.numel() * cache.kv.element_size() == 2 ** 30
    assert _rss_bytes() - before < 64 * 2 ** 20  # not written at start (torch.zeros would add the whole GiB)
    gc.collect()  # the tensor alone keeps its mapping alive
    assert cache.kv.shape == (16, 4, 8192 * 16, 64) and cache.kv.dtype == torch.bfloat16 and cache.kv.is_contiguous()
    assert cache.kv.data_ptr() % 64 == 0
    assert not cache.kv[3, :, 5000:6000].any() and not cache.kv[-1, -1, -16:].any()
    cache.kv[2, 1, 77] = 1.5
    assert float(cache.kv[2, 1, 77, 0]) == 1.5 and float(cache.kv[2, 1, 70:90].float().sum()) == 1.5 * 64
    assert _rss_bytes() - before < 64 * 2 ** 20  # reading and writing a few slots touched only their pages


def test_lazily_zeroed_gives_torch_zeros_meaning():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = lazily_zeroed((3, 5, 7), dtype, torch.device("cpu"))
        assert torch.equal(t, torch.zeros(3, 5, 7, dtype=dtype))
    assert lazily_zeroed((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


def test_a_budget_over_the_available_memory_is_refused_at_start(monkeypatch):
    from engine import llm_engine

    monkeypatch.setattr(llm_engine, "_available_memory_bytes", lambda: 4 << 30)
    llm_engine._check_kv_fits(3 << 30, torch.device("cpu"))  # fits
    with pytest.raises(ValueError) as refused:  # a 5 GiB pool on a 4 GiB machine
        llm_engine._check_kv_fits(5 << 30, torch.device("cpu"))
    message = str(refused.value)
    assert "5.0 GiB" in message and "4.0 GiB" in message and "--kv-cache-space" in message
    monkeypatch.setattr(llm_engine, "_available_memory_bytes", lambda: None)  # no /proc/meminfo: no check
    llm_engine._check_kv_fits(5 << 30, torch.device("cpu"))


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
