"""Device and dtype choice: cpu, cuda, or Ascend npu (torch_npu imported only when asked for)."""

from __future__ import annotations

import importlib

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "npu":
            return torch.float16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {name!r}")
    return _DTYPES[name]
