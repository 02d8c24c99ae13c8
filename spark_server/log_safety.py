"""Log lines that a request cannot forge: control characters in logged values are escaped.

A ``traceId`` of ``"x\\nsid=FORGED code=0"`` must stay inside its own line. The filter escapes every
string argument of a record (the format string is ours), and the message itself when it has no
arguments; ``clean`` does the same for a single value."""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_VALUE_CHARS = 512


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """``value`` as one printable line: control characters escaped, at most ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    return _CONTROL.sub(_escape, text)


class EscapeControlCharacters(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            if isinstance(record.args, dict):
                record.args = {k: clean(v) if isinstance(v, str) else v for k, v in record.args.items()}
            else:
                record.args = tuple(clean(a) if isinstance(a, str) else a for a in args)
        elif isinstance(record.msg, str):
            record.msg = clean(record.msg, limit=1 << 16)
        return True


def protect(logger: logging.Logger) -> logging.Logger:
    """Attach the filter to a logger that prints request-supplied values (idempotent)."""
    if not any(isinstance(f, EscapeControlCharacters) for f in logger.filters):
        logger.addFilter(EscapeControlCharacters())
    return logger
