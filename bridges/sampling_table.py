"""The one table of sampling parameters: each engine knob (a ``SamplingParams`` field), the field that
carries it in each protocol, and that protocol's default where it differs from the engine's. Every
bridge lowers its sampling fields through ``sampling_kwargs``, which reads a field only when it is
not None, so each default lives here and nowhere else (tests/protocol/test_sampling_table.py checks
the schemas against it).

Protocols, and the object their sampling fields live in:
    openai   the body (chat and completions, vLLM and FastDeploy extras included)
    vllm     the body of vLLM's native /generate
    sglang   ``sampling_params``
    textgen  ``parameters`` (TGI, Triton and MindIE share it)
    ollama   ``options``
    spark    ``parameter.chat``
    anthropic  the body of /v1/messages

A default may belong to one endpoint of a protocol (``"openai/completions"`` before ``"openai"``), and
may be ``CONTEXT``: the served model's whole context (``max_model_len``), given to ``sampling_kwargs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def _stops(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else [s for s in value if s]


def _ids(values: list[Any]) -> list[int]:
    return [int(v) for v in values]  # JSON Schema's "integer" admits 7.0


def _int(value: Any) -> int:
    return int(value)


def _bias(value: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    return tuple((int(t), float(b)) for t, b in value.items())  # OpenAI's {"<token id>": bias}


CONTEXT: Any = "<the model's context>"  # a default that is the served model's max_model_len


@dataclass(frozen=True)
class Knob:
    name: str  # the SamplingParams field
    convert: Callable[[Any], Any]
    fields: dict[str, str | tuple[str, ...]]  # protocol -> its field (first non-None of a tuple wins)
    defaults: dict[str, Any] = field(default_factory=dict)  # protocol (or protocol/endpoint) -> its own default


TABLE: tuple[Knob, ...] = (
    # OpenAI: 16 for the legacy completions, the context for chat (vLLM's); textgen 20 and sglang 128 are
    # their documents' defaults; Ollama's -1 is "until the context is full" (its bridge reads any negative
    # num_predict so); Anthropic's is required.
    Knob("max_tokens", _int, {"openai": ("max_completion_tokens", "max_tokens"), "vllm": "max_tokens",
                              "sglang": "max_new_tokens", "textgen": "max_new_tokens", "ollama": "num_predict",
                              "spark": "max_tokens", "anthropic": "max_tokens"},
         {"openai": CONTEXT, "openai/completions": 16, "vllm": CONTEXT, "sglang": 128, "textgen": 20, "ollama": -1,
          "spark": 2048}),
    Knob("min_tokens", _int, {"openai": "min_tokens", "vllm": "min_tokens", "sglang": "min_new_tokens"}),
    Knob("temperature", float, {"openai": "temperature", "vllm": "temperature", "sglang": "temperature",
                                "textgen": "temperature", "ollama": "temperature", "spark": "temperature",
                                "anthropic": "temperature"},
         {"ollama": 0.8, "spark": 0.5}),
    Knob("top_p", float, {"openai": "top_p", "vllm": "top_p", "sglang": "top_p", "textgen": "top_p",
                          "ollama": "top_p", "anthropic": "top_p"}, {"ollama": 0.9}),
    Knob("top_k", _int, {"openai": "top_k", "vllm": "top_k", "sglang": "top_k", "textgen": "top_k",
                         "ollama": "top_k", "spark": "top_k", "anthropic": "top_k"}, {"ollama": 40, "spark": 4}),
    Knob("min_p", float, {"openai": "min_p", "vllm": "min_p", "sglang": "min_p", "ollama": "min_p"}),
    Knob("repetition_penalty", float, {"openai": "repetition_penalty", "vllm": "repetition_penalty",
                                       "sglang": "repetition_penalty", "textgen": "repetition_penalty",
                                       "ollama": "repeat_penalty", "spark": "punish"}, {"ollama": 1.1}),
    Knob("presence_penalty", float, {"openai": "presence_penalty", "vllm": "presence_penalty",
                                     "sglang": "presence_penalty", "ollama": "presence_penalty"}),
    Knob("frequency_penalty", float, {"openai": "frequency_penalty", "vllm": "frequency_penalty",
                                      "sglang": "frequency_penalty", "textgen": "frequency_penalty",
                                      "ollama": "frequency_penalty"}),
    Knob("seed", _int, {"openai": "seed", "vllm": "seed", "sglang": "seed", "textgen": "seed", "ollama": "seed",
                        "anthropic": "seed"}),
    Knob("stop", _stops, {"openai": "stop", "vllm": "stop", "sglang": "stop", "textgen": "stop", "ollama": "stop",
                          "anthropic": "stop_sequences"}),
    Knob("stop_token_ids", _ids, {"openai": "stop_token_ids", "vllm": "stop_token_ids", "sglang": "stop_token_ids"}),
    Knob("banned_token_ids", _ids, {"openai": "bad_words_token_ids"}),
    Knob("allowed_token_ids", _ids, {"openai": "allowed_token_ids"}),
    Knob("logit_bias", _bias, {"openai": "logit_bias"}),
    Knob("include_stop_str_in_output", bool, {"openai": "include_stop_str_in_output",
                                              "vllm": "include_stop_str_in_output", "sglang": "no_stop_trim"}),
    Knob("ignore_eos", bool, {"openai": "ignore_eos", "vllm": "ignore_eos", "sglang": "ignore_eos"}),
    Knob("skip_special_tokens", bool, {"openai": "skip_special_tokens", "vllm": "skip_special_tokens",
                                       "sglang": "skip_special_tokens"}),
    Knob("spaces_between_special_tokens", bool, {"openai": "spaces_between_special_tokens",
                                                 "sglang": "spaces_between_special_tokens"}),
    Knob("n", _int, {"openai": "n", "sglang": "n"}),
    Knob("prompt_logprobs", _int, {"openai": "prompt_logprobs"}),
    # FastDeploy: output logprobs after temperature scaling / renormalised over the top-p set
    Knob("temp_scaled_logprobs", bool, {"openai": "temp_scaled_logprobs"}),
    Knob("top_p_normalized_logprobs", bool, {"openai": "top_p_normalized_logprobs"}),
    # keep the prompt's last so many tokens (TGI's truncate means the same)
    Knob("truncate_prompt_tokens", _int, {"openai": "truncate_prompt_tokens", "textgen": "truncate"}),
)

# Fields of each protocol's sampling object that are not engine knobs, each handled by its bridge
# (named here so the schema check can tell a forgotten knob from a field with another job).
OTHER_FIELDS: dict[str, frozenset[str]] = {
    "openai": frozenset({"model", "lora_path", "stream", "stream_options", "user", "bad_words", "return_token_ids",
                         "priority", "parallel_tool_calls", "best_of", "length_penalty", "use_beam_search",
                         "return_tokens_as_token_ids", "request_id", "metadata", "add_special_tokens",
                         "prompt_token_ids", "response_format", "guided_json", "guided_regex", "guided_choice",
                         "guided_grammar", "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern",
                         # features this server has not: bridges/unserved_fields.py
                         "logits_processors", "mm_processor_kwargs", "include_draft_logprobs",
                         "logits_processors_args", "mm_hashes",
                         "reasoning_max_tokens"}),  # the thinking's budget: bridges/reasoning.py
    "vllm": frozenset({"prompt", "stream", "model"}),
    "sglang": frozenset({"json_schema", "regex", "ebnf",  # structured output: bridges/constraints.py
                         "custom_params"}),  # for custom logit processors: bridges/unserved_fields.py
    "textgen": frozenset({"decoder_input_details", "details", "do_sample", "return_full_text",
                          "typical_p", "watermark", "adapter_id", "best_of", "top_n_tokens", "grammar", "batch_size",
                          "perf_stat", "priority", "timeout"}),
    "ollama": frozenset({"typical_p", "repeat_last_n", "num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu",
                         "num_thread", "use_mmap", "low_vram", "numa"}),
    "spark": frozenset({"chat_id", "adjustTokens", "domain", "response_format"}),
    "anthropic": frozenset({"model", "messages", "system", "stream", "metadata", "tools", "tool_choice", "thinking"}),
}


def _default(knob: Knob, protocol: str, endpoint: str | None) -> Any:
    if endpoint is not None and f"{protocol}/{endpoint}" in knob.defaults:
        return knob.defaults[f"{protocol}/{endpoint}"]
    return knob.defaults.get(protocol)


def default(protocol: str, name: str, endpoint: str | None = None) -> Any:
    """A protocol's (or one of its endpoints') default for an engine knob (None: the engine's own)."""
    return next(_default(k, protocol, endpoint) for k in TABLE if k.name == name)


def sampling_kwargs(protocol: str, source: dict[str, Any] | None, *, endpoint: str | None = None,
                    context: int | None = None, server_defaults: Mapping[str, Any] | None = None,
                    max_tokens_cap: int | None = None) -> dict[str, Any]:
    """The engine knobs a protocol's sampling object sets, with that protocol's (or ``endpoint``'s)
    defaults for the rest; knobs it neither sets nor has a default for are left out (the engine's default
    applies). ``context``: the served model's context, for a default that is ``CONTEXT``.
    ``server_defaults`` (engine knob names): the server's defaults, which come before the protocol's (vLLM's
    order: the request's value, the server's default, OpenAI's). ``max_tokens_cap``: no max_tokens above it,
    the request's own included (vLLM's override_max_tokens)."""
    source = source or {}
    server_defaults = server_defaults or {}
    out: dict[str, Any] = {}
    for knob in TABLE:
        names = knob.fields.get(protocol)
        if names is None:
            continue
        value = None
        for name in (names,) if isinstance(names, str) else names:
            if source.get(name) is not None:
                value = source[name]
                break
        if value is None:
            value = server_defaults.get(knob.name)
        if value is None:
            value = _default(knob, protocol, endpoint)
            if value is CONTEXT:
                if context is None:
                    raise ValueError(f"{protocol}'s default for {knob.name} is the model's context: pass context")
                value = context
        if value is not None:
            out[knob.name] = knob.convert(value)
    if max_tokens_cap is not None and out.get("max_tokens", max_tokens_cap) > max_tokens_cap:
        out["max_tokens"] = max_tokens_cap
    return out


def fields_of(protocol: str) -> set[str]:
    """Every field name a protocol's sampling object may carry for an engine knob."""
    names: set[str] = set()
    for knob in TABLE:
        f = knob.fields.get(protocol)
        if f is not None:
            names.update((f,) if isinstance(f, str) else f)
    return names
