"""Structured output in the engine: the grammar library sees the tokenizer's true bytes, the mask kernel
equals the torch path, constrained and free rows share one batch without changing the free ones, and a
seeded constrained sample reproduces alone or in a busy batch."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch

from engine.kernels import load_cpu_kernels
from engine.request import ChatMessage, ChatPrompt, GenerationRequest
from engine.sampling_params import SamplingParams
from engine.structured import Constraint, MaskApplier, grammar_tokenizer
from tests.engine.helpers import chat, run_all, text_of, tokens_of

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["city", "rank"], "additionalProperties": False}
QUESTIONS = ["Name a city.", "What is 2+2?", "Say hello.", "Name a colour."]


def test_the_grammar_tokenizer_sees_each_tokens_true_bytes(llm_engine):
    """Every token that decodes to whole characters must have exactly those bytes in the grammar's view
    (the converted tokenizer's decoders once made byte tokens read as literal 'Ċ', letting a raw newline
    into JSON strings)."""
    tok = llm_engine.tokenizer
    view = grammar_tokenizer(tok, llm_engine.eos_token_ids)
    specials = set(tok.all_special_ids)
    wrong = []
    for tid in range(len(tok)):
        if tid in specials:
            continue
        text = tok.decode([tid], clean_up_tokenization_spaces=False)
        if "\ufffd" not in text and view.decode_bytes([tid]) != text.encode():
            wrong.append(tid)
    assert not wrong, wrong[:20]


def test_mask_kernel_equals_the_torch_path(llm_engine):
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    compiler = llm_engine.grammars()
    g = torch.Generator().manual_seed(0)
    vocab = compiler.tokenizer.vocab_size + 37  # logits wider than the tokenizer (padded embeddings)
    words = (compiler.tokenizer.vocab_size + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[1] = -1  # all allowed
    logits = torch.randn(5, vocab, generator=g)
    rows = [4, 0, 2]
    fast, slow = logits.clone(), logits.clone()
    MaskApplier(compiler, 1, kernels).apply(fast, rows, mask)
    MaskApplier(compiler, 1, None).apply(slow, rows, mask)
    assert torch.equal(fast, slow)
    assert torch.equal(fast[[1, 3]], logits[[1, 3]])  # rows not listed are untouched
    assert torch.isinf(fast[[4, 2], -37:]).all() and not torch.isinf(fast[0, :-37]).any()


def _constrained(rid: str, question: str, seed: int) -> GenerationRequest:
    return GenerationRequest(rid, ChatPrompt([ChatMessage("user", question)]),
                             SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                            constraint=Constraint("json", json.dumps(SCHEMA))))


PAIRS = 8  # constrained and free rows interleaved: every question twice, plain and with a trailing space


def test_constrained_and_free_rows_share_a_batch(llm_engine):
    free = [chat(f"f{i}", QUESTIONS[i % 4] + " " * (i // 4), max_tokens=16, temperature=0) for i in range(PAIRS)]
    alone = run_all(llm_engine, free)
    constrained = [_constrained(f"c{i}", QUESTIONS[i % 4], seed=i) for i in range(PAIRS)]
    free_again = [chat(f"g{i}", QUESTIONS[i % 4] + " " * (i // 4), max_tokens=16, temperature=0)
                  for i in range(PAIRS)]
    mixed = run_all(llm_engine, [x for pair in zip(constrained, free_again) for x in pair])
    for i in range(PAIRS):
        assert tokens_of(mixed[f"g{i}"]) == tokens_of(alone[f"f{i}"]), i
        text = text_of(mixed[f"c{i}"])
        jsonschema.validate(json.loads(text), SCHEMA)
        assert mixed[f"c{i}"][-1].finish_reason == "stop"


def test_a_seeded_constrained_sample_is_the_same_alone_and_in_a_busy_batch(llm_engine):
    alone = text_of(run_all(llm_engine, [_constrained("a", "Name a city.", seed=7)])["a"])
    busy = [_constrained("b", "Name a city.", seed=7)] + [_constrained(f"x{i}", QUESTIONS[i % 4], seed=100 + i)
                                                          for i in range(8)]
    assert text_of(run_all(llm_engine, busy)["b"]) == alone


def test_every_sample_of_n_follows_the_grammar(llm_engine):
    req = GenerationRequest("n", ChatPrompt([ChatMessage("user", "Pick one.")]),
                            SamplingParams(max_tokens=8, temperature=1.0, n=6, seed=1,
                                           constraint=Constraint.choice(["alpha", "beta", "gamma"])))
    outs = run_all(llm_engine, [req])["n"]
    texts = ["".join(o.text_delta for o in outs if o.index == i) for i in range(6)]
    assert all(t in ("alpha", "beta", "gamma") for t in texts), texts


def test_a_grammar_the_vocabulary_cannot_spell_ends_as_an_invalid_request(llm_engine):
    """SmolLM2's byte-level vocabulary has no token for byte 0xF1 (the lead byte of U+40000..U+7FFFF), so
    a regex naming such a character allows nothing after its first part: the request ends as invalid
    instead of sampling from an empty mask."""
    req = GenerationRequest("x", ChatPrompt([ChatMessage("user", "Say it.")]),
                            SamplingParams(max_tokens=8, temperature=0,
                                           constraint=Constraint("regex", "ab\U00050000")))
    outs = run_all(llm_engine, [req])["x"]
    assert outs[-1].finish_reason == "error" and outs[-1].error_kind == "invalid", outs[-1]
    assert "cannot produce" in outs[-1].error
    assert text_of(outs) == "ab"


def test_a_grammar_whose_masks_grow_too_costly_ends_alone(llm_engine):
    # An ambiguous grammar's mask costs more with every token ("a" forced by the allow-list); past the
    # step budget its answers end with an error naming the field and the flag, and a free answer beside
    # it goes on to its own end.
    costly = Constraint("grammar", 'start: s\ns: s s s s | s s s | s s | "a" | "b"\n', field="guided_grammar")
    outs = run_all(llm_engine, [
        chat("costly", "Say a.", max_tokens=300, n=2, allowed_token_ids=[81], constraint=costly, seed=1),
        chat("free", "Count to twenty.", max_tokens=40, ignore_eos=True, temperature=0)])
    ends = [o for o in outs["costly"] if o.finished]
    assert len(ends) == 2 and all(o.finish_reason == "error" for o in ends), ends
    assert "'guided_grammar' costs too much to match" in ends[0].error and "--max-constraint-step-ms" in ends[0].error
    assert all(o.num_output_tokens < 300 for o in ends)
    assert outs["free"][-1].finish_reason == "length" and outs["free"][-1].num_output_tokens == 40


def test_a_mask_waiting_for_a_core_is_not_charged_to_its_grammar(llm_engine, monkeypatch):
    """The step budget bounds a grammar's own cost: a mask fill whose thread is kept off the CPU (a busy
    machine; here a wall clock that jumps a second at every reading) does not end a cheap constrained answer."""
    import engine.structured as structured

    class BusyMachineClock:
        """``time`` as the mask fill sees it, with a wall clock that loses a second at every reading."""

        def __init__(self) -> None:
            self.wall = 0.0

        def perf_counter(self) -> float:
            self.wall += 1.0
            return self.wall

        def __getattr__(self, name):
            return getattr(time, name)

    monkeypatch.setattr(structured, "time", BusyMachineClock())
    out = run_all(llm_engine, [_constrained("c", "Name a city and a rank.", seed=3)])["c"]
    assert out[-1].finish_reason in ("stop", "length") and not out[-1].error, out[-1]
    json.loads(text_of(out))
