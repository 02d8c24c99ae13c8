"""The same conversation with the synchronous `websocket-client` library.

    SPARK_SERVER=http://127.0.0.1:9990 python examples/spark_websocket_client.py
"""

import json
import os

import websocket  # pip install websocket-client

URL = os.environ.get("SPARK_SERVER", "http://127.0.0.1:9990").replace("http", "ws", 1) + "/turing/v3/gpt"

ws = websocket.create_connection(URL, timeout=120)
ws.send(json.dumps({"header": {"traceId": "example"}, "parameter": {"chat": {"max_tokens": 24, "top_k": 1}},
                    "payload": {"message": {"text": [{"role": "user", "content": "Name three colours."}]}}}))
while True:
    frame = json.loads(ws.recv())
    if frame["header"]["code"] != 0:
        raise SystemExit(f"error {frame['header']['code']}: {frame['header']['message']}")
    print(frame["payload"]["choices"]["text"][0]["content"], end="", flush=True)
    if frame["header"]["status"] == 2:
        usage = frame["payload"]["usage"]["text"]
        print(f"\n[{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens]")
        break
ws.close()
