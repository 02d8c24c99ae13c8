"""iFlytek's public Spark form (/v3.5/chat ...) on the fake engine, reached by the clients people use
unchanged: the official SDK (`spark-ai-python`, module `sparkai`), LangChain's `ChatSparkLLM`, and a JDK
`java.net.http.WebSocket` client (examples/SparkPublicJdk.java). Each is only given this server's URL; the
server checks their HMAC signatures (--spark-auth) and app_id (--spark-app-ids)."""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from pathlib import Path

import httpx
import pytest
import websocket

from bridges.errors import SparkError
from spark_server.app import build_app
from spark_server.auth import sign_url
from spark_server.settings import Settings
from spark_server.spark_public import PUBLIC_PATHS, PublicSettings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import DEFAULT_ANSWER, FAKE_MODEL, FakeEngine, Script

APP_ID, KEY, SECRET = "app-1", "key-1", "secret-1"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Hefei"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    settings = Settings(port=free_port(), spark_auth=f"{KEY}:{SECRET},other-key:other-secret",
                        spark_app_ids=f"{APP_ID},bound-app:other-key", max_history_tokens=200)
    with ServerThread(build_app(settings, engine), settings.port):
        yield engine, settings.port


@pytest.fixture
def fake(server):
    engine, port = server
    engine.script = Script()
    engine.requests.clear()
    yield engine, f"ws://127.0.0.1:{port}"
    engine.script = Script()


def frames(url: str, body: dict, key: str = KEY, secret: str = SECRET) -> list[dict]:
    ws = websocket.create_connection(sign_url(url, key, secret), timeout=30)
    try:
        ws.send(json.dumps(body))
        out = []
        while True:
            frame = json.loads(ws.recv())
            out.append(frame)
            if frame["header"]["status"] == 2:
                return out
    finally:
        ws.close()


def public_body(content: str = "hello", domain: str = "generalv3.5", app_id: str = APP_ID, **chat) -> dict:
    return {"header": {"app_id": app_id, "uid": "u1"}, "parameter": {"chat": {"domain": domain, **chat}},
            "payload": {"message": {"text": [{"role": "user", "content": content}]}}}


def test_the_official_sdk_two_turns_and_a_function_call(fake):
    from sparkai.core.messages import ChatMessage
    from sparkai.llm.llm import ChatSparkLLM

    engine, base = fake
    spark = ChatSparkLLM(spark_api_url=base + "/v3.5/chat", spark_app_id=APP_ID, spark_api_key=KEY,
                         spark_api_secret=SECRET, spark_llm_domain="generalv3.5", streaming=False)
    dialogue = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hello?")]
    first = spark.generate([dialogue])
    assert first.generations[0][0].text == DEFAULT_ANSWER
    assert first.llm_output["token_usage"]["completion_tokens"] > 0
    dialogue += [ChatMessage(role="assistant", content=first.generations[0][0].text),
                 ChatMessage(role="user", content="And then?")]
    assert spark.generate([dialogue]).generations[0][0].text == DEFAULT_ANSWER
    seen = engine.requests[-1].prompt.messages
    assert [(m.role, m.content) for m in seen] == [("system", "Be brief."), ("user", "Hello?"),
                                                   ("assistant", DEFAULT_ANSWER), ("user", "And then?")]
    assert engine.requests[-1].params.top_k == 4 and engine.requests[-1].params.max_tokens == 2048

    engine.script = Script(answer=CALL)
    called = spark.generate([[ChatMessage(role="user", content="Weather in Hefei?")]], function_definition=[WEATHER])
    message = called.generations[0][0].message
    assert message.function_call == {"name": "get_weather", "arguments": '{"city": "Hefei"}'}
    assert "get_weather" in engine.requests[-1].prompt.messages[0].content  # offered in the system turn


def test_langchain_chat_spark_llm_two_turns_and_streaming(fake):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # langchain-community's notice of its own sunset
        from langchain_community.chat_models import ChatSparkLLM
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    engine, base = fake
    chat = ChatSparkLLM(spark_app_id=APP_ID, spark_api_key=KEY, spark_api_secret=SECRET,
                        spark_api_url=base + "/v4.0/chat", spark_llm_domain="4.0Ultra")
    history = [SystemMessage(content="Be brief."), HumanMessage(content="Hello?")]
    first = chat.invoke(history)
    assert first.content == DEFAULT_ANSWER and first.response_metadata["token_usage"]["total_tokens"] > 0
    history += [first, HumanMessage(content="Again?")]
    chunks = list(chat.stream(history))
    assert "".join(c.content for c in chunks) == DEFAULT_ANSWER and len(chunks) > 2
    assert [m.role for m in engine.requests[-1].prompt.messages] == ["system", "user", "assistant", "user"]
    assert isinstance(history[2], AIMessage)


