"""Multi-LoRA inside a shared batch: a fixed set of resident adapter slots, each token applying its
own adapter's low-rank update (punica / S-LoRA / LoRAX style), never merged into the base weights.

Per layer, adapters are stacked per projection group (qkv, o, gate_up, down):
    A  [G * S * r, in]     the A matrices of the group's G projections for all S slots. Under a dense base
                           weight it is fused: one matmul over [W_base; A] gives x @ W^T and x @ A^T. Beside
                           a packed base (the engine's kernels) each token multiplies its own slot's rows
                           alone (``lora_shrink``: no other slot is computed, and a token's bits never
                           follow its batch)
    B  with the fused CPU kernels: per projection [S, r, out]; each token applies only its own
       slot's B (engine/kernels, ``lora_expand``), so only adapters in use are read.
       Without them: [out, G * S * r], block-diagonal (slot s of projection g writes only g's
       rows), and out += ((x @ A^T) * mask) @ B^T, where mask [T, G*S*r] keeps each token's own
       slot's columns (none for base-model tokens).
The dense matmuls use the same (on CPU bf16: oneDNN-prepacked) Linear as the base projections; every
packed or prepacked copy is made again when an adapter is written into a slot.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import LoraUnavailableError
from engine.kernels import CpuKernels
from engine.models import layout
from engine.models.linear import Linear

if TYPE_CHECKING:
    from engine.models.llama import PromptRows

logger = logging.getLogger(__name__)

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
SUPPORTED_MODULES = tuple(m for ms in GROUPS.values() for m in ms)
MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHT_MAGNITUDE = 65504.0  # fp16's largest value: far above any trained adapter's weights
# lora_alpha / r (or / sqrt(r), rsLoRA): trained adapters scale their update by 0.5-64; a finite but huge
# alpha (1e300) would overflow the adapter's rows into NaN and answer empty tokens instead of refusing
MAX_SCALING = 1024.0


@dataclass(slots=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # (layer, module) -> (A [r, in], B [out, r]), fp32 on CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # what the adapter's slot is kept under (LoraRef.identity): never the name, which people choose
    key: str = ""


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of every LoRA-targetable projection of a Llama-family model."""
    hidden, d = config.hidden_size, layout.head_dim(config)
    q = config.num_attention_heads * d
    kv = config.num_key_value_heads * d
    inter = config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def read_adapter(path: str | Path, name: str, config, max_rank: int) -> LoraAdapter:
    """Parse and check a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors).

    Raises LoraUnavailableError(code="incompatible" | "invalid_pack") saying exactly what is wrong."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights_file.is_file():
        raise LoraUnavailableError(f"{name}: a LoRA pack needs adapter_config.json and adapter_model.safetensors "
                                   "(pickled .bin weights are refused)", code="invalid_pack")
    if cfg_file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoraUnavailableError(f"{name}: adapter_config.json is over {MAX_CONFIG_BYTES} bytes", code="invalid_pack")
    try:
        cfg = json.loads(cfg_file.read_text())
        tensors = load_file(str(weights_file))
    except Exception as exc:
        raise LoraUnavailableError(f"{name}: unreadable adapter: {exc}", code="invalid_pack") from None
    rank, alpha = _rank_and_alpha(cfg, name)
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        problems.append("DoRA adapters are not supported")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save {cfg['modules_to_save']} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        problems.append("LoRA bias terms are not supported")
    if cfg.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out adapters are not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problems.append("per-module rank_pattern / alpha_pattern is not supported")
    if not 1 <= rank <= max_rank:
        problems.append(f"rank {rank} is outside 1..{max_rank} (--max-lora-rank)")
    shapes = module_shapes(config)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                problems.append(f"unexpected tensor {key}")
            continue
        parts = key.split(".")
        try:
            layer = int(parts[parts.index("layers") + 1])
            module = parts[parts.index("lora_A") - 1]
        except (ValueError, IndexError):
            problems.append(f"unexpected tensor {key}")
            continue
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if module not in shapes:
            problems.append(f"{key}: target module {module!r} is not one of {', '.join(SUPPORTED_MODULES)}")
            continue
        if not 0 <= layer < config.num_hidden_layers:
            problems.append(f"{key}: layer {layer} does not exist (model has {config.num_hidden_layers})")
            continue
        out_f, in_f = shapes[module]
        if b is None:
            problems.append(f"{key}: lora_B is missing")
        elif tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            problems.append(f"{module} in layer {layer}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                            f"this model (expected A ({rank}, {in_f}), B ({out_f}, {rank}))")
        else:
            weights[(layer, module)] = (_checked_fp32(name, key, a),
                                        _checked_fp32(name, key.replace(".lora_A.", ".lora_B."), b))
    if not weights and not problems:
        problems.append("the adapter holds no LoRA weights")
    if problems:
        raise LoraUnavailableError(f"{name}: incompatible with the served model: " + "; ".join(problems[:5]),
                                   code="incompatible")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    if not abs(scaling) <= MAX_SCALING:
        raise LoraUnavailableError(f"{name}: adapter_config.json 'lora_alpha' {alpha:g} over 'r' {rank} scales the "
                                   f"update by {scaling:g}; at most {MAX_SCALING:g} in magnitude is accepted "
                                   "(trained adapters use 0.5-64)", code="invalid_pack")
    return LoraAdapter(name=name, rank=rank, scaling=scaling, weights=weights)


def _rank_and_alpha(cfg: object, name: str) -> tuple[int, float]:
    """``r`` and ``lora_alpha`` of a parsed adapter_config.json; a config of the wrong shape is 12006."""
    if not isinstance(cfg, dict):
        raise LoraUnavailableError(f"{name}: adapter_config.json must be a JSON object, not "
                                   f"{type(cfg).__name__}", code="invalid_pack")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise LoraUnavailableError(f"{name}: adapter_config.json 'r' must be an integer, not {rank!r}",
                                   code="invalid_pack")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraUnavailableError(f"{name}: adapter_config.json 'lora_alpha' must be a finite number, not "
                                   f"{alpha!r}", code="invalid_pack")
    return rank, float(alpha)


def _checked_fp32(name: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """The weight in fp32, once checked: floating point (else 12007), finite and of a sane size (else 12006)."""
    if not tensor.is_floating_point():
        raise LoraUnavailableError(f"{name}: {key} has dtype {str(tensor.dtype).removeprefix('torch.')}; LoRA "
                                   "weights must be floating point", code="incompatible")
    t = tensor.float()
    if not bool(torch.isfinite(t).all()):
        raise LoraUnavailableError(f"{name}: {key} holds NaN or infinite values", code="invalid_pack")
    if t.numel() and float(t.abs().max()) > MAX_WEIGHT_MAGNITUDE:
        raise LoraUnavailableError(f"{name}: {key} holds values over {MAX_WEIGHT_MAGNITUDE:g} in magnitude (a "
                                   "trained adapter's weights are orders of magnitude smaller)", code="invalid_pack")
    return t


class LoraBatch:
    """One step's per-token adapter assignment, ready to apply in every layer."""

    def __init__(self, manager: LoraManager, token_slots: torch.Tensor) -> None:
        self.manager = manager
        self.token_slots = token_slots
        self.masks: dict[str, torch.Tensor] = {}
        if manager.kernels is None:
            r, S = manager.max_rank, manager.max_loras
            col_slot = (torch.arange(S * r, device=token_slots.device) // r)
            one = (col_slot[None, :] == token_slots[:, None]).to(manager.dtype)  # [T, S*r]
            self.masks = {g: one.repeat(1, len(ms)) if len(ms) > 1 else one for g, ms in GROUPS.items()}

    def project(self, layer: int, group: str, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        """The group's base projection of ``x`` plus each token's own low-rank update.

        A dense base: one matmul over [W_base; A_stack] gives the base output and x @ A^T together. A packed
        base (the engine's kernels) runs on its own, each row in its own activation mode (``prompt_rows``,
        --linear-activations int8-prompt) as in a step without adapters, and then each token computes its
        own slot's x @ A^T alone (``lora_shrink``: a token's rows never depend on its batch, and no slot
        but its own is multiplied). Then each token applies its own slot's B (fused CPU kernel), or all
        slots' block-diagonal B under a mask."""
        m = self.manager
        fused, b, n = m.fused[layer][group]
        kern = m.kernels
        if kern is not None and isinstance(fused, _BaseThenA):
            y = fused.base_only(x, prompt_rows)
            u = torch.empty(x.shape[0], fused.a.shape[0], dtype=x.dtype, device=x.device)
            kern.lora_shrink(x, fused.a, self.token_slots, len(GROUPS[group]), m.max_loras, m.max_rank, u)
        else:
            y = fused(x, prompt_rows) if isinstance(fused, _BaseThenA) else fused(x)
            u = y[:, n:]
        if kern is not None:
            out = torch.empty(y.shape[0], n, dtype=y.dtype, device=y.device)
            kern.lora_expand(y, u, n, out, self.token_slots, m.b_compact[layer][group], m.out_sizes[group],
                             m.max_loras, m.max_rank)
            return out
        assert b is not None  # without the kernels every group keeps its block-diagonal B
        return y[:, :n] + b(u * self.masks[group])


class _BaseThenA:
    """A base projection that cannot be stacked with A (packed kernels, or a reference linear) and the group's A
    stack ``a`` (written in place when a slot is loaded): with the fused kernels the project step takes the
    base alone and each token's own A rows (``lora_shrink``); without them, [x @ W_base^T | x @ A^T]."""

    def __init__(self, base: Any, a: torch.Tensor) -> None:
        self.base = base
        self.a = a

    def base_only(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        return prompt_rows.project(self.base, x) if prompt_rows is not None else self.base(x)

    def __call__(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        return torch.cat([self.base_only(x, prompt_rows), torch.nn.functional.linear(x, self.a)], dim=1)


class LoraManager:
    def __init__(self, config, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 base_projections: list[dict[str, Any]], kernels: CpuKernels | None = None) -> None:
        self.config = config
        # With the fused CPU kernels each token applies only its own adapter's B, stored per projection
        # as [S, r, out] (b_compact); without them, B is one block-diagonal matrix per group.
        self.kernels = kernels
        self.base_projections = base_projections  # per layer: group -> the base projection's linear
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.shapes = module_shapes(config)
        rows = max_loras * max_rank
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = []
        self.b_compact: list[dict[str, torch.Tensor]] = []
        self.out_sizes = {g: torch.tensor([self.shapes[m][0] for m in ms], dtype=torch.int64)
                          for g, ms in GROUPS.items()}
        for _ in range(config.num_hidden_layers):
            layer: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
            compact = {}
            for group, modules in GROUPS.items():
                in_f = self.shapes[modules[0]][1]
                out_total = sum(self.shapes[m][0] for m in modules)
                a_stack = torch.zeros(len(modules) * rows, in_f, dtype=dtype, device=device)
                if kernels is None:
                    layer[group] = (a_stack, torch.zeros(out_total, len(modules) * rows, dtype=dtype, device=device))
                else:
                    layer[group] = (a_stack, None)
                    compact[group] = torch.zeros(rows * out_total, dtype=dtype, device=device)
            self.stacks.append(layer)
            self.b_compact.append(compact)
        self.fused: list[dict[str, tuple[Any, Linear | None, int]]] = []
        self._pack()
        # resident adapters by identity (LoraAdapter.key), least recently used first: two adapters that
        # share a display name are different keys, so they never share a slot's weights
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        self.pins = [0] * max_loras
        self.free_slots = list(range(max_loras))
        self.num_loads = 0

    def can_acquire(self, key: str) -> bool:
        """Whether the adapter of identity ``key`` can be given a slot now."""
        return key in self.slot_of or bool(self.free_slots) or any(
            self.pins[s] == 0 for s in self.slot_of.values())

    def acquire(self, adapter: LoraAdapter) -> int:
        """Pin the adapter's slot, writing it in (and evicting an unpinned one) when needed. The adapter
        was read and checked before admission: no disk I/O here."""
        if not adapter.key:
            raise ValueError(f"LoRA {adapter.name}: an adapter needs its identity (key) to take a slot")
        key = adapter.key
        if key in self.slot_of:
            slot = self.slot_of[key]
            self.slot_of.move_to_end(key)
        else:
            slot = self._take_slot()
            self._write(slot, adapter)
            self._refresh()
            self.slot_of[key] = slot
            self.num_loads += 1
            logger.info("LoRA %s (%s) loaded into slot %d (rank %d)", adapter.name, key, slot, adapter.rank)
        self.pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        if slot >= 0:
            self.pins[slot] -= 1

    def _take_slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop(0)
        for key, slot in self.slot_of.items():  # least recently used first
            if self.pins[slot] == 0:
                del self.slot_of[key]
                return slot
        raise LoraUnavailableError("every LoRA slot is in use; raise --max-loras", code="busy")

    def _pack(self) -> None:
        """The fused projections, built once. A dense base is copied once into [W_base; A] and the group's
        A stack becomes a view of that weight's last rows, so writing a slot updates the fused weight in
        place: loading an adapter never copies the base model's weights again."""
        self.fused = []
        for layer, groups in enumerate(self.stacks):
            packed = {}
            for g, (a, b) in groups.items():
                base = self.base_projections[layer][g]
                if isinstance(base, Linear):  # dense: one matmul over [W_base; A]
                    bias = base.bias
                    if bias is not None:  # the A rows get no bias
                        bias = torch.cat([bias, bias.new_zeros(a.shape[0])])
                    weight = torch.cat([base.weight, a])
                    groups[g] = (weight[base.out_features:], b)
                    first: Any = Linear(weight, bias)
                else:  # packed or quantized base: its own kernel, then A
                    first = _BaseThenA(base, a)
                packed[g] = (first, Linear(b) if b is not None else None, base.out_features)
            self.fused.append(packed)

    def _refresh(self) -> None:
        """After a slot's rows were written in place: the linears that keep a prepacked copy of their weight
        (oneDNN's for bf16) pack it again; an A stack beside a packed base, and plain linears, are read as
        they are."""
        for packed in self.fused:
            for first, b, _ in packed.values():
                if not isinstance(first, _BaseThenA):
                    first.weight_changed()
                if b is not None:
                    b.weight_changed()

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        r, rows = self.max_rank, self.max_loras * self.max_rank
        for layer, groups in enumerate(self.stacks):
            for group, modules in GROUPS.items():
                a_stack, b_stack = groups[group]
                out_off = 0
                for g, module in enumerate(modules):
                    out_f = self.shapes[module][0]
                    lo = g * rows + slot * r
                    a_stack[lo:lo + r].zero_()
                    compact = None
                    if b_stack is not None:
                        b_stack[:, lo:lo + r].zero_()
                    else:  # this projection's [S, r, out] block of the group's compact B
                        start = rows * out_off
                        compact = self.b_compact[layer][group][start:start + rows * out_f].view(
                            self.max_loras, r, out_f)
                        compact[slot].zero_()
                    pair = adapter.weights.get((layer, module))
                    if pair is not None:
                        a, b = pair
                        a_stack[lo:lo + adapter.rank] = a.to(self.dtype)
                        scaled = (b * adapter.scaling).to(self.dtype)  # [out, rank]
                        if b_stack is not None:
                            b_stack[out_off:out_off + out_f, lo:lo + adapter.rank] = scaled
                        else:
                            assert compact is not None  # set above wherever there is no B stack
                            compact[slot, :adapter.rank] = scaled.T
                    out_off += out_f

    def batch(self, token_slots: list[int]) -> LoraBatch | None:
        if all(s < 0 for s in token_slots):
            return None
        return LoraBatch(self, torch.tensor(token_slots, device=self.device))
