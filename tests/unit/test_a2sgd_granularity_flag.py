"""``--a2sgd-granularity``: parsed with its choices and handed to every chunk's A2SGD reducer."""

import pytest
import torch

from megatron.core.distributed.a2sgd import (A2SGD_REDUCER, FLAG_BUCKET_SIZE, GRANULARITIES,
                                             A2SGDReducer)
from megatron.core.distributed.reducers import build_gradient_reducers
from megatron.training.arguments import parse_args

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 5 "
        "--mock-data --dp-gradient-reducer a2sgd").split()


def _reducer_for(argv) -> A2SGDReducer:
    config = parse_args(TINY + argv, world_size=1)
    chunks = [torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))]
    reducers = build_gradient_reducers(chunks, [0], lambda key: None, 1.0, kind=A2SGD_REDUCER,
                                       parallel=config.parallel)
    reducer = reducers.by_module[0]
    assert isinstance(reducer, A2SGDReducer)
    return reducer


def test_the_default_is_the_papers_whole_model():
    assert _reducer_for([]).granularity == "model"


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_flag_reaches_the_reducer(granularity):
    reducer = _reducer_for(["--a2sgd-granularity", granularity])
    assert reducer.granularity == granularity
    assert reducer.bucket_size == FLAG_BUCKET_SIZE
    runs = reducer._segment_runs(torch.float32)  # 2 tensors of 12 and 3, then 6 and 2 entries
    assert runs.count == {"model": 1, "bucket": 1, "tensor": 4}[granularity]


def test_a_bad_granularity_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--a2sgd-granularity", "layer"], world_size=1)
    message = capsys.readouterr().err
    assert "--a2sgd-granularity layer: not a valid choice" in message
    assert all(name in message for name in GRANULARITIES)
