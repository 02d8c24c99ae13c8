"""Which weights and which linear kernel each projection runs on (``--quantization``).

  none:  the model's weights in its dtype. On a CPU with AVX512-BF16, bf16 projections are also packed
         for the engine's kernels, used at every batch size unless oneDNN measures clearly faster above
         some row count at start (AMX tiles): then for batches up to that count (oneDNN above).
  int8:  per-channel int8, rounded by GPTQ against each linear's inputs measured on text the model
         samples itself (engine/quant/gptq.py, calibration.py); once at load, then cached on disk.
  int4:  4-bit groups of 32 with fp16 scale and min, quantized once at load and cached on disk.
  gguf:  a GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks, as the file holds them (other types dequantized).
  auto:  gguf for a GGUF model where the kernels have a fast path (AVX-512, or AVX2); none otherwise.

And what 4-bit weights (int4, GGUF Q4_0 / Q4_1) multiply (``--linear-activations``):
  bf16:  the activations as they are; products exact in fp32 (AVX512-BF16). The default: it computes
         what the weights mean.
  int8:  the activations in int8 per block of 32 inputs, as llama.cpp runs these formats
         (engine/quant/activations.py; each block's outlier kept exact): integer dot products, twice
         the rate with AVX512-VNNI, ~1.2-1.4x faster prefill and large batches, at a measured cost in
         accuracy (the README's table, level with int8 weights), which is why it is a choice and not
         the default. The start-up log gives both modes' time at 64 rows.
  int8-prompt: int8 on the prompt rows whose output no one reads (they only write the KV cache), bf16 on
         every other row (decode and draft rows, logits, prompt-logprob and pooled rows): about half of
         int8's prefill gain at a small part of its divergence (benchmarks/bench_int8_split.py). Steps with
         adapters run bf16 throughout.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import torch

from engine.cpu_contention import CpuContention
from engine.kernels import LINEAR_PATH_NAMES, CpuKernels
from engine.models.linear import Linear, PackedLinear, ReferenceLinear, TwoTermBf16Linear
from engine.models.tuning import TuningCache
from engine.quant.calibration import PROGRESS_EVERY_S
from engine.quant.formats import QuantizedWeight, concat, quantize_int4, quantize_int8
from engine.quant.gptq import quantize_int8_gptq
from engine.quant.packing import pack_bf16, pack_quantized, packable

_CPU = torch.device("cpu")

logger = logging.getLogger(__name__)

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "gguf")
# bf16: exact products; int8: int8 blocks on every row of a 4-bit projection (llama.cpp's arithmetic);
# int8-prompt: int8 on the prompt rows whose logits no one reads (they only write the KV cache), exact on
# decode rows and on the rows that give logits, where nearly all of int8's divergence arises
ACTIVATION_CHOICES = ("bf16", "int8", "int8-prompt")
_INT8_PROBE_ROWS = 64  # a prefill-sized batch: where compute, not the weight stream, bounds a linear
_QUANTIZERS: dict[str, Callable[[torch.Tensor], QuantizedWeight]] = {"int8": quantize_int8, "int4": quantize_int4}
_ROW_PROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Quantized weights' oneDNN fallback costs twice a bf16 matmul and ~4 bytes a weight, and rounds
# differently from the packed kernels (both within fp32 noise of the weights' meaning): taken only
# where it is clearly faster, up to a prefill chunk's rows.
_QUANTIZED_ROW_PROBES = (1, 4, 16, 64, 256, 512)
# A oneDNN fallback (for bf16 weights, or the two-term one for quantized weights) is taken above a row count
# only where it is this much faster: it rounds a row otherwise than the packed kernels, so past the switch a
# row's bits depend on how many rows share its step, and a request's answer on the requests beside it.
# Without AMX tiles oneDNN's bf16 matmul runs on the kernels' own dot products and measured level with them
# from 32 rows up: a narrower margin let a busy moment's timing pick a switch point.
_FALLBACK_MARGIN = 1.25
_PATH_PROBE_ROWS = (1, 8, 32)
_RATE_REPS = 7  # passes each rate takes the best of (MeasuredRates: the one-row pass is ~2 ms here)
_PATH_MARGIN = 1.05
# The path probe stops after two rounds where one path leads by this much: a neighbour's traffic moved
# single timings by up to a fifth, so a lead past a quarter is the paths' own difference, not noise.
_PATH_DECIDED = 1.25
_PATH_ROUNDS = 5  # rounds the path probe takes at most where its timings are plausible
_PATH_BUDGET_S = 1.5  # where they are not, it goes on for this long looking for a quiet moment
# A pass over more rows of the same weights is never markedly faster than one over fewer. A best time that
# breaks this held a stall in every sample (a neighbour spinning on the cores: a scheduler tick each call).
_MORE_ROWS_SLACK = 0.9
# Start-up's measurements are kept for later starts only where the probes' threads waited for a CPU at most
# this share of the time they wanted one (engine/cpu_contention.py): a neighbour's busy engine had made every
# best-of timing of a path a scheduler tick long, and the slower path was kept for every start after.
_CONTENDED = 0.1

AnyLinear = Linear | PackedLinear | ReferenceLinear


@dataclass(frozen=True, slots=True)
class MeasuredRates:
    """What the packed linears reached at start on this machine (LinearBuilder.tune)."""

    stream_bytes_per_s: float  # one-row passes over every packed weight: bound by memory
    # _INT8_PROBE_ROWS rows through the largest layer projection, in the prompt rows' activation mode: bound
    # by arithmetic (the scheduler's unit is a prompt token's linears)
    batch_macs_per_s: float
    weight_bytes: int  # what a one-row pass streams: every packed weight, once
    # the same batch on exact activations, where the prompt rows' rate above is int8's (else None)
    exact_batch_macs_per_s: float | None = None


def resolve_quantization(mode: str, is_gguf: bool, kernels: CpuKernels | None, dtype: torch.dtype,
                         device: torch.device = _CPU) -> str:
    if mode not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, not {mode!r}")
    fast = kernels is not None and kernels.linear_isa >= 1 and dtype == torch.bfloat16  # AVX-512 or AVX2
    if mode == "auto":
        return "gguf" if is_gguf and fast else "none"
    if mode == "none":
        return mode
    if mode == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf model file")
    if device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs on the fused CPU kernels, not on {device.type}: "
                         "use --quantization none there, or --device cpu")
    if kernels is None:
        raise ValueError(f"--quantization {mode} needs the fused CPU kernels (a C compiler, --native-kernels)")
    if dtype != torch.bfloat16:
        raise ValueError(f"--quantization {mode} computes in bfloat16: use --dtype bfloat16 or auto")
    if not kernels.linear_paths:
        logger.warning("--quantization %s: this CPU has neither AVX-512 nor AVX2, so the quantized linears run on the "
                       "portable C path (slower than --quantization none here)", mode)
    return mode


def resolve_activations(mode: str, quantization: str) -> str:
    if mode not in ACTIVATION_CHOICES:
        raise ValueError(f"--linear-activations must be one of {', '.join(ACTIVATION_CHOICES)}, not {mode!r}")
    if mode != "bf16" and quantization not in ("int4", "gguf"):
        raise ValueError(f"--linear-activations {mode} applies to 4-bit weights: use --quantization int4 or gguf "
                         f"(resolved --quantization: {quantization})")
    return mode


class LinearBuilder:
    """Builds every projection for one ``--quantization`` mode. ``reference=True`` builds the slow
    dequantize-then-fp32-matmul linears instead (tests compare the two paths)."""

    def __init__(self, mode: str, dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None,
                 stored: Mapping[str, QuantizedWeight] | None = None, reference: bool = False,
                 activations: str = "bf16", hessians: dict[str, torch.Tensor] | None = None,
                 dense_source: Callable[[str], torch.Tensor] | None = None, batch_invariant: bool = False) -> None:
        self.mode = mode
        # --batch-invariant: no oneDNN fallback at any batch, however much faster it measures
        self.batch_invariant = batch_invariant
        self.activations = resolve_activations(activations, mode)
        self.dtype = dtype
        self.device = device
        self.kernels = kernels
        self.stored = stored or {}  # gguf: HF name -> the file's blocks; int8/int4: cached quantized weights
        self.hessians = hessians or {}  # int8: HF name -> E[x x^T] of its inputs (GPTQ rounding), when calibrated
        # A model served in place hands weights not read yet (on the meta device): this reads one by HF name,
        # when its projection is built, so no whole dense copy of the model exists at once.
        self.dense_source = dense_source
        self.reference = reference
        self.made: dict[str, QuantizedWeight] = {}  # int8/int4 weights quantized now (to be cached)
        self._reported = time.monotonic()  # the last progress line (_report_progress)
        self.built: list[AnyLinear] = []
        self.rates: MeasuredRates | None = None  # set by tune() where the packed kernels run
        self.pack_bf16 = (mode == "none" and kernels is not None and kernels.linear_isa == 2
                          and dtype == torch.bfloat16 and device.type == "cpu" and not reference)

    def build(self, names: list[str], weights: list[torch.Tensor], bias: torch.Tensor | None) -> AnyLinear:
        """One (possibly fused) projection: ``names`` are the HF weight names of its parts, in order."""
        if self.mode != "gguf":  # every other mode starts from the dense weights
            weights = self._read(names, weights)
        direct = self._packed_directly(names, bias)
        if direct is not None:
            self.built.append(direct)
            return direct
        quantized = self._quantized(names, weights)
        if quantized is not None:
            if self.reference:
                linear: AnyLinear = ReferenceLinear(quantized, bias, int8_activations=self.activations == "int8")
            else:
                assert self.kernels is not None
                # no plain codes kept beside the packed layout: a second copy, which its few users unpack
                linear = PackedLinear(pack_quantized(quantized), bias, self.kernels, source=quantized.source)
        else:
            weights = self._read(names, weights)
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            weight = weight.detach().to(device=self.device, dtype=self.dtype).contiguous()
            dense = Linear(weight, bias)
            linear = dense
            if self.pack_bf16 and packable("bf16", weight.shape[1], weight.shape[1]):
                assert self.kernels is not None
                linear = PackedLinear(pack_bf16(weight), bias, self.kernels, fallback=dense, max_kernel_rows=0)
        self.built.append(linear)
        return linear

    def _packed_directly(self, names: list[str], bias: torch.Tensor | None) -> PackedLinear | None:
        """A GGUF file's blocks packed for the kernels without unpacking their codes, where ``stored`` can
        (engine/gguf_weights.py's BlockWeights); None otherwise."""
        packer = getattr(self.stored, "packed", None)
        if self.mode != "gguf" or self.reference or self.kernels is None or packer is None:
            return None
        made = packer(names, self.kernels)
        if made is None:
            return None
        packed, source = made
        return PackedLinear(packed, bias, self.kernels, source=source)

    def _read(self, names: list[str], weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """``weights`` with those not read yet (meta tensors) read from ``dense_source``."""
        if not any(w.is_meta for w in weights):
            return weights
        if self.dense_source is None:
            raise RuntimeError(f"{', '.join(names)}: weights not loaded and no source to read them from")
        return [self.dense_source(n) if w.is_meta else w for n, w in zip(names, weights)]

    def _quantized(self, names: list[str], weights: list[torch.Tensor]) -> QuantizedWeight | None:
        if self.mode in ("none", "auto"):
            return None
        parts = []
        self._quantize_shared_inputs(names, weights)
        for name, weight in zip(names, weights):
            q = self.stored.get(name) or self.made.get(name)
            if q is None and self.mode in _QUANTIZERS:
                if not packable("u4" if self.mode == "int4" else "i8", weight.shape[1],
                                32 if self.mode == "int4" else weight.shape[1]):
                    return None
                q = self.made[name] = self._quantize(name, weight)
                self._report_progress()
            if q is None:
                return None  # gguf: a tensor type read dequantized
            parts.append(q)
        kinds = {(p.kind, p.group) for p in parts}
        if len(kinds) != 1:
            return None  # parts stored in different block types: the dequantized weights serve
        fused = concat(parts) if len(parts) > 1 else parts[0]
        kind, group = kinds.pop()
        return fused if packable(kind, fused.shape[1], group) else None

    def _quantize_shared_inputs(self, names: list[str], weights: list[torch.Tensor]) -> None:
        """GPTQ rounds each output row on its own against its inputs' statistic, so the parts of a fused
        projection that read one input (q/k/v, gate/up) are rounded as one stacked matrix, the same codes
        as part by part in one pass of the column loop instead of one per part (int8's start-up time)."""
        if self.mode != "int8" or len(names) < 2 or any(n in self.stored or n in self.made for n in names):
            return
        hessians = [self.hessians.get(n) for n in names]
        first = hessians[0]
        if first is None or any(h is None or not torch.equal(h, first) for h in hessians[1:]):
            return
        if not packable("i8", weights[0].shape[1], weights[0].shape[1]):
            return
        stacked = quantize_int8_gptq(torch.cat([w.detach() for w in weights]), first)
        start = 0
        for name, weight in zip(names, weights):
            rows = slice(start, start + weight.shape[0])
            self.made[name] = QuantizedWeight("i8", stacked.codes[rows].contiguous(), stacked.scales[rows].contiguous(),
                                              None, stacked.group, stacked.source)
            start = rows.stop
        self._report_progress()

    def _report_progress(self) -> None:
        """A line every PROGRESS_EVERY_S while calibrated rounding (int8's GPTQ) goes on."""
        if not self.hessians or time.monotonic() - self._reported < PROGRESS_EVERY_S:
            return
        self._reported = time.monotonic()
        logger.info("int8: %d of %d weights rounded", len(self.made), len(self.hessians))

    def _quantize(self, name: str, weight: torch.Tensor) -> QuantizedWeight:
        hessian = self.hessians.get(name)
        if self.mode == "int8" and hessian is not None:
            return quantize_int8_gptq(weight, hessian)
        return _QUANTIZERS[self.mode](weight)

    def tune(self, tuning: TuningCache | None = None) -> str:
        """Measure where the bf16 kernels stop beating oneDNN, and the weights' stream rate at one row, or
        apply what ``tuning`` kept from an earlier start's measurement (engine/models/tuning.py).
        Returns a line for the start-up log."""
        packed = [lin for lin in self.built if isinstance(lin, PackedLinear)]
        if not packed:
            return "linears: " + ("reference (fp32 dequantized)" if self.reference else "oneDNN / torch")
        known = tuning.load() if tuning is not None else None
        if known is not None:
            try:
                return self._apply_measured(packed, known)
            except (KeyError, ValueError, TypeError) as exc:
                logger.info("kernel measurements kept from an earlier start do not fit (%s): measuring again", exc)
        with CpuContention() as contention:
            summary, results, path_doubt = self._measure(packed)
        if tuning is None:
            return summary
        if contention.busy(_CONTENDED):
            why = f"the probes' {_queued(contention)}"
        elif path_doubt is not None:
            why = f"the kernel path probe's {path_doubt}"
        else:
            tuning.save(results)
            return summary
        logger.warning("kernel measurements not kept for later starts: %s; measured again at the next start", why)
        return f"{summary} (not kept: {why})"

    def _measure(self, packed: list[PackedLinear]) -> tuple[str, dict, str | None]:
        """The probes; (the log line, what they found, for the tuning cache, and why the kernel path probe's
        timings were not to be trusted: None where they were)."""
        # first: every probe below times the path that will run
        path, path_doubt = choose_linear_path(packed)
        with_fallback = [lin for lin in packed if lin.fallback is not None]
        repeated_rows, single_rows = None, []
        if with_fallback:
            # The layers' projections share one limit, probed on the largest of them; a one-off matrix (the
            # head: 49,152 x 576, memory-bound up to more rows than a layer's) gets its own.
            repeated, single = _split_repeated(with_fallback)
            if repeated:
                largest_layer = max(repeated, key=lambda lin: lin.out_features * lin.in_features)
                repeated_rows = self._dense_kernel_rows(largest_layer)
                for lin in repeated:
                    lin.max_kernel_rows = repeated_rows
            for lin in single:
                lin.max_kernel_rows = self._dense_kernel_rows(lin)
                single_rows.append(lin.max_kernel_rows)
        activations = self._choose_activations(packed)
        self._fallback_rows: int | None = None
        quantized_fallback = self._attach_quantized_fallbacks(packed)
        total = sum(lin.packed.data.numel() for lin in packed)  # bytes: the packed weights are uint8
        gbps, read_gbps = _stream_rate(packed, total)
        layers, _ = _split_repeated(packed)
        largest = max(layers or packed, key=lambda lin: lin.out_features * lin.in_features)
        prompt_int8 = largest.int8_activations or (self.activations == "int8-prompt"
                                                   and largest.takes_int8_activations)
        batch_macs = _batch_rate(largest, prompt_int8)
        exact_macs = _batch_rate(largest, False) if prompt_int8 else None
        self.rates = MeasuredRates(gbps * 1e9, batch_macs, total, exact_macs)
        tail = (f"{path}; {activations}; {quantized_fallback}one-row pass {gbps:.1f} GB/s = "
                f"{100 * gbps / read_gbps:.0f}% of a plain read ({read_gbps:.1f} GB/s); {_INT8_PROBE_ROWS} rows "
                f"{batch_macs / 1e9:.0f} G multiply-adds/s")
        summary = f"linears: {len(packed)} packed ({self._describe(packed, with_fallback, total)}; {tail}"
        results = {"linear_path": packed[0].kernels.linear_path, "repeated_rows": repeated_rows,
                   "single_rows": single_rows, "quantized_fallback_rows": self._fallback_rows,
                   "stream_bytes_per_s": self.rates.stream_bytes_per_s, "batch_macs_per_s": batch_macs,
                   "exact_batch_macs_per_s": exact_macs,
                   "weight_bytes": total, "summary": tail}
        return summary, results, path_doubt

    def _describe(self, packed: list[PackedLinear], with_fallback: list[PackedLinear], total: int) -> str:
        sources = sorted({lin.source for lin in packed})
        limits = sorted({lin.max_kernel_rows for lin in with_fallback if lin.max_kernel_rows is not None})
        unlimited = any(lin.max_kernel_rows is None for lin in with_fallback)
        if limits:
            rest = ", the others at every batch" if unlimited else ""
            limit = f", up to {' / '.join(map(str, limits))} rows (oneDNN above){rest}"
        elif with_fallback and self.batch_invariant:
            limit = ", at every batch (--batch-invariant)"
        elif with_fallback:
            limit = f", at every batch (oneDNN not {_FALLBACK_MARGIN}x faster up to {_ROW_PROBES[-1]} rows)"
        else:
            limit = ""
        return f"{', '.join(sources)}; {total / 1e6:.0f} MB){limit}"

    def _apply_measured(self, packed: list[PackedLinear], known: dict) -> str:
        """``tune``'s settings from an earlier start's measurement of the same model, CPU and kernels."""
        total = sum(lin.packed.data.numel() for lin in packed)
        if known["weight_bytes"] != total:
            raise ValueError("other weights")
        kern = packed[0].kernels
        if kern.linear_paths and len(kern.linear_paths) > 1:
            kern.set_linear_path(known["linear_path"])
        with_fallback = [lin for lin in packed if lin.fallback is not None]
        repeated, single = _split_repeated(with_fallback)
        if len(single) != len(known["single_rows"]):
            raise ValueError("other fallbacks")
        for lin in repeated:
            lin.max_kernel_rows = _stored_rows(known["repeated_rows"])
        for lin, rows in zip(single, known["single_rows"]):
            lin.max_kernel_rows = _stored_rows(rows)
        for lin in packed:
            if lin.takes_int8_activations:
                lin.int8_activations = self.activations == "int8"
        if known["quantized_fallback_rows"] is not None:
            layers, _ = _split_repeated([lin for lin in packed if not lin.dense and lin.fallback is None])
            attach_two_term_fallbacks(layers, int(known["quantized_fallback_rows"]))
        exact = known["exact_batch_macs_per_s"]
        self.rates = MeasuredRates(float(known["stream_bytes_per_s"]), float(known["batch_macs_per_s"]), total,
                                   float(exact) if exact is not None else None)
        return (f"linears: {len(packed)} packed ({self._describe(packed, with_fallback, total)}; {known['summary']} "
                "(measured at an earlier start on this CPU; --remeasure-kernels times them again)")

    def _dense_kernel_rows(self, lin: PackedLinear) -> int | None:
        """Up to how many rows a bf16 linear runs on the packed kernel (oneDNN above); None: at every batch,
        under --batch-invariant, or where oneDNN is not _FALLBACK_MARGIN faster at any probed size (at the
        largest probe both are bound by the same arithmetic, so a larger batch would not change the answer)."""
        if self.batch_invariant:
            return None
        rows = _kernel_row_limit(lin, margin=_FALLBACK_MARGIN)
        return None if rows >= _ROW_PROBES[-1] else rows

    def _attach_quantized_fallbacks(self, packed: list[PackedLinear]) -> str:
        """Where oneDNN's bf16 matmul (AMX tiles) beats the packed kernels at large batches by a clear
        margin even at twice the work, the layers' quantized projections get a two-term bf16 fallback
        (``TwoTermBf16Linear``) above the measured row count. Returns a phrase for the log (empty where
        there was nothing to decide)."""
        layers, _ = _split_repeated([lin for lin in packed if not lin.dense and lin.fallback is None])
        # (the one-off matrix, the head, keeps its kernel: logits of a few rows a step)
        if not layers or self.reference:
            return ""
        if self.activations != "bf16":
            return "no oneDNN fallback with int8 activations; "  # it would compute with bf16 ones
        if self.batch_invariant:
            return "no oneDNN fallback (--batch-invariant); "
        if not _has_matrix_unit():
            # Without AMX tiles oneDNN's bf16 matmul runs on the same AVX512-BF16 dot products as the packed
            # kernels: at twice the work it measured 1.8x slower at every size (AMD EPYC), so no probe. On an
            # AVX2 CPU torch's fp32 matmul on the dequantized weights is no clear win either (the kernels
            # 0.85-1.2x its speed at 32-512 rows, 1.5-2.8x below; Zen 4 held to AVX2), and one arithmetic at
            # every batch keeps a row's bits independent of the rows beside it (a seeded request repeated
            # over a cached prefix prefills fewer rows).
            return ""
        probe = max(layers, key=lambda lin: lin.out_features * lin.in_features)
        assert probe.quantized is not None
        fallback = TwoTermBf16Linear.build(probe.quantized, probe.bias)
        if fallback is None:
            return ""
        largest = _QUANTIZED_ROW_PROBES[-1]
        # One quick look at the largest batch first: where the packed kernels hold there, nothing smaller is
        # worth probing.
        if _kernel_row_limit(probe, fallback, (largest,), _FALLBACK_MARGIN, rounds=1) == largest:
            return f"no oneDNN fallback (two-term bf16 not {_FALLBACK_MARGIN}x faster at {largest} rows); "
        rows = _kernel_row_limit(probe, fallback, _QUANTIZED_ROW_PROBES, _FALLBACK_MARGIN)
        if rows >= largest:
            return f"no oneDNN fallback (two-term bf16 not {_FALLBACK_MARGIN}x faster up to {rows} rows); "
        attach_two_term_fallbacks(layers, rows, {id(probe): fallback})
        self._fallback_rows = rows
        return f"two-term bf16 oneDNN above {rows} rows; "

    def _choose_activations(self, packed: list[PackedLinear]) -> str:
        """Sets the 4-bit linears' activation mode (int8, or bf16 where int8-prompt picks by row in the model's
        forward); returns a phrase for the log."""
        four_bit = [lin for lin in packed if lin.takes_int8_activations]
        if not four_bit:
            return "activations bf16"
        use_int8 = self.activations == "int8"
        for lin in four_bit:
            lin.int8_activations = use_int8
        if self.activations == "int8-prompt":
            head = ("4-bit weights take int8 activations on prompt rows without logits, bf16 on the others "
                    "(--linear-activations int8-prompt")
        else:
            head = f"4-bit weights take {self.activations} activations (--linear-activations"
        kernels = four_bit[0].kernels
        if not (kernels.int8_activations_fast and kernels.linear_isa == 2):
            # portable C: timing a prefill-sized batch there would cost seconds of start-up
            return f"{head}; int8 would run on portable C here: no AVX512-VNNI path)"
        probe = max(four_bit, key=lambda lin: lin.out_features * lin.in_features)
        bf16_s, int8_s = _activation_times(probe)
        return (f"{head}; {_INT8_PROBE_ROWS} rows of the largest: {bf16_s * 1e3:.2f} ms bf16, {int8_s * 1e3:.2f} ms "
                f"int8 on AVX512-VNNI)")


def choose_linear_path(packed: list[PackedLinear], margin: float = _PATH_MARGIN) -> tuple[str, str | None]:
    """Where the kernels have both fast paths, time them on the largest layer projection and keep the
    faster for the process. Returns a phrase for the start-up log, and why the timings were not to be
    trusted (None where they were).

    AVX512-BF16 dot products ("dot") are the default: on AMD EPYC (Zen 4) they issue at twice the fp32
    FMA rate. On an Intel Xeon (family 6 model 207) they issued at half of it, and the fp32 FMA path
    ("fma") ran 32-row passes 1.3x faster. Each path is timed at the row counts a server's steps have
    (one stream decoding, a batch, a prefill chunk), alternately, best of up to five rounds; "fma" must
    win the sum by ``margin`` to replace the default. Where a path's best times break _MORE_ROWS_SLACK
    (a neighbour's stalls in every sample), the rounds go on up to _PATH_BUDGET_S; where they never
    turn plausible, or the probe's threads waited for a CPU (_CONTENDED), the default stays."""
    kern = packed[0].kernels
    paths = kern.linear_paths
    if not paths:
        return "linear kernels: portable C", None
    if len(paths) == 1:
        assert kern.linear_path is not None  # a build with fast paths starts on the first of them
        avx2 = " (AVX2)" if kern.target == "avx2" else ""
        return f"linear kernels: {LINEAR_PATH_NAMES[kern.linear_path]}{avx2}", None
    layers, _ = _split_repeated(packed)
    probe = max(layers or packed, key=lambda lin: lin.out_features * lin.in_features)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, probe.in_features, generator=gen).to(torch.bfloat16) for rows in _PATH_PROBE_ROWS]
    best = {path: [float("inf")] * len(inputs) for path in ("dot", "fma")}
    start, round_, plausible = time.perf_counter(), 0, False
    with CpuContention() as contention:
        while not plausible or round_ < _PATH_ROUNDS:
            for path in ("dot", "fma"):
                with kern.on_linear_path(path):
                    for i, x in enumerate(inputs):
                        best[path][i] = min(best[path][i],
                                            _best_time(partial(kern.linear, x, probe.packed), reps=3))
            round_ += 1
            plausible = all(_more_rows_take_longer(times) for times in best.values())
            dot, fma = sum(best["dot"]), sum(best["fma"])
            if plausible and round_ >= 2 and max(dot, fma) > _PATH_DECIDED * min(dot, fma):
                break  # a lead this wide is past what the later rounds' noise could overturn
            if not plausible and time.perf_counter() - start > _PATH_BUDGET_S:
                break
            if round_ >= 2 and contention.read().busy(_CONTENDED):
                break  # no quiet moment to wait for: the default stays (below)
    # Stalls on both paths alike pass the rows rule: timings taken while the threads queued for a CPU are
    # not trusted either.
    doubt = (_queued(contention) if contention.busy(_CONTENDED) else
             None if plausible else "timings were implausible (more rows faster than fewer)")
    chosen = "fma" if doubt is None and sum(best["fma"]) * margin < sum(best["dot"]) else "dot"
    kern.set_linear_path(chosen)
    times = ", ".join(f"{rows} rows {d * 1e3:.2f} / {f * 1e3:.2f} ms"
                      for rows, d, f in zip(_PATH_PROBE_ROWS, best["dot"], best["fma"]))
    kept = "" if doubt is None else f"; the default kept: {doubt}"
    return (f"linear kernels: {LINEAR_PATH_NAMES[chosen]} (largest projection, AVX512-BF16 dot / fp32 FMA: "
            f"{times}{kept})"), doubt


