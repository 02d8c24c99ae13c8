"""A causal LM with no weights in it (engine/models/layout.py's tree, or transformers' own model for what that
does not lay out): its modules, config and buffers (RoPE's frequencies), its parameters on the meta device
until ``fill`` puts one in. The engine's model reads the parameters it needs from it (norms, the embedding)
and has the projections read one at a time from their source (engine/models/weights.py, ``dense_source``),
so a load never holds a whole dense copy of the model. Sources: a GGUF file (engine/gguf_weights.py) and an
HF directory's safetensors (engine/safetensors_weights.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.checkpoint_names import EMBEDDING, HEAD, is_linear
from engine.models import layout


class WeightSource(Protocol):
    """Where a model's weights are read from, one tensor at a time, by transformers' parameter names."""

    @property
    def tied_head(self) -> bool:
        """Whether the output head is the token embedding (read once, shared)."""
        ...

    @property
    def auto_dtype(self) -> torch.dtype:
        """The dtype ``--dtype auto`` loads in where the weights start from their own precision."""
        ...

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in ``dtype``, a copy of its own."""
        ...

    def resident_bytes(self, dtype_size: int) -> int:
        """An estimate of what the engine will hold for these weights, made before any is read."""
        ...

    def release_all(self) -> None:
        """Let go of the source's pages once the load has read what it needs."""
        ...


def parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter the config's causal-LM model has, by state-dict name (a tied head included)."""
    if layout.lays_out(config):
        model = layout.empty_causal_lm(config, torch.float32)
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def read_skeleton(source: WeightSource, config: Any, dtype: torch.dtype,
                  whole: bool) -> tuple[torch.nn.Module, Callable[[str], torch.Tensor]]:
    """The transformers model with its small weights read (norms, the embedding, biases) and its
    projections left to be read one at a time by the builder through the returned reader (all of them
    read now where ``whole``: a calibration runs the whole model). A tied head is the embedding's tensor,
    not a second read of it."""
    model = empty_model(config, dtype, runs=whole)
    # An embedding the source can keep in its own blocks stays there (rows dequantized as looked up), beside
    # the meta parameter; a model that runs whole (calibration) gets it dense. The table is made when the
    # model asks (``table_maker``): where the head is the same tensor, packed, its rows serve instead
    # (engine/models/embedding.py) and no second copy is made.
    table_of = getattr(source, "embedding_table", None)
    kept = table_of is not None and not whole and getattr(source, "keeps_embedding_blocks", False)
    if kept:
        assert table_of is not None
        embedding = model.get_submodule(EMBEDDING.rpartition(".")[0])
        embedding.table_maker = lambda: table_of(EMBEDDING, dtype)
        embedding.head_is_embedding = bool(getattr(source, "head_is_embedding", False))
    for name in unfilled(model):
        if name == HEAD and source.tied_head:
            continue
        if name == EMBEDDING and kept:
            continue
        if whole or not is_linear(name):
            fill(model, name, source.dense(name, dtype))
    if whole and source.tied_head:
        fill(model, HEAD, model.get_parameter(EMBEDDING).data)

    def read(name: str) -> torch.Tensor:
        if name == HEAD and source.tied_head:
            embedding = model.get_parameter(EMBEDDING)
            return source.dense(EMBEDDING, dtype) if embedding.is_meta else embedding.data
        return source.dense(name, dtype)

    return model, read


def empty_model(config: Any, dtype: torch.dtype, runs: bool = False) -> torch.nn.Module:
    """``runs``: transformers' own model, whose forward a calibration calls; else the engine's families are
    laid out without importing transformers' model code."""
    if not runs and layout.lays_out(config):
        return layout.empty_causal_lm(config, dtype)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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
