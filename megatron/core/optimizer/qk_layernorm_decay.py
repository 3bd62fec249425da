"""``--apply-wd-to-qk-layernorm``: weight decay on the query/key norms too.

By default (Megatron's classic rule) biases and every norm parameter are excluded from weight decay
(the model marks them ``no_weight_decay``). Megatron-LM's ``--apply-wd-to-qk-layernorm`` (the
Qwen3-Next recipe) keeps that rule except for the parameters of the ``q_layernorm`` / ``k_layernorm``
modules of ``--qk-layernorm``, weight and (LayerNorm) bias alike: they are decayed like the weight
matrices. :func:`decay_qk_layernorm_parameters` clears their ``no_weight_decay`` mark, before the
gradient reducers are built, so the optimizer's parameter groups and the distributed optimizer's
sharded segments both see it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

_QK_NORM_MODULES = ("q_layernorm.", "k_layernorm.")


def is_qk_layernorm_parameter(name: str) -> bool:
    """Megatron's test: the parameter's qualified name contains ``q_layernorm.`` or
    ``k_layernorm.``."""
    return any(module in name for module in _QK_NORM_MODULES)


def decay_qk_layernorm_parameters(model_chunks: Iterable[torch.nn.Module]) -> int:
    """Put the query/key norm parameters of ``model_chunks`` under weight decay; returns how many
    parameters changed (0 without ``--qk-layernorm``)."""
    changed = 0
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if is_qk_layernorm_parameter(name):
                flagged: Any = param  # a plain attribute on the Parameter
                flagged.no_weight_decay = False
                changed += 1
    return changed
