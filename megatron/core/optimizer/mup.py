"""``--use-mup``: per-parameter-group learning rates (and Adam epsilon) of Megatron-LM's MuP.

Megatron-LM (``get_mup_config_overrides``, d98e8a6) sorts the parameters into two classes:

- *vector-like*: the embedding-class parameters (word and position embeddings, an untied output
  layer) and every parameter with at most one dimension (biases, norm weights);
- *hidden*: every other (matrix) parameter: query/key/value, attention output, MLP weights.

With width multiplier m ≠ 1 (see :mod:`megatron.core.models.gpt.mup`):

- Adam: hidden parameters get peak and minimum learning rate ``--lr / m`` and ``--min-lr / m``
  and epsilon ``--adam-eps / m``; vector-like ones keep the base values;
- SGD: vector-like parameters get ``--lr · m`` and ``--min-lr · m``, hidden ones keep the base
  values; with ``--decoupled-lr`` the embedding and output weights keep their decoupled schedule.

The learning-rate schedule's shape is shared; a group's ``max_lr`` / ``min_lr`` are read by
:class:`~.lr_scheduler.OptimizerParamScheduler`, as for ``--decoupled-lr``.

:func:`mark_mup_parameters` sets ``mup_class`` on every parameter before the gradient reducers are
built, so that under ``--use-distributed-optimizer`` the sharded reducer keeps the classes in
separate flat segments and each shard carries one class (as for ``--decoupled-lr``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

HIDDEN = "hidden"
VECTOR_LIKE = "vector"


def mup_class(name: str, param: torch.nn.Parameter) -> str:
    """``"hidden"`` or ``"vector"`` for the parameter called ``name`` (Megatron's rule)."""
    if "embedding" in name or name.endswith("output_layer.weight") or param.ndim <= 1:
        return VECTOR_LIKE
    return HIDDEN


def mark_mup_parameters(model_chunks: Iterable[torch.nn.Module]) -> None:
    """Set ``mup_class`` on every parameter of ``model_chunks`` (before the reducers are built)."""
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            flagged: Any = param  # a plain attribute on the Parameter, like no_weight_decay
            flagged.mup_class = mup_class(name, param)


def mup_width_mult(config) -> float:
    """The run's width multiplier (1 without ``--use-mup``); ``config``: the whole config."""
    model = getattr(config, "model", None)
    if not getattr(model, "use_mup", False):
        return 1.0
    from megatron.core.models.gpt.mup import width_mult
    return width_mult(model)


def split_mup_groups(groups: list[dict], optimizer_config, width_mult: float) -> list[dict]:
    """``groups`` with each split by ``mup_class`` and MuP's ``max_lr`` / ``min_lr`` / ``eps``.

    Parameters must carry ``mup_class`` (:func:`mark_mup_parameters`; a distributed-optimizer
    shard carries its segment's class). Unchanged when ``width_mult`` is 1, as in Megatron."""
    if width_mult == 1.0:
        return groups
    result = []
    for group in groups:
        unmarked = [p for p in group["params"] if getattr(p, "mup_class", None) is None]
        if unmarked:
            raise ValueError("--use-mup needs every parameter marked (mark_mup_parameters) before "
                             "the optimizer and the sharded gradient reducers are built")
        for kind in (HIDDEN, VECTOR_LIKE):
            params = [p for p in group["params"] if p.mup_class == kind]
            if params:
                result.append({**group, "params": params,
                               **_overrides(kind, group, optimizer_config, width_mult)})
    return result


def _overrides(kind: str, group: dict, optimizer_config, width_mult: float) -> dict:
    """The group keys MuP sets for one class (empty: base values)."""
    lr, min_lr = optimizer_config.lr or 0.0, optimizer_config.min_lr
    if optimizer_config.optimizer == "sgd":
        if kind == VECTOR_LIKE and "max_lr" not in group:  # not a --decoupled-lr group
            return {"max_lr": lr * width_mult, "min_lr": min_lr * width_mult}
        return {}
    if kind == HIDDEN:
        overrides = {"max_lr": lr / width_mult, "min_lr": min_lr / width_mult}
        if optimizer_config.optimizer == "adam":
            overrides["eps"] = optimizer_config.adam_eps / width_mult
        return overrides
    return {}