def _queued(contention: CpuContention) -> str:
    return (f"threads queued for a CPU (one waited {100 * (contention.share or 0):.0f}% of the time it wanted "
            "one)")


def _more_rows_take_longer(times: list[float]) -> bool:
    """Whether best times over ascending row counts of the same weights could be a kernel's own."""
    return all(later >= _MORE_ROWS_SLACK * earlier for earlier, later in pairwise(times))


def _split_repeated(linears: list[PackedLinear]) -> tuple[list[PackedLinear], list[PackedLinear]]:
    """(those whose shape occurs more than once: the layers' projections, which share one probe; the
    one-off matrices, such as the head)."""
    shapes = Counter((lin.out_features, lin.in_features) for lin in linears)
    repeated = [lin for lin in linears if shapes[(lin.out_features, lin.in_features)] > 1]
    return repeated, [lin for lin in linears if shapes[(lin.out_features, lin.in_features)] == 1]


def _has_matrix_unit() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's bf16 matmul uses (the only x86 unit that makes it
    several times faster than AVX512-BF16 dot products)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def attach_two_term_fallbacks(layers: list[PackedLinear], rows: int,
                              built: dict[int, TwoTermBf16Linear] | None = None) -> None:
    """Batches of more than ``rows`` rows through these quantized linears go to a two-term bf16 oneDNN
    matmul from now on (``built``: fallbacks already made, by ``id`` of their linear)."""
    built = built or {}
    for lin in layers:
        assert lin.quantized is not None
        fallback = built.get(id(lin)) or TwoTermBf16Linear.build(lin.quantized, lin.bias)
        if fallback is None:
            raise RuntimeError("torch here has no oneDNN bf16 weight packing: no two-term fallback")
        lin.fallback = fallback
        lin.max_kernel_rows = rows
    logger.info("quantized linears: oneDNN bf16 (two terms a weight) takes batches over %d rows (%.0f MB more)",
                rows, 4 * sum(lin.out_features * lin.in_features for lin in layers) / 1e6)


