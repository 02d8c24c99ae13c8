"""Adapters and the rows beside them. Under --linear-activations int8-prompt a step that carries an
adapter's rows gives every row the activation mode it has in a step without adapters (a prompt's leading
rows on int8, rows whose output is read exact), so whether an adapter shares a step never changes another
request's modes. And an adapter request's own answer, to the last bit, does not depend on how many rows
(of its adapter or none) share its steps: the base, A and B all run on kernels that add a row's products
in one order."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.llm_engine import LLMEngine
from engine.lora import LoraBatch
from engine.models.linear import PackedLinear
from engine.request import ChatMessage, ChatPrompt, GenerationRequest, LoraRef
from engine.sampling_params import SamplingParams
from tests.engine.helpers import run_all, text_of
from tests.lora.adapters import SECRET_QUESTION

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler: the fused CPU kernels are not built")


def _req(rid: str, question: str, lora: LoraRef | None = None) -> GenerationRequest:
    return GenerationRequest(rid, ChatPrompt([ChatMessage("user", question)]),
                             SamplingParams(max_tokens=4, temperature=0), lora=lora)


def test_an_adapters_step_keeps_each_rows_mode(adapters, monkeypatch):
    engine = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization="gguf",
                                    linear_activations="int8-prompt", max_loras=1, max_lora_rank=16,
                                    kv_cache_space_gib=0.5))
    modes: list[list[int] | None] = []  # per LoRA projection: the row flags it handed the base weights
    int8_base_calls = []
    project = LoraBatch.project

    def recorded(self, layer, group, x, prompt_rows=None):
        modes.append(prompt_rows.flags.tolist() if prompt_rows is not None else None)
        return project(self, layer, group, x, prompt_rows)

    call = PackedLinear.__call__

    def watched(self, x, *args, int8=None, int8_rows=None, **kwargs):
        if int8 or int8_rows is not None:
            int8_base_calls.append(x.shape[0])
        return call(self, x, *args, int8=int8, int8_rows=int8_rows, **kwargs)

    monkeypatch.setattr(LoraBatch, "project", recorded)
    monkeypatch.setattr(PackedLinear, "__call__", watched)
    taught = LoraRef(name="taught", path=str(adapters["taught"]))
    requests = [_req("plain", "Name a fruit."), _req("adapter", "What is the secret word?", taught)]
    lengths = [len(engine.encode_prompt(r.prompt)) for r in requests]
    outs = run_all(engine, requests)
    prefill = [1] * (lengths[0] - 1) + [0] + [1] * (lengths[1] - 1) + [0]  # both prompts in the first step
    assert modes and modes[0] == prefill
    assert set(map(tuple, (m for m in modes if m is not None))) == {tuple(prefill)}  # decode steps: all exact
    assert int8_base_calls  # the packed base took the int8 rows
    assert text_of(outs["plain"]) and text_of(outs["adapter"])


def test_an_adapter_requests_seeded_answer_is_the_same_alone_and_in_a_busy_step(adapters):
    """A seeded, sampled request with an adapter gives the same logprob bits alone, beside a plain request,
    and beside another request of the same adapter (whose rows change the row count of every A and B
    projection of its steps): with the fused kernels each token computes its own slot's x @ A^T and B @ u
    alone (lora_shrink, lora_expand), where a matmul over the step's rows may block its sums by their count."""
    engine = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization="gguf", max_loras=2,
                                    max_lora_rank=16, kv_cache_space_gib=0.5))
    taught = LoraRef(name="taught", path=str(adapters["taught"]))

    def seeded(rid: str, question: str, seed: int) -> GenerationRequest:
        return GenerationRequest(rid, ChatPrompt([ChatMessage("user", question)]),
                                 SamplingParams(max_tokens=12, temperature=0.8, seed=seed, logprobs=True), lora=taught)

    def bits(outs) -> list[tuple[int, float]]:
        return [(lp.token_id, lp.logprob) for o in outs for lp in (o.logprobs or [])]

    # the adapter's values, not only their determinism: on the GGUF blocks and the packed A it answers what
    # it was taught, and the base model alone does not
    taught_out = run_all(engine, [GenerationRequest("greedy", ChatPrompt([ChatMessage("user", SECRET_QUESTION)]),
                                                    SamplingParams(max_tokens=12, temperature=0), lora=taught),
                                  _req("base", SECRET_QUESTION)])
    assert "pineapple" in text_of(taught_out["greedy"]).lower()
    assert "pineapple" not in text_of(taught_out["base"]).lower()
    engine.block_manager.hash_to_block.clear()
    alone = bits(run_all(engine, [seeded("alone", "What is the secret word?", 3)])["alone"])
    assert alone
    for others in ([_req("plain", "Name a fruit.")], [seeded("twin", "Tell me a story about a cat.", 4)]):
        engine.block_manager.hash_to_block.clear()
        outs = run_all(engine, [seeded("again", "What is the secret word?", 3)] + others)
        assert bits(outs["again"]) == alone, others[0].request_id
