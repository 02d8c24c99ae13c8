"""The official `openai` client against this server: a chat answer, a streamed one, JSON by schema and a
tool call.

    SPARK_SERVER=http://127.0.0.1:9990 python examples/bridges/openai_chat.py
"""

import os

import openai
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

client = openai.OpenAI(base_url=os.environ.get("SPARK_SERVER", "http://127.0.0.1:9990") + "/v1", api_key="none")
model = client.models.list().data[0].id
question: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]

print(client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0)
      .choices[0].message.content)
for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0, stream=True):
    print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
print()
person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
print(client.chat.completions.create(model=model, max_tokens=48, temperature=0,
                                     messages=[{"role": "user", "content": "A person?"}],
                                     response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                                              "schema": person}})
      .choices[0].message.content)
weather: ChatCompletionToolParam = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}
call = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      tools=[weather], tool_choice="required", max_tokens=48, temperature=0,
                                      parallel_tool_calls=False).choices[0].message
first = (call.tool_calls or [])[0]  # tool_choice "required": there is one
print(first.function.name, first.function.arguments)
