"""GPT model (GPT-2 or the Llama-style modern block) built from tensor-parallel layers, whole or as
pipeline chunks with stable names."""

from megatron.core.models.gpt.model import GPTModel, resolve_model_config

__all__ = ["GPTModel", "resolve_model_config"]
