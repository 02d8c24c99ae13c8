"""Weight quantization: formats, packing for the CPU linear kernels, and GGUF blocks read as they are."""

from engine.quant.formats import QuantizedWeight, quantize_int4, quantize_int8

__all__ = ["QuantizedWeight", "quantize_int4", "quantize_int8"]
