from __future__ import annotations

from engine.llm_engine import LLMEngine
from engine.request import ChatMessage, ChatPrompt, GenerationRequest, RequestOutput
from engine.sampling_params import SamplingParams


def chat(request_id: str, text: str, **params) -> GenerationRequest:
    return GenerationRequest(request_id, ChatPrompt([ChatMessage("user", text)]), SamplingParams(**params))


def run_all(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, list[RequestOutput]]:
    """Add every request, step until all finish; the outputs of each request in order."""
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert not engine.has_unfinished()
    return outputs


def by_index(outs: list[RequestOutput], index: int) -> list[RequestOutput]:
    return [o for o in outs if o.index == index]


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.text_delta for o in outs)
