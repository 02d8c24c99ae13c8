"""Every example in examples/ runs as written against a real server (Node and Java are marked slow and
skipped where their toolchain is missing; the Java-WebSocket one also needs its jars). Those whose output must
hold a right answer (Paris) run against the real model; the others only need a server that answers, and run
on the scripted fake engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(cmd: list[str], server, cwd: Path = EXAMPLES, timeout: int = 240) -> str:
    env = dict(os.environ, SPARK_SERVER=server.http_url)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_spark_curl(fake):
    out = run(["bash", "spark_curl.sh"], fake)
    assert '"code":0' in out.replace(" ", "") and '"status":2' in out.replace(" ", "")


def test_spark_websockets(live_server):
    out = run([sys.executable, "spark_websockets.py"], live_server)
    assert "Paris" in out and "Rome" in out  # the second turn saw the first


def test_spark_websocket_client(fake):
    pytest.importorskip("websocket")
    out = run([sys.executable, "spark_websocket_client.py"], fake)
    assert "completion tokens" in out


def test_openai_client(live_server):
    out = run([sys.executable, "bridges/openai_chat.py"], live_server)
    assert "Paris" in out and "get_weather" in out


def test_tgi_client(fake):  # a server with no flags: the client posts to its root
    out = run([sys.executable, "bridges/tgi_text_generation.py"], fake)
    assert out.strip()


def test_ollama_client(fake):
    assert run([sys.executable, "bridges/ollama_chat.py"], fake).strip()


def test_curl_per_bridge(fake):
    out = run(["bash", "bridges/curl_examples.sh"], fake)
    assert out.count("== POST") == 9 and '"error"' not in out


@pytest.mark.slow
def test_node_ws(live_server, tmp_path):
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not installed here")
    work = tmp_path / "node"
    shutil.copytree(EXAMPLES, work, ignore=shutil.ignore_patterns("*.java", "*.class"))
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=work, check=True, timeout=300)
    assert "Paris" in run(["node", "spark_ws.js"], live_server, cwd=work)


@pytest.mark.slow
def test_java_jdk_websocket(live_server, tmp_path):
    if not (shutil.which("javac") and shutil.which("java")):
        pytest.skip("a JDK is not installed here")
    shutil.copy(EXAMPLES / "SparkJdk.java", tmp_path)
    subprocess.run(["javac", "SparkJdk.java"], cwd=tmp_path, check=True, timeout=300)
    out = run(["java", "-cp", str(tmp_path), "SparkJdk"], live_server, cwd=tmp_path)
    assert '"status":2' in out.replace(" ", "") and "Paris" in out


@pytest.mark.slow
def test_java_websocket_library(live_server, tmp_path):
    jars = os.environ.get("JAVA_WEBSOCKET_CLASSPATH")  # Java-WebSocket.jar:slf4j-api.jar (Maven, not fetched here)
    if not (jars and shutil.which("javac")):
        pytest.skip("set JAVA_WEBSOCKET_CLASSPATH to the Java-WebSocket and slf4j-api jars to run it")
    shutil.copy(EXAMPLES / "SparkJavaWebSocket.java", tmp_path)
    subprocess.run(["javac", "-cp", jars, "SparkJavaWebSocket.java"], cwd=tmp_path, check=True, timeout=300)
    out = run(["java", "-cp", f"{tmp_path}:{jars}", "SparkJavaWebSocket"], live_server, cwd=tmp_path)
    assert '"status":2' in out.replace(" ", "")
