"""A leading section (SamplingParams.leading_section, a thinking to the bridges): its budget forces the
closing ids after that many output tokens, and a structured-output constraint starts only after them."""

from __future__ import annotations

from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import LeadingSection, SamplingParams
from engine.structured import Constraint
from tests.engine.helpers import run_all, text_of, tokens_of


def test_the_budget_forces_the_end_and_the_constraint_follows_it(llm_engine):
    tok = llm_engine.tokenizer
    end = tuple(tok.encode(" END", add_special_tokens=False))  # closing ids of any length
    prompt = TokensPrompt(tok.encode("Count: 1 2 3 4 5 6 7", add_special_tokens=False))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, leading_section=LeadingSection(end, 4),
                            constraint=Constraint.choice(["yes", "no"]))
    free = GenerationRequest("free", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    capped = GenerationRequest("capped", prompt, params)
    outs = run_all(llm_engine, [free, capped])
    ids = tokens_of(outs["capped"])
    assert ids[:4] == tokens_of(outs["free"])  # the section itself is free text, as without it
    assert tuple(ids[4:4 + len(end)]) == end  # then its end, forced
    assert text_of(outs["capped"]).split(" END", 1)[1] in ("yes", "no")  # and the grammar after it
    assert outs["capped"][-1].finish_reason == "stop"
