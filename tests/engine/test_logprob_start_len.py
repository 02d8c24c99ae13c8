"""SGLang's logprob_start_len on the real engine: the request its bridge lowers asks the engine for the
prompt's logprobs, and the input_token_logprobs / input_top_logprobs rendered from them equal a direct
computation (transformers' forward over the prompt) from that position on."""

from __future__ import annotations

import torch

from bridges.sglang import input_logprobs, lower
from tests.engine.helpers import run_all

TEXT = "The capital of France is Paris. The capital of Italy is"


def test_input_logprobs_from_logprob_start_len_equal_transformers(llm_engine, hf_model):
    ids = llm_engine.tokenizer.encode(TEXT, add_special_tokens=False)
    start = 4
    (req,), _, _ = lower({"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3,
                          "logprob_start_len": start, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                         "lsl")
    assert req.params.prompt_logprobs == 3
    outs = run_all(llm_engine, [req])[req.request_id]
    got = input_logprobs(outs[0].prompt_logprobs, ids, start)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)  # row p predicts token p + 1
    tokens, tops = got["input_token_logprobs"], got["input_top_logprobs"]
    assert [t[1] for t in tokens] == ids[start:]
    for k, pos in enumerate(range(start, len(ids))):
        assert abs(tokens[k][0] - ref[pos - 1, ids[pos]].item()) < 1e-3
        assert [t for _, t, _ in tops[k]] == ref[pos - 1].topk(3).indices.tolist()
