"""--apply-wd-to-qk-layernorm: the query/key norm parameters (weight and LayerNorm bias) move into
the weight-decay group, as in Megatron-LM's get_standard_config_overrides; every other parameter
keeps its group, for the plain optimizer's parameter groups and the distributed optimizer's shards."""

import pytest
import torch

from megatron.core.config import ModelConfig
from megatron.core.distributed.sharded_reducer import ShardedGradientReducer
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer.optimizer import build_param_groups
from megatron.core.optimizer.qk_layernorm_decay import decay_qk_layernorm_parameters
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args

NUM_LAYERS = 2


def _model(normalization="LayerNorm", qk_layernorm=True):
    config = ModelConfig(num_layers=NUM_LAYERS, hidden_size=32, num_attention_heads=4,
                         seq_length=8, max_position_embeddings=8, padded_vocab_size=64,
                         attention_dropout=0.0, hidden_dropout=0.0, normalization=normalization,
                         qk_layernorm=qk_layernorm)
    return GPTModel(config, None, ParallelState.single_process(), 5)


def _group_names(model):
    names = {id(param): name for name, param in model.named_parameters()}
    groups = build_param_groups(model.parameters(), 0.1)
    return {group["weight_decay"]: {names[id(p)] for p in group["params"]} for group in groups}


def test_the_flag_parses_into_the_optimizer_config():
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--lr", "0.01", "--train-iters", "1", "--mock-data", "--vocab-size", "64",
            "--qk-layernorm"]
    assert parse_args(args, world_size=1).optimizer.apply_wd_to_qk_layernorm is False
    assert parse_args(args + ["--apply-wd-to-qk-layernorm"],
                      world_size=1).optimizer.apply_wd_to_qk_layernorm is True


def test_only_the_query_key_norms_change_group():
    model = _model()
    before = _group_names(model)
    assert decay_qk_layernorm_parameters([model]) == NUM_LAYERS * 4  # q/k x weight/bias
    after = _group_names(model)
    moved = before[0.0] - after[0.0]
    assert moved == {name for name, _ in model.named_parameters()
                     if "q_layernorm." in name or "k_layernorm." in name}
    assert len(moved) == NUM_LAYERS * 4
    assert after[0.1] == before[0.1] | moved
    # The other norms and the biases still skip weight decay.
    assert any(name.endswith("input_layernorm.weight") for name in after[0.0])
    assert any(name.endswith("linear_qkv.bias") for name in after[0.0])


def test_rmsnorm_query_key_norms_and_models_without_them():
    model = _model("RMSNorm")
    assert decay_qk_layernorm_parameters([model]) == NUM_LAYERS * 2  # RMSNorm: weight only
    plain = _model(qk_layernorm=False)
    before = _group_names(plain)
    assert decay_qk_layernorm_parameters([plain]) == 0
    assert _group_names(plain) == before


def test_adamw_decays_the_query_key_norm_weights():
    """With a zero gradient AdamW's only change is the decay p <- p (1 - lr wd)."""
    model = _model()
    decay_qk_layernorm_parameters([model])
    optimizer = torch.optim.AdamW(build_param_groups(model.parameters(), 0.1), lr=0.5)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    params = dict(model.named_parameters())
    q_norm = params["decoder.layers.0.self_attention.q_layernorm.weight"]
    input_norm = params["decoder.layers.0.input_layernorm.weight"]
    optimizer.step()
    assert torch.equal(q_norm.detach(), torch.full_like(q_norm, 1.0 * (1 - 0.5 * 0.1)))
    assert torch.equal(input_norm.detach(), torch.ones_like(input_norm))


def test_distributed_optimizer_shards_carry_the_decay():
    model = _model()
    decay_qk_layernorm_parameters([model])
    reducer = ShardedGradientReducer(model.parameters())
    decayed = sum(shard.numel() for shard in reducer.shards if not shard.no_weight_decay)
    expected = sum(param.numel() for group in build_param_groups(model.parameters(), 0.1)
                   if group["weight_decay"] > 0 for param in group["params"])
    assert decayed == expected


TRAIN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
         "--mock-data --seed 7 --micro-batch-size 2 --global-batch-size 2 --lr 1e-2 "
         "--train-iters 1 --log-interval 1 --eval-iters 0 --weight-decay 0.1 --qk-layernorm")


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_training_decays_the_query_key_norms_only_with_the_flag(distributed_optimizer):
    """Through pretrain(): the elements under weight decay grow by exactly the q/k norm
    parameters with the flag, for the plain and the distributed optimizer."""
    import pretrain_gpt
    from megatron.core.parallel_state import ParallelState
    from megatron.training.training import pretrain
    from pipeline_reference import test_model_provider

    def decayed_elements(extra):
        argv = TRAIN.split() + extra + (["--use-distributed-optimizer"]
                                        if distributed_optimizer else [])
        result = pretrain(parse_args(argv, world_size=1), test_model_provider,
                          pretrain_gpt.datasets_provider, pretrain_gpt.forward_step,
                          parallel_state=ParallelState.single_process(), log=lambda _: None)
        chunks = result.components.model_chunks
        qk = sum(p.numel() for chunk in chunks for name, p in chunk.named_parameters()
                 if "q_layernorm." in name or "k_layernorm." in name)
        groups = result.components.optimizer.optimizer.param_groups
        return sum(p.numel() for group in groups if group["weight_decay"] > 0
                   for p in group["params"]), qk

    plain, qk = decayed_elements([])
    with_flag, _ = decayed_elements(["--apply-wd-to-qk-layernorm"])
    assert qk == 2 * 2 * 2 * 8  # layers x (q, k) x (weight, bias) x head size
    assert with_flag - plain == qk
