"""A transformers model with no weights in it: its modules, config and buffers (RoPE's frequencies), its
parameters on the meta device until ``fill`` puts one in. The engine's model reads the parameters it
needs from it (norms, the embedding) and has the projections read one at a time from their source
(engine/models/weights.py, ``dense_source``), so a load never holds a whole dense copy of the model."""

from __future__ import annotations

from typing import Any

import torch


def empty_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.requires_grad_(False)
    # Buffers are computed from the config, not read: the rotary embedding's are made again on the CPU.
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if not hasattr(module, "inv_freq"):
            raise ValueError(f"{type(module).__name__} ({name}) has buffers that are not RoPE frequencies")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, type(module)(config=model.config, device="cpu"))
    return model


def fill(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put one parameter (by its state-dict name) in place of its meta tensor."""
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(tensor, requires_grad=False))


def unfilled(model: torch.nn.Module) -> list[str]:
    """The parameters still on the meta device."""
    return [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
