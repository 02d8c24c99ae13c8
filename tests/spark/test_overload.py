"""Overload: more sessions than the server runs and queues. Each gets an answer or the busy code."""

from __future__ import annotations

import asyncio

from tests.spark.client import converse, spark_request


def test_200_sessions_against_32_running_and_32_waiting(live_server):
    core = live_server.engine.engine
    assert core.config.max_num_seqs == 32
    old = core.config.max_waiting
    core.config.max_waiting = 32
    try:
        async def all_sessions():
            bodies = [spark_request(f"Say a word about the number {i}.", max_tokens=8, top_k=1) for i in range(200)]
            return await asyncio.wait_for(asyncio.gather(*(converse(live_server.ws_url, b) for b in bodies)),
                                          timeout=600)

        results = asyncio.run(all_sessions())
    finally:
        core.config.max_waiting = old
    codes = [frames[-1]["header"]["code"] for frames in results]
    assert set(codes) <= {0, 10110}, set(codes)
    assert codes.count(0) >= 64  # at least what fits: 32 running + 32 waiting
    assert codes.count(10110) > 0  # and the rest were refused at once, not hung
    for frames in results:
        last = frames[-1]
        assert last["header"]["status"] == 2
        if last["header"]["code"] == 0:
            assert last["payload"]["usage"]["text"]["completion_tokens"] > 0
        else:
            assert "queue is full" in last["header"]["message"]
    live_server.wait_idle()
    assert core.block_manager.num_used_blocks == 0


def test_100_clients_leaving_mid_answer_leave_nothing_behind(live_server):
    import json

    import websockets

    async def leave_early(i: int):
        async with websockets.connect(live_server.ws_url) as ws:
            await ws.send(json.dumps(spark_request(f"Write a long story number {i}.", max_tokens=500,
                                                   temperature=1.0, top_k=6)))
            await ws.recv()

    async def run():
        await asyncio.gather(*(leave_early(i) for i in range(100)))

    asyncio.run(run())
    live_server.wait_idle(timeout=60)
