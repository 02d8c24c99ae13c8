"""One parse of a GGUF file per conversion, however many times transformers opens it.

Converting a GGUF file through transformers opens it four times (the tokenizer, the config twice, the
weights), and ``gguf.GGUFReader`` parses every metadata field anew each time: ~8 s for the embedded
model's 49k-token vocabulary and merges, a third of a cold first start. A reader is a read-only memory
map, so within ``shared_gguf_readers()`` every ``GGUFReader`` of a path is the first one made. Blocks
nest (a cold engine start converts the file, then reads its quantized blocks: one parse for both).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.RLock()  # the patch is process-wide: one thread's blocks at a time
_depth = 0


@contextmanager
def shared_gguf_readers() -> Iterator[None]:
    global _depth
    import gguf

    with _lock:
        if _depth:  # an enclosing block's readers serve
            _depth += 1
            try:
                yield
            finally:
                _depth -= 1
            return
        original = gguf.GGUFReader
        readers: dict[tuple[str, str], object] = {}

        def shared(path, mode: str = "r"):
            key = (os.path.realpath(os.fspath(path)), mode)
            if key not in readers:
                readers[key] = original(path, mode)
            return readers[key]

        gguf.GGUFReader = shared  # transformers imports the name from the module at each call
        _depth = 1
        try:
            yield
        finally:
            _depth = 0
            gguf.GGUFReader = original
