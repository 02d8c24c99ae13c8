"""The attack corpus (tests/fuzz/attacks.py) against a real server process, a steady victim stream beside
it: for every attack the server stays alive and healthy, answers what the corpus documents, the victim's
largest wait between tokens stays under 1 s plus its own largest wait measured alone, and the server's
resident memory returns within 10% of its level before the attack."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import free_port, wait_healthy
from tests.fuzz import attacks
from tests.plain_http import TLS

CORPUS = attacks.corpus()


@dataclass
class Run:
    baseline_gap_s: float = 0.0
    outcomes: dict[str, attacks.Outcome] = field(default_factory=dict)
    unhealthy: list[str] = field(default_factory=list)
    victim_failures: list[str] = field(default_factory=list)
    exit_code: int | None = None


@pytest.fixture(scope="module")
def run() -> Run:
    port = free_port()
    base, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/turing/v3/gpt"
    env = {**os.environ, "SPARK_KV_CACHE_SPACE": "0.25"}
    proc = subprocess.Popen([sys.executable, "-m", "spark_server", "serve", "--port", str(port), "--log-level",
                             "warning", *attacks.SERVER_ARGS], env=env)
    result = Run()
    try:
        wait_healthy(base, timeout=180, verify=TLS)

        async def go() -> None:
            stop = asyncio.Event()

            async def watch_health() -> None:
                async with httpx.AsyncClient(timeout=5, verify=TLS) as client:
                    while not stop.is_set():
                        try:
                            status = (await client.get(base + "/health")).status_code
                            if status != 200:
                                result.unhealthy.append(f"/health {status}")
                        except httpx.TransportError as exc:
                            result.unhealthy.append(f"/health: {exc!r}")
                        await asyncio.sleep(0.1)

            health = asyncio.create_task(watch_health())
            victim = attacks.Victim(base)
            await victim.start()
            alone = time.perf_counter()  # the victim alone: while the RSS settles, 2 s (~200 chunks) at least
            await attacks.settled_rss(proc.pid)
            await asyncio.sleep(max(0.0, alone + 2.0 - time.perf_counter()))
            result.baseline_gap_s = victim.largest_gap(alone, time.perf_counter())
            for out in await attacks.run_corpus(CORPUS, base, ws_url, proc.pid, victim):
                result.outcomes[out.attack.name] = out
            await victim.stop()
            result.victim_failures = victim.failures
            stop.set()
            await health

        asyncio.run(go())
        result.exit_code = proc.poll()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return result


@pytest.mark.parametrize("attack", CORPUS, ids=[a.name for a in CORPUS])
def test_attack(run: Run, attack: attacks.Attack):
    out = run.outcomes[attack.name]
    assert out.reply.status in attack.expect_status, out.reply
    assert attack.expect_text.lower() in out.reply.text.lower(), out.reply
    assert out.victim_gap_s < 1.0 + run.baseline_gap_s, (
        f"the victim waited {out.victim_gap_s:.2f} s between tokens (alone: {run.baseline_gap_s:.2f} s)")
    assert out.rss_after <= 1.1 * out.rss_before, (
        f"RSS {out.rss_before >> 20} MiB before, {out.rss_after >> 20} MiB after (peak {out.rss_peak >> 20})")


def test_abandoned_compiles_do_not_delay_the_next_structured_request(run: Run):
    out = run.outcomes["24 abandoned compiles, then a new one"]
    assert out.reply.seconds < 5.0, f"the next structured request took {out.reply.seconds:.1f} s"


def test_the_server_stayed_alive_and_healthy_and_the_victim_was_served(run: Run):
    assert run.exit_code is None, f"the server exited with {run.exit_code}"
    assert not run.unhealthy, run.unhealthy[:5]
    assert not run.victim_failures, run.victim_failures[:5]
