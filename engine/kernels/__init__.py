"""Fused CPU kernels (cpu_kernels.c, cpu_linear.c), compiled once per machine with its C compiler and cached.

``load_cpu_kernels()`` returns a ``CpuKernels`` or None when they cannot be had (no compiler, a
failed build, ``SPARK_NATIVE_KERNELS=0``); callers then keep the pure-torch path, which computes the
same thing. The library links OpenMP by the soname torch already loaded (libgomp.so.1), so both
share one thread pool instead of fighting over the cores.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.model_loader import default_cache_dir

if TYPE_CHECKING:
    from engine.quant.packing import PackedWeight

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).parent
# The compilation units, compiled side by side (the linears take most of the time), then linked.
UNITS = (KERNELS_DIR / "cpu_kernels.c", KERNELS_DIR / "cpu_linear.c")
HEADERS = tuple(KERNELS_DIR / name for name in ("cpu_common.h", "cpu_kernels_impl.h", "cpu_linear.h",
                                                 "cpu_linear_fma.h", "cpu_linear_avx2.h", "cpu_prefill_attention.h",
                                                 "cpu_forward.h", "cpu_sampling.h", "cpu_greedy_head.h"))
SOURCES = UNITS + HEADERS
ABI_VERSION = 10
CFLAGS = ["-O3", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c11"]
NATIVE = "-march=native"  # this CPU's full instruction set (AVX-512 where it has it)
DISABLE_ENV = "SPARK_NATIVE_KERNELS"
# another -march target instead of this CPU's (e.g. x86-64-v3: what a CPU with AVX2 but no AVX-512 runs),
# to see and test that build's paths on this machine
MARCH_ENV = "SPARK_KERNELS_MARCH"
# the linear kernels' fast paths, by their C enum value (cpu_linear.h): AVX512-BF16 dot products, fp32 FMAs
LINEAR_PATHS = ("dot", "fma")
PEAK_KINDS = ("dot", "fma", "vnni")  # spark_dot_peak's kinds: the linears' two paths, the greedy head's int8
LINEAR_PATH_NAMES = {"dot": "AVX512-BF16 dot products", "fma": "fp32 FMAs"}  # for logs and tables

_lock = threading.Lock()
_loaded: CpuKernels | None = None
_failed = False


def cache_dir() -> Path:
    return default_cache_dir() / "kernels"  # beside the converted models


def find_compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def kernel_march() -> str:
    """The -march flag the engine's kernels are built with: this CPU's own, or ``SPARK_KERNELS_MARCH``'s target."""
    march = os.environ.get(MARCH_ENV)
    return f"-march={march}" if march else NATIVE


