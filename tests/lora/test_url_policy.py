"""The LoRA URL allow-list: a table of URL tricks against the policy itself (what is refused, and the
canonical URL fetched for what is allowed). The same tricks against a real server and a real pack
server, checking where requests actually arrive, are in test_lora_sessions.py."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import LoraUnavailableError
from lora_store.url_policy import UrlPolicy, remove_dot_segments

A = "http://127.0.0.1:8320"
REFUSED = None

# (allowed prefixes, requested URL, canonical URL fetched or REFUSED)
TABLE = [
    # the red team's five
    ([f"{A}/packs/"], f"{A}/packs/../evil/valid.tar.gz", REFUSED),
    ([A], "http://127.0.0.1:8320@127.0.0.1:8321/valid.tar.gz", REFUSED),
    ([f"{A}/packs"], f"{A}/packs-evil/valid.tar.gz", REFUSED),
    ([A], "http://127.0.0.1:83200/valid.tar.gz", REFUSED),
    ([A], f"{A}/packs/a\r\nHost: evil/valid.tar.gz", REFUSED),
    ([A], f"{A}/packs/a\x00.tar.gz", REFUSED),
    # userinfo in every form
    ([A], "http://user:pass@127.0.0.1:8320/valid.tar.gz", REFUSED),
    ([A], "http://@127.0.0.1:8320/valid.tar.gz", REFUSED),
    ([A], "http://127.0.0.1:8320%40127.0.0.1:8321/valid.tar.gz", REFUSED),
    # host and port compared exactly
    ([A], "http://localhost:8320/valid.tar.gz", REFUSED),
    ([A], "http://127.1:8320/valid.tar.gz", REFUSED),
    ([A], "http://2130706433:8320/valid.tar.gz", REFUSED),
    ([A], "http://0x7f000001:8320/valid.tar.gz", REFUSED),
    ([A], "http://[::ffff:127.0.0.1]:8320/valid.tar.gz", REFUSED),
    ([A], "http://127.0.0.1.:8320/valid.tar.gz", REFUSED),
    ([A], "http://127.0.0.1:8321/valid.tar.gz", REFUSED),
    ([A], "http://127.0.0.1/valid.tar.gz", REFUSED),
    ([A], "http://127.0.0.1:8320:80/valid.tar.gz", REFUSED),
    ([A], "http://127.0.0.1:0/valid.tar.gz", REFUSED),
    ([A], "https://127.0.0.1:8320/valid.tar.gz", REFUSED),
    # schemes
    ([A], "ftp://127.0.0.1:8320/valid.tar.gz", REFUSED),
    ([A], "file:///etc/passwd", REFUSED),
    ([A], "gopher://127.0.0.1:8320/_x", REFUSED),
    ([A], "http:/127.0.0.1:8320/valid.tar.gz", REFUSED),
    ([A], "http:///127.0.0.1:8320/valid.tar.gz", REFUSED),
    # dot segments and encodings
    ([f"{A}/packs/"], f"{A}/packs/%2e%2e/evil/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/%2E%2E/evil/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/..%2fevil/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs%2f..%2fevil/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/..\\evil/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/..%5cevil/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/x/../../evil/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/./packs/../../evil/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}//packs/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/PACKS/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/%zz.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/%00.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/valid.tar.gz?x=%0d%0a", REFUSED),
    ([f"{A}/packs/"], f" {A}/packs/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/v\talid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs/vä.tar.gz", REFUSED),
    # segment boundaries and globs
    ([f"{A}/packs"], f"{A}/packs2/valid.tar.gz", REFUSED),
    ([f"{A}/packs/v1"], f"{A}/packs/v10/valid.tar.gz", REFUSED),
    ([f"{A}/packs*/"], f"{A}/packsX/valid.tar.gz", REFUSED),
    ([f"{A}/packs/"], f"{A}/packs", REFUSED),
    # allowed, and fetched in canonical form
    ([f"{A}/packs/"], f"{A}/packs/valid.tar.gz", f"{A}/packs/valid.tar.gz"),
    ([f"{A}/packs"], f"{A}/packs/valid.tar.gz", f"{A}/packs/valid.tar.gz"),
    ([f"{A}/packs/"], f"{A}/packs/./valid.tar.gz", f"{A}/packs/valid.tar.gz"),
    ([f"{A}/packs/"], f"{A}/packs/x/../valid.tar.gz", f"{A}/packs/valid.tar.gz"),
    ([f"{A}/packs/"], "HTTP://127.0.0.1:8320/packs/valid.tar.gz", f"{A}/packs/valid.tar.gz"),
    ([f"{A}/packs/"], f"{A}/packs/valid.tar.gz#frag", f"{A}/packs/valid.tar.gz"),
    ([f"{A}/packs/"], f"{A}/packs/valid.tar.gz?v=2", f"{A}/packs/valid.tar.gz?v=2"),
    ([f"{A}/packs*/"], f"{A}/packs*/valid.tar.gz", f"{A}/packs*/valid.tar.gz"),
    ([A], f"{A}/anything/valid.tar.gz", f"{A}/anything/valid.tar.gz"),
    (["http://Packs.Example.com/"], "http://packs.example.COM/a.tar", "http://packs.example.com:80/a.tar"),
    (["http://packs.example.com:80/"], "http://packs.example.com/a.tar", "http://packs.example.com:80/a.tar"),
    (["http://[::1]:8320/"], "http://[0:0::1]:8320/a.tar", "http://[::1]:8320/a.tar"),
]


@pytest.mark.parametrize("allowed, url, expected", TABLE, ids=[repr(row[1])[:60] for row in TABLE])
def test_url_tricks(allowed, url, expected):
    policy = UrlPolicy(allowed)
    if expected is REFUSED:
        with pytest.raises(LoraUnavailableError) as err:
            policy.check(url)
        assert err.value.code == "host_not_allowed"  # Spark 12001
        assert str(err.value).startswith("lora.url")
    else:
        assert policy.check(url) == expected


def test_the_table_is_large_enough():
    assert sum(1 for row in TABLE if row[2] is REFUSED) >= 30


def test_nothing_is_allowed_until_configured():
    with pytest.raises(LoraUnavailableError, match="no LoRA source is allowed"):
        UrlPolicy([]).check(f"{A}/packs/valid.tar.gz")


@pytest.mark.parametrize("prefix", ["http://user@127.0.0.1/", "ftp://127.0.0.1/", "http://127.0.0.1/?q=1",
                                    "http://127.0.0.1/a%2fb/"])
def test_a_malformed_prefix_is_a_configuration_error(prefix):
    with pytest.raises(ValueError, match="--lora-allowed-urls"):
        UrlPolicy([prefix])


def test_dot_segment_removal_follows_rfc3986():
    assert remove_dot_segments(["a", "b", "c", ".", "..", "..", "g"]) == ("a", "g")
    assert remove_dot_segments(["..", "..", "g"]) == ("g",)
    assert remove_dot_segments(["a", ".."]) == ("",)


def test_private_addresses_are_refused_by_name_when_asked():
    async def check(policy: UrlPolicy, url: str) -> None:
        await policy.check_address(policy.check(url))

    strict = UrlPolicy(["http://localhost:8320/", "http://127.0.0.1:8320/"], refuse_private=True)
    with pytest.raises(LoraUnavailableError, match="private or loopback") as err:
        asyncio.run(check(strict, "http://localhost:8320/a.tar"))
    assert err.value.code == "host_not_allowed"
    asyncio.run(check(strict, "http://127.0.0.1:8320/a.tar"))  # an IP literal the operator named
    lenient = UrlPolicy(["http://localhost:8320/"])
    asyncio.run(check(lenient, "http://localhost:8320/a.tar"))
