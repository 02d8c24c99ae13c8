"""The loader: a served model resolved, read, quantized (int8: calibrated first) and tuned, with its KV pool,
tokenizer and the facts the engine core serves it by. ``load(config)`` does all of start-up's work that is
not the serving core's; ``LLMEngine(config, loaded)`` then only builds scheduler, runner and the rest."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import PagedKVCache
from engine.checkpoint_names import EMBEDDING
from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.device import resolve_device, resolve_dtype
from engine.file_identity import content_digest
from engine.generation_config import recommended_sampling_or_none
from engine.gguf_file import GgufFile
from engine.gguf_metadata import resolve_served_model
from engine.gguf_parse import shared_gguf_readers
from engine.gguf_weights import BlockWeights, GgufWeights
from engine.heap import release_freed_memory
from engine.kernels import CpuKernels, load_cpu_kernels
from engine.model_loader import EMBEDDED_MODEL_NAME, default_cache_dir, resolve_model_dir
from engine.models import LlamaForCausalLM, model_class
from engine.models.skeleton import WeightSource, parameter_shapes, read_skeleton
from engine.models.tuning import TuningCache, tuning_cache
from engine.models.weights import resolve_activations, resolve_quantization
from engine.packed_cache import PackedCache
from engine.pooling import Pooler, PoolerConfig, matryoshka_of, read_head, resolve_task
from engine.prompts import read_chat_template
from engine.protocol import ModelInfo
from engine.quant import cache as quant_cache
from engine.quant.calibration import Sampler, calibrate, sample_on_engine
from engine.resident import Prefault
from engine.safetensors_weights import SafetensorsWeights
from engine.tokenizer_files import load_tokenizer

logger = logging.getLogger(__name__)

_LONG_LOAD_BYTES = 256 << 20  # weights from this size up are loaded with progress lines


@dataclass(frozen=True, slots=True)
class Loaded:
    """A loaded model and what the engine core needs to serve it."""

    model: LlamaForCausalLM
    tokenizer: Any
    kv_cache: PagedKVCache
    kv_prefault: Prefault | None  # the pool faulted in on idle CPU; the core tells it when the engine is busy
    eos_token_ids: tuple[int, ...]
    hf_config: Any  # transformers' config of the checkpoint (LoRA reads its projections' shapes)
    model_dir: Path
    max_model_len: int
    task: str
    pooler: Pooler
    dtype: torch.dtype
    device: torch.device
    quantization: str
    cost_model: CostModel
    model_info: ModelInfo
    started: float  # time.monotonic() when loading began (the engine's ready line counts from it)
    packed_cache: PackedCache | None = None  # where a GGUF's packed projections were mapped from or are kept


@dataclass(slots=True)
class _Checkpoint:
    """Where the weights come from: the HF directory (or GGUF metadata directory), the GGUF file if any,
    transformers' config, the model class, and the weights read in place (None: transformers loads them)."""

    model_dir: Path
    gguf: Path | None
    hf_config: Any
    model_cls: type[LlamaForCausalLM]
    in_place: WeightSource | None


