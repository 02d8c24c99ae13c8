"""One TLS context for test clients that speak plain HTTP to a local server.

httpx loads the CA store into a fresh context for every client it builds (~50-100 ms of CPU on 2 busy
cores): a health poll every tenth of a second pays it while a server starts beside it on the same cores,
and each one-off ``httpx.get`` pays it again. Handing every client this one context skips that; no
request here uses TLS, so nothing about them changes."""

from __future__ import annotations

import ssl
from typing import Any

import httpx

TLS = ssl.create_default_context()


def get(url: str, **options: Any) -> httpx.Response:
    return httpx.get(url, verify=TLS, **options)


def post(url: str, **options: Any) -> httpx.Response:
    return httpx.post(url, verify=TLS, **options)
