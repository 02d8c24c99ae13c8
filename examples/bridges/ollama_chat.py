"""The `ollama` Python client against this server's Ollama routes.

    SPARK_SERVER=http://127.0.0.1:9990 python examples/bridges/ollama_chat.py
"""

import os

import ollama

client = ollama.Client(host=os.environ.get("SPARK_SERVER", "http://127.0.0.1:9990"))
model = client.list().models[0].model or ""  # a listed model always has its name
print(client.chat(model=model, messages=[{"role": "user", "content": "Say hello."}], options={"num_predict": 16})
      .message.content)