@pytest.mark.skipif(not (shutil.which("javac") and shutil.which("java")), reason="a JDK is not installed here")
def test_a_jdk_websocket_client_signs_and_converses(fake, tmp_path):
    engine, base = fake
    shutil.copy(EXAMPLES / "SparkPublicJdk.java", tmp_path)
    subprocess.run(["javac", "SparkPublicJdk.java"], cwd=tmp_path, check=True, timeout=120)
    env = {"PATH": shutil.os.environ["PATH"], "SPARK_SERVER": base.replace("ws://", "http://"),
           "SPARK_APP_ID": APP_ID, "SPARK_API_KEY": KEY, "SPARK_API_SECRET": SECRET}

    def run(*args: str) -> str:
        proc = subprocess.run(["java", "-cp", str(tmp_path), "SparkPublicJdk", *args], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    out = run()
    assert f"answer 1: {DEFAULT_ANSWER}" in out and f"answer 2: {DEFAULT_ANSWER}" in out
    assert [m.role for m in engine.requests[-1].prompt.messages] == ["system", "user", "assistant", "user"]
    engine.script = Script(answer=CALL)
    assert '"name": "get_weather"' in run("function")


@pytest.mark.parametrize("path", PUBLIC_PATHS)
def test_every_public_path_answers(fake, path):
    _, base = fake
    last = frames(base + path, public_body())[-1]
    assert last["header"]["code"] == 0 and last["payload"]["choices"]["text"][0]["content"]
    assert set(last["payload"]["usage"]["text"]) == {"question_tokens", "prompt_tokens", "completion_tokens",
                                                     "total_tokens"}


@pytest.mark.parametrize("body, code, words", [
    (public_body(domain="gpt-9"), 10163, "parameter.chat.domain"),
    (public_body(max_tokens=0), 10163, "max_tokens"),
    ({"header": {"traceId": "x"}, "payload": {"message": {"text": []}}}, 10163, "app_id"),
    (public_body(content=" "), 10163, "latest turn"),
    (public_body(content="word " * 400), 10907, "limit"),
    (public_body(app_id="stranger"), 11200, "app_id"),
    (public_body(app_id="bound-app"), 11200, "app_id"),  # allowed, but only with URLs signed by other-key
])
def test_refusals_use_iflyteks_codes(fake, body, code, words):
    _, base = fake
    (frame,) = frames(base + "/v3.5/chat", body)
    assert frame["header"]["code"] == code and words in frame["header"]["message"], frame
    assert frame["header"]["status"] == 2 and frame["header"]["sid"]


def test_a_null_turn_content_is_refused_naming_that_turn(fake):
    _, base = fake
    (frame,) = frames(base + "/v3.5/chat", public_body(content=None))
    message = frame["header"]["message"]
    assert frame["header"]["code"] == 10163 and message.startswith("payload.message.text[0].content: null"), message


def test_a_frame_that_is_not_json_is_10003(fake):
    _, base = fake
    ws = websocket.create_connection(sign_url(base + "/v3.5/chat", KEY, SECRET), timeout=30)
    ws.send("{oops")
    assert json.loads(ws.recv())["header"]["code"] == 10003
    ws.close()


def test_metrics_count_each_answer_under_the_code_its_client_got(fake):
    """/metrics' spark:requests_total counts a public-form answer under iFlytek's code, as its client and the
    log line saw it, not under the seed form's code for the same fault."""
    from tests.test_metrics import _value

    _, base = fake
    metrics = base.replace("ws://", "http://") + "/metrics"
    labels = {code: f'code="{code}",protocol="spark"' for code in (10163, 10003, 0)}
    before = {code: _value(httpx.get(metrics).text, "spark:requests_total", lab) for code, lab in labels.items()}
    assert frames(base + "/v3.5/chat", public_body(domain="gpt-9"))[0]["header"]["code"] == 10163
    ws = websocket.create_connection(sign_url(base + "/v3.5/chat", KEY, SECRET), timeout=30)
    ws.send("{oops")
    assert json.loads(ws.recv())["header"]["code"] == 10003
    ws.close()
    assert frames(base + "/v3.5/chat", public_body())[-1]["header"]["code"] == 0
    after = httpx.get(metrics).text
    assert {code: _value(after, "spark:requests_total", lab) - before[code] for code, lab in labels.items()} == {
        10163: 1, 10003: 1, 0: 1}


def test_an_app_id_bound_to_a_key_and_a_bad_signature(fake):
    _, base = fake
    ok = frames(base + "/v3.5/chat", public_body(app_id="bound-app"), key="other-key", secret="other-secret")
    assert ok[-1]["header"]["code"] == 0
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(sign_url(base + "/v3.5/chat", KEY, "wrong"), timeout=30)
    assert refused.value.status_code == 401


def test_the_seed_form_is_unchanged_beside_it(fake):
    _, base = fake
    (frame,) = frames(base + "/turing/v3/gpt", public_body())  # the public body on the seed path
    assert frame["header"]["code"] == 10000 and "traceId" in frame["header"]["message"]


def test_domains_map_to_the_model_or_an_adapter():
    public = PublicSettings.from_flags(None, "4.0Ultra=ad,mine=" + FAKE_MODEL, signing=False)
    assert public.target("generalv3.5", FAKE_MODEL, {"ad"}) is None
    assert public.target(FAKE_MODEL, FAKE_MODEL, set()) is None
    assert public.target("mine", FAKE_MODEL, set()) is None
    assert public.target("4.0Ultra", FAKE_MODEL, {"ad"}).name == "ad"
    assert public.target("ad", FAKE_MODEL, {"ad"}).name == "ad"
    with pytest.raises(SparkError, match=r"parameter\.chat\.domain: 'x' is not served here"):
        public.target("x", FAKE_MODEL, {"ad"})
    with pytest.raises(ValueError, match="--spark-app-ids needs --spark-auth"):
        PublicSettings.from_flags("app", None, signing=False)
