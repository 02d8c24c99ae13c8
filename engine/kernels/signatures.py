"""The kernel library's entry points and structs as ctypes sees them: the one table the bindings use.

Each entry mirrors a declaration in csrc/*.h (name -> return type, argument types); the structs mirror
forward.h's. tests/engine/test_kernel_signatures.py parses the headers and checks every declaration against
this table (argument count and types, return type, which calls return a status) and the structs' fields;
the loader also compares the structs' sizes with the library's own (spark_forward_struct_size). Pointers
are ``c_void_p`` (the callers pass ``tensor.data_ptr()``), except the descriptors' typed ones.
"""

from __future__ import annotations

import ctypes
from typing import Any

P = ctypes.c_void_p
I64 = ctypes.c_int64
F = ctypes.c_float
INT = ctypes.c_int

# enum spark_status (spark_types.h)
SPARK_OK, SPARK_ERR_NOMEM, SPARK_ERR_UNSUPPORTED = 0, 1, 2
# enum spark_linear_path (spark_types.h): the paths' names by value
LINEAR_PATHS = ("dot", "fma", "portable")
# enum spark_target (spark_types.h): the built libraries, lowest first
TARGETS = ("portable", "avx2", "avx512", "avx512bf16")


class LinearDesc(ctypes.Structure):
    """One packed linear for ``forward_layers`` (forward.h's spark_linear_desc; pointers as integers)."""
    _fields_ = [(name, ctypes.c_int64) for name in
                ("fmt", "weight", "out_features", "in_features", "group", "bias", "int8_activations")]


class LayerDesc(ctypes.Structure):
    """One decoder layer's weights for ``forward_layers`` (spark_layer_desc)."""
    _fields_ = [("input_norm", ctypes.c_int64), ("post_norm", ctypes.c_int64), ("qkv", LinearDesc),
                ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc)]


