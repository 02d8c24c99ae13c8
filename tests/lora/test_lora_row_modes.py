"""Adapters beside --linear-activations int8-prompt: a step that carries an adapter's rows gives every
row the activation mode it has in a step without adapters (a prompt's leading rows on int8, rows whose
output is read exact), so whether an adapter shares a step never changes another request's modes.

The modes, not the bits, are what is checked: an exact row's last bits can follow its place in the step
on the 4-bit kernels (a pass of one to three rows splits each row's sums over more chains than a pass of
four or more), with adapters in the step or not."""

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
