"""``--decoupled-lr`` / ``--decoupled-min-lr``: the input embedding and the output layer follow a
learning-rate schedule of their own (Megatron's ``is_embedding_or_output_parameter`` parameters).

The schedule's shape (warm-up, decay style and length) is shared; only its peak (``--decoupled-lr``)
and its floor (``--decoupled-min-lr``, default ``--min-lr``) differ. The parameters are the word
embedding (on the first stage, and its tied copy on the last) and an untied output layer; the
position embedding follows the main schedule, as in Megatron-LM.

With ``--use-distributed-optimizer`` the parameters are marked first
(:func:`mark_embedding_or_output_parameters`, Megatron's ``is_embedding_or_output_parameter``), so the
sharded gradient reducer puts them into flat segments of their own: every shard then holds either
only such elements or none, and the shards of the marked segments get the decoupled groups.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

_NAMES = ("word_embeddings.weight", "output_layer.weight")


def embedding_or_output_parameters(model_chunks: Iterable[torch.nn.Module]) -> set[int]:
    """``id()`` of every word-embedding and output-layer weight of ``model_chunks``."""
    return {id(param) for chunk in model_chunks for name, param in chunk.named_parameters()
            if name == "output_layer.weight" or name.endswith(_NAMES)}


def mark_embedding_or_output_parameters(model_chunks: Iterable[torch.nn.Module]) -> None:
    """Set ``is_embedding_or_output_parameter`` on the word-embedding and output-layer weights
    (before the sharded gradient reducers are built: it gives them segments of their own)."""
    marked = embedding_or_output_parameters(model_chunks)
    for chunk in model_chunks:
        for param in chunk.parameters():
            if id(param) in marked:
                flagged: Any = param  # a plain attribute on the Parameter, like no_weight_decay
                flagged.is_embedding_or_output_parameter = True


def is_marked(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` (or a shard cut from such parameters only) follows the decoupled lr."""
    return bool(getattr(param, "is_embedding_or_output_parameter", False))


def split_decoupled_groups(groups: list[dict], decoupled: set[int], optimizer_config
                           ) -> list[dict]:
    """``groups`` with the ``decoupled`` parameters moved into groups of their own that carry
    ``max_lr`` / ``min_lr`` (read by :class:`~.lr_scheduler.OptimizerParamScheduler`)."""
    result = []
    for group in groups:
        main = [p for p in group["params"] if id(p) not in decoupled]
        moved = [p for p in group["params"] if id(p) in decoupled]
        if main:
            result.append({**group, "params": main})
        if moved:
            min_lr = optimizer_config.decoupled_min_lr
            result.append({**group, "params": moved, "max_lr": optimizer_config.decoupled_lr,
                           "min_lr": optimizer_config.min_lr if min_lr is None else min_lr})
    return result
