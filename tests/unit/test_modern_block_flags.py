"""A Llama-3-8B-style Megatron-LM command line (RoPE, SwiGLU, RMSNorm, GQA, bias-free, sequence
parallelism, distributed optimizer) parses unchanged, with Chimera added, into the config the model
reads."""

import logging

import pytest

from megatron.training.arguments import parse_args

LLAMA3_8B = """
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000
--rotary-percent 1.0 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear
--untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
--no-masked-softmax-fusion --attention-softmax-in-fp32 --tensor-model-parallel-size 4
--pipeline-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer --bf16
--micro-batch-size 1 --global-batch-size 128 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
--lr-warmup-iters 100 --train-iters 1000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--clip-grad 1.0 --init-method-std 0.008 --mock-data --vocab-size 128256
""".split()


def test_llama3_command_line_parses_with_chimera(caplog):
    with caplog.at_level(logging.WARNING):
        config = parse_args(LLAMA3_8B + ["--pipeline-schedule", "chimera"], world_size=32)
    model, parallel = config.model, config.parallel
    assert (model.position_embedding_type, model.rotary_base, model.swiglu,
            model.normalization, model.disable_bias_linear) == ("rope", 500000, True, "RMSNorm",
                                                                True)
    assert model.group_query_attention and model.num_query_groups == 8
    assert model.kv_channels == 128 and model.layernorm_epsilon == 1e-5
    assert parallel.sequence_parallel and parallel.use_distributed_optimizer
    assert parallel.pipeline_schedule == "chimera" and parallel.data_parallel_size == 2
    assert not any("not supported" in record.getMessage() for record in caplog.records)


def test_sequence_parallel_is_refused_only_for_an_uneven_sequence():
    argv = LLAMA3_8B + ["--seq-length", "8190", "--max-position-embeddings", "8192"]
    with pytest.raises(ValueError, match="--seq-length 8190 is not divisible by "
                                         "--tensor-model-parallel-size 4"):
        parse_args(argv, world_size=32)
