"""The interpreter on one rank with a fake transport: sent activations keep no data, received
gradients flow into the backward, reductions start at the schedule's points."""

import torch

import pretrain_gpt
from megatron.core.config import ModelConfig, RecomputeConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.execution.interpreter import ExecutionContext, Interpreter
from megatron.core.pipeline_parallel.planning.lowering import lower_schedule
from megatron.core.pipeline_parallel.execution.model_chunks import ModuleKey
from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout

SEQ, BATCH, HIDDEN = 8, 2, 16


class RecordingTransport:
    """Stands in for the peers: records what is sent, answers receives with ones, and lets the
    test look at the interpreter's stored activations at every exchange."""

    def __init__(self):
        self.interpreter = None
        self.sent = []  # (message text, elements)
        self.sent_before = []  # per exchange: stored outputs (by micro-batch) sent earlier, size

    def start(self, sends, receives):
        """The Transport seam: post a group; the answer is ready at once."""
        # a message's text ends with its op in brackets, e.g. "... [>1:a0.0.1]"
        already_sent = {what.rstrip("]").rsplit(".", 1)[1] for what, _ in self.sent
                        if ":a" in what}
        self.sent_before.append({key[2]: output.numel() for key, (_, output, _)
                                 in self.interpreter.stored.items()
                                 if str(key[2]) in already_sent})
        self.sent.extend((item.what, item.tensor.numel()) for item in sends)
        return Completed([torch.ones(item.shape, dtype=item.dtype) for item in receives])


class Completed:
    """A posted exchange that has already completed."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait_received(self):
        return self.tensors

    def wait_sent(self):
        pass


class CountingReducer:
    def __init__(self):
        self.started = False

    def start(self):
        self.started = True


def test_first_stage_frees_sent_activations_and_backpropagates_received_gradients():
    config = ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, seq_length=SEQ,
                         max_position_embeddings=SEQ, padded_vocab_size=32, hidden_dropout=0.0,
                         attention_dropout=0.0)
    chunk = GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234,
                     layer_range=range(0, 1), pre_process=True, post_process=False)
    layout = schedule_layout("1f1b", 2)
    lowered = lower_schedule(build_schedule("1f1b", 2, 2), layout)
    tokens = torch.randint(0, 32, (BATCH, SEQ))
    microbatches = [{"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(BATCH, SEQ),
                     "sample_ids": torch.arange(BATCH) + 2 * k} for k in range(2)]
    transport, reducer = RecordingTransport(), CountingReducer()
    interpreter = Interpreter(ExecutionContext(
        chunks={ModuleKey(0, 0): chunk}, layout=layout, transport=transport,
        forward_step_func=pretrain_gpt.forward_step, microbatches=microbatches, loss_divisor=2,
        activation_shape=(SEQ, BATCH, HIDDEN), wire_dtype=torch.float32,
        reducers={ModuleKey(0, 0): reducer}))
    transport.interpreter = interpreter
    assert interpreter.run(lowered, rank=0) == []  # stage 0 computes no loss

    # Both activations went out whole, and once sent the stored outputs hold one element only.
    assert [size for what, size in transport.sent if ":a" in what] == [SEQ * BATCH * HIDDEN] * 2
    assert any(transport.sent_before), "no exchange happened while a sent activation was stored"
    for stored in transport.sent_before:
        assert all(size == 1 for size in stored.values()), transport.sent_before
    assert interpreter.peak_stored == 2 and interpreter.peak_bytes > 0
    assert reducer.started
    # The received (all-ones) gradients reached the parameters of the chunk.
    assert chunk.embedding.word_embeddings.weight.grad.abs().sum() > 0
