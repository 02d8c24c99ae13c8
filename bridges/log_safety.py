"""Log lines that a request can neither forge nor use to leak credentials.

- Control characters in logged values are escaped: a ``traceId`` of ``"x\\nsid=FORGED code=0"``
  stays inside its own line.
- Credentials in URLs (the Spark signature's ``authorization`` and ``signature`` query parameters,
  ``api_key``) are replaced by ``REDACTED``: uvicorn logs every WebSocket handshake's full path.
The filter cleans every string argument of a record (the format string is ours), and the message
itself when it has no arguments; ``clean`` does the same for a single value."""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CREDENTIAL = re.compile(r"(?i)\b(authorization|signature|api_key)=[^&\s\"']*")
MAX_VALUE_CHARS = 512
SERVER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """``value`` as one printable line: credentials redacted, control characters escaped, at most
    ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    return _CONTROL.sub(_escape, _CREDENTIAL.sub(r"\1=REDACTED", text))


class SanitizeLogValues(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            if isinstance(record.args, dict):
                record.args = {k: clean(v) if isinstance(v, str) else v for k, v in record.args.items()}
            else:
                args = record.args if isinstance(record.args, tuple) else (record.args,)
                record.args = tuple(clean(a) if isinstance(a, str) else a for a in args)
        elif isinstance(record.msg, str):
            record.msg = clean(record.msg, limit=1 << 16)
        return True


class DropDenialNoise(logging.Filter):
    """uvicorn's sans-I/O WebSocket protocol never marks a handshake refused with a denial response
    (401 / 403) as complete, and logs every ordinary refusal as an ERROR. Our WebSocket endpoint always
    accepts or denies, so that line only ever reports a refusal that was answered correctly."""

    NOISE = "ASGI callable returned without completing handshake."

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.NOISE


def protect(logger: logging.Logger) -> logging.Logger:
    """Attach the filter to a logger that prints request-supplied values (idempotent)."""
    if not any(isinstance(f, SanitizeLogValues) for f in logger.filters):
        logger.addFilter(SanitizeLogValues())
    return logger


def protect_server_logs() -> None:
    """The root logger's handlers and uvicorn's own loggers (which log handshake paths)."""
    for name in SERVER_LOGGERS:
        protect(logging.getLogger(name))
    error_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DropDenialNoise) for f in error_log.filters):
        error_log.addFilter(DropDenialNoise())
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, SanitizeLogValues) for f in handler.filters):
            handler.addFilter(SanitizeLogValues())