def _best_time(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _kernel_row_limit(lin: PackedLinear, fallback: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      probes: tuple[int, ...] = _ROW_PROBES, margin: float = 1.05, rounds: int = 3) -> int:
    """The largest probed row count up to which the packed kernel is as fast as oneDNN (``fallback``,
    by default the linear's own), within ``margin``; 0 where it loses at the first probe.

    The two are timed alternately, best of three rounds each: a single timing of each stopped the probe
    at 2, 4 or 16 rows in three starts on the same machine (AMD EPYC, shared), where the packed kernel
    was 1.07-1.66x oneDNN up to 32 rows and level (0.98-1.05x) up to 256."""
    other = fallback if fallback is not None else lin.fallback
    assert other is not None
    limit = 0
    gen = torch.Generator().manual_seed(0)
    for rows in probes:
        x = torch.randn(rows, lin.in_features, generator=gen).to(torch.bfloat16)
        mine = theirs = float("inf")
        for _ in range(rounds):
            mine = min(mine, _best_time(partial(lin.kernels.linear, x, lin.packed, lin._bias32,
                                                int8_activations=lin.int8_activations), reps=3))
            theirs = min(theirs, _best_time(partial(other, x), reps=3))
        if mine > margin * theirs:
            break
        limit = rows
    return limit


def _stored_rows(rows: int | None) -> int | None:
    return int(rows) if rows is not None else None


def _activation_times(lin: PackedLinear) -> tuple[float, float]:
    """Seconds for a prefill-sized batch through one 4-bit linear, with bf16 and with int8 activations."""
    x = torch.randn(_INT8_PROBE_ROWS, lin.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    times = [_best_time(partial(lin.kernels.linear, x, lin.packed, int8_activations=int8)) for int8 in (False, True)]
    return times[0], times[1]


def _batch_rate(lin: PackedLinear, int8: bool) -> float:
    """Multiply-adds a second of one prefill-sized batch through ``lin`` on the kernel that runs it, its
    activations in int8 where ``int8`` (prompt rows under --linear-activations int8 and int8-prompt)."""
    x = torch.randn(_INT8_PROBE_ROWS, lin.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    # int8 on portable C (no VNNI path) takes seconds a pass: one is enough to size the scheduler's unit
    reps = _RATE_REPS if lin.kernels.int8_activations_fast or not int8 else 1
    seconds = _best_time(lambda: lin.kernels.linear(x, lin.packed, lin._bias32, int8_activations=int8), reps=reps)
    return _INT8_PROBE_ROWS * lin.in_features * lin.out_features / seconds


# The plain read reads the packed weights' own bytes (the largest first), no new buffer: a fresh GiB of
# memory is a second of a first start. Up to twice the largest last-level cache a CPU shares (~500 MB), so
# it reads memory as the pass does.
_PLAIN_READ_MAX_BYTES = 1 << 30


def _stream_rate(packed: list[PackedLinear], total: int) -> tuple[float, float]:
    """GB/s of one-row passes over every packed weight (``total`` bytes; one C call for the pass, as
    bench_kernels times it), and of a plain read of the same bytes (up to _PLAIN_READ_MAX_BYTES)."""
    kern = packed[0].kernels
    inputs = {lin.in_features: torch.ones(1, lin.in_features, dtype=torch.bfloat16) for lin in packed}
    outs = [torch.empty(1, lin.out_features, dtype=torch.bfloat16) for lin in packed]
    calls = kern.linear_calls([(inputs[lin.in_features], lin.packed, out) for lin, out in zip(packed, outs)],
                              packed[0].int8_activations)
    # the best of several: a neighbour's memory traffic had brought single passes down by up to a fifth
    elapsed = _best_time(lambda: kern.run_linear_calls(calls), reps=_RATE_REPS)
    words, nbytes = [], 0
    for lin in sorted(packed, key=lambda lin: lin.packed.data.numel(), reverse=True):
        if nbytes >= _PLAIN_READ_MAX_BYTES:
            break
        data = lin.packed.data
        if data.is_contiguous() and data.storage_offset() % 8 == 0 and data.numel() >= 8:
            words.append(data[:data.numel() // 8 * 8].view(torch.int64))
            nbytes += words[-1].numel() * 8
    if not words:  # no packed matrix of whole words: a plain buffer of the same size
        words = [torch.ones(min(total, _PLAIN_READ_MAX_BYTES) // 8 + 1, dtype=torch.int64)]
        nbytes = words[0].numel() * 8
    read = _best_time(lambda: [kern.read_sum(w) for w in words], reps=3)
    return total / elapsed / 1e9, nbytes / read / 1e9
