"""GPT as a :class:`~megatron.training.model_spec.ModelSpec`: the pieces every GPT run shares.

``pretrain_gpt.py`` builds ``GPT_SPEC = gpt_model_spec(model_provider, forward_step,
datasets_provider)``. The pieces: the loss key ``"lm loss"``, the config section
:class:`~megatron.core.config.ModelConfig` (Megatron's model flags) with its checks
(:data:`~megatron.training.config_validation.GPT_VALIDATION_STEPS`), micro-batches of token
samples (:func:`~megatron.training.microbatches.batch_from_samples`), Megatron's FLOPs formula
(:func:`~megatron.training.flops.gpt_flops_per_iteration`) and the Hugging Face GPT-2 conversion
(:mod:`megatron.training.hf_checkpoint`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron.core.config import ModelConfig
from megatron.training.config_validation import GPT_VALIDATION_STEPS
from megatron.training.flops import gpt_flops_per_iteration
from megatron.training.microbatches import batch_from_samples
from megatron.training.model_spec import HFAdapter, ModelSpec

GPT_LOSS_KEYS = ("lm loss",)


def _export_to_hf(*args, **kwargs):
    from megatron.training.hf_checkpoint import export_to_hf
    return export_to_hf(*args, **kwargs)


def _import_from_hf(*args, **kwargs):
    from megatron.training.hf_checkpoint import import_from_hf
    return import_from_hf(*args, **kwargs)


GPT_HF_ADAPTER = HFAdapter(export_checkpoint=_export_to_hf, import_checkpoint=_import_from_hf)


def gpt_model_spec(model_provider: Callable, forward_step: Optional[Callable] = None,
                   datasets_provider: Optional[Callable] = None) -> ModelSpec:
    """The GPT spec with these functions (``pretrain_gpt.py``'s, or a test's variant of them)."""
    return ModelSpec(name="gpt", model_provider=model_provider, forward_step=forward_step,
                     datasets_provider=datasets_provider, loss_keys=GPT_LOSS_KEYS,
                     config_section=ModelConfig, validation_steps=GPT_VALIDATION_STEPS,
                     batch_from_samples=batch_from_samples,
                     flops_per_iteration=gpt_flops_per_iteration, hf_adapter=GPT_HF_ADAPTER)


def as_model_spec(model: Any, forward_step: Optional[Callable] = None) -> ModelSpec:
    """``model`` as a spec: a :class:`ModelSpec` (``forward_step``, when given, replaces its own),
    or a bare GPT model provider, the older ``pretrain(config, model_provider, datasets_provider,
    forward_step)`` form, which means the GPT spec with these functions."""
    if isinstance(model, ModelSpec):
        return model.with_functions(forward_step=forward_step)
    if not callable(model):
        raise TypeError(f"pretrain needs a ModelSpec (or a model provider function), got "
                        f"{type(model).__name__}; build one as pretrain_gpt.py builds GPT_SPEC")
    return gpt_model_spec(model, forward_step)
