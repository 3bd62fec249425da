"""Maximal-update parameterisation (MuP, ``--use-mup``): the model side of Megatron-LM's rules.

With width multiplier ``m = hidden_size / --mup-base-hidden-size`` (1 without a base size),
Megatron-LM's ``TransformerConfig`` (d98e8a6) makes these changes, reproduced by
:func:`mup_scales`:

- initialisation: the hidden matrices (query/key/value and the first MLP layer) draw from
  N(0, σ/√m), the output projections of attention and MLP from N(0, σ/(√(2L)·√m)); the word and
  position embeddings and an untied output layer keep N(0, σ) (σ = ``--init-method-std``);
- attention: softmax scale ``c / d^p`` instead of ``1/√d`` (d = channels per head,
  p = ``--mup-attn-scale-power``, default 1; c = √``--mup-base-head-dim`` when given, else 1);
- the embedding output (word + position) is multiplied by ``--mup-embedding-mult`` (default 1);
- the logits are multiplied by ``--mup-output-mult``; left at 1 it becomes 1/m.

The optimizer side (learning rate and Adam epsilon of the hidden matrices divided by m) is in
:mod:`megatron.core.optimizer.mup`. Initial values still come from the layout-independent
initialisation (:mod:`megatron.core.models.gpt.init`): only the standard deviations change, so
every parallel layout starts from the same full weights.

With ``--mup-base-hidden-size`` equal to the hidden size (m = 1) only the attention scale differs
from the standard model; with ``--mup-attn-scale-power 0.5`` (or ``--mup-base-head-dim`` equal to
the head dimension) the model and its training are exactly the standard ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

MUP_OPTIONS = ("mup_width_mult", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
               "mup_base_head_dim", "mup_attn_scale_power")


@dataclass(frozen=True)
class MupScales:
    """Standard deviations and multipliers of a model (the standard ones without ``--use-mup``)."""

    width_mult: float
    hidden_init_std: float           # query/key/value, first MLP layer
    output_init_std: float           # attention and MLP output projections
    embedding_init_std: float        # word and position embeddings, untied output layer
    softmax_scale: Optional[float]   # None: 1/sqrt(head dim)
    embedding_mult: float
    output_mult: float


def head_dim(model_config) -> int:
    """Channels per attention head (``--kv-channels``, default hidden / heads)."""
    return model_config.kv_channels or model_config.hidden_size // model_config.num_attention_heads


def width_mult(model_config) -> float:
    """m = hidden / base hidden with ``--use-mup`` (base defaults to the hidden size), else 1."""
    if not getattr(model_config, "use_mup", False):
        return 1.0
    base = model_config.mup_base_hidden_size or model_config.hidden_size
    return model_config.hidden_size / base


def mup_scales(model_config) -> MupScales:
    """The initialisation and forward scales of ``model_config`` (see the module docstring)."""
    std = model_config.init_method_std
    depth = math.sqrt(2.0 * model_config.num_layers)
    if not getattr(model_config, "use_mup", False):
        return MupScales(1.0, std, std / depth, std, None, 1.0, 1.0)
    m = width_mult(model_config)
    base_head = 1.0 if model_config.mup_base_head_dim is None else \
        math.sqrt(model_config.mup_base_head_dim)
    output_mult = model_config.mup_output_mult
    if output_mult == 1.0 and m != 1.0:
        output_mult = 1.0 / m  # Megatron: left at its default, it follows the width
    return MupScales(
        width_mult=m, hidden_init_std=std / math.sqrt(m),
        output_init_std=std / (depth * math.sqrt(m)), embedding_init_std=std,
        softmax_scale=base_head / head_dim(model_config) ** model_config.mup_attn_scale_power,
        embedding_mult=model_config.mup_embedding_mult, output_mult=output_mult)


def validate_mup_options(model_config) -> None:
    """Rules of ``--use-mup`` and the ``--mup-*`` flags; raises ValueError naming the fix."""
    if not model_config.use_mup:
        given = [name for name in MUP_OPTIONS
                 if getattr(model_config, name) != _DEFAULTS[name]]
        if given:
            raise ValueError(f"{', '.join('--' + n.replace('_', '-') for n in given)} only "
                             f"act(s) with --use-mup; add --use-mup or drop them")
        return
    base = model_config.mup_base_hidden_size
    if base is not None and base <= 0:
        raise ValueError(f"--mup-base-hidden-size {base} must be positive (the hidden size of "
                         f"the base model whose hyperparameters are transferred)")
    if model_config.mup_base_head_dim is not None and model_config.mup_base_head_dim <= 0:
        raise ValueError(f"--mup-base-head-dim {model_config.mup_base_head_dim} must be positive")
    for name in ("mup_embedding_mult", "mup_output_mult", "mup_attn_scale_power"):
        if not math.isfinite(getattr(model_config, name)):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number")
    given = model_config.mup_width_mult
    if given is not None and not math.isclose(given, width_mult(model_config)):
        raise ValueError(f"--mup-width-mult {given} differs from --hidden-size / "
                         f"--mup-base-hidden-size = {width_mult(model_config)} (Megatron-LM "
                         f"derives it from them); drop --mup-width-mult")


_DEFAULTS = {"mup_width_mult": None, "mup_base_hidden_size": None, "mup_embedding_mult": 1.0,
             "mup_output_mult": 1.0, "mup_base_head_dim": None, "mup_attn_scale_power": 1.0}
