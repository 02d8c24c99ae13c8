"""Which URLs LoRA packs may come from: the allow-list, matched exactly, never as text prefixes.

A URL is parsed, checked and rebuilt in one canonical form, and the *rebuilt* URL is what gets
fetched, so no second parser (httpx's, the pack server's) can read it differently from the check.

What is refused (code ``host_not_allowed`` -> Spark 12001):
- anything but http / https; userinfo (``user@host``); a host that is not a plain DNS name, IPv4
  or bracketed IPv6 literal; a bad or out-of-range port;
- whitespace, control characters, backslashes and non-ASCII characters anywhere;
- percent-encoded dots, slashes, backslashes or control characters in the path (``%2e``, ``%2f``,
  ``%5c``, ``%00``..), and malformed percent escapes;
- a URL whose scheme, host (case-insensitive) and port differ from every allowed prefix's, or whose
  path, after dot-segments are resolved, does not start with the prefix's path *segments*
  (``/packs`` allows ``/packs/a.tar`` but not ``/packs-evil/a.tar``).
A ``*`` in a prefix is a literal character, not a glob. Redirect hops go through the same check.
With ``refuse_private`` a host *name* must resolve to public addresses only; IP literals pass only
because the operator named them in the allow-list.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from engine.errors import LoraUnavailableError

_DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_DNS_NAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_FORBIDDEN_CHAR = re.compile(r"[\x00-\x20\x7f-\U0010ffff\\]")
# malformed escapes and encoded control characters anywhere; encoded dots and (back)slashes in the path
_BAD_ESCAPE = re.compile(r"%(?![0-9a-fA-F]{2})|%[01][0-9a-fA-F]|%7[fF]")
_PATH_ESCAPE = re.compile(r"%2[eEfF]|%5[cC]")


def refused(url: object, why: str) -> LoraUnavailableError:
    shown = repr(url) if len(repr(url)) <= 200 else repr(url)[:200] + "..."
    return LoraUnavailableError(f"lora.url {shown}: {why}", code="host_not_allowed")


@dataclass(frozen=True, slots=True)
class CanonicalUrl:
    scheme: str
    host: str  # lower case; IPv6 without brackets
    port: int
    segments: tuple[str, ...]  # path segments after dot-segment removal ("/a/b/" -> ("a", "b", ""))
    query: str

    @property
    def is_ip_literal(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def text(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        query = f"?{self.query}" if self.query else ""
        return f"{self.scheme}://{host}:{self.port}/{'/'.join(self.segments)}{query}"

    def is_under(self, prefix: CanonicalUrl) -> bool:
        if (self.scheme, self.host, self.port) != (prefix.scheme, prefix.host, prefix.port):
            return False
        wanted = prefix.segments[:-1] if prefix.segments and prefix.segments[-1] == "" else prefix.segments
        return len(self.segments) > len(wanted) and self.segments[:len(wanted)] == wanted


def remove_dot_segments(segments: list[str]) -> tuple[str, ...]:
    """RFC 3986 section 5.2.4 over path segments; ``..`` at the root stays at the root."""
    out: list[str] = []
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == ".":
            if last:
                out.append("")
        elif seg == "..":
            if out:
                out.pop()
            if last:
                out.append("")
        else:
            out.append(seg)
    return tuple(out)


def canonicalize(url: object) -> CanonicalUrl:
    """Parse ``url`` strictly into its canonical parts, or raise 12001 saying why."""
    if not isinstance(url, str) or not url:
        raise refused(url, "must be a non-empty string")
    bad = _FORBIDDEN_CHAR.search(url)
    if bad:
        raise refused(url, f"character {bad.group()!r} is not allowed in a pack URL (percent-encode it, or "
                           "remove whitespace, control characters and backslashes)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise refused(url, f"not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise refused(url, "only http:// and https:// URLs are accepted")
    if "@" in parts.netloc:
        raise refused(url, "user information (user@host) is not allowed in a pack URL")
    host = (parts.hostname or "").lower()
    if not host:
        raise refused(url, "the URL has no host")
    if parts.netloc.startswith("["):
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise refused(url, f"host [{host}] is not a valid IPv6 address") from None
    elif not _DNS_NAME.match(host):
        raise refused(url, f"host {host!r} is not a valid host name or IPv4 address")
    if port == 0:
        raise refused(url, "port 0 is not a valid port")
    if _BAD_ESCAPE.search(parts.path) or _BAD_ESCAPE.search(parts.query):
        raise refused(url, "malformed %-escapes and percent-encoded control characters are not allowed")
    if _PATH_ESCAPE.search(parts.path):
        raise refused(url, "percent-encoded dots, slashes or backslashes are not allowed in the path")
    path = parts.path or "/"
    segments = remove_dot_segments(path.split("/")[1:])
    return CanonicalUrl(scheme, host, port if port is not None else _DEFAULT_PORTS[scheme], segments or ("",),
                        parts.query)


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return ip.is_global and not ip.is_multicast


class UrlPolicy:
    def __init__(self, prefixes: Iterable[str] = (), refuse_private: bool = False) -> None:
        self.prefixes: list[CanonicalUrl] = []
        self.refuse_private = refuse_private
        for prefix in prefixes:
            if prefix.strip():
                self.allow(prefix.strip())

    def allow(self, prefix: str) -> None:
        """Add an allowed prefix; a malformed one is a configuration error (ValueError)."""
        try:
            canonical = canonicalize(prefix)
        except LoraUnavailableError as exc:
            raise ValueError(f"--lora-allowed-urls: {exc}") from None
        if canonical.query:
            raise ValueError(f"--lora-allowed-urls {prefix!r}: a prefix may not have a query string")
        self.prefixes.append(canonical)

    def describe(self) -> str:
        return ", ".join(p.text() for p in self.prefixes) or "none"

    def check(self, url: object) -> str:
        """The canonical URL to fetch for ``url``, or 12001 saying why it is refused."""
        if not self.prefixes:
            raise LoraUnavailableError("lora.url: no LoRA source is allowed on this server (the operator sets "
                                       "--lora-allowed-urls / SPARK_LORA_ALLOWED_URLS)", code="host_not_allowed")
        canonical = canonicalize(url)
        if not any(canonical.is_under(p) for p in self.prefixes):
            raise refused(url, f"is not under an allowed prefix (scheme, host and port must match exactly and the "
                               f"path must start with the prefix's path segments; allowed: {self.describe()})")
        return canonical.text()

    async def check_address(self, url: str) -> None:
        """With ``refuse_private``: a host name must resolve to public addresses only (an IP literal was
        named by the operator). Without it, nothing to do."""
        canonical = canonicalize(url)
        if not self.refuse_private or canonical.is_ip_literal:
            return
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(canonical.host, canonical.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise LoraUnavailableError(f"lora.url {url!r}: host {canonical.host!r} does not resolve ({exc})",
                                       code="download_failed") from None
        private = sorted({str(info[4][0]) for info in infos if not _is_public(str(info[4][0]))})
        if private:
            raise refused(url, f"host {canonical.host!r} resolves to a private or loopback address "
                               f"({', '.join(private)}); name that address in --lora-allowed-urls to allow it")
