"""Making a lazily mapped CPU pool resident ahead of use, on CPU time nothing else wants.

The KV pool is an anonymous mapping whose pages the OS zeroes on first touch (attention.lazily_zeroed), so
start-up costs nothing. But every fresh page is then faulted inside a model step, by the kernel writing
the step's K and V, while the other thread waits at the step's barrier; and a FIFO free list reaches
every page of the pool before it reuses one. On a 2-core virtual machine (AMD EPYC) a first touch costs
~1.2-2 ms a MiB (the host backs the memory then too), ~45 us for each token's 23 KB of KV with the
embedded model: ~6% of a 32-stream load's samples were in clear_page alone.

So after start a thread asks the kernel to fault the pool in (madvise MADV_POPULATE_WRITE, Linux 5.14+:
what a first write would do, without writing), in the order the free list hands blocks out. The thread
runs under SCHED_IDLE: it gets a core only when no other thread wants it, and any waking thread (a
step's OpenMP worker) preempts it at once, so it never competes with a step. Where the policy or the
call is missing, it stops and pages are faulted on first use, as before.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>


class Prefault:
    """One background pass over a tensor's spans; ``done`` is set when every span is resident."""

    def __init__(self, tensor: torch.Tensor, spans: Iterable[tuple[int, int]], what: str) -> None:
        self.done = threading.Event()
        self._cancelled = threading.Event()
        self.policy: int | None = None  # the thread's scheduling policy, once it has set it
        self.stopped: str | None = None  # why it stopped early, if it did
        self.seconds: float | None = None
        self._what = what
        self._thread = threading.Thread(target=self._run, args=(weakref.ref(tensor), iter(spans)),
                                        name="kv-prefault", daemon=True)
        _passes.add(self)
        self._thread.start()
        logger.info("%s: made resident on idle CPU time from now on (--no-kv-cache-prefault: on first use)", what)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the whole pass is done."""
        self._thread.join(timeout)
        return self.done.is_set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def cancel(self, timeout: float = 10.0) -> None:
        """Stop after the span in progress (milliseconds) and wait for the thread."""
        self._cancelled.set()
        self._thread.join(timeout)

    def _stop(self, why: str) -> None:
        self.stopped = why
        logger.info("%s: left to fault in on first use (%s)", self._what, why)

    def _run(self, tensor_ref: weakref.ref[torch.Tensor], spans: Iterator[tuple[int, int]]) -> None:
        try:  # Linux: pid 0 is the calling thread
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            self.policy = os.sched_getscheduler(0)
        except (AttributeError, OSError) as e:
            self._stop(f"no idle scheduling policy here: {e}")  # never compete with a step
            return
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError) as e:
            self._stop(f"no madvise: {e}")
            return
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        page = mmap.PAGESIZE
        started = time.monotonic()
        for offset, length in spans:
            if self._cancelled.is_set():
                return
            tensor = tensor_ref()
            if tensor is None:
                return  # the pool was dropped: nothing left to make resident
            first = tensor.data_ptr() + offset
            start = first & ~(page - 1)
            end = first + length
            # ctypes releases the GIL for the call; the tensor reference keeps the mapping alive through it
            if madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                self._stop(f"madvise(MADV_POPULATE_WRITE): {os.strerror(ctypes.get_errno())}")
                return
            del tensor
        self.seconds = time.monotonic() - started
        logger.info("%s: resident after %.1fs", self._what, self.seconds)
        self.done.set()


_passes: weakref.WeakSet[Prefault] = weakref.WeakSet()


@atexit.register
def _cancel_all() -> None:
    """Before the interpreter finalizes: a daemon thread still running then is torn down mid-call, and a
    process exiting during a pass died of SIGABRT ("terminate called without an active exception")."""
    for prefault in list(_passes):
        prefault.cancel()
