"""Batched forward of the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.
Qwen3 adds an RMSNorm over each head of q and k before RoPE; Qwen2 biases on q/k/v.

Weights come from the transformers model (so loading, tying and RoPE variants match it exactly);
the forward is ours: flat tokens, fused QKV and gate/up projections, paged attention.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, PagedKVCache, paged_attention, prefill_attention
from engine.checkpoint_names import HEAD
from engine.kernels import CpuKernels, ForwardStep, LayerDesc, LinearDesc, load_cpu_kernels
from engine.models import layout
from engine.models.embedding import HeadRowsEmbedding
from engine.models.greedy_head import GreedyHead, GreedyPicks
from engine.models.linear import Linear, PackedLinear, ReferenceLinear
from engine.models.tuning import TuningCache
from engine.models.weights import AnyLinear, LinearBuilder, MeasuredRates
from engine.progress import track
from engine.quant.formats import QuantizedWeight

if TYPE_CHECKING:
    from engine.lora import LoraBatch

logger = logging.getLogger(__name__)

# decode_cost_per_key and decode_step_cost where the linears' rates were not measured (torch's path, a
# GPU): the figures the long-prefill cap was calibrated with (engine/scheduler.py)
DEFAULT_DECODE_COST_PER_KEY = 1 / 360
DEFAULT_DECODE_STEP_COST = 7.0
# and at most this (above every value measured on an idle machine), so that a start timed while a
# neighbour took the memory bandwidth cannot hand a long prompt more of a step than the token-gap limit
# allows beside long-context streams
MAX_DECODE_COST_PER_KEY = 1 / 250
# Decode attention reads its keys' K and V in blocks scattered through the pool, between its own
# arithmetic: at about this share of the weights' one-row stream rate (scattered blocks stream slower
# than one contiguous weight)
KV_READ_SHARE = 0.6


@dataclass(slots=True)
class _LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear | PackedLinear | ReferenceLinear  # [(H + 2*Hkv) * D, hidden]
    o: Linear | PackedLinear | ReferenceLinear
    post_norm: torch.Tensor
    gate_up: Linear | PackedLinear | ReferenceLinear  # [2 * intermediate, hidden]
    down: Linear | PackedLinear | ReferenceLinear
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm weights [D] over each head of q and of k
    k_norm: torch.Tensor | None = None

    def linears(self) -> tuple[Linear | PackedLinear | ReferenceLinear, ...]:
        """The layer's four projections, in forward order."""
        return self.qkv, self.o, self.gate_up, self.down


@dataclass(frozen=True, slots=True)
class PromptRows:
    """A step's rows by activation mode: ``int8_runs`` the prompt rows whose output no one reads, ``exact``
    the rest (decode and draft rows, logits and pooled rows). A prompt row only writes the KV cache, and the
    answers reading a KV cache made on int8 activations move far less than answers computed on them
    (``benchmarks/bench_int8_split``)."""

    int8_runs: tuple[tuple[int, int], ...]  # (first row, end): each prompt chunk's rows without logits
    exact: torch.Tensor  # every other row's index: decode and draft rows, rows whose output is read
    num_rows: int
    flags: torch.Tensor  # uint8 per row, 1 on the int8 rows: what a call with a mode per row takes

    @classmethod
    def of(cls, int8: torch.Tensor) -> PromptRows:
        """From a bool per row."""
        flags = int8.tolist()
        starts = [i for i, on in enumerate(flags) if on and (i == 0 or not flags[i - 1])]
        ends = [i + 1 for i, on in enumerate(flags) if on and (i + 1 == len(flags) or not flags[i + 1])]
        return cls(tuple(zip(starts, ends)), (~int8).nonzero().flatten(), len(flags), int8.to(torch.uint8))

    def project(self, linear: AnyLinear, x: torch.Tensor) -> torch.Tensor:
        """One call with a mode per row where the linear takes it (one pass over the weights, as an
        unsplit step's); else the prompt rows run by run, read and written in place (long contiguous
        blocks), and the other rows, few and scattered, gathered into one call: a pass over the weights per
        prompt chunk and one more. A linear that takes no int8 activations (dense weights) runs whole."""
        if isinstance(linear, Linear) or not linear.takes_int8_activations:
            return linear(x)
        if linear.takes_int8_rows:
            return linear(x, int8_rows=self.flags)
        out = torch.empty(self.num_rows, linear.out_features, dtype=x.dtype)
        for a, b in self.int8_runs:
            linear(x[a:b], int8=True, out=out[a:b])
        if self.exact.numel():
            out.index_copy_(0, self.exact, linear(x.index_select(0, self.exact), int8=False))
        return out


