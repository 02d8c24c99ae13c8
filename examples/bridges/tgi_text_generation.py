"""The HF `text_generation` client. It posts to the server's root, which answers in the shape it reads
(no flag needed):  spark-server serve

    SPARK_SERVER=http://127.0.0.1:9990 python examples/bridges/tgi_text_generation.py
"""

import os

from text_generation import Client

client = Client(os.environ.get("SPARK_SERVER", "http://127.0.0.1:9990"), timeout=120)
print(client.generate("The capital of France is", max_new_tokens=12).generated_text)
for response in client.generate_stream("The capital of Italy is", max_new_tokens=12):
    print(response.token.text, end="", flush=True)
print()
