"""Peak memory of loading a model, in a process of its own: ``python -m tests.engine.load_memory DIR``
prints one JSON line with the engine's weight bytes and the peak resident memory the load added.

The peak is VmHWM at the end less the resident memory just before the engine starts (the peak is
reset there). A first
engine on ``--warm DIR`` (a tiny checkpoint of the same family and tokenizer) is started and dropped before
that baseline, so what Python imports and makes once per process (transformers' model code, the tokenizer's
modules, the template compiler) is not counted as the load's. ``--from-pretrained`` loads through
transformers' ``from_pretrained`` instead of reading the safetensors in place (the fallback path), to
compare the two."""

from __future__ import annotations

import argparse
import gc
import json
import resource
from typing import Any

import torch

from engine import loader
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_bytes() -> int:
    """The process's peak resident memory (VmHWM: this process image's own; ``ru_maxrss`` would also hold
    the parent's size at the fork that started it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM again from the resident memory now (Linux 4.0+: ``5`` to clear_refs); where that is not
    allowed the peak keeps counting from the process's start, which only overstates the load's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def tensor_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(an identity of its memory, its size): storages shared between tensors count once."""
    if t.is_mkldnn:  # oneDNN's prepacked layout: no storage to look at
        return id(t), t.numel() * t.element_size()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def weight_bytes(model: Any) -> int:
    """Bytes of every tensor the engine's model holds (weights, packed copies, fallbacks, RoPE tables)."""
    seen: dict[int, int] = {}
    visited: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in visited or depth > 8:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not obj.is_meta:
                key, size = tensor_bytes(obj)
                seen[key] = max(seen.get(key, 0), size)
            return
        if isinstance(obj, list | tuple):
            for item in obj:
                walk(item, depth + 1)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth + 1)
            return
        fields = getattr(obj, "__dict__", None)
        if fields is None and hasattr(obj, "__slots__"):
            fields = {name: getattr(obj, name, None) for name in obj.__slots__}
        if fields is None or type(obj).__module__.split(".")[0] not in ("engine", "builtins"):
            return
        for name, item in fields.items():
            if name not in ("kernels", "builder"):  # the C library handle; the builder's own copies are gone
                walk(item, depth + 1)

    walk(model, 0)
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--warm", help="a tiny checkpoint started first, outside the measurement")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--native-kernels", action="store_true")
    parser.add_argument("--from-pretrained", action="store_true")
    args = parser.parse_args()
    if args.from_pretrained:
        loader._safetensors_in_place = lambda model_dir, hf_config: None

    def start(model: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, dtype=args.dtype, native_kernels=args.native_kernels,
                                      num_kv_blocks=4, kv_cache_prefault=False, max_loras=0))

    if args.warm:
        start(args.warm)
        gc.collect()
    reset_peak()
    baseline = resident_bytes()
    engine = start(args.model)
    peak = peak_bytes()
    print(json.dumps({"weight_bytes": weight_bytes(engine.model), "peak_added": peak - baseline,
                      "resident_added": resident_bytes() - baseline, "baseline": baseline}))


if __name__ == "__main__":
    main()