def load(config: EngineConfig) -> Loaded:
    """Resolve, read, quantize and tune ``config.model``; refuses what cannot be served before loading weights."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    started = time.monotonic()
    pinned = CostModel.parse(config.cost_model) if config.cost_model else None  # a bad value: refused first
    device = resolve_device(config.device)
    # On a cold cache the compiler (~20 s of one core) runs while the model converts (a Python loop).
    kernel_build = _in_background(load_cpu_kernels) if config.native_kernels and device.type == "cpu" else None
    with shared_gguf_readers():  # a cold start reads a GGUF file's tokenizer and config: one parse for both
        ckpt = _resolve_checkpoint(config)
        _check_context(config, getattr(ckpt.hf_config, "max_position_embeddings", None))  # before the weights
        # --task, and the checkpoint's sequence-classification head: refused before any loading too
        head = read_head(ckpt.model_dir)
        task = resolve_task(config.task, getattr(ckpt.hf_config, "architectures", None) or (), head is not None,
                            config.model or EMBEDDED_MODEL_NAME)
        pooler_config = PoolerConfig.parse(config.override_pooler_config)
        kernels = kernel_build.result() if kernel_build is not None else None
        dtype = _dtype(config, kernels, ckpt.gguf is not None, device)
        weight_bytes = _weight_bytes(ckpt, dtype)
        # The pool is sized (and refused) here, before the weights load, but faulted in only at the end: the
        # load is itself page faults on both cores (the repack's fresh pages), which a pass over the pool
        # beside it slows, and the cost model's timings are taken on a quiet machine.
        kv_cache = _make_kv_cache(config, ckpt, dtype, device, weight_bytes)
        quantization = resolve_quantization(config.quantization, ckpt.gguf is not None, kernels, dtype, device)
        resolve_activations(config.linear_activations, quantization)  # refuses a bad pair before loading
        stored, cache_file = _stored_weights(ckpt, quantization, config.packed_weights_cache)
    packed_cache = stored.cache if isinstance(stored, BlockWeights) else None
    try:
        tokenizer = _tokenizer(config, ckpt)
        model = _build_model(config, ckpt, tokenizer, dtype, device, quantization, stored, cache_file, weight_bytes)
        max_model_len = _max_model_len(config, model, ckpt.hf_config)
        name = config.served_model_name or (EMBEDDED_MODEL_NAME if config.model in (None, "", "embedded")
                                            else ckpt.model_dir.name)
        pooler = _make_pooler(task, name, ckpt.hf_config, head, pooler_config)
        model_info = ModelInfo(name=name, path=str(ckpt.model_dir), model_type=ckpt.hf_config.model_type,
                               max_model_len=max_model_len, vocab_size=model.embed.shape[0],
                               dtype=str(dtype).removeprefix("torch."), device=str(device),
                               chat_template_tools="tools" in (tokenizer.chat_template or ""),
                               task=task, pooling_tasks=pooler.tasks, labels=_labels(ckpt.hf_config, pooler),
                               recommended_sampling=tuple(recommended_sampling_or_none(ckpt.model_dir).items()))
        release_freed_memory()  # the load's transient copies (fp32 dequantized tensors, the file's pages) leave RSS
        cost_model = pinned or _cost_model(model)
        if packed_cache is not None:
            if packed_cache.mapped_bytes:
                logger.info("weights: %.2f GiB of packed projections mapped from %s",
                            packed_cache.mapped_bytes / (1 << 30), packed_cache.directory)
            packed_cache.commit_in_background()  # what this start packed, to disk while the engine serves
    except BaseException:
        if packed_cache is not None:  # its staged files and its lock, let go now rather than at exit
            packed_cache.abandon()
        raise
    kv_prefault = kv_cache.prefault_in_background() if config.kv_cache_prefault else None
    return Loaded(model=model, tokenizer=tokenizer, kv_cache=kv_cache, kv_prefault=kv_prefault,
                  eos_token_ids=_eos_ids(tokenizer, ckpt.model_dir), hf_config=ckpt.hf_config,
                  model_dir=ckpt.model_dir, max_model_len=max_model_len, task=task, pooler=pooler, dtype=dtype,
                  device=device, quantization=quantization, cost_model=cost_model,
                  model_info=model_info, started=started, packed_cache=packed_cache)


def _resolve_checkpoint(config: EngineConfig) -> _Checkpoint:
    """The model's directory and config, and its weights read in place where the engine maps them."""
    from transformers import AutoConfig

    model_dir, gguf = resolve_served_model(config.model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cls = model_class(hf_config.model_type)  # refuses an unsupported family before any loading
    in_place: WeightSource | None = (_in_place(gguf, hf_config) if gguf is not None
                                     else _safetensors_in_place(model_dir, hf_config))
    if gguf is not None and in_place is None:
        model_dir = resolve_model_dir(config.model)  # transformers' conversion, written once
    return _Checkpoint(model_dir, gguf, hf_config, model_cls, in_place)


def _dtype(config: EngineConfig, kernels: CpuKernels | None, is_gguf: bool, device: torch.device) -> torch.dtype:
    if config.dtype == "auto" and _packed_kernels_run(kernels, config.quantization, is_gguf):
        return torch.bfloat16  # the packed kernels take bf16 activations
    return resolve_dtype(config.dtype, device)


def _tokenizer(config: EngineConfig, ckpt: _Checkpoint) -> Any:
    """The model's tokenizer, or --tokenizer's, with --chat-template in place of its own template."""
    tokenizer = load_tokenizer(_tokenizer_dir(config.tokenizer) if config.tokenizer else ckpt.model_dir)
    vocab_size = ckpt.hf_config.vocab_size
    if len(tokenizer) > vocab_size:  # ids past the embedding would fail a shared step
        raise ValueError(f"--tokenizer {config.tokenizer or ckpt.model_dir} has {len(tokenizer)} tokens; the "
                         f"model's vocabulary has {vocab_size}")
    if config.chat_template:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return tokenizer


def _build_model(config: EngineConfig, ckpt: _Checkpoint, tokenizer: Any, dtype: torch.dtype, device: torch.device,
                 quantization: str, stored: Any, cache_file: Path | None, weight_bytes: int) -> LlamaForCausalLM:
    """The engine's model: the checkpoint read (int8: calibrated and rounded), converted, and its kernels tuned."""
    calibrating = quantization == "int8" and stored is None  # the calibration runs the whole model
    hf_model, dense_source = _read_checkpoint(ckpt, dtype, quantization, whole=calibrating)
    # int8 rounds against the layers' calibrated inputs (GPTQ): measured once, then the cache serves
    hessians = calibrate(hf_model, tokenizer, _calibration_sampler(config)) if calibrating else None
    if hessians is not None:
        logger.info("int8: rounding each linear against its calibrated inputs (GPTQ), once")
    building = time.monotonic()
    model = ckpt.model_cls(hf_model, dtype, device, config.native_kernels, quantization, stored,
                           linear_activations=config.linear_activations, batch_invariant=config.batch_invariant,
                           hessians=hessians,
                           dense_source=dense_source, show_progress=weight_bytes > _LONG_LOAD_BYTES,
                           tuning=_tuning(config, ckpt, quantization, dtype, device))
    if hessians is not None:
        logger.info("int8: %d weights rounded in %.1fs", len(model.builder.made), time.monotonic() - building)
    if cache_file is not None and model.builder.made:
        quant_cache.save(cache_file, model.builder.made)
    del hf_model, dense_source, stored
    if ckpt.in_place is not None:
        ckpt.in_place.release_all()
    logger.info("weights: --quantization %s; %s", quantization, model.linears_summary)
    return model


def _read_checkpoint(ckpt: _Checkpoint, dtype: torch.dtype, quantization: str, whole: bool) -> tuple[Any, Any]:
    """(transformers' model or the in-place skeleton, the dense weights' reader or None). ``whole``: every
    weight read now (the calibration runs the whole model)."""
    # Quantizing starts from the checkpoint's own precision, not from a bf16 rounding of it.
    load_dtype: torch.dtype | str = dtype if quantization in ("none", "gguf") else "auto"
    if ckpt.in_place is None:
        from transformers import AutoModelForCausalLM  # its import brings transformers' model code: only here

        return AutoModelForCausalLM.from_pretrained(ckpt.model_dir, dtype=load_dtype), None
    in_place = ckpt.in_place
    return read_skeleton(in_place, ckpt.hf_config,
                         load_dtype if isinstance(load_dtype, torch.dtype) else in_place.auto_dtype, whole=whole)


def _calibration_sampler(config: EngineConfig) -> Sampler:
    """int8's calibration text, sampled by a helper engine core over the same checkpoint in bf16 with the
    fused kernels (about 3x faster than transformers' fp32 forward; docs/performance.md has the figures).
    A flat sequence: load in bf16, serve the samples on a bare core, drop both. Its start-up lines are held
    back: operators see the calibration's."""

    def sample(starts: list[list[int]], length: int, seed: int) -> list[list[int]]:
        from engine.llm_engine import EngineCore  # the serving core imports this module

        block = config.block_size
        blocks = len(starts) * (-(-(max(map(len, starts)) + length + 1) // block))
        helper_config = dataclasses.replace(  # what the calibration needs
            config, quantization="none", max_num_seqs=len(starts), num_kv_blocks=blocks, max_model_len=None,
            enable_prefix_caching=False, max_loras=0, linear_activations="bf16", kv_cache_prefault=False,
            cost_model=None)
        with _log_level(logging.WARNING, __name__, "engine.llm_engine", "engine.models.weights"):
            helper = EngineCore(helper_config, load(helper_config))
        return sample_on_engine(helper, starts, length, seed)  # the helper and its KV mapping go with this frame

    return sample


def _check_context(config: EngineConfig, max_position: int | None) -> None:
    """--max-model-len within the model's training length: positions past it give no sensible answers, so
    a longer one is refused, never shortened quietly. Checked from the checkpoint's config before its
    weights load (a mistyped flag costs no model load) and again against the built model."""
    if config.max_model_len and max_position and config.max_model_len > max_position:
        raise ValueError(f"--max-model-len {config.max_model_len} is more than this model's context "
                         f"({max_position} tokens); leave it out or give at most that")


def _max_model_len(config: EngineConfig, model: LlamaForCausalLM, hf_config: Any) -> int:
    """--max-model-len, within the model's training length and its sliding window."""
    _check_context(config, model.max_position)
    max_model_len = config.max_model_len or model.max_position
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < max_model_len:
        # Our attention is full attention; past the window it would differ from the model's.
        logger.warning("model uses a %d-token sliding window: context capped at %d tokens", window, window)
        return window
    return max_model_len


def _cost_model(model: LlamaForCausalLM) -> CostModel:
    """The scheduler's costs where --scheduler-cost-model pins none: the model's, measured at start where its
    kernels' rates were (engine/models/tuning.py caches them), else the default figures."""
    return CostModel(attention_cost_per_key=model.attention_cost_per_key(),
                     decode_cost_per_key=model.decode_cost_per_key(), decode_step_cost=model.decode_step_cost(),
                     decode_row_cost=model.decode_row_cost(), measured=model.decode_costs_measured)


def _make_pooler(task: str, name: str, hf_config: Any, head: tuple[torch.Tensor, torch.Tensor | None] | None,
                 config: PoolerConfig) -> Pooler:
    hidden = hf_config.hidden_size
    if head is not None and (head[0].dim() != 2 or head[0].shape[1] != hidden):
        raise ValueError(f"the checkpoint's score.weight has shape {tuple(head[0].shape)}; this model's hidden "
                         f"size is {hidden}")
    if task == "generate" and head is not None:
        logger.warning("the checkpoint has a classification head (score.weight) but --task generate: it is not "
                       "used (--task classify or score uses it)")
    used = head if task in ("classify", "score", "reward") else None
    pooler = Pooler(task, name, hidden, used, config, matryoshka_of(hf_config))
    logger.info("task %s: pooling %s%s", task, ", ".join(pooler.tasks),
                f" (a {pooler.num_labels}-label head)" if pooler.num_labels else "")
    return pooler


def _labels(hf_config: Any, pooler: Pooler) -> tuple[str, ...]:
    """The head's labels by index (config.json's id2label; LABEL_<i> where it names none)."""
    id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(pooler.num_labels))


def _make_kv_cache(config: EngineConfig, ckpt: _Checkpoint, dtype: torch.dtype, device: torch.device,
                   weight_bytes: int = 0) -> PagedKVCache:
    """The KV pool the budget holds, refused before any weight loads where it and the weights cannot fit."""
    layers, kv_heads, head_dim = ckpt.model_cls.kv_geometry(ckpt.hf_config)
    per_token = PagedKVCache.bytes_per_token(layers, kv_heads, head_dim, dtype)
    num_blocks = config.num_kv_blocks or int(config.kv_cache_space_gib * (1 << 30)
                                             // (per_token * config.block_size))
    if num_blocks < 2:
        raise ValueError("the KV cache budget holds fewer than 2 blocks; raise --kv-cache-space")
    _check_kv_fits(num_blocks * config.block_size * per_token, device, weight_bytes)
    return PagedKVCache(layers, num_blocks, config.block_size, kv_heads, head_dim, dtype, device)


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_kv_fits(nbytes: int, device: torch.device, weight_bytes: int = 0) -> None:
    """The CPU KV pool is mapped, not written, at start (attention.lazily_zeroed), and faulted in afterwards
    (engine/resident.py), so a budget larger than the machine's memory would not fail here but seconds or
    hours later, killed by the OS. Refuse it now instead, with the weights the model will hold beside it
    (``weight_bytes``, an estimate made before they load)."""
    available = _available_memory_bytes() if device.type == "cpu" else None
    if available is not None and nbytes + weight_bytes > available:
        weights = f" and the weights (~{weight_bytes / (1 << 30):.1f} GiB)" if weight_bytes else ""
        raise ValueError(f"the KV cache budget ({nbytes / (1 << 30):.1f} GiB){weights} are more than this machine's "
                         f"available memory ({available / (1 << 30):.1f} GiB); lower --kv-cache-space")


def _stored_weights(ckpt: _Checkpoint, quantization: str, keep_packed: bool = False) -> tuple[Any, Path | None]:
    """(quantized weights already made, the cache file to save new ones to) for this run's mode; a GGUF's
    blocks read in place are packed through the packed-weights cache where ``keep_packed``."""
    in_place = ckpt.in_place if isinstance(ckpt.in_place, GgufWeights) else None
    gguf = ckpt.gguf
    if quantization in ("none", "auto"):
        return None, None
    if quantization == "gguf" and in_place is not None:
        # read from the file as each projection is built, or mapped from where an earlier start packed them
        cache = PackedCache.beside(ckpt.model_dir, in_place.packed_bytes()) if keep_packed else None
        return in_place.blocks(cache), None
    if in_place is not None:  # int8 / int4 made from a GGUF file's weights
        assert gguf is not None  # GGUF weights are read in place only from a GGUF file
        path = quant_cache.cache_path([gguf], quantization)
        stored = quant_cache.load(path)
        return stored, (path if stored is None else None)
    if quantization == "gguf":
        return _gguf_blocks(gguf, ckpt.hf_config), None
    sources = sorted(ckpt.model_dir.glob("*.safetensors")) or sorted(ckpt.model_dir.glob("*.bin"))
    path = quant_cache.cache_path(sources or [ckpt.model_dir / "config.json"], quantization)
    stored = quant_cache.load(path)
    return stored, (path if stored is None else None)


def _gguf_blocks(gguf: Any, hf_config: Any) -> Any:
    """A GGUF file's own blocks for its linears where it is not read in place: decoded once, then cached."""
    path = quant_cache.cache_path([gguf], "gguf")
    stored = quant_cache.load(path)
    if stored is None:
        from engine.quant.gguf_blocks import read_gguf_linears

        stored = {k: v for k, v in read_gguf_linears(gguf, hf_config).items() if k != EMBEDDING}
        quant_cache.save(path, stored)
    return stored


def _in_place(gguf: Path | None, hf_config: Any) -> GgufWeights | None:
    """The GGUF file's weights, read in place where the engine maps its architecture and types; None
    (and a line saying why) where transformers' conversion has to serve it instead."""
    if gguf is None:
        return None
    weights = GgufWeights(GgufFile(gguf), hf_config)
    if weights.unservable is None:
        return weights
    logger.warning("%s is not read in place (%s): serving a copy converted by transformers, written once to "
                   "the cache directory", gguf.name, weights.unservable)
    return None


def _safetensors_in_place(model_dir: Path, hf_config: Any) -> SafetensorsWeights | None:
    """The HF directory's safetensors weights, read one tensor at a time where the engine maps them;
    None (and a line saying why) where transformers' ``from_pretrained`` has to load them instead."""
    weights = SafetensorsWeights(model_dir, hf_config, parameter_shapes(hf_config))
    if weights.unservable is None:
        return weights
    logger.warning("%s is not read in place (%s): loading it through transformers, which holds a whole copy "
                   "of the weights beside the engine's while it loads", model_dir.name, weights.unservable)
    return None


def _weight_bytes(ckpt: _Checkpoint, dtype: torch.dtype) -> int:
    """What the weights will hold in memory, estimated before they load (for the refusal at start)."""
    if ckpt.in_place is not None:
        return ckpt.in_place.resident_bytes(dtype.itemsize)
    return sum(f.stat().st_size for f in Path(ckpt.model_dir).glob("*.safetensors"))


def _tuning(config: EngineConfig, ckpt: _Checkpoint, quantization: str, dtype: torch.dtype,
            device: torch.device) -> TuningCache | None:
    """Where the kernel probes' results for this model are kept (engine/models/tuning.py)."""
    kernels = load_cpu_kernels() if config.native_kernels and device.type == "cpu" else None
    if kernels is None:
        return None
    sources = [ckpt.gguf] if ckpt.gguf is not None else (sorted(Path(ckpt.model_dir).glob("*.safetensors"))
                                                          or [Path(ckpt.model_dir) / "config.json"])
    cache_dir = default_cache_dir()
    identity = ",".join(content_digest(p, cache_dir) for p in sources)
    settings = f"{quantization}/{config.linear_activations}/{dtype}" + ("/batch-invariant" if config.batch_invariant
                                                                        else "")
    return tuning_cache(cache_dir, identity, torch.get_num_threads(), settings, config.remeasure_kernels)


def _eos_ids(tokenizer: Any, model_dir: Path) -> tuple[int, ...]:
    """The tokenizer's EOS id and generation_config.json's, sorted."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    try:
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(model_dir)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    return tuple(sorted(ids))


def _tokenizer_dir(source: str) -> Path:
    """--tokenizer: a directory of tokenizer files as it is, or a .gguf's (read from its metadata directory)."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return resolve_served_model(str(path))[0]
    if not path.is_dir():
        raise FileNotFoundError(f"--tokenizer {source}: not a directory or a .gguf file")
    return path


@contextmanager
def _log_level(level: int, *names: str) -> Iterator[None]:
    """These loggers at ``level`` for the block."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, saved):
            lg.setLevel(old)


def _in_background(work: Callable[[], Any]) -> Future:
    """``work()`` on a thread of its own; its result (or exception) from the future."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-start")
    try:
        return pool.submit(work)
    finally:
        pool.shutdown(wait=False)


def _packed_kernels_run(kernels: CpuKernels | None, quantization: str, is_gguf: bool) -> bool:
    """Whether the linears will run on the packed kernels, which take bf16 activations (``--dtype auto``
    then means bf16). With AVX512-BF16 they run every mode. With fp32 FMAs alone (AVX2, or AVX-512 without
    BF16: ``linear_isa`` 1) they run the quantized weights
    (the GGUF file's own blocks by default): against torch's fp32 linears held to AVX2, 4-bit weights ran
    1.5-2.8x at 1-8 rows, 0.9-1.2x at 32-128 and 0.85-0.9x at 512 (the head 1.1-2.8x throughout);
    bf16 weights stay with torch's fp32 there (torch's bf16 matmul has no fast AVX2 path)."""
    if kernels is None or kernels.linear_isa == 0:
        return False
    return kernels.linear_isa == 2 or quantization in ("int4", "int8", "gguf") or (quantization == "auto" and is_gguf)