def _ascending(indices: torch.Tensor) -> bool:
    """Whether the row indices strictly increase (the runner's logits rows always do)."""
    return indices.dtype == torch.int64 and bool((indices[1:] > indices[:-1]).all())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm arithmetic: normalise in fp32 (the fused kernel is bit-identical there),
    # round to the model dtype, then scale in it. Fusing the scale too rounds differently, and bf16
    # answers visibly drift (tests/engine/test_bf16_tracks_transformers.py).
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class LlamaForCausalLM:
    def __init__(self, hf_model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 native_kernels: bool = True, quantization: str = "none",
                 stored: dict[str, QuantizedWeight] | None = None, reference: bool = False,
                 linear_activations: str = "bf16", hessians: dict[str, torch.Tensor] | None = None,
                 batch_invariant: bool = False,
                 dense_source: Callable[[str], torch.Tensor] | None = None, show_progress: bool = False,
                 tuning: TuningCache | None = None) -> None:
        """``quantization`` is a resolved ``--quantization`` mode (engine/models/weights.py); ``stored`` its
        weights read from a GGUF file or the quantization cache; ``reference`` builds the slow
        dequantize-then-fp32 linears that the packed kernels are held to; ``hessians`` are the linears'
        calibrated input statistics for int8's error-compensating rounding (engine/quant/gptq.py);
        ``dense_source`` reads a projection's weight that ``hf_model`` holds on the meta device (a model
        served in place, engine/models/skeleton.py); ``show_progress`` reports the layers as they are
        built (long loads); ``tuning`` keeps the kernel probes' results beside the model
        (engine/models/tuning.py)."""
        cfg: Any = hf_model.config  # a transformers config: attributes by model family
        self.config = cfg
        self.num_layers, self.num_kv_heads, self.head_dim = self.kv_geometry(cfg)
        self.num_heads: int = cfg.num_attention_heads
        self.eps: float = cfg.rms_norm_eps
        self.dtype = dtype
        self.device = device
        self.kernels: CpuKernels | None = None
        if native_kernels and device.type == "cpu":
            kernels = load_cpu_kernels()
            if kernels is not None and kernels.supports(dtype, self.head_dim, self.num_heads // self.num_kv_heads):
                kernels.num_threads = torch.get_num_threads()  # the engine has set its thread count by now
                self.kernels = kernels
        self.builder = LinearBuilder(quantization, dtype, device, self.kernels, stored, reference, linear_activations,
                                     hessians, dense_source, batch_invariant)

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        def linear(prefix: str, parts: list[str], modules: list[Any], bias: torch.Tensor | None = None) -> AnyLinear:
            return self.builder.build([f"{prefix}.{p}.weight" for p in parts], [m.weight for m in modules], bias)

        inner: Any = hf_model.model  # the decoder stack (transformers' attribute, not typed by torch)
        head: Any = hf_model.lm_head
        self.lm_head = self.builder.build([HEAD], [head.weight], None)
        self.embed: Any = self._embedding(inner.embed_tokens, w)
        # greedy rows' picks through int8 logits and a bound (int8 heads on VNNI CPUs; None elsewhere)
        self.greedy_head = (GreedyHead.build(self.lm_head, self.kernels)
                            if isinstance(self.lm_head, PackedLinear) else None)
        self.final_norm = w(inner.norm.weight)
        self.layers: list[_LayerWeights] = []
        layers = (track(inner.layers, "loading weights", logger, unit="layers") if show_progress
                  else inner.layers)
        for i, layer in enumerate(layers):
            att, mlp = layer.self_attn, layer.mlp
            bias = None
            if att.q_proj.bias is not None:
                bias = w(torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]))
            prefix = f"model.layers.{i}"
            self.layers.append(_LayerWeights(
                input_norm=w(layer.input_layernorm.weight),
                qkv=linear(prefix, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                           [att.q_proj, att.k_proj, att.v_proj], bias),
                o=linear(prefix, ["self_attn.o_proj"], [att.o_proj]),
                post_norm=w(layer.post_attention_layernorm.weight),
                gate_up=linear(prefix, ["mlp.gate_proj", "mlp.up_proj"], [mlp.gate_proj, mlp.up_proj]),
                down=linear(prefix, ["mlp.down_proj"], [mlp.down_proj]),
                q_norm=w(att.q_norm.weight) if hasattr(att, "q_norm") else None,
                k_norm=w(att.k_norm.weight) if hasattr(att, "k_norm") else None,
            ))
        self.linears_summary = self.builder.tune(tuning)
        self.intermediate = self.layers[0].gate_up.out_features // 2
        # RoPE tables from the model's own rotary module, so every rope_scaling variant matches it.
        # rotate_half(x) * sin == roll(x, D/2) * sin_signed, with the sign folded into the table.
        max_pos = cfg.max_position_embeddings
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        rotary = inner.rotary_emb.to(device)
        cos, sin = rotary(probe, torch.arange(max_pos, device=device)[None])
        half = self.head_dim // 2
        sin = sin[0].clone()
        sin[:, :half] = -sin[:, :half]
        self.cos = cos[0].to(dtype)
        self.sin_signed = sin.to(dtype)
        self.max_position = max_pos
        self._scratch = torch.empty(0, dtype=torch.float32)
        # Every decoder layer in one C call where the layers are all the fused kernels' own work (see
        # _layers_in_one_call); tests that watch each projection's call turn it off.
        self.layers_in_one_call = True
        # --linear-activations int8-prompt: 4-bit projections take int8 activations on the prompt rows that
        # give no logits (they only write the KV cache) and exact ones on every other row (PromptRows)
        self.prompt_int8_activations = self.builder.activations == "int8-prompt"
        # The last layer's o / MLP for the logits rows only (see keep_last_rows in engine/kernels/csrc/forward_loop.h).
        self.trim_last_layer = True
        self._layer_descs: ctypes.Array | None = None
        self._one_call_max_rows = 0.0
        self._described: tuple[list[object], tuple[int, ...]] = ([], ())

    def _embedding(self, embed_tokens: Any, w: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """The token embedding: the tied head's packed rows where they give the file's values
        (engine/models/embedding.py), else a table of the file's blocks (engine/gguf_weights.py, rows
        dequantized as they are looked up) where the source keeps one, else the dense weight."""
        make_table = getattr(embed_tokens, "table_maker", None)
        if make_table is None:
            return w(embed_tokens.weight)
        head = self.lm_head
        if self.device.type == "cpu" and embed_tokens.head_is_embedding and isinstance(head, PackedLinear) \
                and HeadRowsEmbedding.serves(head):
            return HeadRowsEmbedding(head, self.dtype)
        table = make_table()
        return table.to(self.dtype) if self.device.type == "cpu" else w(table.dense())

    def _layers_as_described(self) -> ctypes.Array | None:
        """The layers' descriptors for the one-call loop, made again whenever a layer's weights, linears,
        fallbacks or activation mode have changed since they were made (tests swap in reference linears
        and attach fallbacks after load; a stale descriptor would run the old weights)."""
        objects: list[object] = []
        settings: list[int] = []
        per_row = self._per_row_int8()
        for lw in self.layers:
            objects += (lw.input_norm, lw.post_norm, lw.q_norm)
            for lin in lw.linears():
                objects += (lin, getattr(lin, "packed", None), getattr(lin, "fallback", None))
                rows = getattr(lin, "max_kernel_rows", None)
                settings += (-1 if rows is None else rows, self._int8_mode(lin, per_row))
        state = tuple(map(id, objects)) + tuple(settings)  # ids stay unique: ``objects`` is kept alive below
        if state != self._described[1]:
            self._layer_descs, self._one_call_max_rows = self._describe_layers()
            self._described = (objects, state)
        return self._layer_descs

    def _describe_layers(self) -> tuple[ctypes.Array | None, float]:
        """The layers' weights as forward.h's descriptors, and the most rows every projection's packed
        kernel takes (above it some go to oneDNN); None where some layer needs Python between the kernels
        (dense or reference linears, Qwen3's head norms, fp32)."""
        linears = [lin for lw in self.layers for lin in lw.linears()]
        packed_linears = [lin for lin in linears if isinstance(lin, PackedLinear)]
        if (self.kernels is None or self.dtype != torch.bfloat16 or any(lw.q_norm is not None for lw in self.layers)
                or len(packed_linears) != len(linears)):
            return None, 0
        limits = [lin.max_kernel_rows for lin in packed_linears
                  if lin.fallback is not None and lin.max_kernel_rows is not None]
        per_row = self._per_row_int8()

        def describe(lin: AnyLinear) -> LinearDesc:
            assert isinstance(lin, PackedLinear)  # checked above for every projection
            packed = lin.packed
            return LinearDesc(packed.fmt_code, packed.data.data_ptr(), packed.out_features, packed.in_features,
                              packed.group, lin.bias_pointer, self._int8_mode(lin, per_row))

        descs = (LayerDesc * self.num_layers)(*[
            LayerDesc(lw.input_norm.data_ptr(), lw.post_norm.data_ptr(), describe(lw.qkv), describe(lw.o),
                      describe(lw.gate_up), describe(lw.down)) for lw in self.layers])
        return descs, min(limits, default=math.inf)

    def _per_row_int8(self) -> bool:
        """Whether the 4-bit projections take a mode per row in this process: int8-prompt, on kernels that
        take one on the path in use (read with the descriptors, as the path is chosen at start)."""
        return self.prompt_int8_activations and self.kernels is not None and self.kernels.takes_int8_rows()

    @staticmethod
    def _int8_mode(lin: AnyLinear, per_row: bool) -> int:
        """A projection's activation mode in the one-call loop (forward.h's descriptor): 0 exact, 1 int8
        on every row, 2 int8 on the rows each step flags (given ``per_row``, 4-bit weights)."""
        if per_row and isinstance(lin, PackedLinear) and lin.takes_int8_activations:
            return 2
        return int(getattr(lin, "int8_activations", False))

    def projections(self) -> list[dict[str, Linear | PackedLinear | ReferenceLinear]]:
        """Per layer, each LoRA-targetable projection group (qkv, o, gate_up, down)."""
        return [dict(zip(("qkv", "o", "gate_up", "down"), lw.linears())) for lw in self.layers]

    def attention_cost_per_key(self) -> float:
        """A prompt token's attention over one earlier key, as a fraction of its linears' cost: the
        multiply-adds of q.k and p.v over every head and layer against those of every projection (the
        head aside: a prompt's rows skip it), times exact_row_cost (attention runs on bf16 whatever the
        linears' activations). SmolLM2-135M: 1 / 3,072, so at 2,000 keys a prompt token's attention costs 65%
        more on top of its exact linears."""
        return 2 * self.num_heads * self.head_dim / self._layer_macs() * self.exact_row_cost()

    def exact_row_cost(self) -> float:
        """A row's linears on exact activations as a multiple of a prompt token's (the scheduler's unit): the
        ratio of the two batch rates measured at start where prompt rows take int8 activations, else 1."""
        rates = self.builder.rates
        if rates is None or not rates.exact_batch_macs_per_s:
            return 1.0
        return rates.batch_macs_per_s / rates.exact_batch_macs_per_s

    def kv_follows_row_role(self) -> bool:
        """Whether a row's KV follows its role: under int8-prompt a prompt's leading rows take int8 and every
        row whose output is read is exact, so the KV of an answer's rows, or of a prompt's last row, differs
        from what a prompt holding those tokens at those positions computes for them. Only where some
        projection runs a prompt row on int8 (4-bit weights on the fused kernels)."""
        return (self.prompt_int8_activations and self.kernels is not None
                and any(getattr(lin, "takes_int8_activations", False) for lw in self.layers for lin in lw.linears()))

    def decode_row_cost(self) -> float:
        """A decoding row's own linears, in prompt tokens' (exact_row_cost where decode rows stay exact
        while prompt rows take int8: --linear-activations int8-prompt; 1 otherwise)."""
        return self.exact_row_cost() if self.prompt_int8_activations else 1.0

    def _layer_macs(self) -> int:
        """Multiply-adds of one token through one layer's projections."""
        return sum(lin.in_features * lin.out_features for lin in self.layers[0].linears())

    def _token_seconds(self, rates: MeasuredRates) -> float:
        """A token's linears (every layer's projections) at the measured batch rate."""
        return self.num_layers * self._layer_macs() / rates.batch_macs_per_s

    @property
    def decode_costs_measured(self) -> bool:
        """Whether decode_step_cost and decode_cost_per_key come from rates measured at start."""
        return self.builder.rates is not None

    def decode_step_cost(self) -> float:
        """What a decode step costs before any row, as a fraction of a token's linears: it streams every
        weight once (at the measured one-row rate). Where nothing was measured, DEFAULT_DECODE_STEP_COST."""
        rates = self.builder.rates
        if rates is None:
            return DEFAULT_DECODE_STEP_COST
        return rates.weight_bytes / rates.stream_bytes_per_s / self._token_seconds(rates)

    def decode_cost_per_key(self) -> float:
        """A decoding sequence's attention over one key of its context, as a fraction of a token's linears.
        Its first row reads the key's K and V in every layer from memory, so this is those bytes at
        KV_READ_SHARE of the weights' one-row stream rate against the token's multiply-adds at a batch's
        arithmetic rate, both rates measured at start (LinearBuilder.tune), capped at MAX_DECODE_COST_PER_KEY.
        Where nothing was measured (torch's path), DEFAULT_DECODE_COST_PER_KEY."""
        rates = self.builder.rates
        if rates is None:
            return DEFAULT_DECODE_COST_PER_KEY
        key_seconds = self.kv_bytes_per_token() / (KV_READ_SHARE * rates.stream_bytes_per_s)
        return min(MAX_DECODE_COST_PER_KEY, key_seconds / self._token_seconds(rates))

    @staticmethod
    def kv_geometry(cfg: Any) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of a model config: the KV pool's shape, known before any weight loads."""
        return cfg.num_hidden_layers, cfg.num_key_value_heads, layout.head_dim(cfg)

    def kv_bytes_per_token(self) -> int:
        return PagedKVCache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: PagedKVCache, logits_indices: torch.Tensor, lora: LoraBatch | None = None,
                greedy_bans: list[list[int]] | None = None, hidden_indices: torch.Tensor | None = None) -> Any:
        """input_ids/positions [T]; returns fp32 logits [len(logits_indices), vocab]. With greedy_bans (one
        list of banned ids per logits row, every row a plain argmax) and a greedy head that takes the step,
        returns the rows' greedy tokens instead (GreedyPicks). Given ``hidden_indices`` (pooling), returns
        (that answer, the final-normed hidden states of those rows, fp32 [len(hidden_indices), hidden])."""
        if self.kernels is not None:
            return self._forward_fused(input_ids, positions, meta, cache, logits_indices, lora, greedy_bans,
                                       hidden_indices)
        return self._forward_torch(input_ids, positions, meta, cache, logits_indices, lora, hidden_indices)

    def _project(self, lora: LoraBatch | None, layer: int, group: str, linear: AnyLinear,
                 x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        if lora is not None:
            return lora.project(layer, group, x, prompt_rows)
        return prompt_rows.project(linear, x) if prompt_rows is not None else linear(x)

    def _prompt_rows(self, num_rows: int, meta: AttentionMetadata, logits_indices: torch.Tensor,
                     hidden_indices: torch.Tensor | None) -> PromptRows | None:
        """The step's rows split by activation mode under int8-prompt; None when every row is exact (no
        prompt row without logits) or the mode is off. A row's mode depends on that row alone (a prompt row
        before the prompt's last token, whose output is not read), never on the step around it: not on what
        it was batched with (adapters' rows included: the LoRA batch takes the modes to the base weights), nor
        on how its prompt was chunked, whether a prefix of the same prompt was cached, or whether the
        sequence is recomputed after a preemption (its outputs then stay exact, as they were decoded)."""
        if not self.prompt_int8_activations or not meta.prefills:
            return None
        int8 = torch.zeros(num_rows, dtype=torch.bool)
        for span in meta.prefills:
            rows = span.q_len if span.kv_only_rows is None else span.kv_only_rows
            int8[span.q_start:span.q_start + rows] = True
        int8[logits_indices] = False
        if hidden_indices is not None:
            int8[hidden_indices] = False
        if not bool(int8.any()):
            return None
        return PromptRows.of(int8)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       cache: PagedKVCache, logits_indices: torch.Tensor, lora: LoraBatch | None,
                       greedy_bans: list[list[int]] | None = None, hidden_indices: torch.Tensor | None = None) -> Any:
        """Same arithmetic as ``_forward_torch``, with everything between the linears in fused kernels."""
        kern = self.kernels
        assert kern is not None
        T = input_ids.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        nd = meta.num_decodes
        x = self.embed[input_ids]  # a fresh tensor: the residual stream, updated in place
        h = torch.empty_like(x)
        act = torch.empty(T, self.intermediate, dtype=x.dtype, device=x.device)
        a = torch.empty(T, H * D, dtype=x.dtype, device=x.device)  # attention output, reused by every layer
        scratch = self._attention_scratch(nd * H * meta.decode_max_len) if nd else None
        prompt_rows = self._prompt_rows(T, meta, logits_indices, hidden_indices)
        # the one-call loop takes a split step where its descriptors give the 4-bit projections a mode per row
        # (_int8_mode); else a split step goes call by call
        descs = (self._layers_as_described() if self.layers_in_one_call and lora is None
                 and (meta.prefill_spans is not None or not meta.prefills) else None)
        if prompt_rows is not None and descs is not None and not self._per_row_int8():
            descs = None
        if descs is not None and self._one_call_max_rows >= T:
            kept = (logits_indices if self.trim_last_layer and hidden_indices is None and logits_indices.shape[0] < T
                    and _ascending(logits_indices) else None)  # decode-only steps: every row is a logits row
            int8_rows = prompt_rows.flags if prompt_rows is not None else None
            down = self._layers_in_one_call(descs, x, h, a, act, positions, meta, cache, scratch, kept, int8_rows)
            if kept is not None:  # x and down hold the logits rows, in order, at the front
                n = kept.shape[0]
                x, down, logits_indices = x[:n], down[:n], torch.arange(n)
            return self._with_hidden(x, down, logits_indices, greedy_bans, hidden_indices)
        # the runner fills the decode tables whenever there are decodes, the prefill ones with prefill_spans
        decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        prefill: tuple[torch.Tensor, torch.Tensor] | None = None
        if nd:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            assert tables is not None and lens is not None and scratch is not None
            decode = tables, lens, scratch
        if meta.prefill_spans is not None:
            assert meta.prefill_block_tables is not None
            prefill = meta.prefill_spans, meta.prefill_block_tables
        kern.add_rms_norm(x, None, self.layers[0].input_norm, h, self.eps)
        for i, lw in enumerate(self.layers):
            qkv = self._project(lora, i, "qkv", lw.qkv, h, prompt_rows)
            if lw.q_norm is not None:
                self._norm_heads(qkv, lw)
            layer_kv = cache.kv[i]
            kern.rope_cache_write(qkv, positions, self.cos, self.sin_signed, layer_kv, meta.slot_mapping, H, Hkv, D)
            if decode is not None:
                kern.decode_attention(qkv, layer_kv, decode[0], decode[1],
                                      cache.block_size, nd, H, Hkv, D, meta.decode_max_len, decode[2], a)
            if prefill is not None:
                kern.prefill_attention(qkv, layer_kv, prefill[0], prefill[1],
                                       cache.block_size, H, Hkv, D, a)
            elif meta.prefills:
                q = qkv[:, : H * D].view(T, H, D)
                new_kv = qkv[:, H * D:].view(T, 2 * Hkv, D).transpose(0, 1)
                prefill_attention(q, new_kv, layer_kv, meta.prefills, a.view(T, H, D))
            kern.add_rms_norm(x, self._project(lora, i, "o", lw.o, a, prompt_rows), lw.post_norm, h, self.eps)
            kern.silu_mul(self._project(lora, i, "gate_up", lw.gate_up, h, prompt_rows), act)
            down = self._project(lora, i, "down", lw.down, act, prompt_rows)
            if i + 1 < self.num_layers:
                kern.add_rms_norm(x, down, self.layers[i + 1].input_norm, h, self.eps)
        return self._with_hidden(x, down, logits_indices, greedy_bans, hidden_indices)

    def _with_hidden(self, x: torch.Tensor, down: torch.Tensor, logits_indices: torch.Tensor,
                     greedy_bans: list[list[int]] | None, hidden_indices: torch.Tensor | None) -> Any:
        """``_final_logits``, and first (it adds the last layer into x in place) the pooled rows' final-normed
        hidden states when ``hidden_indices`` asks for them."""
        if hidden_indices is None:
            return self._final_logits(x, down, logits_indices, greedy_bans)
        assert self.kernels is not None
        hx, hd = x[hidden_indices], down[hidden_indices]  # copies: x stays as _final_logits expects it
        hidden = torch.empty_like(hx)
        self.kernels.add_rms_norm(hx, hd, self.final_norm, hidden, self.eps)
        return self._final_logits(x, down, logits_indices, greedy_bans), hidden.float()

    def _final_logits(self, x: torch.Tensor, down: torch.Tensor, logits_indices: torch.Tensor,
                      greedy_bans: list[list[int]] | None = None) -> torch.Tensor | GreedyPicks:
        """The last layer's residual add and the final norm, for the rows that need logits; then the head
        (or, given greedy_bans, the greedy head's picks where it takes the step: see ``forward``)."""
        assert self.kernels is not None
        T = x.shape[0]
        if logits_indices.shape[0] != T or not torch.equal(logits_indices, torch.arange(T, device=x.device)):
            x, down = x[logits_indices], down[logits_indices]
        h = torch.empty_like(x)
        self.kernels.add_rms_norm(x, down, self.final_norm, h, self.eps)
        if greedy_bans is not None and self.greedy_head is not None:
            picks = self.greedy_head.pick(h, greedy_bans)
            if picks is not None:
                return picks
        return self._logits(h)

    def _layers_in_one_call(self, descs: ctypes.Array, x: torch.Tensor, h: torch.Tensor, attn: torch.Tensor,
                            act: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache,
                            scratch: torch.Tensor | None, kept: torch.Tensor | None = None,
                            int8_rows: torch.Tensor | None = None) -> torch.Tensor:
        """_forward_fused's layer loop as one C call (engine/kernels/csrc/forward_loop.h: the same kernels in the
        same order), with its buffers: h, attn [T, H*D] and act [T, intermediate]. x is updated in place;
        returns the last layer's down projection. Given ``kept`` (ascending row indices), the last layer's
        output projection and MLP run for those rows only: afterwards x's first len(kept) rows are theirs,
        and so are the returned rows. ``int8_rows`` (uint8 per row, read only): the rows that take int8
        activations in the projections described with a mode per row."""
        assert self.kernels is not None
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = torch.empty(T, self.layers[0].qkv.out_features, dtype=x.dtype)
        proj = torch.empty_like(x)
        gate_up = torch.empty(T, 2 * self.intermediate, dtype=x.dtype)
        kv = cache.kv
        step = ForwardStep(
            tokens=T, num_heads=H, num_kv_heads=Hkv, head_dim=D, hidden=x.shape[1], intermediate=self.intermediate,
            x=x.data_ptr(), h=h.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(), proj=proj.data_ptr(),
            gate_up=gate_up.data_ptr(), act=act.data_ptr(),
            positions=positions.data_ptr(), cos=self.cos.data_ptr(), sin_signed=self.sin_signed.data_ptr(),
            slot_mapping=meta.slot_mapping.data_ptr(),
            kv=kv.data_ptr(), kv_layer_stride=kv.stride(0), num_slots=kv.shape[2], block_size=cache.block_size,
            eps=self.eps, scale=D ** -0.5)
        if meta.num_decodes:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            assert tables is not None and lens is not None and scratch is not None
            step.decodes, step.decode_max_len, step.scratch = meta.num_decodes, meta.decode_max_len, scratch.data_ptr()
            step.decode_block_tables, step.decode_max_blocks = tables.data_ptr(), tables.shape[1]
            step.decode_context_lens = lens.data_ptr()
        if meta.prefill_spans is not None:
            tables = meta.prefill_block_tables
            assert tables is not None
            step.prefill_spans, step.num_spans = meta.prefill_spans.data_ptr(), meta.prefill_spans.shape[0]
            step.prefill_block_tables, step.prefill_max_blocks = tables.data_ptr(), tables.shape[1]
        if kept is not None:
            kept = kept.contiguous()  # alive until the call returns
            step.trim_last_layer, step.kept_rows, step.num_kept = 1, kept.data_ptr(), kept.shape[0]
        if int8_rows is not None:
            step.row_int8 = int8_rows.data_ptr()
        self.kernels.forward_layers(descs, step)
        return proj

    def _norm_heads(self, qkv: torch.Tensor, lw: _LayerWeights) -> None:
        """Qwen3: RMSNorm over each head of q and of k (before RoPE), in place in the fused qkv rows."""
        assert lw.q_norm is not None and lw.k_norm is not None
        T, H, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, : H * D].view(T, H, D)
        k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
        q.copy_(rms_norm(q, lw.q_norm, self.eps))
        k.copy_(rms_norm(k, lw.k_norm, self.eps))

    def _attention_scratch(self, floats: int) -> torch.Tensor:
        """fp32 scores for decode attention, kept between steps (long contexts need megabytes, and a
        fresh allocation that size is page-faulted in on every step)."""
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch

    def _forward_torch(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       cache: PagedKVCache, logits_indices: torch.Tensor, lora: LoraBatch | None,
                       hidden_indices: torch.Tensor | None = None) -> Any:
        T = input_ids.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin_signed[positions].unsqueeze(1)
        half = D // 2
        x = self.embed[input_ids]
        for i, lw in enumerate(self.layers):
            h = rms_norm(x, lw.input_norm, self.eps)
            qkv = self._project(lora, i, "qkv", lw.qkv, h)
            if lw.q_norm is not None:
                self._norm_heads(qkv, lw)
            qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
            qk = qk * cos + torch.roll(qk, half, dims=-1) * sin  # RoPE on q and k at once
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            a = paged_attention(qk[:, :H], qk[:, H:], v, i, cache, meta)
            a = a.reshape(T, H * D)
            x = x + self._project(lora, i, "o", lw.o, a)
            h = rms_norm(x, lw.post_norm, self.eps)
            gu = self._project(lora, i, "gate_up", lw.gate_up, h)
            act = F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:]
            x = x + self._project(lora, i, "down", lw.down, act)
        logits = self._logits(rms_norm(x[logits_indices], self.final_norm, self.eps))
        if hidden_indices is None:
            return logits
        return logits, rms_norm(x[hidden_indices], self.final_norm, self.eps).float()

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [S, vocab] of the final hidden states h [S, hidden].

        In bf16 / fp16 the linear rounds its fp32 sums to the model dtype: ~3 significant digits, so
        two close candidates can come out equal (greedy then takes the lower id, whatever the model
        preferred). Rounding keeps order, so the true best is always among the tokens tied at the
        top; those few are recomputed in fp32, and greedy picks the model's own preference."""
        if isinstance(self.lm_head, (PackedLinear, ReferenceLinear)) and self.lm_head.takes(h.shape[0]):
            return self.lm_head(h, fp32_out=True)  # summed in fp32 and never rounded: no ties to break
        logits = self.lm_head(h).float()
        if self.dtype == torch.float32 or logits.shape[0] == 0:
            return logits
        if self.kernels is not None:
            tied_rows = (self.kernels.count_top_ties(logits) > 1).nonzero().flatten().tolist()
        else:
            tied_rows = ((logits == logits.amax(-1, keepdim=True)).sum(-1) > 1).nonzero().flatten().tolist()
        for row in tied_rows:
            cols = (logits[row] == logits[row].max()).nonzero().flatten()
            logits[row, cols] = (h[row].float() * self.lm_head.weight_rows(cols)).sum(-1)
        return logits
