"""vLLM's and FastDeploy's launch lines, taken as they are: the one table of their flags and what each does here.

A deployment script written for ``vllm serve MODEL ...`` or FastDeploy's ``api_server`` should start this
server unchanged. Every flag of theirs that is not already one of ours (same name, same meaning) is in
``TABLE``, with one rule:

- ``Alias``: another name for one of our settings (the settings line shows the value, from "flag" or "file");
- ``Honoured``: what it asks for is what this server always does (one start-up line says how);
- ``Effect``: applied at start outside the settings (log levels, served-name aliases, ...), one line;
- ``Ignored``: needs hardware or a feature this server does not have: one start-up line names it and why;
- ``Only``: honoured at the values listed; any other value would change what clients get in a way this server
  cannot honour, so the start is refused with a message naming the flag;
- ``ByValue``: one of the above chosen by the value (``--kv-cache-dtype auto`` vs ``fp8``);
- ``MatchModel``: allowed where it repeats the model's own config.json (checked once the model is loaded).

Our own settings whose value names differ (``--device tpu``, ``--quantization awq``) get their foreign values
from ``FOREIGN_VALUES``. The same table serves the command line and the keys of a ``--config`` YAML/TOML file.
Flags that another part of the server implements as real settings (``--task``, ``--reasoning-parser``...)
step aside by themselves: an entry whose name is a ``Settings`` field is never registered here.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

INFO, WARNING = logging.INFO, logging.WARNING
POSITIONAL = "model_tag"  # `serve MODEL`: vLLM's positional model, beside --model


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "y"):
        return True
    if text in ("0", "false", "no", "off", "n"):
        return False
    raise ValueError(f"{_flag(name)}: expected true or false, got {value!r}")


def _number(kind: type) -> Callable[[str, Any], Any]:
    def convert(name: str, value: Any) -> Any:
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"{_flag(name)}: expected {kind.__name__}, got {value!r}") from None
    return convert


def as_json(name: str, value: Any) -> Any:
    """A JSON value given as text on the command line, or already parsed from a YAML file."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError(f"{_flag(name)} {value!r}: not valid JSON") from None


as_int, as_float = _number(int), _number(float)


