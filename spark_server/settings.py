"""Server settings, resolved as: command-line flag > environment variable > config file > default.

Every setting ``foo_bar`` is the flag ``--foo-bar``, the variable ``SPARK_FOO_BAR`` and the key
``foo_bar`` (or ``foo-bar``) in a TOML or YAML config file given by ``--config`` or ``SPARK_CONFIG``.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.constraint_budget import ConstraintBudget
from engine.cost_model import CostModel
from engine.generation_config import recommended_sampling
from spark_server import launch_compat
from spark_server.sampling_defaults import parse_override

ENV_PREFIX = "SPARK_"
_CONSTRAINT = ConstraintBudget()  # structured output's limits keep their defaults there


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(slots=True)
class Settings:
    host: str = _opt("127.0.0.1", "address to bind")
    port: int = _opt(9990, "port to bind")
    model: str | None = _opt(None, "local HF model directory or .gguf file (default: the embedded "
                                   "SmolLM2-135M-Instruct)")
    served_model_name: str | None = _opt(None, "model name shown to clients (default: the model's name); several "
                                               "names as vLLM: answers carry the first, requests may name any",
                                         many=True)
    engine_url: str | None = _opt(None, "serve with no local model, over a fleet: a router's URL (smg), or several "
                                        "OpenAI-compatible backends comma-separated (this server, vLLM, SGLang), "
                                        "tried in turn; --model / --tokenizer then name only the tokenizer")
    engine_api_key: str | None = _opt(None, "bearer key the --engine-url backends require")
    tokenizer: str | None = _opt(None, "tokenizer directory or .gguf to use in place of the model's own (with "
                                       "--engine-url: the front end's; default: --model's)")
    lora_shared_dir: str | None = _opt(None, "a directory every engine of the fleet can read: packs are unpacked "
                                             "there for the backends (a front end), and /v1/load_lora_adapter takes "
                                             "paths under it (a replica)")
    device: str = _opt("auto", "auto, cpu, cuda or npu (npu needs torch_npu)",
                       choices=["auto", "cpu", "cuda", "npu"])
    dtype: str = _opt("auto", "auto, float32 (float), bfloat16 or float16 (half); the names in brackets are "
                              "vLLM's aliases", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    quantization: str = _opt("auto", "weights the linears run on: none (the model's dtype), int8 (per channel, "
                                     "GPTQ-rounded on self-sampled calibration text the first time, then cached), "
                                     "int4 (groups of 32), gguf (a GGUF file's own Q4_0/Q4_1/Q8_0 blocks); auto: "
                                     "gguf for a GGUF model on a CPU with AVX512-BF16, else none",
                             choices=["auto", "none", "int8", "int4", "gguf"])
    linear_activations: str = _opt("bf16", "what 4-bit weights (int4, gguf Q4_0/Q4_1) multiply: bf16 activations "
                                           "(exact products); int8 per block of 32 as llama.cpp does (integer dot "
                                           "products, faster prefill with AVX512-VNNI, less accurate); or "
                                           "int8-prompt: int8 on the prompt rows whose logits are not read, bf16 on "
                                           "the rest, faster prefill than bf16 at close to its accuracy "
                                           "(docs/performance.md)",
                                   choices=["bf16", "int8", "int8-prompt"])
    max_model_len: int | None = _opt(None, "context length in tokens (default: the model's; more than the model's is "
                                           "refused at start)")
    max_num_seqs: int = _opt(64, "most sequences decoded together in one step")
    max_num_batched_tokens: int = _opt(512, "token budget of one engine step (prefill is chunked to fit)")
    long_prefill_token_threshold: int = _opt(16, "while other sequences decode, long prompts (over half of "
                                                 "--max-num-batched-tokens) prefill at most max(this, what the "
                                                 "decoding streams cost a step x long prompts pending^2) "
                                                 "tokens per step, keeping token gaps even (0: no cap)")
    scheduler_cost_model: str | None = _opt(None, "the scheduler's cost model pinned, step=S,decode_key=D,"
                                                  "attention_key=A[,decode_row=R] (numbers >= 0, in one prompt "
                                                  "token's linears), so "
                                                  "replicas on one hardware class schedule alike; default: measured "
                                                  "at start (the start-up line gives the measured figures in this "
                                                  "form)")
    num_speculative_tokens: int = _opt(5, "prompt-lookup speculation (vLLM's ngram method), greedy and sampled: "
                                          "up to this many tokens that followed an earlier occurrence of the "
                                          "answer's last tokens in prompt or answer are checked in one step; the "
                                          "answer is the same, sooner where it copies (0: off)")
    prompt_lookup_min: int = _opt(4, "shortest match of the answer's last tokens that proposes a draft")
    prompt_lookup_max: int = _opt(8, "longest match looked for (the longest found proposes)")
    max_waiting: int = _opt(1024, "most requests waiting for a running slot before new ones are refused")
    kv_cache_space: float = _opt(2.0, "KV cache budget in GiB")
    num_kv_blocks: int | None = _opt(None, "KV cache blocks (overrides --kv-cache-space)")
    kv_cache_prefault: bool = _opt(True, "CPU: after start, make the KV cache's memory resident in the background, "
                                         "at the lowest priority and only while no request runs, so steps do not "
                                         "fault its pages in (--no-kv-cache-prefault: on first use)")
    packed_weights_cache: bool = _opt(True, "a GGUF model's weights, once packed for the kernels, kept in the cache "
                                            "directory (about the file's size) and mapped at later starts "
                                            "(--no-packed-weights-cache: packed again at every start)")
    block_size: int = _opt(16, "tokens per KV cache block")
    enable_prefix_caching: bool = _opt(True, "reuse the KV cache of previously seen prompt prefixes")
    spark_http_markers: bool = _opt(True, "Spark HTTP answers as the document's example writes them: newlines as "
                                          "<ret>, the answer ending with <end> (--no-spark-http-markers: plain text)")
    max_history_tokens: int = _opt(8192, "Spark limit on the tokens of all dialogue contents (error 10003)")
    tgi_compat: str = _opt("spec", "TGI /generate and /generate_stream shape: spec (token id as a list, special "
                                   "null) or hf (the HF text_generation client's; its root POST / answers so "
                                   "either way)", choices=["spec", "hf"])
    vllm_stream: str = _opt("delta", "vLLM /generate stream: delta (the spec: deltas separated by \\0) or "
                                     "cumulative (vLLM's own server: prompt + output so far, one per line)",
                            choices=["delta", "cumulative"])
    full_text_enabled: bool = _opt(False, "the spec's fullTextEnabled: TGI / vLLM stream text is cumulative")
    lora_allowed_urls: str | None = _opt(None, "comma-separated URL prefixes LoRA packs may come from (nothing "
                                               "until set; like ALLOWED_MEDIA_URLS_ENV)")
    lora_refuse_private_addresses: bool = _opt(False, "refuse LoRA pack hosts named in --lora-allowed-urls by DNS "
                                                      "name when they resolve to private, loopback or link-local "
                                                      "addresses (IP literals in the list stay allowed)")
    lora: str | None = _opt(None, "pre-registered adapter NAME=DIR or NAME=URL#md5 (repeatable; env: comma-"
                                  "separated), used by TGI adapter_id, vLLM/OpenAI model, SGLang lora_path",
                            repeatable=True)
    lora_modules: str | None = _opt(None, "vLLM's name for --lora: NAME=PATH items, or JSON objects with name and path "
                                          "(repeatable; several after one flag, as vLLM)", repeatable=True, many=True)
    max_loras: int = _opt(16, "LoRA adapters resident at once (each request may use its own)")
    max_lora_rank: int = _opt(16, "largest LoRA rank accepted")
    lora_cache_dir: str | None = _opt(None, "where downloaded packs are cached (default: <cache>/lora)")
    lora_max_pack_mb: int = _opt(512, "largest LoRA pack accepted, in MiB")
    lora_pack_dir: str | None = _opt(None, "where packs published with POST /v1/lora/packs are kept (default: "
                                           "<cache>/lora-packs)")
    lora_disk_budget_gb: float = _opt(4.0, "disk budget of the LoRA pack cache (least recently used evicted)")
    lora_download_timeout: float = _opt(300.0, "seconds a LoRA pack download may take in all")
    api_key: str | None = _opt(None, "require `Authorization: Bearer <key>` on the HTTP endpoints (off by default)")
    allow_unauthenticated_admin: bool = _opt(False, "let the adapter endpoints (/v1/load_lora_adapter, "
                                                    "/v1/unload_lora_adapter, POST /v1/lora/packs) answer without "
                                                    "--api-key, for a lab: anyone who reaches the server may then "
                                                    "change its adapters (without either they answer 403)")
    allowed_hosts: str | None = _opt(None, "comma-separated Host header values answered (name, name:port, or "
                                           "*.domain for its subdomains); other hosts get 400 and refused "
                                           "WebSocket handshakes, against DNS rebinding (off by default: any)")
    spark_auth: str | None = _opt(None, "Spark WebSocket HMAC key pair KEY:SECRET (repeatable; env: comma-separated); "
                                        "off when unset", repeatable=True)
    spark_app_ids: str | None = _opt(None, "iFlytek's public Spark form (/v3.5/chat ...): the header.app_id values "
                                           "allowed, APP_ID or APP_ID:KEY (that app_id only with URLs signed by "
                                           "that --spark-auth key); repeatable; needs --spark-auth (off: any app_id)",
                                     repeatable=True)
    spark_domains: str | None = _opt(None, "iFlytek's public Spark form: DOMAIN=NAME maps a parameter.chat.domain to "
                                           "the served model's name or a --lora adapter (repeatable; iFlytek's own "
                                           "domains, generalv3.5, 4.0Ultra ..., are the served model unless mapped)",
                                     repeatable=True)
    request_timeout: float = _opt(600.0, "deadline in seconds for requests that do not set their own (Triton/MindIE "
                                         "`timeout` do); past it Spark answers 12100, HTTP 504")
    max_body_mb: float = _opt(8.0, "largest HTTP request body, in MiB (413 beyond)")
    header_timeout: float = _opt(10.0, "seconds a connection may take to send a request's complete headers (idle "
                                      "and slowly-sent sockets are closed)")
    body_timeout: float = _opt(30.0, "seconds a request body may take to arrive in full (408 beyond)")
    body_min_rate_kb: float = _opt(8.0, "KiB/s a request body must average after its first 2 s (408 below; 0: off)")
    timeout_keep_alive: float = _opt(5.0, "seconds an idle keep-alive connection stays open between requests "
                                          "(uvicorn's --timeout-keep-alive)")
    enable_request_id_headers: bool = _opt(True, "vLLM's flag, accepted: every HTTP answer carries X-Request-Id (the "
                                                 "client's, or one made for it); --no-enable-request-id-headers "
                                                 "leaves it out")
    max_request_items: int = _opt(16384, "most entries in any one JSON array or object of a request (token ids, "
                                         "messages, stop strings, bad words...), refused before any per-item work")
    max_seqs_per_request: int | None = _opt(None, "most sequences one request may start: prompts x n (x best_of); "
                                                   "default: half of --max-num-seqs (at least 1), so one request "
                                                   "never holds every running slot; at most --max-num-seqs")
    max_stop_strings: int = _opt(64, "most stop strings one request may bring (400 beyond): each is matched "
                                     "against every token of every sample")
    max_stop_chars: int = _opt(4096, "most characters of all of one request's stop strings together (400 beyond)")
    max_frame_mb: float = _opt(4.5, "largest WebSocket frame, in MiB (the spec allows 4 MB of text)")
    stuck_step_timeout: float = _opt(60.0, "a model step running longer than this turns /health red")
    ssl_certfile: str | None = _opt(None, "TLS certificate (PEM): serve https:// and wss://")
    ssl_keyfile: str | None = _opt(None, "TLS private key (PEM)")
    shutdown_grace: float = _opt(30.0, "seconds running sessions get to finish after SIGTERM before they are ended")
    ws_request_timeout: float = _opt(30.0, "seconds a new WebSocket may wait before sending its request")
    num_threads: int | None = _opt(None, "torch CPU threads (default: torch's choice)")
    native_kernels: bool = _opt(True, "CPU: fused C kernels between the linear layers, compiled once with the "
                                      "machine's C compiler (--no-native-kernels: plain torch ops)")
    remeasure_kernels: bool = _opt(False, "time the linear kernels' probes again (kernel path, oneDNN row limits, "
                                          "the cost model's rates) instead of reading the results an earlier "
                                          "start kept for this model, CPU and kernel build")
    batch_invariant: bool = _opt(False, "keep every batch on the engine's own linear kernels, whose result for a "
                                        "row does not depend on the rows beside it, even where oneDNN's matmul "
                                        "measures faster for large batches (CPUs with AMX tiles, where it is "
                                        "otherwise taken): a seeded request then answers the same alone and in "
                                        "a busy batch, at the kernels' prefill speed. It covers the linears the "
                                        "kernels run: quantized weights (GGUF, int8, int4), and bf16 weights on "
                                        "CPUs with AVX512-BF16 (elsewhere bf16 and fp32 weights run on torch). "
                                        "An earlier answer's cached KV then serves only its own request, so a "
                                        "next turn holding it answers as on a fresh server (it computes that "
                                        "answer's rows again)")
    max_logprobs: int = _opt(20, "most logprobs a request may ask for (top_logprobs, logprobs, prompt_logprobs)")
    max_logprob_entries: int = _opt(1_000_000, "most logprob entries one request's answers may hold: (prompt tokens "
                                               "x (prompt_logprobs + 1) + max_tokens x (top_logprobs + 1)) x n, "
                                               "summed over its prompts; ~100 bytes of JSON each (400 beyond)")
    seed: int | None = _opt(None, "seeds the samples of requests that bring no seed: a run can be repeated exactly")
    chat_template: str | None = _opt(None, "a Jinja chat template, or a file holding one, replacing the model's")
    trust_request_chat_template: bool = _opt(False, "vLLM's flag, accepted: a request's own `chat_template` is "
                                                    "always accepted, rendered in a sandboxed worker with time, "
                                                    "memory and output bounds (as FastDeploy accepts it)")
    task: str = _opt("auto", "what the model is for (vLLM's names): generate (text; embeddings and cosine scores "
                             "are served too), embed (embeddings and cosine scores only), classify / score (a "
                             "checkpoint's sequence-classification head: /classify, and /score and /rerank for a "
                             "one-label head), reward (the head on every token, /pooling); auto: classify for a "
                             "*ForSequenceClassification checkpoint, else generate; embedding is embed's older "
                             "name; transcription is refused (docs/pooling.md)",
                     choices=["auto", "generate", "embedding", "embed", "classify", "score", "reward",
                              "transcription"])
    generation_config: str = _opt("auto", "the sampling defaults of the OpenAI-compatible endpoints (chat, "
                                          "completions, responses, Anthropic messages), as vLLM's flag: auto: what "
                                          "the model's "
                                          "generation_config.json recommends (temperature, top_p, top_k, min_p, the "
                                          "penalties, max_new_tokens), for the knobs a request leaves out; vllm: "
                                          "OpenAI's own defaults; or a directory holding a generation_config.json. "
                                          "The other protocols keep their documented defaults")
    override_generation_config: str | None = _opt(None, "vLLM's JSON object of sampling defaults laid over "
                                                        "--generation-config's, e.g. '{\"temperature\": 0.5}' (the "
                                                        "same knobs, transformers' names)")
    override_pooler_config: str | None = _opt(None, "vLLM's JSON pooler settings: pooling_type (LAST, the default; "
                                                    "MEAN, CLS or ALL), normalize (embeddings, default true), softmax "
                                                    "(the head's activation, default true)")
    allowed_origins: str | None = _opt(None, "browser origins allowed to call the HTTP endpoints (CORS) and open the "
                                             "Spark WebSocket, comma-separated or as vLLM's JSON list, or * (off by "
                                             "default: no CORS headers, any Origin may open the WebSocket)",
                                       repeatable=True)
    structured_output_backend: str = _opt("auto", "the grammar library of structured output (response_format, "
                                                  "guided_*, SGLang json_schema/regex/ebnf, TGI grammar): llguidance "
                                                  "(vLLM calls it guidance); auto picks it",
                                          choices=["auto", "llguidance", "guidance"])
    max_constraint_kb: int = _opt(_CONSTRAINT.max_source_bytes >> 10, "largest structured-output constraint a "
                                  "request may send (a JSON schema, grammar, regex or choice list), in KiB (400 "
                                  "beyond)")
    max_constraint_depth: int = _opt(_CONSTRAINT.max_depth, "deepest nesting of a constraint, $ref and rule chains "
                                                            "followed (400 beyond): its compiler recurses")
    constraint_compile_timeout: float = _opt(_CONSTRAINT.compile_timeout_s, "seconds one constraint may take to "
                                                                            "compile (400 beyond)")
    max_constraint_compiled_mb: int = _opt(_CONSTRAINT.max_compiled_bytes >> 20, "most memory one compiled "
                                           "constraint may hold, in MiB (400 beyond)")
    constraint_cache_mb: int = _opt(_CONSTRAINT.cache_bytes >> 20, "memory of the compiled constraints kept for "
                                    "reuse, in MiB (least recently used dropped)")
    max_constraint_step_ms: float = _opt(_CONSTRAINT.max_step_ms, "most milliseconds one client's grammar masks "
                                         "may take in one engine step (its constrained answers end with an error "
                                         "beyond): every stream in the step waits for them")
    constraint_compile_workers: int = _opt(_CONSTRAINT.workers, "constraints compiled at once, each in its own "
                                                                "worker process")
    guided_decoding_backend: str | None = _opt(None, "vLLM's older name for --structured-output-backend",
                                               choices=["auto", "llguidance", "guidance"])
    tool_call_parser: str = _opt("hermes", "how tool calls are written into the prompt and read back, in the model's "
                                           "own form: hermes (<tool_call>{json}</tool_call>: Qwen, Hermes, ChatML "
                                           "models), llama3_json (Llama 3.1+ JSON calls), mistral ([TOOL_CALLS]), "
                                           "pythonic ([f(a=1)]: Llama 3.2/4)",
                                 choices=["hermes", "llama3_json", "mistral", "pythonic"])
    reasoning_parser: str | None = _opt(None, "split thinking models' answers into reasoning_content and content: "
                                              "qwen3, deepseek_r1 (<think>...</think>) or granite (off by "
                                              "default: the thinking stays in content)",
                                        choices=["qwen3", "deepseek_r1", "granite"])
    enable_reasoning: bool = _opt(False, "vLLM's older switch for --reasoning-parser, which it needs; a parser "
                                         "alone turns reasoning on")
    enable_auto_tool_choice: bool = _opt(True, "vLLM's flag: tool_choice auto parses calls out of free answers "
                                               "(--no-enable-auto-tool-choice refuses auto with a 400)")
    responses_store_max_items: int = _opt(1000, "most responses kept for GET /v1/responses/{id} and "
                                                "previous_response_id (store: true); least recently used evicted")
    responses_store_max_mb: float = _opt(64.0, "memory of the kept responses (their JSON), in MiB; least recently "
                                               "used evicted, and a response larger than all of it is not kept")
    log_level: str = _opt("info", "debug, info, warning or error",
                          choices=["debug", "info", "warning", "error"])
    config: str | None = _opt(None, "config file with any of these settings: TOML, or YAML (.yaml / .yml) as vLLM's "
                                    "--config")

    def __post_init__(self) -> None:
        if self.enable_reasoning and not self.reasoning_parser:  # as vLLM refused it
            raise ValueError("--enable-reasoning requires --reasoning-parser (qwen3, deepseek_r1 or granite)")
        # One request may hold at most half of the running slots by default, so another client always gets
        # one; more than all of them is a mistake in the settings, refused at start.
        if self.max_seqs_per_request is None:
            self.max_seqs_per_request = max(1, self.max_num_seqs // 2)
        elif self.max_seqs_per_request > self.max_num_seqs:
            raise ValueError(f"--max-seqs-per-request {self.max_seqs_per_request} is more than --max-num-seqs "
                             f"{self.max_num_seqs}: one request could never start that many sequences")
        elif self.max_seqs_per_request < 1:
            raise ValueError("--max-seqs-per-request must be at least 1")
        if self.scheduler_cost_model is not None:
            CostModel.parse(self.scheduler_cost_model)  # refused at start, naming the flag
        parse_override(self.override_generation_config)  # likewise, before the model loads
        if self.generation_config not in ("auto", "vllm"):
            if not (Path(self.generation_config) / "generation_config.json").is_file():
                raise ValueError(f"--generation-config {self.generation_config}: auto, vllm, or a directory holding "
                                 "a generation_config.json")
            try:
                recommended_sampling(self.generation_config)
            except ValueError as exc:
                raise ValueError(f"--generation-config: {exc}") from None

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_allowed_urls or self.lora or self.lora_modules or self.lora_shared_dir)

    @property
    def engine_urls(self) -> list[str]:
        return [u.strip() for u in (self.engine_url or "").split(",") if u.strip()]

    def remote_engine(self):  # -> fleet.client.RemoteEngine
        """The engine of a front end with no model (--engine-url): the fleet client, speaking the
        sampling table's OpenAI vocabulary to its backends."""
        from bridges.openai_fields import openai_fields
        from fleet.client import RemoteEngine

        return RemoteEngine(self.engine_urls, openai_fields, tokenizer_source=self.tokenizer or self.model,
                            served_model_name=self.served_model_name, api_key=self.engine_api_key,
                            max_model_len=self.max_model_len, chat_template=self.chat_template)

    def lora_sources(self) -> dict[str, str]:
        return {**parse_pairs(self.lora, "=", "--lora", "NAME=DIR or NAME=URL#md5"),
                **parse_lora_modules(self.lora_modules)}

    @property
    def origins(self) -> list[str]:
        """Comma-separated, or vLLM's JSON list form (``'["*"]'``)."""
        value = (self.allowed_origins or "").strip()
        if value.startswith("["):
            try:
                items = json.loads(value)
            except ValueError:
                raise ValueError(f"--allowed-origins {value!r}: not a JSON list of origins") from None
            if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
                raise ValueError(f"--allowed-origins {value!r}: a JSON list must hold origin strings")
            return [o.strip() for o in items if o.strip()]
        return [o.strip() for o in value.split(",") if o.strip()]

    @property
    def hosts(self) -> list[str]:
        return [h.strip().lower() for h in (self.allowed_hosts or "").split(",") if h.strip()]

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, served_model_name=self.served_model_name, tokenizer=self.tokenizer, device=self.device,
            dtype=DTYPE_ALIASES.get(self.dtype, self.dtype),
            quantization=self.quantization, linear_activations=self.linear_activations,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold, block_size=self.block_size,
            kv_cache_space_gib=self.kv_cache_space, max_logprobs=self.max_logprobs, seed=self.seed,
            chat_template=self.chat_template, num_kv_blocks=self.num_kv_blocks,
            kv_cache_prefault=self.kv_cache_prefault, packed_weights_cache=self.packed_weights_cache,
            enable_prefix_caching=self.enable_prefix_caching, max_waiting=self.max_waiting,
            max_stop_strings=self.max_stop_strings, max_stop_chars=self.max_stop_chars,
            num_threads=self.num_threads, native_kernels=self.native_kernels,
            remeasure_kernels=self.remeasure_kernels, batch_invariant=self.batch_invariant,
            max_loras=self.max_loras if self.lora_enabled else 0,
            max_lora_rank=self.max_lora_rank, num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
            constraint_budget=self.constraint_budget(),
            task=self.task, override_pooler_config=self.override_pooler_config,
            cost_model=self.scheduler_cost_model,
        )

    def constraint_budget(self) -> ConstraintBudget:
        return ConstraintBudget(
            max_source_bytes=self.max_constraint_kb << 10, max_depth=self.max_constraint_depth,
            compile_timeout_s=self.constraint_compile_timeout,
            max_compiled_bytes=self.max_constraint_compiled_mb << 20, cache_bytes=self.constraint_cache_mb << 20,
            workers=max(1, self.constraint_compile_workers), max_step_ms=self.max_constraint_step_ms)


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names