def build_library(cc: str, march: str | None = None, directory: Path | None = None,
                  extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernels (once: the file name carries a hash of sources, flags and CPU). ``march``: by
    default the engine's (``kernel_march``), so that variant builds compare like with like. ``extra_flags``:
    a variant build (benchmarks/bench_layers_ab.py's -D switches); the engine's own build has none."""
    source = b"".join(p.read_bytes() for p in SOURCES)
    flags = [*CFLAGS, march or kernel_march(), *extra_flags]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    # -march=native code is only valid on this CPU model: its flags are part of the key
    key = hashlib.sha256(source + " ".join(flags).encode() + version.encode() + platform.machine().encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Several processes starting on a cold cache at once (a fleet's replicas, test workers): one compiles
    # (~13 s of CPU, its two units side by side), the others wait for its library instead of compiling
    # the same one beside it.
    with open(directory / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            objects = [Path(tmp) / f"{unit.stem}.o" for unit in UNITS]
            out = Path(tmp) / target.name
            _run_all([[cc, *flags, "-c", str(unit), "-o", str(obj)] for unit, obj in zip(UNITS, objects)], cc)
            _run_all([[cc, *flags, "-shared", *map(str, objects), "-o", str(out), "-lm"]], cc)
            os.replace(out, target)  # atomic: a reader without the lock sees the whole library or none
    logger.info("compiled fused CPU kernels into %s", target)
    return target


def _run_all(commands: list[list[str]], cc: str) -> None:
    """Run compiler commands side by side; the first failure's message is raised."""
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for command in commands]
    errors = []
    for proc in procs:
        try:
            _, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            stderr = f"timed out after 300 s. {stderr}"
        if proc.returncode != 0:
            errors.append(stderr.strip())
    if errors:
        raise RuntimeError(f"{cc} failed: {errors[0][:2000]}")


def open_library(path: Path) -> CpuKernels:
    lib = ctypes.CDLL(str(path))
    if lib.spark_kernels_abi_version() != ABI_VERSION:
        raise RuntimeError("kernel library ABI mismatch")
    return CpuKernels(lib)


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_F = ctypes.c_float
_INT = ctypes.c_int


class LinearDesc(ctypes.Structure):
    """One packed linear for ``forward_layers`` (cpu_forward.h's spark_linear_desc; pointers as integers)."""
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
        "num_kept")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class CpuKernels:
    """Typed entry points into the compiled library; each takes contiguous tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.max_head_dim = lib.spark_kernels_max_head_dim()
        self.max_group = lib.spark_kernels_max_group()
        self._fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        signatures = {
            "add_rms_norm": [_P, _P, _P, _P, _I64, _I64, _F, _INT],
            "silu_mul": [_P, _P, _I64, _I64, _INT],
            "rope_cache_write": [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT],
            "lora_expand": [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _INT],
            "decode_attention": [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F, _I64, _P, _P,
                                 _INT],
            "prefill_attention": [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F, _P, _I64, _INT],
        }
        for name, argtypes in signatures.items():
            for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes = argtypes
                fn.restype = None
                self._fns[(name, dtype)] = fn
        self._linear = lib.spark_linear
        self._linear.argtypes = [_INT, _P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _INT, _INT, _INT, _INT]
        self._linear.restype = None
        self._linear_many = lib.spark_linear_many
        self._linear_many.argtypes = [_I64, _P, _INT]
        self._linear_many.restype = None
        self._forward_layers = lib.spark_forward_layers
        self._forward_layers.argtypes = [ctypes.POINTER(LayerDesc), _I64, ctypes.POINTER(ForwardStep), _INT]
        self._forward_layers.restype = None
        self._read_sum = lib.spark_read_sum
        self._read_sum.argtypes = [_P, _I64, _INT]
        self._read_sum.restype = ctypes.c_uint64
        self._dot_peak = lib.spark_dot_peak
        self._dot_peak.argtypes = [_INT, _I64, _INT]
        self._dot_peak.restype = ctypes.c_double
        # 2: AVX512-BF16 dot products (and AVX-512F FMAs); 1: AVX2 FMAs; 0: the portable C path only (correct
        # everywhere, slower)
        self.linear_isa = lib.spark_linear_isa()
        # the fast paths for bf16 activations this build has ("dot": AVX512-BF16, "fma": fp32 FMAs on AVX-512F,
        # or on AVX2 where the build has no AVX-512)
        paths = lib.spark_linear_paths()
        self.linear_paths = tuple(name for bit, name in enumerate(LINEAR_PATHS) if paths >> bit & 1)
        self._set_linear_path = lib.spark_linear_set_path
        self._set_linear_path.argtypes = [_INT]
        self._set_linear_path.restype = _INT
        self.linear_path = LINEAR_PATHS[self._set_linear_path(-1)] if self.linear_paths else None
        # int8 activations against 4-bit weights have a VNNI path here (else they run on portable C)
        self.int8_activations_fast = bool(lib.spark_linear_int8_act_fast())
        self._count_top_ties = lib.count_top_ties
        self._count_top_ties.argtypes = [_P, _I64, _I64, _P]
        self._count_top_ties.restype = None
        self._argmax_rows = lib.argmax_rows
        self._argmax_rows.argtypes = [_P, _I64, _I64, _P]
        self._argmax_rows.restype = None
        # exact greedy picks through int8 logits and a bound (cpu_greedy_head.h; AVX512-VNNI builds only)
        self.greedy_head_fast = bool(lib.spark_greedy_head_fast())
        self._greedy_head_bounds = lib.spark_greedy_head_bounds
        self._greedy_head_bounds.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _INT]
        self._greedy_head_bounds.restype = _INT
        self._greedy_candidates = lib.spark_greedy_candidates
        self._greedy_candidates.argtypes = [_P, _P, _I64, _I64, _I64, _P, _P]
        self._greedy_candidates.restype = None
        self._greedy_exact = lib.spark_greedy_exact
        self._greedy_exact.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P]
        self._greedy_exact.restype = None
        self._sample_rows = lib.sample_rows
        self._sample_rows.argtypes = [_P, _I64, _I64, _P, _P, _P, _P, _P, _P]
        self._sample_rows.restype = None
        self._apply_token_bitmask = lib.apply_token_bitmask
        self._apply_token_bitmask.argtypes = [_P, _I64, _P, _I64, _P, _I64]
        self._apply_token_bitmask.restype = None
        self.num_threads = torch.get_num_threads()

    def set_linear_path(self, path: str) -> None:
        """Which fast path every later linear call runs (one of ``linear_paths``): a process-wide choice,
        made at start by timing both (engine/models/weights.py)."""
        if path not in self.linear_paths:
            raise ValueError(f"linear path {path!r} is not in this build (it has: {', '.join(self.linear_paths)})")
        self.linear_path = LINEAR_PATHS[self._set_linear_path(LINEAR_PATHS.index(path))]

    @contextmanager
    def on_linear_path(self, path: str) -> Iterator[None]:
        """Runs the block on one fast path, then restores the path chosen before (benchmarks, tests)."""
        saved = self.linear_path
        self.set_linear_path(path)
        try:
            yield
        finally:
            self.set_linear_path(saved)

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

    def lora_expand(self, y: torch.Tensor, n: int, out: torch.Tensor, token_slots: torch.Tensor, b: torch.Tensor,
                    out_sizes: torch.Tensor, num_slots: int, rank: int) -> None:
        """out [T, n] = y[:, :n] + each token's own adapter's B applied to its slot's columns of y."""
        self._fns[("lora_expand", y.dtype)](
            y.data_ptr(), y.stride(0), n, out.data_ptr(), token_slots.data_ptr(), y.shape[0], b.data_ptr(),
            out_sizes.shape[0], out_sizes.data_ptr(), num_slots, rank, self.num_threads)

    def linear(self, x: torch.Tensor, weight: "PackedWeight", bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, portable: bool = False,
               int8_activations: bool = False) -> torch.Tensor:
        """y = x @ W^T (+ bias) over a packed weight (engine/quant/packing.py); x bf16 [M, K] with unit
        column stride; y bf16 (or fp32 when ``out`` is fp32). ``portable`` forces the plain-C path.
        ``int8_activations`` (4-bit weights only; ignored for others): x's code term is taken in int8 per
        block of 32 inputs, as llama.cpp computes these formats (engine/quant/activations.py)."""
        m, k = x.shape
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or k != weight.in_features:
            raise ValueError("linear kernel takes bf16 rows of in_features with unit stride")
        if out is None:
            out = torch.empty(m, weight.out_features, dtype=torch.bfloat16)
        if bias is not None and bias.dtype != torch.float32:
            raise ValueError("linear kernel bias must be fp32")
        self.linear_into(x, weight, bias.data_ptr() if bias is not None else None, out, int8_activations, portable)
        return out

    def linear_into(self, x: torch.Tensor, weight: "PackedWeight", bias_ptr: int | None, out: torch.Tensor,
                    int8_activations: bool, portable: bool = False) -> None:
        """``linear`` for callers that have checked x (bf16, unit column stride, in_features wide) and made
        ``out``: the engine's per-projection path, where each check costs a measurable share of a decode step."""
        self._linear(weight.fmt_code, x.data_ptr(), x.shape[0], weight.in_features, x.stride(0), weight.data.data_ptr(),
                     weight.out_features, weight.group, bias_ptr, out.data_ptr(), out.stride(0),
                     int(out.dtype == torch.float32), int(int8_activations), int(portable), self.num_threads)

    def linear_calls(self, calls: list[tuple[torch.Tensor, "PackedWeight", torch.Tensor]],
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
        self._linear_many(described.shape[0], described.data_ptr(), self.num_threads)

    def forward_layers(self, layers: ctypes.Array, step: ForwardStep) -> None:
        """Every decoder layer of a bf16 forward in one call (cpu_forward.h); the tensors that ``layers`` and
        ``step`` point at must be alive and shaped as they say."""
        self._forward_layers(layers, len(layers), ctypes.byref(step), self.num_threads)

    def read_sum(self, buffer: torch.Tensor) -> int:
        """Read every byte of a buffer (a multiple of 8 bytes) once: the plain-read bandwidth reference."""
        return self._read_sum(buffer.data_ptr(), buffer.numel() * buffer.element_size() // 8, self.num_threads)

    def dot_peak(self, kind: str, seconds: float = 0.2) -> float | None:
        """Multiply-adds a second that ``kind``'s instruction reaches on register-resident values, all threads
        ("dot": vdpbf16ps, "fma": fp32 FMAs, "vnni": vpdpbusd); best of three runs of ~``seconds`` each.
        None where this build lacks the instruction. The ceiling a kernel's arithmetic can approach."""
        code = PEAK_KINDS.index(kind)
        if not self._dot_peak(code, 1, self.num_threads):
            return None
        rounds, best = 1 << 12, 0.0
        while True:  # grow until one run takes a fair share of the time asked for
            start = time.perf_counter()
            done = self._dot_peak(code, rounds, self.num_threads)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / 4 or rounds >= 1 << 34:
                break
            rounds *= 2
        for _ in range(3):
            start = time.perf_counter()
            done = self._dot_peak(code, rounds, self.num_threads)
            best = max(best, done / (time.perf_counter() - start))
        return best

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
        (cpu_sampling.h): per-row temperature, top_k (0: off), top_p (1: off), min_p (0: off) as fp32 / int64
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
        if rows and int(out.min()) < 0:
            raise MemoryError("sampling scratch could not be allocated")
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
        return self._greedy_head_bounds(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), codes.data_ptr(),
                                        meta.data_ptr(), n, hi.data_ptr(), best.data_ptr(), ban_off.data_ptr(),
                                        ban_ids.data_ptr(), self.num_threads) == 0

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
            layer_cache.shape[1], head_dim ** -0.5, out.data_ptr(), out.stride(0), self.num_threads)


def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, built on first use; None where they cannot be had (logged once)."""
    global _loaded, _failed
    with _lock:
        if _loaded is not None or _failed:
            return _loaded
        if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
            logger.info("fused CPU kernels disabled by %s", DISABLE_ENV)
            _failed = True
            return None
        cc = find_compiler()
        if cc is None:
            logger.warning("no C compiler found: the CPU forward runs on plain torch ops (slower at small batch)")
            _failed = True
            return None
        if kernel_march() != NATIVE:
            logger.info("fused CPU kernels built for %s (%s), not this CPU's own", kernel_march(), MARCH_ENV)
        try:
            _loaded = open_library(build_library(cc))
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            logger.warning("fused CPU kernels unavailable (%s): the CPU forward runs on plain torch ops", exc)
            _failed = True
        return _loaded
