"""Pooling: a prompt's hidden states run through the model without sampling, pooled and finished as vLLM
does for decoder models.

- The server's task (``--task``, vLLM's names) says what the model is for: ``generate`` (text, and here
  also the embeddings of its final hidden states), ``embed``, ``classify`` / ``score`` (a checkpoint's
  sequence-classification head, ``score.weight``), ``reward`` (the head on every token).
- A request asks for one pooling task: ``embed`` (one vector, L2-normalised), ``classify`` (the head's
  logits through softmax, or sigmoid for a one-label head), ``score`` (a one-label head's sigmoid: a
  cross-encoder) or ``encode`` (what the server's task pools: vLLM's /pooling).
- Pooling types (vLLM's): LAST (the last token's final hidden state, the default for decoder models),
  MEAN (the mean over the prompt's tokens), CLS (the first token's), ALL (every token's).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.request import Prompt

SERVER_TASKS = ("auto", "generate", "embedding", "embed", "classify", "score", "reward", "transcription")
REQUEST_TASKS = ("embed", "classify", "score", "encode")
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")


@dataclass(slots=True)
class PoolingParams:
    """What one pooling request asks (None: the server's default for its task)."""

    task: str = "embed"  # one of REQUEST_TASKS
    dimensions: int | None = None  # Matryoshka: keep the first so many values, then normalise
    normalize: bool | None = None  # embed: L2-normalise (default on)
    activation: bool | None = None  # classify / score: softmax or sigmoid over the head's logits (default on)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last so many tokens


@dataclass(slots=True)
class PoolingRequest:
    request_id: str
    prompt: Prompt
    params: PoolingParams = field(default_factory=PoolingParams)
    priority: int = 5  # 1 (most urgent) .. 5, as GenerationRequest
    deadline: float | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    client: str | None = None  # fair share while waiting (engine/scheduler.py)


@dataclass(slots=True)
class PoolingOutput:
    request_id: str
    data: list[float] | list[list[float]]  # one vector, or one per token (ALL pooling)
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """--override-pooler-config (vLLM's JSON): the pooling type and the normalisation / activation defaults."""

    pooling_type: str | None = None
    normalize: bool | None = None
    softmax: bool | None = None

    @classmethod
    def parse(cls, text: str | None) -> PoolerConfig:
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError:
            raise ValueError(f"--override-pooler-config {text!r}: not a JSON object") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--override-pooler-config {text!r}: not a JSON object")
        unknown = sorted(set(raw) - {"pooling_type", "normalize", "softmax", "activation"})
        if unknown:
            raise ValueError(f"--override-pooler-config: {', '.join(unknown)} not supported (pooling_type, normalize, "
                             "softmax)")
        kind = raw.get("pooling_type")
        if kind is not None and (not isinstance(kind, str) or kind.upper() not in POOLING_TYPES):
            raise ValueError(f"--override-pooler-config: pooling_type {kind!r} is not one of "
                             f"{', '.join(POOLING_TYPES)}")
        for key in ("normalize", "softmax", "activation"):
            if raw.get(key) is not None and not isinstance(raw[key], bool):
                raise ValueError(f"--override-pooler-config: {key} must be true or false")
        softmax = raw.get("softmax", raw.get("activation"))
        return cls(kind.upper() if kind else None, raw.get("normalize"), softmax)


def resolve_task(task: str, architectures: Seq[str], has_head: bool, model: str) -> str:
    """The server's task from --task and the checkpoint; a task this engine cannot serve fails at start."""
    if task not in SERVER_TASKS:
        raise ValueError(f"--task {task!r} is not one of {', '.join(SERVER_TASKS)}")
    if task == "transcription":
        raise ValueError("--task transcription: speech recognition (Whisper) models are not served by this engine, "
                         "which runs decoder text models only")
    if task == "embedding":  # vLLM's older name
        task = "embed"
    if task == "auto":
        task = "classify" if any(a.endswith("ForSequenceClassification") for a in architectures) else "generate"
    if task in ("classify", "reward") and not has_head:
        raise ValueError(f"--task {task} needs a checkpoint with a sequence-classification head (score.weight); "
                         f"{model} has none (--task embed serves its embeddings)")
    return task


def served_tasks(task: str, num_labels: int) -> tuple[str, ...]:
    """The pooling tasks a server of ``task`` answers; ``num_labels``: the head's (0: no head). Scores come
    from a one-label head (a cross-encoder) where there is one, else from the embeddings' cosine."""
    if task == "reward":
        return ("encode",)
    if num_labels and task in ("classify", "score"):
        return ("classify", "encode", "score") if num_labels == 1 else ("classify", "encode")
    return ("embed", "encode", "score")


def read_head(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The sequence-classification head (``score.weight`` [labels, hidden], and ``score.bias`` if any) from a
    checkpoint's safetensors files, or None when it has none."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / weight_map[k] for k in ("score.weight", "score.bias") if k in weight_map})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in ("score.weight", "score.bias"):
                if key in f.keys():  # noqa: SIM118 (safetensors' handle has keys() but no __contains__)
                    found[key] = f.get_tensor(key).float()
    if "score.weight" not in found:
        return None
    return found["score.weight"], found.get("score.bias")


def matryoshka_of(hf_config: Any) -> tuple[bool, tuple[int, ...] | None]:
    """(whether the model takes ``dimensions``, the dimensions it allows or None for any), from config.json's
    ``is_matryoshka`` / ``matryoshka_dimensions`` as vLLM reads them."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return True, tuple(int(d) for d in dims)
    return bool(getattr(hf_config, "is_matryoshka", False)), None


def check_dimensions(dimensions: int | None, model: str, matryoshka: bool, allowed: tuple[int, ...] | None,
                     hidden_size: int) -> None:
    """vLLM's rule: ``dimensions`` only for a Matryoshka model, and then one it allows."""
    if dimensions is None:
        return
    if not matryoshka:
        raise InvalidRequestError(f'Model "{model}" does not support matryoshka representation, changing output '
                                  "dimensions will lead to poor results.", parameter="dimensions")
    if dimensions < 1:
        raise InvalidRequestError("dimensions must be greater than 0", parameter="dimensions")
    if allowed is not None and dimensions not in allowed:
        raise InvalidRequestError(f'Model "{model}" only supports {list(allowed)} for matryoshka representation, '
                                  "changing output dimensions will lead to poor results.", parameter="dimensions")
    if dimensions > hidden_size:
        raise InvalidRequestError(f"dimensions is {dimensions}; this model's embeddings have {hidden_size}",
                                  parameter="dimensions")


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation first, then L2 normalisation (vLLM's order)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector.float(), p=2, dim=-1)
    return vector


def activate(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's classification activation: softmax over two or more labels, sigmoid for one."""
    return torch.sigmoid(logits) if logits.shape[-1] < 2 else torch.softmax(logits, dim=-1)


class PoolingState:
    """One sequence's pooled rows as its prompt is computed (chunk by chunk; again after a preemption,
    when positions already taken are skipped)."""

    __slots__ = ("count", "kind", "params", "rows", "total", "upto")

    def __init__(self, params: PoolingParams, kind: str) -> None:
        self.params = params
        self.kind = kind
        self.upto = 0  # the next position not yet taken
        self.rows: list[torch.Tensor] = []  # LAST / CLS: the one row; ALL: every row, in order
        self.total: torch.Tensor | None = None  # MEAN: the running sum
        self.count = 0

    @property
    def needs_every_position(self) -> bool:
        """Whether a cached prefix would skip positions this pooling reads (all but LAST)."""
        return self.kind != "LAST"

    def span(self, start: int, n: int, length: int) -> tuple[int, int]:
        """(first position, count) of the positions in [start, start + n) whose hidden states it needs."""
        if self.kind == "LAST":
            return (length - 1, 1) if start + n == length else (start, 0)
        if self.kind == "CLS":
            return (0, 1) if start == 0 else (start, 0)
        return start, n

    def take(self, first: int, rows: torch.Tensor) -> None:
        skip = max(0, self.upto - first)
        rows = rows[skip:]
        if not rows.shape[0]:
            return
        self.upto = first + skip + rows.shape[0]
        if self.kind == "MEAN":
            part = rows.float().sum(0)
            self.total = part if self.total is None else self.total + part
            self.count += rows.shape[0]
        elif self.kind == "ALL":
            self.rows.append(rows.float())
        else:
            self.rows = [rows[-1:].float()]

    def pooled(self) -> torch.Tensor:
        """[hidden] for LAST / MEAN / CLS, [tokens, hidden] for ALL."""
        if self.kind == "MEAN":
            assert self.total is not None
            return self.total / self.count
        if self.kind == "ALL":
            return torch.cat(self.rows)
        return self.rows[0][0]


class Pooler:
    """The server's pooling: its task, the head read from the checkpoint, the defaults, the checks."""

    def __init__(self, task: str, model: str, hidden_size: int, head: tuple[torch.Tensor, torch.Tensor | None] | None,
                 config: PoolerConfig, matryoshka: tuple[bool, tuple[int, ...] | None] = (False, None)) -> None:
        self.task = task
        self.model = model
        self.hidden_size = hidden_size
        self.weight: torch.Tensor | None
        self.bias: torch.Tensor | None
        self.weight, self.bias = head if head is not None else (None, None)
        self.num_labels = self.weight.shape[0] if self.weight is not None else 0
        self.config = config
        self.matryoshka, self.allowed_dimensions = matryoshka
        self.tasks = served_tasks(task, self.num_labels)

    def check(self, params: PoolingParams) -> None:
        """Refuse what this server cannot pool, naming the field, before any work."""
        if params.task not in self.tasks:
            raise InvalidRequestError(f"the served model does not support the '{params.task}' pooling task (it runs "
                                      f"--task {self.task}; it serves {', '.join(self.tasks)})", parameter="task")
        if params.task == "embed" or (params.task == "encode" and self._encode_kind() == "embed"):
            check_dimensions(params.dimensions, self.model, self.matryoshka, self.allowed_dimensions,
                             self.hidden_size)
        elif params.dimensions is not None:
            raise InvalidRequestError("dimensions applies to embeddings only", parameter="dimensions")

    def _encode_kind(self) -> str:
        """What /pooling (the ``encode`` task) returns on this server."""
        if self.task == "reward":
            return "reward"
        return "classify" if self.num_labels else "embed"

    def new_state(self, params: PoolingParams) -> PoolingState:
        kind = self.config.pooling_type or "LAST"  # vLLM's default for decoder models, embedding and classifying
        if self.task == "reward" and params.task == "encode":
            kind = "ALL"
        return PoolingState(params, kind)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        logits = hidden.float() @ self.weight.T
        return logits + self.bias if self.bias is not None else logits

    def finish(self, state: PoolingState) -> list[float] | list[list[float]]:
        p = state.params
        hidden = state.pooled()
        task = self._encode_kind() if p.task == "encode" else p.task
        if task == "embed":
            normalize = p.normalize if p.normalize is not None else self.config.normalize is not False
            return finish_embedding(hidden, p.dimensions, normalize).tolist()
        logits = self._head(hidden)
        if task == "reward":
            return logits.tolist()
        use = p.activation if p.activation is not None else self.config.softmax is not False
        return (activate(logits) if use else logits).tolist()