def parse_lora_modules(value: str | None) -> dict[str, str]:
    """vLLM's --lora-modules items: NAME=PATH, or a JSON object {"name": ..., "path": ...}."""
    modules: dict[str, str] = {}
    for item in _split_items(value):
        if item.startswith("{"):
            try:
                obj = json.loads(item)
                modules[str(obj["name"])] = str(obj["path"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH or "
                                 '{"name": ..., "path": ...}') from None
        else:
            modules.update(parse_pairs(item, "=", "--lora-modules", "NAME=PATH"))
    return modules


def _split_items(value: str | None) -> list[str]:
    """Comma-joined items of a repeatable setting; commas inside a JSON object do not split it."""
    items, depth, current = [], 0, ""
    for ch in value or "":
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += ch
    items.append(current.strip())
    return [i for i in items if i]


def parse_pairs(value: str | None, sep: str, flag: str, form: str) -> dict[str, str]:
    """A repeatable setting's comma-joined ``NAME<sep>VALUE`` items as a dict; errors name the flag."""
    pairs = {}
    for item in (value or "").split(","):
        if item.strip():
            name, found, rest = item.strip().partition(sep)
            if not found or not name or not rest:
                raise ValueError(f"{flag} {item!r}: expected {form}")
            pairs[name] = rest
    return pairs


def _base_type(tp: Any) -> type:
    if isinstance(tp, str):
        tp = eval(tp, {"typing": typing}, {})  # annotations are strings under PEP 563
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _convert(name: str, kind: type, value: Any) -> Any:
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if kind is str and isinstance(value, dict | list):  # a config file's mapping for a JSON setting (as vLLM's)
        return json.dumps(value)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(Settings):
        kind = _base_type(f.type)
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        help_text = f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}; default: {default}]"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif f.metadata.get("many"):  # vLLM style: --lora-modules a=/x b=/y, and repeatable
            parser.add_argument(flag, dest=f.name, action="extend", nargs="+", default=None, help=help_text)
        elif f.metadata.get("repeatable"):
            parser.add_argument(flag, dest=f.name, action="append", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text,
                                choices=launch_compat.foreign_choices(f.name, f.metadata.get("choices")))