class ForwardStep(ctypes.Structure):
    """One step's shapes and buffers for ``forward_layers`` (spark_forward_step; pointers as integers)."""
    _fields_ = [(name, ctypes.c_int64) for name in (
        "tokens", "num_heads", "num_kv_heads", "head_dim", "hidden", "intermediate",
        "x", "h", "qkv", "attn", "proj", "gate_up", "act",
        "positions", "cos", "sin_signed", "slot_mapping",
        "kv", "kv_layer_stride", "num_slots", "block_size",
        "decodes", "decode_block_tables", "decode_max_blocks", "decode_context_lens", "decode_max_len", "scratch",
        "prefill_spans", "num_spans", "prefill_block_tables", "prefill_max_blocks", "trim_last_layer", "kept_rows",
        "num_kept", "row_int8")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


# spark_forward_struct_size's argument for each struct
STRUCTS = {"spark_linear_desc": (0, LinearDesc), "spark_layer_desc": (1, LayerDesc),
           "spark_forward_step": (2, ForwardStep)}

Signature = tuple[Any, list[Any]]  # (restype, argtypes)


def _both_dtypes(name: str, restype: Any, argtypes: list[Any]) -> dict[str, Signature]:
    return {f"{name}_bf16": (restype, argtypes), f"{name}_f32": (restype, argtypes)}


SIGNATURES: dict[str, Signature] = {
    # target.h
    "spark_kernels_abi_version": (INT, []),
    "spark_kernels_target": (INT, []),
    "spark_cpu_best_target": (INT, []),
    "spark_kernels_max_head_dim": (INT, []),
    "spark_kernels_max_group": (INT, []),
    # layer_ops.h
    **_both_dtypes("add_rms_norm", None, [P, P, P, P, I64, I64, F, INT]),
    **_both_dtypes("silu_mul", None, [P, P, I64, I64, INT]),
    **_both_dtypes("rope_cache_write", None, [P, P, P, P, P, P, I64, I64, I64, I64, I64, INT]),
    **_both_dtypes("decode_attention", INT, [P, I64, P, P, I64, P, I64, I64, I64, I64, I64, I64, F, I64, P, P, INT]),
    **_both_dtypes("prefill_attention", INT, [P, I64, P, P, I64, P, I64, I64, I64, I64, I64, I64, F, P, I64, INT,
                                              INT]),
    **_both_dtypes("lora_shrink", INT, [P, I64, I64, P, I64, I64, I64, P, I64, P, I64, INT]),
    **_both_dtypes("lora_expand", None, [P, I64, P, I64, I64, P, P, I64, P, I64, P, I64, I64, INT]),
    # linear.h
    "spark_linear": (INT, [INT, P, I64, I64, I64, P, I64, I64, P, P, I64, INT, INT, INT, INT]),
    "spark_linear_rows": (INT, [INT, P, I64, I64, I64, P, I64, I64, P, P, I64, INT, INT, P, INT, INT]),
    "spark_linear_rows_fast": (INT, [INT]),
    "spark_linear_many": (INT, [I64, P, INT, INT]),
    "spark_linear_paths": (INT, []),
    "spark_linear_isa": (INT, []),
    "spark_linear_int8_act_fast": (INT, []),
    "spark_packed_tile_group_bytes": (I64, [INT, I64]),
    "spark_read_sum": (ctypes.c_uint64, [P, I64, INT]),
    # forward.h
    "spark_forward_layers": (INT, [ctypes.POINTER(LayerDesc), I64, ctypes.POINTER(ForwardStep), INT, INT]),
    "spark_forward_struct_size": (I64, [INT]),
    # sampling.h
    "count_top_ties": (None, [P, I64, I64, P]),
    "argmax_rows": (None, [P, I64, I64, P]),
    "sample_rows": (INT, [P, I64, I64, P, P, P, P, P, P]),
    "apply_token_bitmask": (None, [P, I64, P, I64, P, I64]),
    # greedy_head.h
    "spark_greedy_head_fast": (INT, []),
    "spark_greedy_head_bounds": (INT, [P, I64, I64, I64, P, P, I64, P, P, P, P, INT]),
    "spark_greedy_candidates": (None, [P, P, I64, I64, I64, P, P]),
    "spark_greedy_exact": (None, [P, I64, I64, I64, P, P, P, P, I64, P]),
    "spark_greedy_head_from_packed": (INT, [P, I64, I64, I64, P, P, INT]),
    # repack.h
    "spark_repack_gguf_blocks": (INT, [INT, P, I64, I64, P, INT]),
    "spark_packed_rows_f32": (INT, [INT, P, I64, I64, I64, P, I64, P]),
}

# The entry points whose int is an enum spark_status (their header comment says "Returns SPARK_OK ..."):
# bound with an errcheck that raises on anything but SPARK_OK.
RETURNS_STATUS = frozenset({
    "decode_attention_bf16", "decode_attention_f32", "prefill_attention_bf16", "prefill_attention_f32",
    "spark_linear", "spark_linear_rows", "spark_linear_many", "spark_forward_layers", "sample_rows",
    "spark_greedy_head_bounds", "spark_repack_gguf_blocks", "spark_packed_rows_f32",
    "spark_greedy_head_from_packed", "lora_shrink_bf16", "lora_shrink_f32"})

# The public headers SIGNATURES covers (bench.h is the benchmarks' own: benchmarks/kernel_bench.py)
HEADERS = ("target.h", "layer_ops.h", "linear.h", "forward.h", "sampling.h", "greedy_head.h", "repack.h")


class KernelUnsupported(ValueError):
    """A kernel call this build or these shapes cannot run (SPARK_ERR_UNSUPPORTED)."""


def check_status(status: int, func: Any, args: tuple[Any, ...]) -> int:
    """ctypes errcheck for the entry points in RETURNS_STATUS: a failed call raises, naming the kernel."""
    if status == SPARK_OK:
        return status
    name = getattr(func, "__name__", "kernel")
    if status == SPARK_ERR_NOMEM:
        raise MemoryError(f"{name}: the kernel's scratch memory could not be allocated")
    if status == SPARK_ERR_UNSUPPORTED:
        raise KernelUnsupported(f"{name}: not supported by this kernel build for these arguments")
    raise RuntimeError(f"{name} failed with status {status}")


def bind(lib: ctypes.CDLL, table: dict[str, Signature], returns_status: frozenset[str]) -> dict[str, Any]:
    """Every function of ``table`` from ``lib``, typed (and status-checked where it returns one)."""
    bound = {}
    for name, (restype, argtypes) in table.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
        if name in returns_status:
            fn.errcheck = check_status
        bound[name] = fn
    return bound
