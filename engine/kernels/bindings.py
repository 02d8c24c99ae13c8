"""Typed entry points into one kernel library (engine/kernels/csrc), bound from the signature table
(signatures.py). Every call that can fail raises (MemoryError, KernelUnsupported); each takes contiguous
tensors unless it says otherwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.kernels.signatures import (
    LINEAR_PATHS,
    RETURNS_STATUS,
    SIGNATURES,
    STRUCTS,
    TARGETS,
    ForwardStep,
    KernelUnsupported,
    bind,
)

if TYPE_CHECKING:
    from engine.quant.packing import PackedWeight

ABI_VERSION = 17  # target.c's SPARK_KERNELS_ABI_VERSION: a library built from other sources is refused
FAST_PATHS = LINEAR_PATHS[:2]  # the linears' fast paths, by enum spark_linear_path value ("dot", "fma")
LINEAR_PATH_NAMES = {"dot": "AVX512-BF16 dot products", "fma": "fp32 FMAs"}  # for logs and tables


def open_library(path: str | Path, origin: str = "") -> CpuKernels:
    return CpuKernels(ctypes.CDLL(str(path)), origin)


class CpuKernels:
    """Typed entry points into the compiled library; each takes contiguous tensors."""

    def __init__(self, lib: ctypes.CDLL, origin: str = "") -> None:
        if lib.spark_kernels_abi_version() != ABI_VERSION:
            raise RuntimeError("kernel library ABI mismatch (built from other sources)")
        fns = bind(lib, SIGNATURES, RETURNS_STATUS)
        for name, (which, struct) in STRUCTS.items():
            if fns["spark_forward_struct_size"](which) != ctypes.sizeof(struct):
                raise RuntimeError(f"kernel library's struct {name} differs from engine/kernels/signatures.py")
        self.origin = origin  # which library this is, for logs: "prebuilt avx512", "compiled for -march=native"
        self.target = TARGETS[fns["spark_kernels_target"]()]  # the instruction-set target it was compiled for
        self.max_head_dim = fns["spark_kernels_max_head_dim"]()
        self.max_group = fns["spark_kernels_max_group"]()
        self._fns: dict[tuple[str, torch.dtype], Any] = {}
        for name in ("add_rms_norm", "silu_mul", "rope_cache_write", "lora_shrink", "lora_expand", "decode_attention",
                     "prefill_attention"):
            for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
                self._fns[(name, dtype)] = fns[f"{name}_{suffix}"]
        self._linear_rows = fns["spark_linear_rows"]  # spark_linear is spark_linear_rows without flags
        self._linear_rows_fast = fns["spark_linear_rows_fast"]
        self._takes_int8_rows: dict[int, bool] = {}
        self._linear_many = fns["spark_linear_many"]
        self._forward_layers = fns["spark_forward_layers"]
        self._read_sum = fns["spark_read_sum"]
        self._tile_group_bytes = fns["spark_packed_tile_group_bytes"]
        # 2: AVX512-BF16 dot products (and AVX-512F FMAs); 1: fp32 FMAs only (AVX2, or AVX-512F without BF16);
        # 0: the portable C path only (correct everywhere, slower)
        self.linear_isa = fns["spark_linear_isa"]()
        # the fast paths for bf16 activations this build has ("dot": AVX512-BF16, "fma": fp32 FMAs on AVX-512F,
        # or on AVX2 where the build has no AVX-512)
        paths = fns["spark_linear_paths"]()
        self.linear_paths = tuple(name for bit, name in enumerate(FAST_PATHS) if paths >> bit & 1)
        # The path every call without its own runs: a default held here, passed to the library with each call
        # (the library keeps no state). "dot" where the build has it: chosen at start by timing
        # (engine/models/weights.py choose_linear_path). None: portable C only.
        self.linear_path: str | None = self.linear_paths[0] if self.linear_paths else None
        # int8 activations against 4-bit weights have a VNNI path here (else they run on portable C)
        self.int8_activations_fast = bool(fns["spark_linear_int8_act_fast"]())
        self._count_top_ties = fns["count_top_ties"]
        self._argmax_rows = fns["argmax_rows"]
        # exact greedy picks through int8 logits and a bound (greedy_head.c; AVX512-VNNI builds only)
        self.greedy_head_fast = bool(fns["spark_greedy_head_fast"]())
        self._greedy_head_bounds = fns["spark_greedy_head_bounds"]
        self._greedy_candidates = fns["spark_greedy_candidates"]
        self._greedy_exact = fns["spark_greedy_exact"]
        self._greedy_head_from_packed = fns["spark_greedy_head_from_packed"]
        self._sample_rows = fns["sample_rows"]
        self._apply_token_bitmask = fns["apply_token_bitmask"]
        self._repack_gguf_blocks = fns["spark_repack_gguf_blocks"]
        self._packed_rows = fns["spark_packed_rows_f32"]
        self.num_threads = torch.get_num_threads()

    def path_code(self, path: str | None = None) -> int:
        """enum spark_linear_path's value for ``path`` (default: ``linear_path``; None: portable C)."""
        path = path if path is not None else self.linear_path
        return LINEAR_PATHS.index(path) if path is not None else LINEAR_PATHS.index("portable")

    def set_linear_path(self, path: str) -> None:
        """Which fast path the calls that name none run (one of ``linear_paths``): the engine's choice, made
        at start by timing both (engine/models/weights.py)."""
        if path not in self.linear_paths:
            raise ValueError(f"linear path {path!r} is not in this build (it has: {', '.join(self.linear_paths)})")
        self.linear_path = path

    @contextmanager
    def on_linear_path(self, path: str) -> Iterator[None]:
        """Runs the block with ``path`` as the default, then restores the one chosen before (benchmarks, tests)."""
        saved = self.linear_path
        self.set_linear_path(path)
        try:
            yield
        finally:
            self.linear_path = saved  # a path of this build, or None for a build without fast paths

    def supports(self, dtype: torch.dtype, head_dim: int, group: int) -> bool:
        return dtype in (torch.bfloat16, torch.float32) and head_dim <= self.max_head_dim and group <= self.max_group

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, eps: float) -> None:
        """x += residual (in place, when given); out = RMSNorm(x) * weight."""
        rows, dim = x.shape
        self._fns[("add_rms_norm", x.dtype)](x.data_ptr(), residual.data_ptr() if residual is not None else None,
                                             weight.data_ptr(), out.data_ptr(), rows, dim, eps, self.num_threads)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        rows, inter = out.shape
        self._fns[("silu_mul", gate_up.dtype)](gate_up.data_ptr(), out.data_ptr(), rows, inter, self.num_threads)

    def rope_cache_write(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                         layer_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> None:
        self._fns[("rope_cache_write", qkv.dtype)](
            qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), layer_cache.data_ptr(),
            slot_mapping.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim, layer_cache.shape[1],
            self.num_threads)

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, num_proj: int, num_slots: int,
                    rank: int, u: torch.Tensor) -> None:
        """u's columns of each token's own slot = x @ (that slot's rows of the A stack ``a``)^T; x [T, K] with
        unit column stride, a [num_proj * num_slots * rank, K] contiguous, u [T, a's rows], all one dtype."""
        if x.stride(1) != 1 or not a.is_contiguous() or u.stride(1) != 1 or x.dtype != a.dtype or u.dtype != a.dtype:
            raise ValueError("lora_shrink takes rows of one dtype with unit column stride and a contiguous stack")
        rows = num_proj * num_slots * rank
        if (a.shape != (rows, x.shape[1]) or u.shape != (x.shape[0], rows) or token_slots.dtype != torch.int64
                or token_slots.shape != (x.shape[0],) or not token_slots.is_contiguous()):
            raise ValueError("lora_shrink: a [num_proj * num_slots * rank, K], u [tokens, its rows] and one int64 "
                             "slot a token")
        self._fns[("lora_shrink", x.dtype)](
            x.data_ptr(), x.stride(0), x.shape[1], a.data_ptr(), num_proj, num_slots, rank, token_slots.data_ptr(),
            x.shape[0], u.data_ptr(), u.stride(0), self.num_threads)

    def lora_expand(self, y: torch.Tensor, u: torch.Tensor, n: int, out: torch.Tensor, token_slots: torch.Tensor,
                    b: torch.Tensor, out_sizes: torch.Tensor, num_slots: int, rank: int) -> None:
        """out [T, n] = y[:, :n] + each token's own adapter's B applied to its slot's columns of u (the shrink's
        output, or the A columns of a fused projection: ``y[:, n:]``)."""
        self._fns[("lora_expand", y.dtype)](
            y.data_ptr(), y.stride(0), u.data_ptr(), u.stride(0), n, out.data_ptr(), token_slots.data_ptr(),
            y.shape[0], b.data_ptr(), out_sizes.shape[0], out_sizes.data_ptr(), num_slots, rank, self.num_threads)

    def linear(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, portable: bool = False,
               int8_activations: bool = False, path: str | None = None,
               int8_rows: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W^T (+ bias) over a packed weight (engine/quant/packing.py); x bf16 [M, K] with unit
        column stride; y bf16 (or fp32 when ``out`` is fp32). ``path``: this call's fast path (default
        ``linear_path``); ``portable`` forces the plain-C one.
        ``int8_activations`` (4-bit weights only; ignored for others): x's code term is taken in int8 per
        block of 32 inputs, as llama.cpp computes these formats (engine/quant/activations.py); with
        ``int8_rows``, on the flagged rows alone (``linear_into``)."""
        m, k = x.shape
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or k != weight.in_features:
            raise ValueError("linear kernel takes bf16 rows of in_features with unit stride")
        if out is None:
            out = torch.empty(m, weight.out_features, dtype=torch.bfloat16)
        if bias is not None and bias.dtype != torch.float32:
            raise ValueError("linear kernel bias must be fp32")
        self.linear_into(x, weight, bias.data_ptr() if bias is not None else None, out, int8_activations, portable,
                         path, int8_rows)
        return out

    def linear_into(self, x: torch.Tensor, weight: PackedWeight, bias_ptr: int | None, out: torch.Tensor,
                    int8_activations: bool, portable: bool = False, path: str | None = None,
                    int8_rows: torch.Tensor | None = None) -> None:
        """``linear`` for callers that have checked x (bf16, unit column stride, in_features wide) and made
        ``out``: the engine's per-projection path, where each check costs a measurable share of a decode step.
        ``path``: this call's path (default ``linear_path``); ``portable`` overrides it with the plain-C one.
        ``int8_rows`` (uint8 per row of x, contiguous; with ``int8_activations``): only the flagged rows take
        int8 activations, the others the exact path, in one pass (where ``takes_int8_rows``)."""
        if int8_rows is not None:
            if int8_rows.dtype != torch.uint8 or not int8_rows.is_contiguous() or int8_rows.shape != (x.shape[0],):
                raise ValueError("int8_rows takes one contiguous uint8 flag per row of x")
            if not int8_activations or weight.fmt != "u4":
                raise ValueError("int8_rows applies to int8 activations against 4-bit weights")
        self._linear_rows(weight.fmt_code, x.data_ptr(), x.shape[0], weight.in_features, x.stride(0),
                          weight.data.data_ptr(), weight.out_features, weight.group, bias_ptr, out.data_ptr(),
                          out.stride(0), int(out.dtype == torch.float32), int(int8_activations),
                          int8_rows.data_ptr() if int8_rows is not None else None,
                          self.path_code("portable" if portable else path), self.num_threads)

    def takes_int8_rows(self, path: str | None = None) -> bool:
        """Whether a call with a mode per row (``int8_rows``) runs on ``path`` (default ``linear_path``) here:
        the VNNI int8 tiles beside the AVX512-BF16 dot tiles, on the dot path."""
        code = self.path_code(path)
        known = self._takes_int8_rows.get(code)
        if known is None:  # asked per projection per step: the library's answer kept by path
            known = self._takes_int8_rows[code] = bool(self._linear_rows_fast(code))
        return known

    def linear_calls(self, calls: list[tuple[torch.Tensor, PackedWeight, torch.Tensor]],
                     int8_activations: bool = False) -> torch.Tensor:
        """Describes linears (x, weight, out: bf16, no bias) for ``run_linear_calls``: one C call runs them all."""
        rows = []
        for x, weight, out in calls:
            assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.shape[1] == weight.in_features
            assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], weight.out_features)
            rows.append([weight.fmt_code, x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data.data_ptr(),
                         weight.out_features, weight.group, 0, out.data_ptr(), out.stride(0), 0, int(int8_activations)])
        return torch.tensor(rows, dtype=torch.int64)

    def run_linear_calls(self, described: torch.Tensor) -> None:
        """Runs what ``linear_calls`` described, back to back (the tensors it names must still be alive)."""
        self._linear_many(described.shape[0], described.data_ptr(), self.path_code(), self.num_threads)

    def forward_layers(self, layers: ctypes.Array, step: ForwardStep) -> None:
        """Every decoder layer of a bf16 forward in one call (forward.c); the tensors that ``layers`` and
        ``step`` point at must be alive and shaped as they say."""
        self._forward_layers(layers, len(layers), ctypes.byref(step), self.path_code(), self.num_threads)

    def read_sum(self, buffer: torch.Tensor) -> int:
        """Read every byte of a buffer (a multiple of 8 bytes) once: the plain-read bandwidth reference."""
        return self._read_sum(buffer.data_ptr(), buffer.numel() * buffer.element_size() // 8, self.num_threads)

    def packed_tile_group_bytes(self, fmt: str, group: int) -> int:
        """Bytes of one tile's group of ``group`` inputs in the packed layout, in format ``fmt`` ("bf16", "u4",
        "i8"), as the kernels read it."""
        from engine.quant.packing import FORMATS

        return int(self._tile_group_bytes(FORMATS[fmt], group))

    def repack_gguf_blocks(self, kind: int, rows: torch.Tensor, groups: int, out: torch.Tensor) -> None:
        """out (uint8, the packed layout's whole matrix) from GGUF blocks of ``kind`` (enum spark_gguf_block):
        rows int64 [N], each row's address (0: a padding row), N a multiple of 16; every row holds ``groups``
        blocks. The memory the addresses name must stay mapped for the call."""
        assert rows.dtype == torch.int64 and rows.is_contiguous() and out.dtype == torch.uint8 and out.is_contiguous()
        self._repack_gguf_blocks(kind, rows.data_ptr(), rows.shape[0], groups, out.data_ptr(), self.num_threads)

    def packed_rows(self, weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [len(ids), in_features]: rows ``ids`` of a packed u4 / i8 weight, dequantized as
        QuantizedWeight.dequantize defines it (engine/quant/packing.py's unpack_rows is the reference)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), weight.in_features, dtype=torch.float32)
        self._packed_rows(weight.fmt_code, weight.data.data_ptr(), weight.out_features, weight.in_features,
                          weight.group, ids.data_ptr(), ids.numel(), out.data_ptr())
        return out

    def apply_token_bitmask(self, logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
        """fp32 logits [B, V] in place: in row rows[i], tokens whose bit is 0 in mask[i] (int32 words) -> -inf."""
        assert logits.dtype == torch.float32 and logits.is_contiguous() and mask.dtype == torch.int32
        assert mask.is_contiguous() and rows.dtype == torch.int64 and mask.shape[0] >= rows.shape[0]
        assert int(rows.max()) < logits.shape[0] and int(rows.min()) >= 0
        self._apply_token_bitmask(logits.data_ptr(), logits.shape[1], mask.data_ptr(), mask.shape[1], rows.data_ptr(),
                                  rows.shape[0])

    def count_top_ties(self, logits: torch.Tensor) -> torch.Tensor:
        """Per row of fp32 logits [S, V]: how many entries equal the row's maximum."""
        counts = torch.empty(logits.shape[0], dtype=torch.int64)
        self._count_top_ties(logits.data_ptr(), logits.shape[0], logits.shape[1], counts.data_ptr())
        return counts

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(logits, -1) of fp32 logits [S, V] with unit-stride rows (first maximum; first NaN)."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
            raise ValueError("argmax takes fp32 logits [rows, vocab > 0]")
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
        return out

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of fp32 logits [S, V], drawn as engine/sampler.py's torch path defines it
        (sampling.c): per-row temperature, top_k (0: off), top_p (1: off), min_p (0: off) as fp32 / int64
        vectors [S], and u [S] uniforms in [0, 1) from the rows' own generators."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
            raise ValueError("sample takes fp32 logits [rows, vocab > 0]")
        rows = logits.shape[0]
        logits = logits.contiguous()
        args = [t.to(dtype).contiguous() for t, dtype in ((temperature, torch.float32), (top_k, torch.int64),
                                                          (top_p, torch.float32), (min_p, torch.float32),
                                                          (u, torch.float32))]
        if any(a.shape != (rows,) for a in args):
            raise ValueError("sample's per-row parameters are vectors of one entry a row")
        out = torch.empty(rows, dtype=torch.int64)
        self._sample_rows(logits.data_ptr(), rows, logits.shape[1], *(a.data_ptr() for a in args), out.data_ptr())
        return out

    def greedy_head_bounds(self, x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, n: int,
                           hi: torch.Tensor, best: torch.Tensor, banned: list[list[int]]) -> bool:
        """Over a head repacked by engine/models/greedy_head.py: hi [S, n] fp32 = the int8 logits of x [S, K]
        (bf16) plus their proven error bound, and best [S] = each row's largest logit minus its bound, the
        row's banned ids (-inf in hi) left out. False where this build or the shapes cannot."""
        if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or len(banned) != x.shape[0]:
            return False
        ban_off = torch.tensor([0] + [len(ids) for ids in banned], dtype=torch.int64).cumsum_(0)
        ban_ids = torch.tensor([t for ids in banned for t in ids] or [0], dtype=torch.int64)
        try:
            self._greedy_head_bounds(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), codes.data_ptr(),
                                     meta.data_ptr(), n, hi.data_ptr(), best.data_ptr(), ban_off.data_ptr(),
                                     ban_ids.data_ptr(), self.num_threads)
        except KernelUnsupported:
            return False
        return True

    def greedy_head_from_packed(self, head: PackedWeight, codes: torch.Tensor, meta: torch.Tensor) -> None:
        """Fills the greedy head's codes (uint8 [tiles, K / 32, 8, 16, 4]) and meta (fp32 [tiles, K / 32, 2, 16])
        from a packed i8 head in one pass (engine/models/greedy_head.py's GreedyHead.__init__ is the reference)."""
        assert head.fmt == "i8" and codes.dtype == torch.uint8 and meta.dtype == torch.float32
        assert codes.is_contiguous() and meta.is_contiguous()
        self._greedy_head_from_packed(head.data.data_ptr(), head.out_features, head.in_features, head.group,
                                      codes.data_ptr(), meta.data_ptr(), self.num_threads)

    def greedy_candidates(self, hi: torch.Tensor, best: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the ids whose hi reaches the row's best lower bound (ascending, at most cap: idx [S, cap])
        and how many (count [S]; -1: more than cap)."""
        rows, n = hi.shape
        idx = torch.empty(rows, cap, dtype=torch.int64)
        count = torch.empty(rows, dtype=torch.int64)
        self._greedy_candidates(hi.data_ptr(), best.data_ptr(), rows, n, cap, idx.data_ptr(), count.data_ptr())
        return idx, count

    def greedy_exact(self, x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, idx: torch.Tensor,
                     count: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token among its candidates (greedy_candidates' idx and count; every count >= 1),
        from fp32 logits of the dequantized head rows (see greedy_head_bounds for codes and meta)."""
        rows, cap = idx.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._greedy_exact(x.data_ptr(), rows, x.shape[1], x.stride(0), codes.data_ptr(), meta.data_ptr(),
                           idx.data_ptr(), count.data_ptr(), cap, out.data_ptr())
        return out

    def decode_attention(self, qkv: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, block_size: int, batch: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, max_context: int, scratch: torch.Tensor, out: torch.Tensor) -> None:
        self._fns[("decode_attention", qkv.dtype)](
            qkv.data_ptr(), qkv.stride(0), layer_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            context_lens.data_ptr(), block_size, batch, num_heads, num_kv_heads, head_dim, layer_cache.shape[1],
            head_dim ** -0.5, max_context, scratch.data_ptr(), out.data_ptr(), self.num_threads)

    def prefill_attention(self, qkv: torch.Tensor, layer_cache: torch.Tensor, spans: torch.Tensor,
                          block_tables: torch.Tensor, block_size: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, out: torch.Tensor) -> None:
        """Causal attention of prefill chunks over their paged context (the chunks' K/V already in the
        cache). spans [S, 3] int64: (first flat row, queries, context length after the chunk);
        block_tables [S, max_blocks] int64; out [T, H*D] gets the spans' rows."""
        self._fns[("prefill_attention", qkv.dtype)](
            qkv.data_ptr(), qkv.stride(0), layer_cache.data_ptr(), spans.data_ptr(), spans.shape[0],
            block_tables.data_ptr(), block_tables.shape[1], block_size, num_heads, num_kv_heads, head_dim,
            layer_cache.shape[1], head_dim ** -0.5, out.data_ptr(), out.stride(0), self.path_code(), self.num_threads)
