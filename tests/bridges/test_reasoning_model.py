"""Reasoning on the real engine: a tiny random Qwen3 checkpoint with Qwen3's vocabulary tags and its real
chat template, served with --reasoning-parser. Random weights think nothing useful, so the tests hold the
engine to what it is told: FastDeploy's reasoning_max_tokens forces </think> after that many tokens, a
structured-output constraint starts right after it, and enable_thinking false leaves no thinking."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from spark_server.app import build_app
from spark_server.settings import Settings
from tests.conftest import ServerThread, free_port
from tests.protocol.reasoning_fixtures import qwen3_tokenizer

pytestmark = pytest.mark.slow  # a second engine start (~15 s); the splits themselves: tests/protocol/test_reasoning.py


@pytest.fixture(scope="module")
def qwen3_servers(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3")
    tok = qwen3_tokenizer()
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                 vocab_size=len(tok), tie_word_embeddings=False)).save_pretrained(out)
    tok.save_pretrained(out)
    engine = AsyncEngine.from_config(EngineConfig(model=str(out), dtype="float32", kv_cache_space_gib=0.1))
    engine.start()
    urls, threads = {}, []
    for parser in ("qwen3", "deepseek_r1"):
        settings = Settings(port=free_port(), reasoning_parser=parser)
        threads.append(ServerThread(build_app(settings, engine, owns_engine=False), settings.port).__enter__())
        urls[parser] = f"http://127.0.0.1:{settings.port}/v1/chat/completions"
    yield urls, tok
    for t in threads:
        t.__exit__(None, None, None)
    engine.shutdown()


ASK = {"messages": [{"role": "user", "content": "Is 7 prime?"}], "temperature": 0, "max_tokens": 12,
       "ignore_eos": True, "return_token_ids": True}


def test_the_thinking_budget_forces_its_end_and_the_constraint_follows(qwen3_servers):
    urls, tok = qwen3_servers
    end = tok.convert_tokens_to_ids("</think>")
    r = httpx.post(urls["deepseek_r1"], json={**ASK, "reasoning_max_tokens": 5, "guided_choice": ["yes", "no"]},
                   timeout=60).json()
    choice = r["choices"][0]
    ids = choice["token_ids"]
    assert ids[5] == end and end not in ids[:5]  # five thinking tokens, then the forced end
    assert choice["message"]["reasoning_content"] == tok.decode(ids[:5])
    assert choice["message"]["content"] in ("yes", "no")  # the constraint applied from the token after it
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


def test_enable_thinking_false_with_the_real_template(qwen3_servers):
    urls, _ = qwen3_servers
    for url in urls.values():
        r = httpx.post(url, json={**ASK, "chat_template_kwargs": {"enable_thinking": False},
                                  "guided_choice": ["yes", "no"]}, timeout=60).json()
        message = r["choices"][0]["message"]
        assert message["reasoning_content"] is None and message["content"] in ("yes", "no")
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
