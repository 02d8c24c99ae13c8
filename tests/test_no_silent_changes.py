"""A setting or field the server cannot honour as given is refused with a message naming it, never
quietly changed: a context longer than the model's, vLLM's JSON form of --allowed-origins, two LoRA packs
in one Spark session."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from bridges.errors import SparkCode, SparkError
from spark_server import spark_protocol as sp
from spark_server.settings import Settings
from tests.conftest import free_port

PACK_A = {"url": "http://127.0.0.1:1/a.tar.gz", "md5": "0" * 32}
PACK_B = {"url": "http://127.0.0.1:1/b.tar.gz", "md5": "1" * 32}


def spark_body(**where) -> dict:
    body: dict[str, Any] = {"header": {"traceId": "t"}, "parameter": {"chat": {"max_tokens": 4}},
            "payload": {"message": {"text": [{"role": "user", "content": "Hi"}]}}}
    if "parameter" in where:
        body["parameter"]["lora"] = where["parameter"]
    if "payload" in where:
        body["payload"]["lora"] = where["payload"]
    return body


def test_two_different_packs_in_one_session_are_refused_naming_both_fields():
    with pytest.raises(SparkError) as err:
        sp.lower(sp.validate_body(spark_body(parameter=PACK_A, payload=PACK_B)), "sid")
    assert err.value.code == SparkCode.SCHEMA_ERROR
    assert "parameter.lora" in str(err.value) and "payload.lora" in str(err.value)


@pytest.mark.parametrize("where", [{"parameter": PACK_A}, {"payload": PACK_A},
                                   {"parameter": PACK_A, "payload": PACK_A}])
def test_one_pack_in_either_place_is_taken(where):
    request, _ = sp.lower(sp.validate_body(spark_body(**where)), "sid")
    assert request.lora is not None and request.lora.url == PACK_A["url"]


TWO = ["http://a.example", "http://b.example"]


@pytest.mark.parametrize("value,origins", [('["*"]', ["*"]), ('["http://a.example", "http://b.example"]', TWO),
                                           ("http://a.example,http://b.example", TWO), ("*", ["*"])])
def test_allowed_origins_take_vllms_json_list_and_the_comma_form(value, origins):
    assert Settings(allowed_origins=value).origins == origins


def test_a_malformed_json_origin_list_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--allowed-origins"):
        _ = Settings(allowed_origins='["*"').origins


def test_a_context_longer_than_the_models_is_refused_at_start():
    proc = subprocess.run([sys.executable, "-m", "spark_server", "serve", "--port", str(free_port()),
                           "--max-model-len", "32768", "--log-level", "warning"],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "SPARK_KV_CACHE_SPACE": "0.25"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--max-model-len 32768 is more than this model's context (8192 tokens)" in proc.stderr


def test_a_tokenizer_given_with_a_local_model_is_the_one_used(tmp_path):
    import json
    import shutil

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_loader import resolve_model_dir

    model_dir = resolve_model_dir(None)
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, tok_dir / name)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    engine = LLMEngine(EngineConfig(tokenizer=str(tok_dir), num_kv_blocks=8, kv_cache_prefault=False,
                                    max_loras=0))
    assert engine.tokenizer.chat_template == config["chat_template"]
