"""One turn of iFlytek's official SDK (`spark-ai-python`) against the real model, on the public path: the
shared live server, no flags, the client only given this server's URL."""

from __future__ import annotations


def test_the_official_sdk_gets_a_real_answer(live_server):
    from sparkai.core.messages import ChatMessage
    from sparkai.llm.llm import ChatSparkLLM

    spark = ChatSparkLLM(spark_api_url=f"ws://127.0.0.1:{live_server.port}/v3.5/chat", spark_app_id="app",
                         spark_api_key="key", spark_api_secret="secret", spark_llm_domain="generalv3.5",
                         max_tokens=12, top_k=1, streaming=False, request_timeout=120)
    result = spark.generate([[ChatMessage(role="user", content="What is the capital of France?")]])
    assert "Paris" in result.generations[0][0].text
    assert 0 < result.llm_output["token_usage"]["completion_tokens"] <= 12
