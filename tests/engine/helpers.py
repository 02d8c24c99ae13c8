from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from engine.cpu_contention import CpuContention
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


@contextmanager
def kernels_for_every_batch() -> Iterator[None]:
    """Engines built inside keep their linears on the packed kernels at every batch size: the
    start-up probe that, on a CPU with AMX tiles, hands large batches to a two-term oneDNN matmul sees no
    matrix unit, and bf16 weights keep the kernels at every batch (their probe holds to the largest size)
    instead of the limit their timing against oneDNN gives on a CPU where oneDNN is clearly faster. For
    tests of the kernels themselves, which must run the same code on every machine."""
    from engine.models import weights

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weights, "_has_matrix_unit", lambda: False)
        patch.setattr(weights, "_kernel_row_limit", lambda lin, fallback=None, probes=weights._ROW_PROBES, *args,
                      **kwargs: probes[-1])
        yield


class QuietMachine(CpuContention):
    """Stands in for engine.cpu_contention.CpuContention where a test needs start-up's kernel measurements
    kept (a warm start after them): under `make test` the other worker is busy, and a real reading would
    rightly keep nothing. ``share`` sets what it reads (the threads' waiting: a tenth of a second)."""

    def __init__(self, share: float = 0.0) -> None:
        super().__init__()
        self._reads = share

    def __enter__(self) -> QuietMachine:
        return self

    def read(self) -> QuietMachine:
        self.share, self.seconds, self.waited_s = self._reads, 0.1, self._reads * 0.1
        return self
