"""Calibration inputs for error-compensating quantization: what each linear layer sees.

The samples are the model's own writing: sequences sampled (temperature 1, seeded) from one-token
starts in several languages and in code, and answers to a few chat requests. Nothing is shipped or
downloaded, any model works, and the inputs follow what that model produces, not one text's domain.
The engine's own kernels sample the text, from the checkpoint's weights in bf16 (3-4x faster than
transformers' fp32 forward; the text only has to be the model's kind of text), which paid for twice
as much of it as before at the same first-start time.
The statistic kept per linear is H = E[x x^T] over every real token's input row, in fp32, computed on
the checkpoint's own weights. Answering through the chat template matters: calibrated on plain text
alone, the embedded model lost "The capital of France is Paris." to an unrelated French phrase.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# Half the samples continue the first token of these strings (prose, Chinese, numbers, markup, code);
# the other half answer these requests through the model's chat template, so the statistics also cover
# the template's tokens and the assistant's turn, which is what a chat server's model reads most.
SEED_TEXTS = ("The", "In", "我们", "def", "Once", "今天", "1.", "#", "Question", "中国", "import",
              "Hello", "A", "在", "<", "Dear")
SEED_REQUESTS = ("Write a short story about a lighthouse keeper.", "请解释一下光合作用的过程。",
                 "Write a Python function that merges two sorted lists.", "What are the health benefits of walking?",
                 "用三句话介绍一下长城。", "How does an airplane stay in the air?", "Give me a recipe for pancakes.",
                 "Summarize the causes of the First World War.", "写一首关于秋天的短诗。",
                 "Explain recursion to a child.", "List five tips for a job interview.", "为什么天空是蓝色的？",
                 "Translate 'good morning' into Spanish.", "What is 17 times 23? Show your steps.",
                 "Describe the water cycle.", "推荐三本适合初学者的编程书。")
# 8,192 sampled tokens (the prompts come on top). Held-out perplexity moved by up to 1.5% between draws of
# 32 x 128 (English: +0.1%, +1.0%, +1.4% over bf16 in three draws); two draws of 64 x 128 gave +0.5% and +0.6%.
DEFAULT_SEQUENCES = 64
DEFAULT_LENGTH = 128
PROGRESS_EVERY_S = 10.0  # at most one progress line this often


def _chat_start(tokenizer, request: str) -> list[int] | None:
    """A user turn asking ``request`` and the assistant's opening, by the model's chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # a template that refuses a lone user turn: plain starts serve
        logger.warning("int8 calibration: the chat template failed (%s); plain-text samples only", exc)
        return None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _starts(tokenizer, sequences: int) -> list[list[int]]:
    starts = []
    for i in range(sequences):
        chat = _chat_start(tokenizer, SEED_REQUESTS[(i // 2) % len(SEED_REQUESTS)]) if i % 2 else None
        text = SEED_TEXTS[(i // 2) % len(SEED_TEXTS)]
        starts.append(chat or tokenizer(text, add_special_tokens=False)["input_ids"][:1] or [0])
    return starts


# (start token ids per sequence, tokens to sample after each, seed) -> each sequence's sampled tokens
Sampler = Callable[[list[list[int]], int, int], list[list[int]]]


def sample_tokens(sample: Sampler, tokenizer, sequences: int = DEFAULT_SEQUENCES, length: int = DEFAULT_LENGTH,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [sequences, prompt + length]: each start and the ``length`` tokens ``sample`` drew after it,
    prompts left-padded, and the mask of real (not padding) tokens."""
    starts = _starts(tokenizer, sequences)
    continued = sample(starts, length, seed)
    width = max(len(s) for s in starts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(s)) + s + c for s, c in zip(starts, continued)])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * (len(s) + length) for s in starts])
    return ids, mask


def sample_on_engine(engine, starts: list[list[int]], length: int, seed: int) -> list[list[int]]:
    """``length`` tokens after each start, sampled at temperature 1 from the whole vocabulary by an
    engine core (``LLMEngine``), every sequence in one batch and seeded by its index."""
    ids = [f"calibration-{i}" for i in range(len(starts))]
    for i, (request_id, start) in enumerate(zip(ids, starts)):
        engine.add_request(GenerationRequest(request_id, TokensPrompt(start), SamplingParams(
            max_tokens=length, temperature=1.0, seed=seed + i, ignore_eos=True)))
    sampled: dict[str, list[int]] = {request_id: [] for request_id in ids}
    reported, shown = time.monotonic(), 0
    while engine.has_unfinished():
        for out in engine.step():
            sampled[out.request_id].extend(out.new_token_ids)
        done = min(len(tokens) for tokens in sampled.values())
        if shown < done < length and time.monotonic() - reported >= PROGRESS_EVERY_S:  # a first start's
            reported, shown = time.monotonic(), done  # longest quiet stretch
            logger.info("int8 calibration: %d of %d tokens sampled", done, length)
    return [sampled[request_id] for request_id in ids]


def input_second_moments(model: PreTrainedModel, tokens: torch.Tensor,
                         mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per ``nn.Linear`` of ``model``, keyed by its weight's name: the mean of x x^T over its inputs at the
    real tokens (``mask``, 1 = real, left padding 0) while ``model`` reads ``tokens`` [sequences, length].
    The head's input is the decoder's last hidden state: the logits themselves are never computed (at the
    calibration's size they would be gigabytes of fp32 and seconds of CPU)."""
    mask = torch.ones_like(tokens) if mask is None else mask
    keep = mask.reshape(-1).bool()
    sums: dict[str, torch.Tensor] = {}
    last: list = [None, None]  # the input last measured and its x^T x: q/k/v and gate/up read one tensor

    def add(name: str, inputs: torch.Tensor) -> None:
        if inputs is not last[0]:
            x = inputs.detach().float().reshape(-1, inputs.shape[-1])[keep]
            last[:] = [inputs, x.T @ x]
        sums[name] = sums[name] + last[1] if name in sums else last[1].clone()

    names = {module: name for name, module in model.named_modules()}
    head = model.get_output_embeddings()
    decoder = model.get_decoder()

    def record(name: str):
        return lambda module, inputs, output: add(name, inputs[0])

    handles = [module.register_forward_hook(record(f"{names[module]}.weight"))
               for module in decoder.modules() if isinstance(module, torch.nn.Linear)]
    try:
        with torch.inference_mode():
            hidden = decoder(input_ids=tokens, attention_mask=mask,
                             position_ids=(mask.cumsum(1) - 1).clamp_(min=0)).last_hidden_state
            if isinstance(head, torch.nn.Linear):
                add(f"{names[head]}.weight", hidden)
    finally:
        last[:] = [None, None]
        for handle in handles:
            handle.remove()
    count = int(keep.sum())
    return {name: total / count for name, total in sums.items()}


def calibrate(model: PreTrainedModel, tokenizer, sample: Sampler, sequences: int | None = None,
              length: int | None = None) -> dict[str, torch.Tensor]:
    """Sample calibration text with ``sample``, then measure every linear's input statistics on it with
    ``model`` (the checkpoint's own weights)."""
    sequences = sequences or DEFAULT_SEQUENCES
    length = length or DEFAULT_LENGTH
    started = time.monotonic()
    logger.info("int8 calibration: sampling %d x %d tokens from the model (once; the result is cached)",
                sequences, length)
    tokens, mask = sample_tokens(sample, tokenizer, sequences, length)
    sampled = time.monotonic()
    moments = input_second_moments(model, tokens, mask)
    logger.info("int8 calibration: %d linears measured in %.1fs (sampling %.1fs)", len(moments),
                time.monotonic() - started, sampled - started)
    return moments
