"""Megatron-Chimera: a Megatron-LM-style GPT trainer with Chimera bidirectional pipelines."""

__version__ = "0.1.0"