def read_config_file(path: str) -> dict[str, Any]:
    """A TOML file, or YAML (.yaml / .yml, as vLLM's --config): a flat mapping of setting names."""
    if path.endswith((".yaml", ".yml")):
        import yaml

        with open(path, encoding="utf-8") as fh:
            try:
                data = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"{path}: not valid YAML: {exc}") from None
    else:
        with open(path, "rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{path}: not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of setting names to values")
    return data


SECRET_SETTINGS = ("api_key", "spark_auth", "engine_api_key")  # never printed


def resolve(cli: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> Settings:
    return resolve_with_sources(cli, environ)[0]


def describe(settings: Settings, sources: dict[str, str], everything: bool = False) -> str:
    """One line: each setting that differs from its default, its value and where it came from (flag, env,
    file); with ``everything`` (the CLI's --log-level debug) every setting. Secrets masked."""
    parts = []
    for f in fields(Settings):
        value = getattr(settings, f.name)
        source = sources.get(f.name, "default")
        if not everything and (source == "default" or value == f.default):
            continue  # a default, or set to its default (values derived from others are shown where set)
        shown = "***" if f.name in SECRET_SETTINGS and value else value
        parts.append(f"{f.name}={shown!r}({source})")
    if not parts:
        return "settings: all defaults (--log-level debug lists them)"
    return "settings: " + " ".join(parts)


def resolve_with_sources(cli: dict[str, Any] | None = None, environ: dict[str, str] | None = None,
                         launch: launch_compat.Launch | None = None) -> tuple[Settings, dict[str, str]]:
    """The settings, and for each one set by other than its default: "flag", "env" or "file". vLLM's and
    FastDeploy's flags and config keys go through launch_compat's table; ``launch`` receives what they did."""
    launch = launch if launch is not None else launch_compat.Launch()
    cli = launch.take({k: v for k, v in (cli or {}).items() if v is not None}, "flag")
    cli = {k: (",".join(v) if isinstance(v, list) else v) for k, v in cli.items() if v is not None}
    env: Mapping[str, str] = os.environ if environ is None else environ
    config_path = cli.get("config") or env.get(f"{ENV_PREFIX}CONFIG")
    from_file: dict[str, Any] = {}
    if config_path:
        from_file = launch.take({k.replace("-", "_"): v for k, v in read_config_file(config_path).items()},
                                config_path)
        from_file = {k: (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in from_file.items()}
        known = {f.name for f in fields(Settings)}
        unknown = sorted(set(from_file) - known)
        if unknown:
            raise ValueError(f"{config_path}: unknown setting(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in fields(Settings):
        kind = _base_type(f.type)
        env_value = env.get(f"{ENV_PREFIX}{f.name.upper()}")
        if f.name in cli:
            values[f.name], sources[f.name] = _convert(f.name, kind, cli[f.name]), "flag"
        elif env_value is not None and env_value != "":
            values[f.name], sources[f.name] = _convert(f.name, kind, env_value), "env"
        elif f.name in from_file:
            values[f.name], sources[f.name] = _convert(f.name, kind, from_file[f.name]), "file"
    return Settings(**values), sources
