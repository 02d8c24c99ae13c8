"""In bf16 (the CPU default where it is fast) our forward is as accurate as transformers' own bf16.

Exact equality is not expected in bf16 (kernels round differently, and greedy decoding amplifies
one flipped near-tie into a different continuation), but systematic drift is a bug: a norm computed
with other rounding than LlamaRMSNorm once turned 'Paris' into nonsense. So both bf16 forwards are
scored against the fp32 model, teacher-forced over the same sequences, and ours must be no worse.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.helpers import chat, run_all, text_of, tokens_of
from tests.engine.test_greedy_matches_transformers import PROMPTS

CONTINUATION = 32
EXTRA_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                 "Explain gravity to a child."]


@pytest.fixture(scope="module")
def bf16_engine():
    # the bf16 weights themselves
    return LLMEngine(EngineConfig(dtype="bfloat16", quantization="none", kv_cache_space_gib=0.5))


def engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, prefilled in a single step (on the CPU, whatever the
    engine's device)."""
    T = len(ids)
    positions = torch.arange(T, device=engine.device)
    meta = AttentionMetadata(slot_mapping=positions, num_decodes=0, decode_gather=None, decode_mask=None,
                             decode_max_len=0, prefills=[PrefillSpan(0, T, T, None, None)])
    ids_on_device = torch.tensor(ids, device=engine.device)
    return engine.model.forward(ids_on_device, positions, meta, engine.runner.cache, positions).cpu()


def score(logits: torch.Tensor, reference: torch.Tensor) -> tuple[int, float]:
    """(positions whose top token is the reference's, summed KL(reference || logits))."""
    ref = reference.log_softmax(-1)
    kl = (ref.exp() * (ref - logits.float().log_softmax(-1))).sum(-1)
    return int((logits.argmax(-1) == reference.argmax(-1)).sum()), float(kl.sum())


def test_bf16_forward_is_as_accurate_as_transformers_bf16(bf16_engine, llm_engine, hf_model):
    import copy

    hf32 = hf_model  # transformers' own conversion of the GGUF file, fp32 (shared with the greedy tests)
    hf16 = copy.deepcopy(hf_model).to(torch.bfloat16).eval()  # the same weights rounded, as from_pretrained does
    ours = [0, 0.0]
    theirs = [0, 0.0]
    positions = 0
    prompts = PROMPTS[:6] + EXTRA_PROMPTS[1:3]  # English and Chinese, ~550 scored positions
    # The scored sequences: greedy fp32 continuations, from our fp32 engine in one batch (it matches
    # transformers' fp32 greedy decoding, test_greedy_matches_transformers; one sequential
    # `generate` per prompt cost ~20 s). Every position is then scored teacher-forced.
    continued = run_all(llm_engine, [chat(f"c{i}", p, max_tokens=CONTINUATION, temperature=0)
                                     for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        ids = bf16_engine.encode_prompt(chat("x", p).prompt)
        with torch.inference_mode():
            seq = torch.tensor(ids + tokens_of(continued[f"c{i}"]))
            reference = hf32(seq[None]).logits[0].float()
            for acc, logits in ((ours, engine_logits(bf16_engine, seq.tolist())), (theirs, hf16(seq[None]).logits[0])):
                top1, kl = score(logits, reference)
                acc[0] += top1
                acc[1] += kl
        positions += len(seq)
    ours_top1, theirs_top1 = ours[0] / positions, theirs[0] / positions
    ours_kl, theirs_kl = ours[1] / positions, theirs[1] / positions
    assert ours_top1 >= theirs_top1 - 0.01, \
        f"top-1 agreement with fp32: ours {ours_top1:.4f}, hf bf16 {theirs_top1:.4f}"
    assert ours_kl <= 1.25 * theirs_kl, f"mean KL from fp32: ours {ours_kl:.5f}, hf bf16 {theirs_kl:.5f}"


def test_bf16_answers_a_factual_question(bf16_engine):
    out = run_all(bf16_engine, [chat("f", "What is the capital of France?", max_tokens=12, temperature=0)])["f"]
    assert "Paris" in text_of(out)


def test_a_seeded_answer_is_the_same_alone_and_beside_a_long_prompt(bf16_engine):
    """bf16 weights stay on the packed kernels at every batch where oneDNN is not clearly faster (every CPU
    without AMX tiles): a seeded sampled answer is the same, to the last bit of each logprob, alone and in
    steps that also prefill a ~400-token prompt. Before, steps of more than the probed row limit (256 here)
    went to oneDNN, which rounds otherwise, so the answer followed the size of the steps it shared."""
    from engine.models.linear import PackedLinear

    model = bf16_engine.model
    limits = {lin.max_kernel_rows for lw in model.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)
              if isinstance(lin, PackedLinear)}
    if not limits:
        pytest.skip("bf16 weights are not on the packed kernels here")
    if limits != {None}:
        pytest.skip(f"oneDNN measured clearly faster above {limits} rows on this CPU: larger steps round otherwise")

    def seeded(rid: str):
        return chat(rid, "Write a short poem about the sea.", max_tokens=16, temperature=0.7, seed=7, logprobs=True)

    long_prompt = " ".join(["The river runs past the old mill and the bridge, under the willows."] * 28)
    bf16_engine.block_manager.hash_to_block.clear()
    alone = run_all(bf16_engine, [seeded("alone")])["alone"]
    bf16_engine.block_manager.hash_to_block.clear()
    beside = run_all(bf16_engine, [seeded("beside"), chat("long", long_prompt, max_tokens=4, temperature=0.7, seed=1)])
    assert len(bf16_engine.tokenizer.encode(long_prompt)) > 300
    bits = [[(lp.token_id, lp.logprob) for o in outs for lp in (o.logprobs or [])]
            for outs in (alone, beside["beside"])]
    assert bits[0] and bits[0] == bits[1]
