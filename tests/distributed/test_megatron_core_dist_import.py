"""Import of a Megatron-core ``torch_dist`` GPT checkpoint (Megatron-LM's default format).

The megatron-core package is not installed here, so the test writes the checkpoint itself as
Megatron-core lays it out: DCP files of global tensors under mcore key names, every transformer
layer parameter stacked over the layers (leading axis = --num-layers), Transformer Engine's fused
LayerNorm names, saved as the shards a TP2 x PP2 run writes (each (layer, TP rank) box on its
own), with optimizer entries to skip, plus ``common.pt`` (``args``) and mcore's
``metadata.json``. The import must reproduce every weight exactly, and the imported checkpoint
must load into Chimera TP2 x PP2 (4 gloo ranks) and train on with the losses of one process
(1e-5 relative).
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import pretrain_gpt
from dist_harness import run_distributed
from megatron.core.models.gpt.model import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_conversion import (TargetLayout, merge_full_state,
                                                     read_checkpoint)
from megatron.training.checkpointing import Checkpointer
from megatron.training.checkpointing.dcp_io import PieceSavePlanner
from megatron.training.checkpointing.global_keys import Piece
from megatron.training.megatron_lm_import import _partition_dim, import_megatron_lm
from megatron.training.training import pretrain

pytestmark = pytest.mark.distributed

LAYERS, HIDDEN, HEADS, VOCAB, POSITIONS = 4, 32, 4, 128, 16
TRAIN = ("--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-iters 3 "
         "--log-interval 1 --eval-iters 0 --attention-dropout 0 --hidden-dropout 0 --finetune "
         "--distributed-timeout-minutes 1")
MCORE_LAYER_NAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                     "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN, max_position_embeddings=POSITIONS, seq_length=POSITIONS,
        padded_vocab_size=VOCAB, layernorm_epsilon=1e-5, untie_embeddings_and_output_weights=False,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, ckpt_format="torch_dist")


def _reference_weights() -> dict:
    """A GPT model of those sizes with the project's own initialisation (our names)."""
    config = parse_args(f"--num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads "
                        f"{HEADS} --seq-length {POSITIONS} --max-position-embeddings {POSITIONS} "
                        f"--vocab-size {VOCAB} --make-vocab-size-divisible-by 1 --mock-data "
                        f"--micro-batch-size 1 --global-batch-size 1 --lr 1e-3 --train-iters 1 "
                        f"--seed 11".split(), world_size=1)
    model = GPTModel(config.model, config.recompute, ParallelState.single_process(),
                     config.training.seed)
    torch.manual_seed(5)  # perturb so that nothing is at its initial value (e.g. norms of 1)
    return {name: value + 0.01 * torch.randn_like(value)
            for name, value in model.state_dict().items()}


def _mcore_name(ours: str) -> tuple[str, int | None]:
    """(mcore key, layer) of one of our names: layers are stacked, norms fused TE-style."""
    if not ours.startswith("decoder.layers."):
        return ours, None
    layer, rest = ours[len("decoder.layers."):].split(".", 1)
    for plain, fused in MCORE_LAYER_NAMES.items():
        if rest.startswith(plain):
            rest = fused + rest[len(plain):]
    return f"decoder.layers.{rest}", int(layer)


def write_mcore_dist_checkpoint(root: str, full: dict, tp_size: int = 2) -> None:
    """``root/iter_0000010`` as Megatron-core writes it (see the module docstring)."""
    iteration_dir = os.path.join(root, "iter_0000010")
    os.makedirs(iteration_dir)
    stacked: dict = {}
    pieces = []
    for ours, value in full.items():
        key, layer = _mcore_name(ours)
        dim = _partition_dim(ours)
        if layer is not None:
            stacked.setdefault(key, {})[layer] = value
            continue
        for rank, block in enumerate(value.chunk(tp_size, dim) if dim is not None else [value]):
            offsets = [0] * value.dim()
            if dim is not None:
                offsets[dim] = rank * block.shape[dim]
            pieces.append(Piece(key, tuple(value.shape), tuple(offsets), block.contiguous()))
    for key, by_layer in stacked.items():
        shape = (LAYERS, *by_layer[0].shape)
        dim = _partition_dim(key.replace("layer_norm_", "x"))  # fused norms are replicated
        for layer, value in by_layer.items():
            blocks = value.chunk(tp_size, dim) if dim is not None else [value]
            for rank, block in enumerate(blocks):
                offsets = [layer] + [0] * value.dim()
                if dim is not None:
                    offsets[dim + 1] = rank * block.shape[dim]
                pieces.append(Piece(key, shape, tuple(offsets), block.unsqueeze(0).contiguous()))
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]  # an optimizer entry to skip
    pieces.append(Piece("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight",
                        (LAYERS, *qkv.shape), (0, 0, 0), torch.zeros(1, *qkv.shape)))
    pieces.append(Piece("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight",
                        (LAYERS, *qkv.shape), (1, 0, 0), torch.zeros(LAYERS - 1, *qkv.shape)))
    dcp.save({}, storage_writer=FileSystemWriter(iteration_dir),
             planner=PieceSavePlanner(pieces, {"decoder.layers.self_attention.linear_proj."
                                               "_extra_state": b"te"}), no_dist=True)
    torch.save({"args": _args(), "iteration": 10, "checkpoint_version": 3.0},
               os.path.join(iteration_dir, "common.pt"))
    with open(os.path.join(iteration_dir, "metadata.json"), "w") as handle:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, handle)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("10")


def _train(rank, world_size, argv):
    config = parse_args(argv.split(), world_size=world_size)
    state = ParallelState.single_process() if world_size == 1 else None
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=state,
                      checkpointing=Checkpointer(config, log=lambda _: None), log=lambda _: None)
    return [r.losses["lm loss"] for r in result.history]


def test_megatron_core_torch_dist_checkpoint_imports_and_trains_in_chimera_tp2xpp2(tmp_path):
    full = _reference_weights()
    source = str(tmp_path / "mcore")
    write_mcore_dist_checkpoint(source, full)
    chimera = TargetLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                           pipeline_schedule="chimera")
    imported = str(tmp_path / "chimera")
    import_megatron_lm(source, imported, chimera, log=print)
    merged = merge_full_state(read_checkpoint(imported))
    assert merged.keys() == full.keys()
    for name, value in full.items():
        assert torch.equal(merged[name], value), name
    single = str(tmp_path / "single")
    import_megatron_lm(source, single, TargetLayout(), log=print)

    flags = read_checkpoint(imported).config
    model = (f"--num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads {HEADS} "
             f"--seq-length {POSITIONS} --max-position-embeddings {POSITIONS} --vocab-size "
             f"{VOCAB} --make-vocab-size-divisible-by 1 --mock-data --seed 3 {TRAIN}")
    assert flags.model.padded_vocab_size == VOCAB
    reference = _train(0, 1, f"{model} --load {single}")
    losses = run_distributed(
        _train, 4, f"{model} --load {imported} --tensor-model-parallel-size 2 "
                   f"--pipeline-model-parallel-size 2 --pipeline-schedule chimera", timeout=300)
    assert len(reference) == 3
    for rank_losses in losses:
        for loss, expected in zip(rank_losses, reference, strict=True):
            assert loss == pytest.approx(expected, rel=1e-5)
