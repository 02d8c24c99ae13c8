"""Model families the engine runs with its own batched forward: a registry from the HF config's
``model_type`` to the class that builds it. Each family is checked against transformers token for token
(tests/engine/test_model_families.py)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

# The Llama-family forward covers these: Llama 2/3 (and 3.x rope_scaling, from the model's own rotary
# tables), SmolLM2, Mistral (without sliding windows), Qwen2 (q/k/v biases), Qwen3 (q/k norms).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_REGISTRY)


def model_class(model_type: str) -> type[LlamaForCausalLM]:
    cls = MODEL_REGISTRY.get(model_type)
    if cls is None:
        raise ValueError(f"model type '{model_type}' is not supported by this engine "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return cls


__all__ = ["MODEL_REGISTRY", "SUPPORTED_MODEL_TYPES", "LlamaForCausalLM", "model_class"]
