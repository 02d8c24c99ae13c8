"""Device and dtype choice: cpu, cuda, or Ascend npu (torch_npu imported only when asked for)."""

from __future__ import annotations

import importlib
import logging
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# bf16 becomes the CPU default only where it is clearly faster than fp32 (native AVX512-BF16 / AMX);
# where it is emulated it is slower, and fp32 stays.
_BF16_MIN_SPEEDUP = 1.5


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if name == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise RuntimeError("--device npu needs torch_npu, which is not installed") from exc
        return torch.device("npu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or npu, not {name!r}")
    return torch.device(name)


def _matmul_seconds(dtype: torch.dtype, rows: int = 32, size: int = 1024, repeats: int = 8) -> float:
    x = torch.randn(rows, size).to(dtype)
    w = torch.randn(size, size).to(dtype)
    F.linear(x, w)  # warm-up (kernel selection)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def cpu_bf16_speedup() -> float:
    """How much faster a batched bf16 matmul runs than fp32 on this CPU (measured, ~20 ms)."""
    return _matmul_seconds(torch.float32) / _matmul_seconds(torch.bfloat16)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "npu":
            return torch.float16
        speedup = cpu_bf16_speedup()
        chosen = torch.bfloat16 if speedup >= _BF16_MIN_SPEEDUP else torch.float32
        logger.info("dtype auto: bf16 matmul is %.1fx fp32 on this CPU -> %s", speedup,
                    str(chosen).removeprefix("torch."))
        return chosen
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {name!r}")
    return _DTYPES[name]
