"""--decoupled-lr under the distributed optimizer, in one process: marked embedding and output
weights get flat segments of their own, so no shard mixes them with other weights, and unmarked
ones are refused with the fix (the numbers across ranks: tests/distributed/test_distributed_optimizer.py)."""

import pytest
import torch

from megatron.core.distributed.sharded_reducer import ShardedGradientReducer
from megatron.core.optimizer.decoupled_lr import is_marked, mark_embedding_or_output_parameters
from megatron.core.optimizer.distributed import decoupled_shards_and_copies


class TinyLanguageModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(11, 4)
        self.layer = torch.nn.Linear(4, 4)
        self.output_layer = torch.nn.Linear(4, 11, bias=False)


def test_marked_weights_get_segments_and_shards_of_their_own():
    model = TinyLanguageModel()
    mark_embedding_or_output_parameters([model])
    marked = {name for name, p in model.named_parameters() if is_marked(p)}
    assert marked == {"embedding.word_embeddings.weight", "output_layer.weight"}
    reducer = ShardedGradientReducer(model.parameters())
    for segment in reducer.segments:
        kinds = {is_marked(p) for p in segment.params}
        assert len(kinds) == 1 and is_marked(segment.shard) in kinds
    # Two-dimensional weights: one segment of the marked two, one of the layer's; the bias alone.
    assert sorted(sum(p.numel() for p in s.params) for s in reducer.segments) == [4, 16, 88]
    decoupled = decoupled_shards_and_copies([reducer], reducer.shards, [], [model])
    assert decoupled == {id(s.shard) for s in reducer.segments if is_marked(s.shard)}
    assert len(decoupled) == 1


def test_unmarked_embedding_in_a_sharded_reducer_is_refused_with_the_fix():
    model = TinyLanguageModel()
    reducer = ShardedGradientReducer(model.parameters())
    assert len(reducer.segments) == 2  # unmarked: embedding, layer and output weights share one
    with pytest.raises(ValueError, match="mark_embedding_or_output_parameters"):
        decoupled_shards_and_copies([reducer], reducer.shards, [], [model])


def test_replicated_tied_copies_follow_the_decoupled_schedule():
    model = TinyLanguageModel()
    copy = model.embedding.word_embeddings.weight
    assert decoupled_shards_and_copies([], [], [copy, model.layer.weight], [model]) == {id(copy)}
