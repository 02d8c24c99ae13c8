"""Progress of long one-time work (a GGUF file's first conversion): a bar on a terminal, log lines
elsewhere (a service's journal, a container's log, a file), so the wait is visible either way."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

T = TypeVar("T")

LOG_EVERY_S = 5.0  # a log line at most this often ...
LOG_EVERY_FRACTION = 0.25  # ... or at each quarter of the work, and at its end


class Progress:
    """Counts ``total`` steps of one stage. On a terminal (``stream`` is a TTY) a tqdm bar; otherwise an
    INFO line on ``logger`` at each quarter, at most every few seconds between, and at the end."""

    def __init__(self, desc: str, total: int, logger: logging.Logger, unit: str = "it",
                 stream: IO[str] | None = None, terminal: bool | None = None) -> None:
        self.desc, self.total, self.unit, self.logger = desc, total, unit, logger
        self.count = 0
        self.started = self._last_log = time.monotonic()
        self._next_fraction = LOG_EVERY_FRACTION
        stream = stream if stream is not None else sys.stderr
        if terminal is None:
            terminal = bool(getattr(stream, "isatty", lambda: False)())
        self._bar = None
        if terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, leave=True)
        else:
            logger.info("%s: 0/%d %s", desc, total, unit)

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        fraction = self.count / self.total if self.total else 1.0
        if fraction >= self._next_fraction or now - self._last_log >= LOG_EVERY_S:
            if self.count < self.total:
                self.logger.info("%s: %d/%d %s (%d%%, %.0fs)", self.desc, self.count, self.total, self.unit,
                                 100 * fraction, now - self.started)
            self._last_log = now
            while self._next_fraction <= fraction:
                self._next_fraction += LOG_EVERY_FRACTION

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            return
        self.logger.info("%s: %d/%d %s done in %.1fs", self.desc, self.count, self.total, self.unit,
                         time.monotonic() - self.started)


def track(items: Iterable[T], desc: str, logger: logging.Logger, total: int | None = None, unit: str = "it",
          stream: IO[str] | None = None, terminal: bool | None = None) -> Iterator[T]:
    """``items``, reporting progress as they are consumed (see Progress)."""
    if total is None:
        total = len(items)  # type: ignore[arg-type]
    progress = Progress(desc, total, logger, unit, stream, terminal)
    try:
        for item in items:
            yield item
            progress.update()
    finally:
        progress.close()
