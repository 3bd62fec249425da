"""GPT (GPT-2, or the Llama-style modern block) with tensor and optionally sequence parallelism,
buildable whole or as a pipeline chunk with the full model's names.

    tokens [b, s] --embedding--> [s, b, h] --decoder.layers.i--> ... --final_layernorm-->
    --output layer (word embedding^T by default)--> logits [b, s, V/tp] --> per-token loss [b, s]

Under sequence parallelism the hidden states between the tensor-parallel regions are [s/tp, b, h].

A chunk (``layer_range``, ``pre_process``, ``post_process``) holds only its part; parameter names
never depend on the chunk (``decoder.layers.<global i>.…``) and initial values depend only on the
seed and the name (:mod:`megatron.core.models.gpt.init`), so every TP / PP / Chimera layout starts
from the same full weights. Dropout masks depend only on the seed, the global sample ids and the
element's place in the full tensor (:mod:`megatron.core.tensor_parallel.random`), so every layout
also computes the same loss with dropout on.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.config import refused_model_features
from megatron.core.models.gpt.init import initialize_parameters
from megatron.core.models.gpt.mup import mup_scales
from megatron.core.models.gpt.transformer import TransformerBlock
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear, VocabParallelEmbedding, set_parameter_attributes)
from megatron.core.tensor_parallel.mappings import (
    reduce_scatter_to_sequence_parallel_region, sum_gradient_over_tensor_parallel_ranks)
from megatron.core.tensor_parallel.random import (
    SITE_EMBEDDING, CounterBasedDropout, DropoutContext, stable_seed)
from megatron.core.tensor_parallel.utils import divide, full_shape, tensor_parallel_group


def resolve_model_config(model_config, tensor_parallel_size: int = 1):
    """A copy of ``model_config`` with defaults filled in, checked for this TP size.

    Raises ValueError naming the problem and the fix.
    """
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(model_config, name) is None:
            raise ValueError(f"model.{name} is not set; pass --{name.replace('_', '-')}")
    if model_config.padded_vocab_size is None:
        raise ValueError("model.padded_vocab_size is not set; argument validation derives it from "
                         "the tokenizer (or set it with tensor_parallel.pad_vocab_size(...))")
    refused = refused_model_features(model_config)  # the same gates as argument validation
    if refused:
        raise ValueError("; ".join(refused))
    config = dataclasses.replace(
        model_config,
        ffn_hidden_size=model_config.ffn_hidden_size or 4 * model_config.hidden_size,
        max_position_embeddings=(model_config.max_position_embeddings
                                 or model_config.seq_length))
    if config.seq_length > config.max_position_embeddings:
        raise ValueError(f"seq-length {config.seq_length} exceeds max-position-embeddings "
                         f"{config.max_position_embeddings}; raise --max-position-embeddings")
    if config.kv_channels is None:
        divide(config.hidden_size, config.num_attention_heads,
               "hidden-size (must be a multiple of num-attention-heads, or give --kv-channels)")
    elif config.kv_channels < 1:
        raise ValueError(f"kv-channels {config.kv_channels} must be >= 1")
    groups = config.num_attention_heads
    if config.group_query_attention:
        if config.num_query_groups is None:
            raise ValueError("--group-query-attention needs --num-query-groups (the number of "
                             "key/value heads)")
        groups = config.num_query_groups
        divide(config.num_attention_heads, groups,
               "num-attention-heads (must be a multiple of num-query-groups)")
    divide(groups, tensor_parallel_size,
           "num-query-groups (key/value heads; without --group-query-attention the "
           "num-attention-heads) (must be a multiple of tensor-model-parallel-size)")
    if config.swiglu and config.squared_relu:
        raise ValueError("--swiglu and --squared-relu both choose the MLP activation; give one")
    divide(config.ffn_hidden_size, tensor_parallel_size,
           "ffn-hidden-size (must be a multiple of tensor-model-parallel-size)")
    divide(config.padded_vocab_size, tensor_parallel_size,
           "padded vocabulary size (must be a multiple of tensor-model-parallel-size)")
    return config


def has_learned_positions(config) -> bool:
    """Whether the model holds a learned position table (not with RoPE, type none or
    --no-position-embedding)."""
    return config.position_embedding_type == "learned_absolute" and not config.no_position_embedding


class PositionEmbedding(torch.nn.Module):
    """Learned absolute position embeddings, replicated over TP ranks (under sequence
    parallelism each rank looks up its block of positions and the gradient is summed over TP)."""

    def __init__(self, max_positions: int, hidden_size: int, *, init_std: float, params_dtype,
                 device=None, gradient_group=None):
        super().__init__()
        self.gradient_group = gradient_group
        self.weight = set_parameter_attributes(
            torch.nn.Parameter(torch.empty(max_positions, hidden_size, dtype=params_dtype,
                                           device=device)),
            tensor_model_parallel=False, initializer=("normal", init_std))
        self.weight.sequence_parallel_grad = gradient_group is not None

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.gradient_group is not None:
            weight = sum_gradient_over_tensor_parallel_ranks(weight, self.gradient_group)
        return F.embedding(position_ids, weight)


class GPTEmbedding(torch.nn.Module):
    """Word (vocabulary-parallel) + position embeddings and embedding dropout.

    On a last-stage-only chunk with tied weights it holds just ``word_embeddings`` (the copy the
    output layer uses). With RoPE or --no-position-embedding there is no position table. Under
    sequence parallelism the word embeddings' partial sums are reduce-scattered along the
    sequence, and each rank adds the positions and applies dropout to its block of the sequence.
    """

    def __init__(self, config, parallel_state, *, with_positions: bool, params_dtype, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.embedding_mult = mup_scales(config).embedding_mult
        self.group = tensor_parallel_group(parallel_state)
        self.sequence_parallel = sequence_parallel and self.group is not None
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, parallel_state,
            init_std=config.init_method_std, params_dtype=params_dtype, device=device,
            reduce_output=not self.sequence_parallel)
        self.position_embeddings = (
            PositionEmbedding(config.max_position_embeddings, config.hidden_size,
                              init_std=config.init_method_std, params_dtype=params_dtype,
                              device=device,
                              gradient_group=self.group if self.sequence_parallel else None)
            if with_positions and has_learned_positions(config) else None)

    def forward(self, token_ids: torch.Tensor, dropout: DropoutContext) -> torch.Tensor:
        embedded = self.word_embeddings(token_ids)  # [b, s, h]
        if self.sequence_parallel:  # partial sums -> this rank's block of the sequence
            embedded = reduce_scatter_to_sequence_parallel_region(embedded, self.group, 1)
        first = dropout.sequence_shard[0] if dropout.sequence_shard else 0
        if self.position_embeddings is not None:
            positions = torch.arange(first, first + embedded.shape[1], device=token_ids.device)
            embedded = embedded + self.position_embeddings(positions)
        if self.embedding_mult != 1.0:  # --use-mup --mup-embedding-mult
            embedded = embedded * self.embedding_mult
        hidden = embedded.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        return dropout.hidden(hidden, self.hidden_dropout, 0, SITE_EMBEDDING)


class GPTModel(torch.nn.Module):
    """The GPT model, whole (``layer_range=None``) or one pipeline chunk.

    Args:
        model_config: :class:`megatron.core.config.ModelConfig` with ``padded_vocab_size`` set.
        recompute_config: :class:`megatron.core.config.RecomputeConfig` or None.
        parallel_state: :class:`megatron.core.parallel_state.ParallelState` (its TP group is used).
        seed: the model seed (initial weights and dropout masks derive from it).
        layer_range: global indices of the transformer layers of this chunk (default: all).
        pre_process: holds the embedding; inputs are token ids ``[b, s]``.
        post_process: holds the final norm and the output layer; returns logits or the loss.
        params_dtype: dtype of the parameters.
        device: where the parameters live (default CPU).
        sequence_parallel: Megatron's sequence parallelism (ignored when TP is 1): hidden states
            between the tensor-parallel regions are ``[s/tp, b, h]``, this rank's block of the
            sequence (a pipeline chunk receives and returns such blocks).
    """

    def __init__(self, model_config, recompute_config, parallel_state, seed: int, *,
                 layer_range: Optional[range] = None, pre_process: bool = True,
                 post_process: bool = True, params_dtype=torch.float32, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        config = resolve_model_config(model_config, parallel_state.tp_size)
        self.sequence_parallel = sequence_parallel and parallel_state.tp_size > 1
        if self.sequence_parallel:
            divide(config.seq_length, parallel_state.tp_size,
                   "seq-length (must be a multiple of tensor-model-parallel-size under "
                   "--sequence-parallel)")
        self.config = config
        self.parallel_state = parallel_state
        self.seed = seed
        self.pre_process = pre_process
        self.post_process = post_process
        self.tied_output = not config.untie_embeddings_and_output_weights
        layer_range = range(config.num_layers) if layer_range is None else layer_range
        if layer_range.step != 1 or (len(layer_range) and (
                layer_range.start < 0 or layer_range.stop > config.num_layers)):
            raise ValueError(f"layer_range {layer_range} must be a contiguous sub-range of "
                             f"range({config.num_layers})")
        self.layer_range = layer_range
        self.group = tensor_parallel_group(parallel_state)
        self.output_mult = mup_scales(config).output_mult
        common = dict(params_dtype=params_dtype, device=device,
                      sequence_parallel=self.sequence_parallel)

        if pre_process or (post_process and self.tied_output):
            self.embedding = GPTEmbedding(config, parallel_state, with_positions=pre_process,
                                          **common)
        self.decoder = TransformerBlock(config, layer_range, parallel_state, recompute_config,
                                        final_layernorm=post_process, **common)
        if post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, parallel_state, bias=False,
                init_std=None if self.tied_output else mup_scales(config).embedding_init_std,
                **common)
        if self.tied_output and pre_process != post_process:
            # Two copies of the tied weight live on different stages; the pipeline runtime
            # all-reduces their gradients so they stay identical.
            self.embedding.word_embeddings.weight.shared_embedding = True

        initialize_parameters(self, seed, parallel_state)
        self.dropout = CounterBasedDropout(stable_seed(seed, "dropout"))
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        """Pipeline stage contract: the previous stage's hidden state ``[s, b, h]`` that the next
        forward of a chunk without the embedding uses instead of its ``inputs`` argument."""
        self.input_tensor = tensor

    def input_activation_shape(self, microbatch: dict) -> tuple[int, ...]:
        """Pipeline stage contract: shape ``[s, b, h]`` of the hidden state this chunk receives
        (``[s/tp, b, h]`` under sequence parallelism)."""
        batch, sequence = microbatch["tokens"].shape
        if self.sequence_parallel:
            sequence //= self.parallel_state.tp_size
        return (sequence, batch, self.config.hidden_size)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                sample_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run this chunk.

        ``inputs``: token ids ``[b, s]`` when ``pre_process``, else the previous stage's hidden
        state ``[s, b, h]`` (the tensor given to :meth:`set_input_tensor`, when there is one, takes
        its place, so a pipeline calls every chunk with the micro-batch's tokens). ``sample_ids``: global sample indices ``[b]`` (default ``arange(b)``);
        they key the dropout masks. Returns the per-token loss ``[b, s]`` (float32, or float64 for
        float64 parameters) when ``post_process`` and ``labels`` are given, the vocabulary-parallel
        logits ``[b, s, V/tp]`` when ``post_process`` without labels, else the hidden state
        ``[s, b, h]``.
        """
        if not self.pre_process and self.input_tensor is not None:
            inputs = self.input_tensor
        batch = inputs.shape[0] if self.pre_process else inputs.shape[1]
        if sample_ids is None:
            sample_ids = torch.arange(batch, device=inputs.device)
        elif sample_ids.shape != (batch,):
            raise ValueError(f"sample_ids must have shape [{batch}] (one global index per "
                             f"sample), got {tuple(sample_ids.shape)}")
        dropout = DropoutContext(
            self.dropout, sample_ids.to(inputs.device), self.training,
            first_sample=int(sample_ids[0]) if self.training and batch else 0,
            layout_invariant_attention=self.config.layout_invariant_attention_dropout,
            sequence_shard=self._sequence_shard(inputs))

        if self.pre_process:
            if inputs.dim() != 2 or inputs.shape[1] > self.config.max_position_embeddings:
                raise ValueError(f"token ids must be [b, s] with s <= max-position-embeddings "
                                 f"{self.config.max_position_embeddings}, got "
                                 f"{tuple(inputs.shape)}")
            hidden = self.embedding(inputs, dropout)
        else:
            hidden = inputs
        hidden = self.decoder(hidden, dropout)
        if not self.post_process:
            return hidden

        weight = self.embedding.word_embeddings.weight if self.tied_output else None
        if self.sequence_parallel:  # the layer all-gathers the sequence: [s, b, V/tp]
            logits = self.output_layer(hidden, weight=weight).transpose(0, 1)
        else:
            logits = self.output_layer(hidden.transpose(0, 1), weight=weight)  # [b, s, V/tp]
        if self.output_mult != 1.0:  # --use-mup: 1/width by default
            logits = logits * self.output_mult
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.group)

    def _sequence_shard(self, inputs: torch.Tensor) -> Optional[tuple[int, int]]:
        """(first position, full length) of this rank's block of the sequence under sequence
        parallelism (None without it)."""
        if not self.sequence_parallel:
            return None
        tp_size = self.parallel_state.tp_size
        if self.pre_process:
            length = inputs.shape[1]
            block = divide(length, tp_size, "sequence length (must be a multiple of "
                                            "tensor-model-parallel-size under --sequence-parallel)")
        else:
            block = inputs.shape[0]
            length = block * tp_size
        return self.parallel_state.tp_rank * block, length

    def num_parameters(self) -> int:
        """Number of elements of this chunk's parameters counted at their FULL (unsharded) size."""
        total = 0
        for param in self.parameters():
            count = 1
            for dim in full_shape(param, self.parallel_state.tp_size):
                count *= dim
            total += count
        return total
