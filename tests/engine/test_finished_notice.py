"""Every sample of a request reaches the finished-listeners (metrics, the request's log line) exactly once:
at its final output, or, when the caller stops reading mid-answer, with the last output it saw."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from engine.protocol import FinishedNotice
from engine.request import GenerationRequest, RequestOutput, TokensPrompt
from engine.sampling_params import SamplingParams


def _out(index: int, tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", index, [7], "x", num_prompt_tokens=3, num_output_tokens=tokens, finished=finished,
                         finish_reason="length" if finished else None)


def test_each_sample_is_reported_once_final_or_abandoned():
    seen: list[RequestOutput] = []
    notice = FinishedNotice([seen.append])
    notice.saw(_out(0, 1))
    notice.saw(_out(1, 1))
    notice.saw(_out(0, 2, finished=True))
    notice.saw(_out(1, 4))
    notice.abandoned()
    notice.abandoned()  # once only
    assert [(o.index, o.num_output_tokens, o.finish_reason) for o in seen] == [(0, 2, "length"), (1, 4, "abort")]
    assert seen[1].new_token_ids == [] and seen[1].text_delta == ""  # nothing delivered twice


def test_an_answer_the_caller_leaves_reaches_the_listeners_with_its_tokens(async_engine):
    seen: list[RequestOutput] = []
    async_engine.finished_listeners.append(seen.append)

    async def leave_after_five_tokens() -> None:
        request = GenerationRequest("leaver", TokensPrompt([1, 5, 900, 300]),
                                    SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async with aclosing(async_engine.generate(request)) as stream:
            async for out in stream:
                if out.num_output_tokens >= 5:
                    break

    try:
        asyncio.run(leave_after_five_tokens())
    finally:
        async_engine.finished_listeners.remove(seen.append)
    mine = [o for o in seen if o.request_id == "leaver"]
    assert len(mine) == 1, mine
    assert mine[0].finish_reason == "abort" and 5 <= mine[0].num_output_tokens < 200
    assert mine[0].num_prompt_tokens == 4 and mine[0].timings.first_token_s is not None
