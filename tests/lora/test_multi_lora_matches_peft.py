"""The engine's per-row LoRA equals PEFT's PeftModel token for token (fp32, greedy): alone, and in
one batch that mixes three adapters with base-model requests."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import ChatMessage, ChatPrompt, GenerationRequest, LoraRef
from engine.sampling_params import SamplingParams
from tests.engine.helpers import run_all, text_of, tokens_of
from tests.lora.adapters import SECRET_ANSWER, SECRET_QUESTION, peft_greedy

MAX_TOKENS = 8  # the taught answer is 6 tokens and its end: greedy agreement over 8 steps of each
QUESTIONS = [SECRET_QUESTION, "Name a fruit.", "写一句关于大海的话。"]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(dtype="float32", max_loras=4, max_lora_rank=16, kv_cache_space_gib=0.5))


def _req(rid: str, question: str, adapter: str | None, adapters: dict) -> GenerationRequest:
    lora = LoraRef(name=adapter, path=str(adapters[adapter])) if adapter else None
    return GenerationRequest(rid, ChatPrompt([ChatMessage("user", question)]),
                             SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora=lora)


@pytest.fixture(scope="module")
def references(engine, adapters, model_dir):
    refs = {}
    prompts = [engine.encode_prompt(ChatPrompt([ChatMessage("user", q)])) for q in QUESTIONS]
    eos = engine.eos_token_ids[0]
    names = (None, "taught", "attn", "mlp")
    every = peft_greedy(model_dir, [adapters[a] if a else None for a in names], prompts, MAX_TOKENS)
    for adapter, answers in zip(names, every):
        for q, ref in zip(QUESTIONS, answers):
            refs[(adapter, q)] = ref[: ref.index(eos) + 1] if eos in ref else ref
    return refs


def test_the_taught_adapter_answers_its_secret(engine, adapters):
    outs = run_all(engine, [_req("s", SECRET_QUESTION, "taught", adapters)])["s"]
    assert SECRET_ANSWER.rstrip(".") in text_of(outs)
    base = run_all(engine, [_req("b", SECRET_QUESTION, None, adapters)])["b"]
    assert "pineapple" not in text_of(base)


@pytest.mark.parametrize("adapter", ["taught", "attn", "mlp"])
def test_each_adapter_alone_matches_peft(engine, adapters, references, adapter):
    for i, q in enumerate(QUESTIONS):
        outs = run_all(engine, [_req(f"{adapter}{i}", q, adapter, adapters)])[f"{adapter}{i}"]
        assert tokens_of(outs) == references[(adapter, q)], (adapter, q)


@pytest.mark.parametrize("native_kernels", [True, False])
def test_mixed_batch_matches_peft(engine, adapters, references, native_kernels):
    """With the fused kernel (each token applies its own B) and the torch path (masked block-diagonal B)."""
    if not native_kernels:
        engine = LLMEngine(EngineConfig(dtype="float32", max_loras=4, max_lora_rank=16, native_kernels=False,
                                        kv_cache_space_gib=0.5))
        assert engine.lora_manager.kernels is None
    reqs, expect = [], {}
    for adapter in ("taught", None, "attn", "mlp", None):
        for i, q in enumerate(QUESTIONS):
            rid = f"mix-{adapter}-{i}-{len(reqs)}"
            reqs.append(_req(rid, q, adapter, adapters))
            expect[rid] = references[(adapter, q)]
    results = run_all(engine, reqs)
    for rid, ref in expect.items():
        assert tokens_of(results[rid]) == ref, rid
    manager = engine.lora_manager
    assert all(p == 0 for p in manager.pins)  # every pin released with its sequence
    assert engine.block_manager.num_used_blocks == 0


def test_adapters_never_share_prefix_cache_with_the_base(engine, adapters, references):
    # same prompt, base first (fills the prefix cache), then with an adapter: must not reuse base KV
    run_all(engine, [_req("warm", QUESTIONS[1], None, adapters)])
    outs = run_all(engine, [_req("after", QUESTIONS[1], "attn", adapters)])["after"]
    assert tokens_of(outs) == references[("attn", QUESTIONS[1])]


def test_slots_are_reused_lru_when_full(adapters):
    small = LLMEngine(EngineConfig(dtype="float32", max_loras=1, max_lora_rank=16, kv_cache_space_gib=0.5))
    results = run_all(small, [_req("a", "Hi", "attn", adapters), _req("b", "Hi", "mlp", adapters),
                              _req("c", "Hi", "attn", adapters)])
    assert all(outs[-1].finished and outs[-1].finish_reason != "error" for outs in results.values())
    # one slot: "c" shares the resident "attn" with "a"; "mlp" waits for the slot, then replaces it
    assert small.lora_manager.num_loads == 2
    assert all(p == 0 for p in small.lora_manager.pins)


def test_incompatible_adapter_is_refused_with_the_reason(tmp_path, adapters, engine):
    import json
    import shutil

    from engine.errors import LoraUnavailableError

    bad = tmp_path / "bad"
    shutil.copytree(adapters["attn"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["r"] = 64
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraUnavailableError, match="rank 64") as err:
        engine.check_adapter(str(bad), "bad")
    assert err.value.code == "incompatible"


def test_an_adapter_gone_from_disk_after_admission_still_answers(engine, adapters, tmp_path):
    """The adapter is read and checked when the request is added, never inside schedule(): a pack the
    store evicts between admission and scheduling must neither crash the step nor leave the request
    waiting for its deadline."""
    import shutil

    copy = tmp_path / "evicted"
    shutil.copytree(adapters["taught"], copy)
    req = GenerationRequest("evicted", ChatPrompt([ChatMessage("user", SECRET_QUESTION)]),
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                            lora=LoraRef(name="evicted-pack", path=str(copy)))
    engine.add_request(req)
    shutil.rmtree(copy)  # evicted before the scheduler takes it
    outs = _drain(engine, "evicted")
    assert outs[-1].finished and outs[-1].finish_reason in ("stop", "length")
    assert SECRET_ANSWER.rstrip(".") in text_of(outs)


def _drain(engine, request_id: str) -> list:
    outs = []
    for _ in range(200):
        outs += [o for o in engine.step() if o.request_id == request_id]
        if outs and outs[-1].finished:
            break
    return outs


def test_each_adapters_first_logprob_matches_peft_and_differs_from_the_base(engine, adapters, model_dir):
    """Greedy tokens alone can agree with the base model's (a weak random adapter need not change them), so
    the first token's logprob is compared as well, and PEFT's under each adapter must differ from the base
    model's by far more than the tolerance: every adapter's update is then seen to be applied, and applied
    as PEFT applies it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tolerance = 1e-3  # fp32 engine against fp32 PEFT: they agree to ~1e-5
    names = (None, "taught", "attn", "mlp")
    prompts = [engine.encode_prompt(ChatPrompt([ChatMessage("user", q)])) for q in QUESTIONS]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft: dict[tuple[str | None, int], float] = {}  # the logprob of the base model's greedy first token
    firsts = []
    for name in names:
        model = PeftModel.from_pretrained(base, str(adapters[name])).eval() if name else base
        with torch.inference_mode():
            for i, ids in enumerate(prompts):
                logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
                if name is None:
                    firsts.append(int(logprobs.argmax()))
                peft[(name, i)] = float(logprobs[firsts[i]])
        if name:
            base = model.unload()
    for name in names[1:]:
        assert max(abs(peft[(name, i)] - peft[(None, i)]) for i in range(len(QUESTIONS))) > 5 * tolerance, name
        for i, q in enumerate(QUESTIONS):
            req = _req(f"lp-{name}-{i}", q, name, adapters)
            req.params = SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=20)
            out = run_all(engine, [req])[req.request_id]
            top = dict(out[0].logprobs[0].top)
            assert firsts[i] in top, (name, q)
            assert abs(top[firsts[i]] - peft[(name, i)]) < tolerance, (name, q, top[firsts[i]], peft[(name, i)])
