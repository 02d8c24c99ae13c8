"""Engine settings (names follow vLLM's where they mean the same)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.constraint_budget import ConstraintBudget


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    served_model_name: str | None = None
    tokenizer: str | None = None  # a tokenizer directory or .gguf in place of the model's own
    device: str = "auto"  # auto | cpu | cuda | npu
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 16  # floor of the long-prompt prefill cap while others decode (0: no cap)
    block_size: int = 16
    kv_cache_space_gib: float = 2.0
    num_kv_blocks: int | None = None  # overrides kv_cache_space_gib
    kv_cache_prefault: bool = True  # CPU: fault the KV pool in on idle CPU after start (engine/resident.py)
    packed_weights_cache: bool = True  # a GGUF's packed projections kept on disk and mapped (engine/packed_cache.py)
    enable_prefix_caching: bool = True
    max_waiting: int = 1024
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    quantization: str = "auto"  # auto | none | int8 | int4 | gguf (engine/models/weights.py)
    linear_activations: str = "bf16"  # bf16 | int8 | int8-prompt: what 4-bit weights multiply (models/weights.py)
    native_kernels: bool = True  # CPU: fused C kernels between the linears (compiled at first use)
    # time the kernel probes again instead of reading an earlier start's results (engine/models/tuning.py)
    remeasure_kernels: bool = False
    # every batch on the packed kernels, never oneDNN's large-batch matmuls (which round a row by its batch;
    # start-up takes them only where they measure 1.25x faster, CPUs with AMX tiles): engine/models/weights.py;
    # and an answer's cached blocks serve only its own sequence (LLMEngine._build_step)
    batch_invariant: bool = False
    max_loras: int = 0  # resident LoRA adapter slots (0: LoRA off)
    max_lora_rank: int = 16
    max_logprobs: int = 20  # most logprobs a request may ask for (top_logprobs, prompt_logprobs)
    # stop strings one request may bring, and their characters in all: the matcher's tables and the text it
    # holds back grow with them (engine/detokenizer.py)
    max_stop_strings: int = 64
    max_stop_chars: int = 4096
    seed: int | None = None  # seeds the samples of requests that bring no seed (reproducible runs)
    chat_template: str | None = None  # a Jinja template (or a file holding one) replacing the model's
    # prompt-lookup speculation for greedy and sampled requests (engine/speculation.py; vLLM's "ngram" method): up to
    # this many tokens that followed an earlier occurrence of the last n tokens (prompt_lookup_max >= n >=
    # prompt_lookup_min) are verified in one step (0: off)
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 4
    prompt_lookup_max: int = 8
    constraint_budget: ConstraintBudget = field(default_factory=ConstraintBudget)  # structured output's limits
    # what the model is for (vLLM's --task; engine/pooling.py): auto picks classify for a checkpoint with a
    # sequence-classification head, else generate
    task: str = "auto"
    override_pooler_config: str | None = None  # vLLM's JSON: pooling_type (LAST/MEAN/CLS/ALL), normalize, softmax
    # the scheduler's cost model pinned, "step=S,decode_key=D,attention_key=A" (engine/cost_model.py), so
    # replicas on one hardware class schedule alike; None: measured at start
    cost_model: str | None = None
