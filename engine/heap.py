"""The C heap's free pages handed back to the system (glibc's ``malloc_trim``; nothing elsewhere): a load's or an
eviction's freed buffers otherwise stay in the process's resident size until the allocator reuses them."""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
