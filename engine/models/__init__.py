"""Model families the engine runs with its own batched forward."""

from engine.models.llama import LlamaForCausalLM, SUPPORTED_MODEL_TYPES

__all__ = ["LlamaForCausalLM", "SUPPORTED_MODEL_TYPES"]
