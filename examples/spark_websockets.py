"""A Spark WebSocket conversation with the `websockets` library: send the dialogue, print the answer as
its frames arrive (status 0 / 1 / 2), then ask a follow-up with the first turn resent (`<end>` on it).

    SPARK_SERVER=http://127.0.0.1:9990 python examples/spark_websockets.py
"""

import asyncio
import json
import os

import websockets

URL = os.environ.get("SPARK_SERVER", "http://127.0.0.1:9990").replace("http", "ws", 1) + "/turing/v3/gpt"


async def ask(history: list[dict]) -> str:
    body = {"header": {"traceId": "example"}, "parameter": {"chat": {"max_tokens": 24, "top_k": 1}},
            "payload": {"message": {"text": history}}}
    answer = ""
    async with websockets.connect(URL) as ws:
        await ws.send(json.dumps(body, ensure_ascii=False))
        async for message in ws:  # the server closes the socket after the last frame
            frame = json.loads(message)
            if frame["header"]["code"] != 0:
                raise SystemExit(f"error {frame['header']['code']}: {frame['header']['message']}")
            answer += frame["payload"]["choices"]["text"][0]["content"]
            print(frame["payload"]["choices"]["text"][0]["content"], end="", flush=True)
    print()
    return answer


async def main() -> None:
    history = [{"role": "user", "content": "What is the capital of France?"}]
    first = await ask(history)
    history += [{"role": "assistant", "content": first + "<end>"}, {"role": "user", "content": "And of Italy?"}]
    await ask(history)


asyncio.run(main())
