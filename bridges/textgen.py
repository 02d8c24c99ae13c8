"""The `parameters` vocabulary TGI, Triton and MindIE share, lowered once onto a GenerationRequest
(``lower``, pure), and the finish reasons they share. Each of the three protocols renders its own answer
from the ``TextGenRequest``."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from bridges.common import BridgeError, int_list
from bridges.constraints import tgi_grammar
from bridges.log_safety import protect
from bridges.sampling_table import sampling_kwargs
from engine.request import GenerationRequest, LoraRef, TextPrompt, TokensPrompt
from engine.sampling_params import SamplingParams

logger = protect(logging.getLogger(__name__))

DEFAULT_PRIORITY = 5
# Accepted because the spec lists them, with no effect ("当前后处理不支持"): reported in a header when
# set to anything but their default.
NO_EFFECT: dict[str, object] = {"typical_p": 1.0, "watermark": False, "batch_size": 1}
# what asks for logprobs in `parameters` (an answer-volume refusal names it): no prompt logprobs here
LOGPROB_FIELDS = ("parameters.decoder_input_details", "parameters.top_n_tokens", "parameters.details")


def _is_default(value: object, default: object) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):  # True == 1 in Python: compare bools by identity
        return value is default
    return value == default


@dataclass(frozen=True, slots=True)
class TextGenRequest:
    request: GenerationRequest
    seed: int
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    perf_stat: bool
    top_n_tokens: int
    no_effect: tuple[str, ...]  # fields accepted with no effect (answered in X-Ignored-Parameters)
    best_of: int = 1  # TGI: sequences sampled, the one of the highest logprob sum answered (best_of_sequences)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Ignored-Parameters": ",".join(self.no_effect)} if self.no_effect else {}


def finish_reason(reason: str | None, stop_reason: str | int | None) -> str:
    """Engine finish reasons in the TGI / MindIE vocabulary."""
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop_sequence" if isinstance(stop_reason, str) else "eos_token"
    return reason or "length"


def lower(rid: str, inputs: str | list[int], parameters: dict[str, Any] | None,
          adapter_field: str = "adapter_id", max_best_of: int = 1, invalid_status: int = 400) -> TextGenRequest:
    """``max_best_of``: the most ``best_of`` the protocol answers (TGI's 2; 1 where an answer is one
    sequence); ``invalid_status``: the protocol's status for a refused field."""
    p = dict(parameters or {})
    sampling = p.get("do_sample")
    if sampling is None:  # TGI's rule: any sampling knob turns sampling on
        sampling = any(p.get(k) is not None for k in ("temperature", "top_k", "top_p"))
    best_of = int(p.get("best_of") or 1)
    _check_best_of(best_of, max_best_of, bool(sampling), p.get("seed"), invalid_status)
    seed = int(p["seed"]) if p.get("seed") is not None else random.randrange(1, 1 << 63)  # reported in details
    top_n = p.get("top_n_tokens") or 0
    kw = sampling_kwargs("textgen", p)
    if not sampling:  # greedy, whatever sampling knobs say
        kw.update(temperature=0.0, top_k=0, top_p=1.0)
    kw["seed"] = seed
    if best_of > 1:
        kw["n"] = best_of
    # best_of ranks its sequences by their logprobs
    logprobs = bool(p.get("details") or p.get("decoder_input_details") or top_n or best_of > 1)
    params = SamplingParams(**kw, logprobs=logprobs, top_logprobs=top_n, constraint=tgi_grammar(p.get("grammar")))
    adapter = p.get(adapter_field)
    lora = LoraRef(name=adapter) if adapter not in (None, "", "None") else None
    prompt = TextPrompt(inputs) if isinstance(inputs, str) else TokensPrompt(int_list(inputs))
    # no `timeout`: the server's --request-timeout (600 s by default, the spec's default) applies
    deadline = time.monotonic() + p["timeout"] if p.get("timeout") else None
    request = GenerationRequest(rid, prompt, params, lora=lora, priority=int(p.get("priority") or DEFAULT_PRIORITY),
                                deadline=deadline)
    no_effect = tuple(k for k, default in NO_EFFECT.items() if p.get(k) is not None and not _is_default(p[k], default))
    if no_effect:
        logger.info("request %s: %s accepted with no effect (not supported)", rid, ", ".join(no_effect))
    return TextGenRequest(request=request, seed=seed, details=bool(p.get("details")),
                          decoder_input_details=bool(p.get("decoder_input_details")),
                          return_full_text=bool(p.get("return_full_text")), perf_stat=bool(p.get("perf_stat")),
                          top_n_tokens=top_n, no_effect=no_effect, best_of=best_of)


def _check_best_of(best_of: int, max_best_of: int, sampling: bool, seed: Any, status: int) -> None:
    """TGI's rules for best_of, in its words."""
    if best_of > max_best_of:
        why = (f"must be > 0 and <= {max_best_of}. Given: {best_of}" if max_best_of > 1 else
               "must be 1: this protocol answers one sequence (best_of is TGI's, on POST /generate)")
        raise BridgeError(status, f"`best_of` {why}", param="best_of")
    if best_of > 1 and not sampling:
        raise BridgeError(status, "you must use sampling when `best_of` is > 1", param="best_of")
    if best_of > 1 and seed is not None:
        raise BridgeError(status, "`seed` must not be set when `best_of` > 1", param="seed")
