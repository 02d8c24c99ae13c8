"""The kept responses of POST /v1/responses (``store: true``): what GET /v1/responses/{id}, its input items
and a later ``previous_response_id`` read back. In memory, bounded by a count and by bytes (the JSON size of
what an entry holds). Over a bound, the least recently used entry of the client holding the most (bytes, or
entries for the count) goes first: a client that creates responses and never reads them cannot grow the
server, and fills the store at its own entries' expense, never evicting (or cancelling) another client's
while it holds more than they do. A background response still running when it is evicted or deleted is
cancelled: its engine request stops with it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as served
    input_items: list[dict[str, Any]]  # the items this response was given (ids filled in)
    conversation: list[dict[str, Any]]  # every item so far: the earlier turns, this input, this output
    background: bool = False
    task: asyncio.Task | None = field(default=None, repr=False)  # a background response still running
    nbytes: int = 0
    owner: str | None = None  # the client that made it (bridges.common.client_identity)

    def measure(self) -> int:
        self.nbytes = sum(len(json.dumps(part, ensure_ascii=False, separators=(",", ":")))
                          for part in (self.response, self.input_items, self.conversation))
        return self.nbytes

    @property
    def running(self) -> bool:
        return self.response.get("status") in ("queued", "in_progress")


class ResponseStore:
    """Least-recently-used entries by id, at most ``max_items`` of them and ``max_bytes`` together."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._held: dict[str | None, list[int]] = {}  # owner -> [bytes, entries]
        # a large answer is rendered on a worker thread, which stores it from there
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, rid: str, entry: StoredResponse) -> bool:
        """Keep (or replace) ``rid``; False when the entry alone is over the byte budget (not kept)."""
        size = entry.measure()
        evicted: list[StoredResponse] = []
        with self._lock:
            old = self._entries.pop(rid, None)
            if old is not None:
                self._account(old, -1)
            if size > self.max_bytes or self.max_items < 1:
                return False
            self._entries[rid] = entry
            self._account(entry, 1)
            while len(self._entries) > self.max_items or self._bytes > self.max_bytes:
                by_bytes = self._bytes > self.max_bytes
                heaviest = max(self._held, key=lambda owner: self._held[owner][0 if by_bytes else 1])
                gone_id = next(key for key, e in self._entries.items() if e.owner == heaviest)
                gone = self._entries.pop(gone_id)
                self._account(gone, -1)
                evicted.append(gone)
        for gone in evicted:
            _stop(gone)
        return True

    def _account(self, entry: StoredResponse, sign: int) -> None:
        self._bytes += sign * entry.nbytes
        held = self._held.setdefault(entry.owner, [0, 0])
        held[0] += sign * entry.nbytes
        held[1] += sign
        if not held[1]:
            del self._held[entry.owner]

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is not None:
                self._entries.move_to_end(rid)
            return entry

    def delete(self, rid: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.pop(rid, None)
            if entry is not None:
                self._account(entry, -1)
        if entry is not None:
            _stop(entry)
        return entry


def _stop(entry: StoredResponse) -> None:
    if entry.task is not None and not entry.task.done():
        entry.task.get_loop().call_soon_threadsafe(entry.task.cancel)  # safe from a rendering thread too
