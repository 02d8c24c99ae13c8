"""Making a lazily mapped CPU pool resident ahead of use, on CPU time nothing else wants.

The KV pool is an anonymous mapping whose pages the OS zeroes on first touch (attention.lazily_zeroed), so
start-up costs nothing. But every fresh page is then faulted inside a model step, by the kernel writing
the step's K and V, while the other thread waits at the step's barrier; and a FIFO free list reaches
every page of the pool before it reuses one. On a virtual machine a first touch costs milliseconds a MiB
(the host backs the memory then too): a visible share of a loaded engine's step time goes to clearing
pages.

So after start a thread asks the kernel to fault the pool in (madvise MADV_POPULATE_WRITE, Linux 5.14+:
what a first write would do, without writing), in the order the free list hands blocks out, one small
span at a time, and only while the engine has no work: between spans it checks ``busy`` (the engine's
"requests running or waiting") and waits while it is true, so a request waits for at most the span in
progress (about a millisecond). Where the call is missing, it stops and pages are faulted on first use.

The thread runs at nice 19, not under SCHED_IDLE. An idle-class thread gets no CPU at all while any
other thread on the machine wants one, and it holds the GIL between spans and the process's mmap lock
inside each: on a loaded small machine a starved idle thread holding either stalled the event loop and
the first steps for tens of seconds after "ready". At nice 19 it still yields to everything else, but it
always gets some CPU, so whatever it holds is released within a scheduling period.

Each span is first marked for transparent huge pages (MADV_HUGEPAGE, where the kernel's THP mode is
`madvise` or `always`), so the pool it populates is mostly 2 MiB pages. Decode attention reads a sequence's
KV as 2 KB blocks scattered over gigabytes, one 4 KiB page each, and nearly every block was a TLB miss;
on 2 MiB pages decode and prefill attention take measurably less time (docs/performance.md). The mark
goes on a span only as the pass reaches it, never on the whole pool at start: a region the engine writes
before the pass gets there stays in 4 KiB pages, so a first request does not wait for 2 MiB pages to be
zeroed (180 of them for one block of the embedded model, one per layer and K/V head). The pass itself takes
longer in huge pages, on CPU time nothing else wants.
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
from collections.abc import Callable, Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20  # x86-64 and arm64 with 4 KiB base pages
NICE = 19  # the pass's thread: yields to every other thread, but is never starved (see the module's text)
BUSY_POLL_S = 0.02  # how often a paused pass looks whether the engine is idle again


def mapping_fields(start: int, end: int, field: str) -> list[str] | None:
    """The value of ``field`` (e.g. "AnonHugePages") of each mapping lying inside [start, end), from
    /proc/self/smaps; None where there is no smaps."""
    values, inside, key = [], False, field + ":"
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: lo-hi perms ...
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = start <= lo and hi <= end
                elif inside and head == key:
                    values.append(line.split()[1])
    except (OSError, ValueError):
        return None
    return values


def huge_page_bytes(start: int, end: int) -> int | None:
    """Bytes of [start, end) backed by transparent huge pages; None where there is no smaps."""
    sizes = mapping_fields(start, end, "AnonHugePages")
    return None if sizes is None else sum(int(kb) * 1024 for kb in sizes)


class Prefault:
    """One background pass over a tensor's spans; ``done`` is set when every span is resident."""

    def __init__(self, tensor: torch.Tensor, spans: Iterable[tuple[int, int]], what: str,
                 busy: Callable[[], bool] = lambda: False) -> None:
        self.done = threading.Event()
        self._cancelled = threading.Event()
        # the engine's "I have work": the pass waits while it is true. Given before the thread starts, so no
        # span runs before the pass can know the engine is busy.
        self.busy = busy
        self.spans_done = 0
        self.paused_s = 0.0  # time the pass spent waiting for the engine to be idle
        self.policy: int | None = None  # the thread's scheduling policy, once it has set it
        self.nice: int | None = None  # and its niceness
        self.stopped: str | None = None  # why it stopped early, if it did
        self.seconds: float | None = None
        self._what = what
        self._thread = threading.Thread(target=self._run, args=(weakref.ref(tensor), iter(spans)),
                                        name="kv-prefault", daemon=True)
        _passes.add(self)
        self._thread.start()
        logger.info("%s: made resident in the background while no request runs (--no-kv-cache-prefault: on "
                    "first use)", what)

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
        try:  # Linux: a thread's own niceness, by its id
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            self.policy = os.sched_getscheduler(0)
        except (AttributeError, OSError) as e:
            self._stop(f"cannot lower the thread's priority here: {e}")  # never compete with a step
            return
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError) as e:
            self._stop(f"no madvise: {e}")
            return
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        page = mmap.PAGESIZE
        tensor = tensor_ref()
        if tensor is None:
            return
        data = tensor.data_ptr()
        # the mapping's bounds, in numbers: the thread must not keep the pool alive between spans
        base, limit = data & ~(page - 1), -(-(data + tensor.numel() * tensor.element_size()) // page) * page
        del tensor
        huge = True  # until a kernel built without THP refuses the mark (in THP mode `never` it is accepted, and inert)
        started = time.monotonic()
        for offset, length in spans:
            self._wait_for_idle()
            if self._cancelled.is_set():
                return
            tensor = tensor_ref()
            if tensor is None:
                return  # the pool was dropped: nothing left to make resident
            start = (data + offset) & ~(page - 1)
            end = data + offset + length
            if huge:  # the whole 2 MiB pages around the span, within the mapping
                lo, hi = max(base, start & ~(HUGE_PAGE - 1)), min(limit, -(-end // HUGE_PAGE) * HUGE_PAGE)
                if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
                    huge = False
                    logger.info("%s: in 4 KiB pages (madvise(MADV_HUGEPAGE): %s)", self._what,
                                os.strerror(ctypes.get_errno()))
            # ctypes releases the GIL for the call; the tensor reference keeps the mapping alive through it
            if madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                self._stop(f"madvise(MADV_POPULATE_WRITE): {os.strerror(ctypes.get_errno())}")
                return
            del tensor
            self.spans_done += 1
        self.seconds = time.monotonic() - started - self.paused_s
        tensor = tensor_ref()  # alive while smaps is read, so the range is still the pool's
        in_huge = huge_page_bytes(base, limit) if tensor is not None else None
        del tensor
        logger.info("%s: resident after %.1fs of work%s", self._what, self.seconds,
                    f", {in_huge / (1 << 30):.2f} GiB of it in 2 MiB pages" if in_huge is not None else "")
        self.done.set()

    def _wait_for_idle(self) -> None:
        """Until the engine has no work (or the pass is cancelled); polled, as requests come and go."""
        if not self.busy():
            return
        since = time.monotonic()
        while self.busy() and not self._cancelled.wait(BUSY_POLL_S):
            pass
        self.paused_s += time.monotonic() - since


_passes: weakref.WeakSet[Prefault] = weakref.WeakSet()


@atexit.register
def _cancel_all() -> None:
    """Before the interpreter finalizes: a daemon thread still running then is torn down mid-call, and a
    process exiting during a pass died of SIGABRT ("terminate called without an active exception")."""
    for prefault in list(_passes):
        prefault.cancel()