def as_text(name: str, value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _empty(value: Any) -> bool:
    return value in (None, "", [], {}, "[]", "{}", "null", "None")


# --- argparse forms, as vLLM declares each flag ------------------------------------------------------------

VALUE, SWITCH, OPTIONAL_BOOL, MANY, APPEND = "value", "switch", "optional", "many", "append"


@dataclass(frozen=True)
class Rule:
    form: str = VALUE            # how the flag parses: a value, a switch, [--x [BOOL]], nargs+, or repeated
    convert: Callable[[str, Any], Any] = as_text
    sample: str | None = None    # a value for the documentation's example (and the tests)

    def describe(self) -> str:
        raise NotImplementedError

    def take(self, name: str, value: Any, launch: Launch) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Alias(Rule):
    target: str = ""

    def describe(self) -> str:
        return f"another name for `{_flag(self.target)}`"

    def take(self, name: str, value: Any, launch: Launch) -> None:
        launch.set(self.target, self.convert(name, value), name)


@dataclass(frozen=True)
class Honoured(Rule):
    how: str = ""

    def describe(self) -> str:
        return f"accepted: {self.how}"

    def take(self, name: str, value: Any, launch: Launch) -> None:
        self.convert(name, value)
        launch.note(INFO, name, value, self.how)


@dataclass(frozen=True)
class Ignored(Rule):
    why: str = ""

    def describe(self) -> str:
        return f"ignored (logged at start): {self.why}"

    def take(self, name: str, value: Any, launch: Launch) -> None:
        if self.convert(name, value) is False:  # a switch turned off asks for what this server does anyway
            launch.note(INFO, name, value, "off, as here")
            return
        launch.note(WARNING, name, value, "ignored: " + self.why)


@dataclass(frozen=True)
class Effect(Rule):
    how: str = ""
    key: str = ""

    def describe(self) -> str:
        return f"applied at start: {self.how}"

    def take(self, name: str, value: Any, launch: Launch) -> None:
        launch.effects[self.key or name] = self.convert(name, value)
        launch.note(INFO, name, value, self.how)


@dataclass(frozen=True)
class Only(Rule):
    accepted: tuple[Any, ...] = ()
    how: str = ""
    refused: str = ""

    def describe(self) -> str:
        shown = ", ".join("empty" if _empty(a) else json.dumps(a) for a in self.accepted)
        return f"accepted at {shown} ({self.how}); any other value refused at start: {self.refused}"

    def take(self, name: str, value: Any, launch: Launch) -> None:
        converted = self.convert(name, value)
        if not any(converted == a or (_empty(converted) and _empty(a)) for a in self.accepted):
            raise ValueError(f"{_flag(name)} {_shown(value)}: {self.refused}")
        launch.note(INFO, name, value, self.how)


@dataclass(frozen=True)
class Refused(Rule):
    why: str = ""

    def describe(self) -> str:
        return f"refused at start: {self.why}"

    def take(self, name: str, value: Any, launch: Launch) -> None:
        raise ValueError(f"{_flag(name)} {_shown(value)}: {self.why}")


@dataclass(frozen=True)
class ByValue(Rule):
    cases: dict[str, Rule] = field(default_factory=dict)
    otherwise: Rule | None = None

    def describe(self) -> str:
        parts = [f"`{v}`: {r.describe()}" for v, r in self.cases.items()]
        if self.otherwise is not None:
            parts.append(f"other values: {self.otherwise.describe()}")
        return "; ".join(parts)

    def take(self, name: str, value: Any, launch: Launch) -> None:
        key = str(self.convert(name, value))
        rule = self.cases.get(key, self.otherwise)
        if rule is None:
            raise ValueError(f"{_flag(name)} {key}: not one of {', '.join(self.cases)}")
        rule.take(name, value, launch)


@dataclass(frozen=True)
class MatchModel(Rule):
    """A model-config override: allowed where it repeats the model's own config.json (vLLM would run a model
    changed by it; this server runs each model as its checkpoint defines it)."""
    key: str | None = None  # the config.json key; None: the value is a mapping of keys

    def describe(self) -> str:
        what = f"the model's `{self.key}`" if self.key else "the model's config.json"
        return f"accepted where it repeats {what} (checked once the model is loaded); a different value is refused"

    def take(self, name: str, value: Any, launch: Launch) -> None:
        converted = self.convert(name, value)
        if _empty(converted):
            return
        wanted = {self.key: converted} if self.key else converted
        if not isinstance(wanted, dict):
            raise ValueError(f"{_flag(name)} {_shown(value)}: expected a JSON object of config keys")
        launch.model_checks.append((name, wanted))
        launch.note(INFO, name, value, "checked against the model's config.json once it is loaded")


def _shown(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


# --- what each foreign flag does here ----------------------------------------------------------------------

def _ign(why: str, form: str = VALUE, **kw: Any) -> Ignored:
    return Ignored(form=form, why=why, **kw)


def _sw_ign(why: str) -> Ignored:
    return Ignored(form=SWITCH, convert=as_bool, why=why)


def _one(how: str, refused: str, accepted: tuple[Any, ...] = (1,), convert=as_int, **kw: Any) -> Only:
    return Only(accepted=accepted, how=how, refused=refused, convert=convert, **kw)


ONE_DEVICE = "this server runs the model on one device"
NO_HUB = "no model hub is used: the model is a local directory or .gguf file"
NO_CODE = "this server loads no user code"
NO_MM = "this server takes text prompts only (no image, audio or video inputs)"
NO_SPEC_MODEL = ("no draft model runs here; requests use prompt-lookup speculation "
                 "(--num-speculative-tokens, --prompt-lookup-min/-max)")
KV_SIZE = "the KV cache is --kv-cache-space GiB (or --num-kv-blocks blocks)"
NO_PROMPT_ADAPTERS = "prompt adapters (soft prompts) are not supported; LoRA adapters are"


@dataclass(frozen=True)
class SpeculativeConfig(Rule):
    """vLLM's --speculative-config: the ngram method is this server's prompt-lookup speculation."""

    def describe(self) -> str:
        return ('`{"method": "ngram", ...}`: its num_speculative_tokens / prompt_lookup_max / prompt_lookup_min '
                "set ours; other methods (a draft model, EAGLE, Medusa) are ignored (logged at start): "
                + NO_SPEC_MODEL)

    def take(self, name: str, value: Any, launch: Launch) -> None:
        config = as_json(name, value)
        if _empty(config):
            return
        if not isinstance(config, dict):
            raise ValueError(f"{_flag(name)} {_shown(value)}: expected a JSON object")
        if config.get("method") == "ngram" or config.get("model") == "[ngram]":
            for key, ours in (("num_speculative_tokens", "num_speculative_tokens"),
                              ("prompt_lookup_max", "prompt_lookup_max"), ("prompt_lookup_min", "prompt_lookup_min")):
                if key in config:
                    launch.set(ours, as_int(f"{name}.{key}", config[key]), name)
            launch.note(INFO, name, value, "ngram: this server's prompt-lookup speculation")
        else:
            launch.note(WARNING, name, value, "ignored: " + NO_SPEC_MODEL)


TABLE: dict[str, Rule] = {
    # --- the HTTP server
    "uvicorn_log_level": Effect(key="uvicorn_log_level", sample="info",
                                how="uvicorn's own loggers (server and access lines) log at this level",
                                convert=lambda n, v: _choice(n, v, ("debug", "info", "warning", "error",
                                                                    "critical", "trace"))),
    "disable_uvicorn_access_log": Effect(form=SWITCH, convert=as_bool, how="uvicorn's access lines are not logged"),
    "allow_credentials": _sw_ign("CORS answers never allow credentials (cookies); send --api-key's key in the "
                                 "Authorization header"),
    "allowed_methods": _one("CORS allows every method this server answers (GET, POST, OPTIONS)",
                            "CORS here allows every method: a narrower list cannot be honoured",
                            accepted=("*", '["*"]', ["*"]), convert=lambda n, v: v if isinstance(v, list) else str(v),
                            sample='["*"]'),
    "allowed_headers": _one("CORS allows every request header", "CORS here allows every header: a narrower list "
                            "cannot be honoured", accepted=("*", '["*"]', ["*"]),
                            convert=lambda n, v: v if isinstance(v, list) else str(v), sample='["*"]'),
    "prompt_adapters": _ign(NO_PROMPT_ADAPTERS, form=MANY, sample="name=/path"),
    "chat_template_content_format": ByValue(
        sample="auto", cases={
            "auto": Honoured(how="text parts of a message's content are joined into the string the template "
                                 "renders"),
            "string": Honoured(how="text parts of a message's content are joined into the string the template "
                                   "renders"),
            "openai": Ignored(why="messages reach the chat template with their text parts joined into one string")}),
    "response_role": _one("answers come from the assistant role", "answers here always carry role assistant",
                          accepted=("assistant",), convert=as_text, sample="assistant"),
    "ssl_ca_certs": _ign("client certificates are not requested (--ssl-cert-reqs 0)", sample="ca.pem"),
    "enable_ssl_refresh": _sw_ign("the certificate is read once at start: restart to take a new one"),
    "ssl_cert_reqs": _one("client certificates are not requested", "requiring client certificates is not "
                          "supported here; put a TLS-terminating proxy in front", accepted=(0,), sample="0"),
    "root_path": _ign("paths are served from /; a proxy in front must strip its prefix", sample="/api"),
    "middleware": _one("no extra ASGI middleware", NO_CODE, accepted=([], ""), form=APPEND,
                       convert=lambda n, v: [x for x in (v if isinstance(v, list) else [v]) if x], sample=""),
    "return_tokens_as_token_ids": Effect(form=SWITCH, convert=as_bool,
                                         how="logprobs name tokens as 'token_id:{id}' unless a request says "
                                             "otherwise"),
    "disable_frontend_multiprocessing": Honoured(form=SWITCH, convert=as_bool,
                                                 how="the HTTP server and the engine share one process here"),
    "tool_parser_plugin": _one("no tool parser plugin", NO_CODE, accepted=("",), convert=as_text, sample=""),
    # --- the model and its files
    "hf_config_path": _ign("the model's config comes from its directory (or its GGUF file's metadata)",
                           sample="config/"),
    "skip_tokenizer_init": _sw_ign("the tokenizer is always loaded; token-id prompts work as with it"),
    "revision": _ign(NO_HUB, sample="main"),
    "code_revision": _ign(NO_HUB, sample="main"),
    "tokenizer_revision": _ign(NO_HUB, sample="main"),
    "tokenizer_mode": ByValue(sample="auto", cases={
        "auto": Honoured(how="the model's fast tokenizer"),
        "slow": Ignored(why="the fast tokenizer is used; it gives the same tokens"),
        "mistral": Refused(why="mistral_common tokenization is not available here"),
        "custom": Refused(why=NO_CODE)}),
    "trust_remote_code": _sw_ign("no remote code runs here: only the built-in model families load"),
    "allowed_local_media_path": _ign(NO_MM, sample="/data"),
    "download_dir": _ign(NO_HUB, sample="/tmp/models"),
    "load_format": ByValue(sample="auto", cases={
        **{f: Honoured(how="the format is read from the model's files (safetensors, .bin or .gguf)")
           for f in ("auto", "pt", "safetensors", "gguf")},
        "dummy": Refused(why="random weights are not supported: the model's own weights are loaded"),
    }, otherwise=Ignored(why="weights are read straight from the model's safetensors, .bin or .gguf files")),
    "config_format": ByValue(sample="auto", cases={
        "auto": Honoured(how="the model's config.json (or its GGUF metadata)"),
        "hf": Honoured(how="the model's config.json (or its GGUF metadata)"),
        "mistral": Ignored(why="params.json is not read: the model needs a config.json (or a .gguf file)")}),
    "kv_cache_dtype": ByValue(sample="auto", cases={"auto": Honoured(how="the KV cache is kept in the model's dtype")},
                              otherwise=Ignored(why="the KV cache is kept in the model's dtype (no fp8 cache)")),
    "logits_processor_pattern": _ign("requests' logits_processors are not run here (" + NO_CODE + ")",
                                     sample="^mypkg\\."),
    "model_impl": ByValue(sample="auto", cases={"auto": Honoured(how="the built-in model implementation"),
                                                "vllm": Honoured(how="the built-in model implementation")},
                          otherwise=Ignored(why="the built-in model implementation runs")),
    # --- parallelism and devices
    "distributed_executor_backend": _ign("one process, no executors: " + ONE_DEVICE, sample="mp"),
    "pipeline_parallel_size": _one(ONE_DEVICE, ONE_DEVICE + ": pipeline parallelism across devices is not "
                                   "supported", sample="1"),
    "tensor_parallel_size": _one(ONE_DEVICE, ONE_DEVICE + ": tensor parallelism across devices is not supported",
                                 sample="1"),
    "data_parallel_size": _one(ONE_DEVICE, ONE_DEVICE + ": for replicas start several servers behind "
                               "--engine-url", sample="1"),
    "enable_expert_parallel": _sw_ign(ONE_DEVICE),
    "max_parallel_loading_workers": _ign("the weights are loaded by one worker", sample="2"),
    "ray_workers_use_nsight": _sw_ign("no Ray workers run here"),
    # --- KV cache and scheduling
    "prefix_caching_hash_algo": ByValue(sample="builtin", cases={
        "builtin": Honoured(how="prefix blocks are keyed by Python's hash of their tokens, chained per block")},
        otherwise=Ignored(why="prefix blocks are keyed by Python's hash of their tokens, chained per block")),
    "disable_sliding_window": _sw_ign("attention runs as each built-in model family defines it"),
    "use_v2_block_manager": _sw_ign("deprecated in vLLM too: this server has one block manager"),
    "num_lookahead_slots": _ign("speculation reserves its own slots", sample="0"),
    "swap_space": _ign("preempted sequences are recomputed, never swapped to CPU memory", sample="4"),
    "cpu_offload_gb": _ign("weights stay on the serving device", sample="0"),
    "gpu_memory_utilization": _ign(KV_SIZE, sample="0.9"),
    "num_gpu_blocks_override": Alias(target="num_kv_blocks", convert=as_int, sample="64"),
    "max_num_partial_prefills": _ign("long prompts share steps as --long-prefill-token-threshold sets", sample="1"),
    "max_long_partial_prefills": _ign("long prompts share steps as --long-prefill-token-threshold sets",
                                      sample="1"),
    "disable_log_stats": Honoured(form=SWITCH, convert=as_bool,
                                  how="no periodic stats lines are logged here; /metrics has the numbers"),
    "rope_scaling": MatchModel(key="rope_scaling", convert=as_json, sample='{"rope_type":"dynamic","factor":2.0}'),
    "rope_theta": MatchModel(key="rope_theta", convert=as_float, sample="100000"),
    "hf_overrides": MatchModel(convert=as_json, sample="{}"),
    "enforce_eager": Honoured(form=SWITCH, convert=as_bool, how="no CUDA graphs are captured: always eager"),
    "max_seq_len_to_capture": _ign("no CUDA graphs are captured", sample="8192"),
    "disable_custom_all_reduce": _sw_ign(ONE_DEVICE),
    "tokenizer_pool_size": _ign("prompts are tokenized in the server process", sample="0"),
    "tokenizer_pool_type": _ign("prompts are tokenized in the server process", sample="ray"),
    "tokenizer_pool_extra_config": _ign("prompts are tokenized in the server process", sample="{}"),
    "limit_mm_per_prompt": _ign(NO_MM, sample="image=1"),
    "mm_processor_kwargs": _ign(NO_MM, sample="{}"),
    "disable_mm_preprocessor_cache": _sw_ign(NO_MM),
    # --- LoRA and prompt adapters
    "enable_lora": Honoured(form=SWITCH, convert=as_bool,
                            how="LoRA is on whenever adapters can come: --lora-modules, --lora, --lora-allowed-urls "
                                "or --lora-shared-dir"),
    "enable_lora_bias": _sw_ign("adapters apply their A/B weights; bias terms are not supported"),
    "lora_extra_vocab_size": _ign("adapters cannot add tokens to the vocabulary here", sample="256"),
    "lora_dtype": ByValue(sample="auto", cases={"auto": Honoured(how="adapters run in the model's dtype")},
                          otherwise=Ignored(why="adapters run in the model's dtype")),
    "long_lora_scaling_factors": _ign("long-context LoRA scaling is not supported", sample="4.0"),
    "max_cpu_loras": _ign("packs are kept on disk within --lora-disk-budget-gb", sample="16"),
    "fully_sharded_loras": _sw_ign(ONE_DEVICE),
    "enable_prompt_adapter": _sw_ign(NO_PROMPT_ADAPTERS),
    "max_prompt_adapters": _ign(NO_PROMPT_ADAPTERS, sample="1"),
    "max_prompt_adapter_token": _ign(NO_PROMPT_ADAPTERS, sample="0"),
    "qlora_adapter_name_or_path": _one("no QLoRA adapter", "QLoRA checkpoints are not supported; serve the adapter "
                                       "with --lora-modules", accepted=("",), convert=as_text, sample=""),
    # --- the scheduler
    "num_scheduler_steps": _ign("one scheduler step per model step", sample="1"),
    "use_tqdm_on_load": Ignored(form="boolean_optional", convert=as_bool,
                                why="the first conversion of a GGUF model always shows its progress"),
    "multi_step_stream_outputs": _ign("every step's tokens are streamed", form=OPTIONAL_BOOL, convert=as_bool),
    "scheduler_delay_factor": _ign("waiting requests are admitted at the next step", sample="0.0"),
    "enable_chunked_prefill": ByValue(form=OPTIONAL_BOOL, convert=lambda n, v: str(as_bool(n, v)).lower(), cases={
        "true": Honoured(how="prefill is always chunked to --max-num-batched-tokens here"),
        "false": Ignored(why="prefill is always chunked to --max-num-batched-tokens here")}),
    "scheduling_policy": ByValue(sample="fcfs", cases={
        p: Honoured(how="requests are admitted by their priority field (0 unless sent), first come first served "
                        "within one, round-robin across clients") for p in ("fcfs", "priority")}),
    "scheduler_cls": _one("the built-in scheduler", NO_CODE, accepted=("vllm.core.scheduler.Scheduler", ""),
                          convert=as_text, sample="vllm.core.scheduler.Scheduler"),
    "preemption_mode": ByValue(sample="recompute", cases={
        "recompute": Honoured(how="a preempted sequence is recomputed")},
        otherwise=Ignored(why="a preempted sequence is recomputed, never swapped")),
    "disable_async_output_proc": _sw_ign("outputs are processed as this server's engine does"),
    "disable_cascade_attn": _sw_ign("no cascade attention here"),
    # --- speculative decoding
    "speculative_config": SpeculativeConfig(sample='{"method": "ngram", "num_speculative_tokens": 5}'),
    "speculative_model": ByValue(sample="[ngram]", cases={
        "[ngram]": Honoured(how="this server's prompt-lookup speculation")},
        otherwise=Ignored(why=NO_SPEC_MODEL)),
    "speculative_model_quantization": _ign(NO_SPEC_MODEL, sample="None"),
    "speculative_disable_mqa_scorer": _sw_ign(NO_SPEC_MODEL),
    "speculative_draft_tensor_parallel_size": _ign(NO_SPEC_MODEL, sample="1"),
    "speculative_max_model_len": _ign(NO_SPEC_MODEL, sample="2048"),
    "speculative_disable_by_batch_size": _ign("drafting turns itself off where a crowded step makes draft rows cost "
                                              "more than they save", sample="4"),
    "ngram_prompt_lookup_max": Alias(target="prompt_lookup_max", convert=as_int, sample="8"),
    "ngram_prompt_lookup_min": Alias(target="prompt_lookup_min", convert=as_int, sample="4"),
    "spec_decoding_acceptance_method": ByValue(sample="rejection_sampler", cases={
        "rejection_sampler": Honoured(how="a draft is kept exactly as far as the model agrees with it")},
        otherwise=Ignored(why="a draft is kept exactly as far as the model agrees with it (greedy requests only)")),
    "typical_acceptance_sampler_posterior_threshold": _ign("drafts are checked exactly, never by typical acceptance",
                                                           sample="0.09"),
    "typical_acceptance_sampler_posterior_alpha": _ign("drafts are checked exactly, never by typical acceptance",
                                                       sample="0.3"),
    "disable_logprobs_during_spec_decoding": _ign("logprobs are computed for every token, drafted or not",
                                                  form=OPTIONAL_BOOL, convert=as_bool),
    "model_loader_extra_config": _ign("the built-in loader takes no options", sample="{}"),
    "ignore_patterns": _ign("only the model's weight files are read", form=APPEND, sample="original/**/*"),
    # --- observability
    "show_hidden_metrics_for_version": _ign("/metrics shows this server's metrics", sample="0.7"),
    "otlp_traces_endpoint": _ign("no OpenTelemetry export here; every request has one log line", sample="http://otel:4317"),
    "collect_detailed_traces": _ign("no OpenTelemetry export here", sample="all"),
    "override_neuron_config": _ign("no Neuron devices here", sample="{}"),
    "override_pooler_config": _ign("the pooling of each task is as vLLM defines it for the model", sample="{}"),
    "compilation_config": _ign("no graph compilation: the model runs eagerly (with fused C kernels on CPU)",
                               sample="0"),
    "kv_transfer_config": _ign("no disaggregated prefill: one server holds its KV cache", sample="{}"),
    "worker_cls": _one("the built-in worker", NO_CODE, accepted=("auto", ""), convert=as_text, sample="auto"),
    "worker_extension_cls": _one("no worker extension", NO_CODE, accepted=("",), convert=as_text, sample=""),
    "enable_sleep_mode": _sw_ign("the model stays loaded (no sleep mode)"),
    "calculate_kv_scales": _sw_ign("the KV cache is kept in the model's dtype (no fp8 scales)"),
    "additional_config": _ign("no platform plugins here", sample="{}"),
    # --- logging and the API surface
    "disable_log_requests": Effect(form=SWITCH, convert=as_bool,
                                   how="the one line logged per request (ids and token counts) is left out"),
    "max_log_len": Honoured(convert=as_int, sample="100",
                            how="request lines carry ids and token counts, never prompt text"),
    "disable_fastapi_docs": _sw_ign("/openapi.json stays served (no interactive docs page is served)"),
    "enable_prompt_tokens_details": Honoured(form=SWITCH, convert=as_bool,
                                             how="usage.prompt_tokens_details.cached_tokens is sent whenever "
                                                 "part of the prompt came from the prefix cache"),
    "enable_server_load_tracking": _sw_ign("/metrics has the running and waiting request counts"),
    # --- FastDeploy's launch line
    "enable_logprob": Honoured(form=SWITCH, convert=as_bool,
                               how="logprobs are always available, up to --max-logprobs per token"),
}

# Flags another part of the server implements as real settings: while a Settings field of the name exists
# this entry is not registered (that setting takes the flag); until then it is accepted as written here.
PENDING: dict[str, Rule] = {
    "task": ByValue(sample="auto", cases={
        **{t: Honoured(how="text generation") for t in ("auto", "generate")},
        "transcription": Refused(why="speech models are not served here")},
        otherwise=Ignored(why="this server runs text generation: pooling endpoints (/v1/embeddings, /score, "
                              "/rerank, /classify) are not served")),
    "enable_reasoning": _sw_ign("no reasoning parser here: a model's thinking stays in content"),
    "reasoning_parser": _ign("no reasoning parser here: a model's thinking stays in content", sample="deepseek_r1"),
}

# vLLM's short forms
SHORT: dict[str, str] = {"-tp": "tensor_parallel_size", "-pp": "pipeline_parallel_size",
                         "-dp": "data_parallel_size", "-O": "compilation_config",
                         "-spec-draft-tp": "speculative_draft_tensor_parallel_size", "-q": "quantization"}


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise ValueError(f"{_flag(name)} {value!r}: not one of {', '.join(choices)}")
    return text


# Values of our own settings that vLLM names and this server does not have (values outside a setting's own
# choices that are not listed here are refused naming the flag).
_QUANT_METHODS = ("aqlm", "awq", "deepspeedfp", "tpu_int8", "fp8", "ptpc_fp8", "fbgemm_fp8", "modelopt", "nvfp4",
                  "marlin", "gptq_marlin_24", "gptq_marlin", "awq_marlin", "gptq", "compressed-tensors",
                  "bitsandbytes", "qqq", "hqq", "experts_int8", "neuron_quant", "ipex", "quark", "moe_wna16")
FOREIGN_VALUES: dict[str, dict[str, Rule | str]] = {
    "device": {d: Refused(why="this kind of device is not supported here (auto, cpu, cuda or npu)")
               for d in ("neuron", "tpu", "xpu", "hpu")},
    "quantization": {"None": "auto", **{m: Refused(why="checkpoints quantized this way are not supported here: "
                                                       "the weights run as none, int8, int4 or gguf")
                                        for m in _QUANT_METHODS}},
    # until other values are real settings, vLLM's names are taken and logged
    "guided_decoding_backend": {b: Ignored(why="structured output is built by llguidance here")
                                for b in ("xgrammar", "outlines", "lm-format-enforcer")},
    "tool_call_parser": {
        **{p: Ignored(why="tool calls are written and read in the hermes form here")
           for p in ("llama3_json", "mistral", "pythonic")},
        **{p: Refused(why="this tool-call format is not available here")
           for p in ("granite-20b-fc", "granite", "internlm", "jamba")}},
    "reasoning_parser": {"granite": Refused(why="this reasoning format is not available here")},
    "task": {"embedding": "embed",  # vLLM's older name
             "transcription": Refused(why="speech models are not served here")},
}


def own_settings() -> dict[str, Any]:
    from spark_server.settings import Settings

    return {f.name: f for f in fields(Settings)}


def active_rules() -> dict[str, Rule]:
    """The table, less every flag that is (now) one of our own settings."""
    own = own_settings()
    return {name: rule for name, rule in {**PENDING, **TABLE}.items() if name not in own}


def foreign_choices(name: str, choices: list[str] | None) -> list[str] | None:
    """An own setting's argparse choices, widened by vLLM's values for it (taken or refused at resolve)."""
    if not choices:
        return choices
    return [*choices, *(v for v in FOREIGN_VALUES.get(name, {}) if v not in choices)]


# --- taking a launch line ----------------------------------------------------------------------------------

@dataclass
class Launch:
    """What the foreign flags of one launch did: start-up lines, effects to apply, model checks."""

    notes: list[tuple[int, str]] = field(default_factory=list)
    effects: dict[str, Any] = field(default_factory=dict)
    model_checks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _values: dict[str, Any] = field(default_factory=dict)
    _set_by: dict[str, str] = field(default_factory=dict)
    _origin: str = "flag"

    def note(self, level: int, name: str, value: Any, text: str) -> None:
        shown = "" if value is True else f" {_shown(value)}"
        where = "" if self._origin == "flag" else f" (in {self._origin})"
        self.notes.append((level, f"{_flag(name)}{shown}{where}: {text}"))

    def set(self, target: str, value: Any, by: str) -> None:
        if target in self._values and self._values[target] != value:
            first = self._set_by.get(target, target)
            raise ValueError(f"{_flag(by)} {value!r} and {_flag(first)} {self._values[target]!r} both set "
                             f"{_flag(target)}: give one")
        self._values[target] = value
        self._set_by.setdefault(target, by)

    def take(self, given: dict[str, Any], origin: str = "flag") -> dict[str, Any]:
        """Our settings from ``given`` (argparse's values or a config file's keys, snake case): foreign
        flags applied through the table; unknown keys are passed through for the caller to refuse."""
        self._origin, self._values, self._set_by = origin, {}, {}
        own, rules = own_settings(), active_rules()
        positional = given.get(POSITIONAL)
        for name, value in given.items():
            if value is None or name == POSITIONAL:
                continue
            if name in own:
                self._take_own(name, value, own[name])
            elif name in rules:
                rules[name].take(name, value, self)
            else:
                self._values[name] = value  # the caller names it as unknown
        if positional is not None:
            if "model" in self._values and self._values["model"] != positional:
                raise ValueError(f"the model is given twice: {positional!r} (positional) and --model "
                                 f"{self._values['model']!r}")
            self._values["model"] = positional
        return self._values

    def _take_own(self, name: str, value: Any, spec: Any) -> None:
        if name == "served_model_name" and isinstance(value, list):
            # vLLM: several names; the first is the one answers carry, every one is accepted in requests
            names = [str(v) for v in value if str(v)]
            if len(names) > 1:
                self.effects["model_aliases"] = names[1:]
                self.notes.append((INFO, f"--served-model-name: requests may also name {', '.join(names[1:])}"))
            value = names[0] if names else None
        choices = spec.metadata.get("choices")
        if choices and isinstance(value, str) and value not in choices:
            mapped = FOREIGN_VALUES.get(name, {}).get(value)
            if mapped is None:
                raise ValueError(f"{_flag(name)} {value}: not one of {', '.join(choices)}")
            if isinstance(mapped, str):
                value = mapped
            else:
                mapped.take(name, value, self)
                return  # refused (raised) or ignored: the setting keeps its default
        if value is not None:
            self.set(name, value, name)

    # --- applied at start ----------------------------------------------------------------------------------

    def protocol_options(self) -> dict[str, Any]:
        """What the protocols read beside the settings (bridges/context.py ``ProtocolOptions``' names)."""
        return {"model_aliases": tuple(self.effects.get("model_aliases", ())),
                "return_tokens_as_token_ids": bool(self.effects.get("return_tokens_as_token_ids"))}

    def apply_to_logging(self) -> None:
        """After uvicorn configured its loggers (it resets their levels when it does)."""
        level = self.effects.get("uvicorn_log_level")
        if level:
            number = 5 if level == "trace" else logging.getLevelName(level.upper())  # uvicorn's TRACE is 5
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
                logging.getLogger(name).setLevel(number)
        if self.effects.get("disable_uvicorn_access_log"):
            logging.getLogger("uvicorn.access").disabled = True
        if self.effects.get("disable_log_requests"):
            for name in ("spark_server.requests", "spark_server.sessions"):
                logging.getLogger(name).setLevel(logging.WARNING)

    def check_model(self, model_path: str | None) -> None:
        """Model-config overrides must repeat the model's own config.json: refused naming the flag otherwise."""
        if not self.model_checks:
            return
        config: dict[str, Any] = {}
        try:
            config = json.loads((Path(model_path or "") / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
        for name, wanted in self.model_checks:
            for key, value in wanted.items():
                have = config.get(key)
                same = have == value or (isinstance(have, (int, float)) and isinstance(value, (int, float))
                                         and float(have) == float(value))
                if not same:
                    raise ValueError(f"{_flag(name)}: {key}={_shown(value)} differs from the model's config.json "
                                     f"({key}={_shown(have)}); this server runs a model as its checkpoint "
                                     "defines it")


# --- the command line --------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's positional MODEL, its and FastDeploy's flags (each as vLLM parses it), and the short forms."""
    parser.add_argument(POSITIONAL, nargs="?", metavar="MODEL", default=None,
                        help="the model, as vLLM's `serve MODEL` (the same as --model)")
    group = parser.add_argument_group("vLLM and FastDeploy flags", "accepted as their launch lines write them; "
                                      "docs/launch-flags.md says what each does here")
    for name, rule in active_rules().items():
        _add(group, [_flag(name)], name, rule)
    own = own_settings()
    for short, name in SHORT.items():
        if name in own:
            group.add_argument(short, dest=name, default=None, help=argparse.SUPPRESS,
                               choices=foreign_choices(name, own[name].metadata.get("choices")))
        else:
            _add(group, [short], name, active_rules()[name], hidden=True)


def _add(group: Any, options: list[str], name: str, rule: Rule, hidden: bool = False) -> None:
    text = argparse.SUPPRESS if hidden else rule.describe().replace("%", "%%")
    if rule.form == SWITCH:
        group.add_argument(*options, dest=name, action=argparse.BooleanOptionalAction if not hidden else "store_true",
                           default=None, help=text)
    elif rule.form == "boolean_optional":
        group.add_argument(*options, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif rule.form == OPTIONAL_BOOL:
        group.add_argument(*options, dest=name, nargs="?", const=True, default=None, metavar="BOOL", help=text)
    elif rule.form == MANY:
        group.add_argument(*options, dest=name, nargs="+", action="extend", default=None, help=text)
    elif rule.form == APPEND:
        group.add_argument(*options, dest=name, action="append", default=None, help=text)
    else:
        group.add_argument(*options, dest=name, default=None, help=text)


# --- the documentation -------------------------------------------------------------------------------------

def markdown() -> str:
    """docs/launch-flags.md, written from the table."""
    own = own_settings()
    lines = [
        "# vLLM and FastDeploy launch lines",
        "",
        "`spark-server serve` takes the launch lines of `vllm serve` and of FastDeploy's `api_server` as they "
        "are: `spark-server serve MODEL` (the model positional, as `vllm serve MODEL`, or `--model`), every "
        "flag of vLLM's `serve` usage and of FastDeploy's launch example, and the same names as keys of a "
        "`--config` YAML file (`uvicorn-log-level: info`). A flag that has a meaning here does it; one that "
        "needs hardware or a feature this server does not have is accepted and named in one start-up log line "
        "with the reason; a value this server cannot honour stops the start with a message naming the flag.",
        "",
        "Flags with the same name as one of this server's own (`--host`, `--port`, `--model`, `--dtype`, "
        "`--max-model-len`, `--api-key`, `--lora-modules`, `--served-model-name`, `--generation-config`, "
        "`--override-generation-config`, ...) are that setting; "
        "`spark-server serve --help` lists them. This page is generated from `spark_server/launch_compat.py` "
        "(`python -m spark_server.launch_compat > docs/launch-flags.md`).",
        "",
        "## Values of shared flags that this server does not have",
        "",
        "| flag | value | here |",
        "| --- | --- | --- |",
    ]
    own = own_settings()
    for name, values in FOREIGN_VALUES.items():
        if name not in own:
            continue
        choices = own[name].metadata.get("choices") or []
        grouped: dict[str, list[str]] = {}  # one row per outcome
        for value, rule in values.items():
            if value not in choices:
                grouped.setdefault(f"the same as `{rule}`" if isinstance(rule, str) else rule.describe(),
                                   []).append(value)
        for does, shown in grouped.items():
            lines.append(f"| `{_flag(name)}` | {', '.join(f'`{v}`' for v in shown)} | {does} |")
    lines += ["", "`--served-model-name` takes several names, as vLLM: answers carry the first, requests may name "
              "any.", "", "## vLLM's and FastDeploy's other flags", "", "| flag | here |", "| --- | --- |"]
    shorts = {v: k for k, v in SHORT.items()}
    for name, rule in sorted({**PENDING, **TABLE}.items()):
        if name in own:
            continue
        flags = f"`{_flag(name)}`" + (f", `{shorts[name]}`" if name in shorts else "")
        lines.append(f"| {flags} | {rule.describe()} |")
    pending = [n for n in PENDING if n not in own]
    if pending:
        lines += ["", "Until they become settings of their own: " + ", ".join(f"`{_flag(n)}`" for n in pending)
                  + " are taken as above."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
