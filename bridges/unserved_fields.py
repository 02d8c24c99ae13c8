"""Fields the vLLM, FastDeploy and SGLang documents name for features this server does not have: custom
logits processors, multimodal inputs, hidden states, draft-token logprobs, other grammar libraries.

Each is accepted at its no-op value (what clients send by default). A value this server cannot honour is
refused with a 400 naming the field. A value that changes nothing here, because what it tunes is served
another way or not run at all, is accepted and named in ``X-Ignored-Parameters`` and the log, as the TGI
and Ollama bridges report theirs:

- ``guided_decoding_backend`` xgrammar / outlines / lm-format-enforcer: the constraint is served, by
  llguidance (bridges/constraints.py);
- ``logits_processors_args`` (FastDeploy): arguments for the server's logits processors; this server runs
  none, as a FastDeploy server started without ``--logits-processors`` runs none;
- ``include_draft_logprobs`` (FastDeploy): logprobs of a draft model's proposals; the answer's own
  logprobs are returned as asked, draft ones are not reported;
- SGLang ``sampling_params.custom_params``: parameters for a custom logit processor, of which there is
  none (``custom_logit_processor`` itself is refused: this server runs no client code).
"""

from __future__ import annotations

import logging
from typing import Any

from bridges.common import BridgeError
from bridges.constraints import SUBSTITUTED_BACKENDS

logger = logging.getLogger("bridges")


def _given(value: Any) -> bool:
    """A value other than the field's no-op ones (absent, null, false, empty)."""
    return value is not None and value is not False and value != [] and value != {} and value != ""


def _processor_name(entry: Any) -> str:
    """vLLM names a processor by its qualified name, or as {"qualname", "args", "kwargs"}."""
    if isinstance(entry, dict):
        return str(entry.get("qualname", entry))
    return str(entry)


def openai(body: dict[str, Any]) -> list[str]:
    """The OpenAI bodies' (vLLM and FastDeploy extras): refuses what cannot be honoured; returns the fields
    accepted with no effect."""
    processors = body.get("logits_processors")
    if processors is not None and _given(processors):
        raise BridgeError(400, f"logits_processors: {_processor_name(processors[0])!r} is not available; this "
                               "server runs no custom logits processors (send null or [])", param="logits_processors")
    for name in ("mm_processor_kwargs", "mm_hashes"):
        if _given(body.get(name)):
            raise BridgeError(400, f"{name}: this server takes text and token ids only; there is no multimodal input "
                                   "for it to apply to (send null or an empty value)", param=name)
    ignored = [name for name in ("logits_processors_args", "include_draft_logprobs") if _given(body.get(name))]
    if body.get("guided_decoding_backend") in SUBSTITUTED_BACKENDS:
        ignored.append("guided_decoding_backend")
    return ignored


def sglang(body: dict[str, Any], sampling_params: list[dict[str, Any]]) -> list[str]:
    """SGLang /generate's: refuses what cannot be honoured; returns the fields accepted with no effect."""
    if _given(body.get("return_hidden_states")):
        raise BridgeError(400, "return_hidden_states: this server does not return the model's hidden states "
                               "(send false)", param="return_hidden_states")
    processor = body.get("custom_logit_processor")
    if any(_given(p) for p in (processor if isinstance(processor, list) else [processor])):
        raise BridgeError(400, "custom_logit_processor: this server runs no client code as logit processors "
                               "(send null)", param="custom_logit_processor")
    if any(_given(sp.get("custom_params")) for sp in sampling_params):
        return ["sampling_params.custom_params"]
    return []


def report(ignored: list[str], rid: str) -> dict[str, str]:
    """The response headers naming the fields accepted with no effect (and one log line)."""
    if not ignored:
        return {}
    logger.info("request %s: %s accepted with no effect here", rid, ", ".join(ignored))
    return {"X-Ignored-Parameters": ",".join(ignored)}
