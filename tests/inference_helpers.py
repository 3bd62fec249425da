"""Small checkpoints for the export / generation / evaluation tests, written cheaply in any layout
(full weights split by the layout converter's writer, the format the Checkpointer reads)."""

import torch

import pretrain_gpt
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_conversion import split_for_layout, write_weights_checkpoint

# 4 layers split over 1, 2 and 4 stages; vocabulary 60 pads to 64 for TP 1 and 2 alike.
TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 60 --make-vocab-size-divisible-by 32 "
        "--mock-data --seed 1234 --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 "
        "--train-iters 3 --log-interval 1")
VOCAB = 60
# The Llama-style block (RoPE, SwiGLU, RMSNorm, no biases, 2 key/value groups for 4 heads).
LLAMA = ("--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
         "--group-query-attention --num-query-groups 2 --ffn-hidden-size 48 "
         "--untie-embeddings-and-output-weights")


def tiny_config(tp=1, pp=1, schedule=None, extra=""):
    """The validated config of the tiny model in a TP x PP layout."""
    flags = f"{TINY} --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} {extra}"
    if schedule:
        flags += f" --pipeline-schedule {schedule}"
    return parse_args(flags.split(), world_size=tp * pp)


def random_full_weights(config, seed=99, scale=0.1):
    """Full weights unlike the initial values (LayerNorm around 1, everything else random)."""
    model = pretrain_gpt.model_provider(config, ParallelState.single_process())
    generator = torch.Generator().manual_seed(seed)
    full = {}
    for name, value in model.state_dict().items():
        noise = torch.randn(value.shape, generator=generator) * scale
        full[name] = (1.0 + noise) if "layernorm.weight" in name else noise
    return full


def write_checkpoint(root, config, full, iteration=5):
    """A weights-only checkpoint of ``config``'s layout holding ``full``."""
    write_weights_checkpoint(str(root), iteration, config, split_for_layout(full, config),
                             {"consumed_train_samples": 0}, note="test")
    return str(root)
