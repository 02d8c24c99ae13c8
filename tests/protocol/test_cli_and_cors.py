"""Settings a vLLM user brings (YAML config, --dtype half, --lora-modules, --seed, --max-logprobs,
--chat-template, --version), failing fast on a taken port, and the browser switches (CORS and the
WebSocket's Origin allow-list)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import httpx
import pytest
import websockets

from spark_server import settings as settings_mod
from spark_server.app import build_app
from spark_server.cli import main
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.fake_engine import FakeEngine


def test_yaml_config_and_vllm_names(tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("max-num-seqs: 7\nseed: 3\nmax_logprobs: 5\ndtype: half\nlora-modules:\n  - a=/x\n  - b=/y\n")
    s = settings_mod.resolve({"config": str(cfg)}, environ={})
    assert (s.max_num_seqs, s.seed, s.max_logprobs) == (7, 3, 5)
    engine = s.engine_config()
    assert engine.dtype == "float16" and engine.seed == 3 and engine.max_logprobs == 5
    assert s.lora_sources() == {"a": "/x", "b": "/y"} and s.lora_enabled
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqs: [1\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        settings_mod.resolve({"config": str(bad)}, environ={})


def test_lora_modules_flag_takes_several_and_json_forms():
    parser = settings_mod.argparse.ArgumentParser()
    settings_mod.add_arguments(parser)
    args = parser.parse_args(["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--lora-modules", "c=/z",
                              "--dtype", "float", "--chat-template", "t.jinja"])
    s = settings_mod.resolve(vars(args), environ={})
    assert s.lora_sources() == {"a": "/x", "b": "/y", "c": "/z"}
    assert s.engine_config().dtype == "float32" and s.engine_config().chat_template == "t.jinja"


def test_version():
    out = subprocess.run([sys.executable, "-m", "spark_server.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("spark-server ")


def test_the_command_line_parses_without_loading_torch():
    """--help and --version answer at once: parsing the flags imports neither torch nor transformers."""
    probe = ("import sys; from spark_server import cli; cli.build_parser().parse_args(['serve', '--port', '1']); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_engine_package_names_resolve():
    import engine

    assert sorted(engine.__all__) == sorted(engine._HOMES)
    for name in engine.__all__:
        assert getattr(engine, name) is not None  # each resolves, from its own module
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = engine.Nope


def test_a_taken_port_fails_before_the_model_loads(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "cannot load the model" not in err


@pytest.fixture(scope="module")
def cors_server():
    settings = Settings(port=free_port(), allowed_origins="https://app.example")
    with ServerThread(build_app(settings, FakeEngine()), settings.port):
        yield f"127.0.0.1:{settings.port}"


def test_cors_preflight_and_headers(cors_server):
    url = f"http://{cors_server}/v1/chat/completions"
    pre = httpx.options(url, headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}]}, headers={"Origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(url, headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default(fake):
    r = httpx.options(fake.url + "/v1/chat/completions", headers={"Origin": "https://app.example",
                                                                   "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_websocket_origin_allow_list(cors_server):
    async def opens(origin: str | None) -> bool:
        headers = {"Origin": origin} if origin else {}
        try:
            async with websockets.connect(f"ws://{cors_server}/turing/v3/gpt", additional_headers=headers):
                return True
        except websockets.InvalidStatus as exc:
            assert exc.response.status_code == 403
            return False

    assert asyncio.run(opens("https://app.example"))
    assert not asyncio.run(opens("https://evil.example"))
    assert asyncio.run(opens(None))  # not a browser: no Origin
