"""Every schedule, alone and combined with TP and DP, reproduces the single-process model.

One training step (float64, dropout 0.1, gradient clipping on) in each layout: the reported loss, the
global gradient norm, every gradient after synchronisation (every copy: Chimera's replicas and the tied
embedding copies included) and every parameter after the optimizer step must equal the single-process
model's on the same seed and global batch. Tolerance: 1e-9 relative for gradients and parameters (float64
model; the layouts differ only in summation order), 1e-6 for the reported loss, which pretrain_gpt's loss
function averages in float32 as Megatron does (backward halving averages two half micro-batches, so its
loss differs from the whole micro-batch's in the float32 rounding).
"""

import functools
import os

import pytest
import torch

from dist_harness import run_distributed
from pipeline_reference import assert_matches_reference, merge_copies, train_one_step


@functools.lru_cache(maxsize=None)
def reference(batch_flags: str) -> dict:
    """The single-process run for a batch configuration (computed once per session)."""
    return train_one_step(0, 1, batch_flags.split())


BATCH_N4 = "--micro-batch-size 2 --global-batch-size 8"
# Op costs with a 4 ms message latency and per-op overheads: the latency-tolerant plans.
LATENCY_COSTS = "--pipeline-op-costs " + os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "data", "op_costs_latency.json")

# (flags, world size, batch flags): PP = 2 and PP = 4, every schedule and Chimera variant.
LAYOUTS = [
    ("--pipeline-model-parallel-size 2 --pipeline-schedule gpipe", 2, BATCH_N4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b", 2, BATCH_N4),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2", 2, BATCH_N4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 2, BATCH_N4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--chimera-variant forward-doubling", 2, BATCH_N4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--chimera-variant backward-halving", 2, BATCH_N4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 2,
     "--micro-batch-size 2 --global-batch-size 2"),  # N = 1 < D
    # Interleaved with N not a multiple of D (Megatron's micro-batch groups of G): one group of
    # N = 3, and groups of 3 + 2 for N = 5.
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
     "--microbatch-group-size-per-virtual-pipeline-stage 3", 2,
     "--micro-batch-size 2 --global-batch-size 6"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--microbatch-group-size-per-virtual-pipeline-stage 3", 2,
     "--micro-batch-size 1 --global-batch-size 5"),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule gpipe", 4, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule 1f1b", 4, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1", 4, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
     "--microbatch-group-size-per-virtual-pipeline-stage 5", 4,
     "--micro-batch-size 1 --global-batch-size 5"),  # Megatron's tunable_overlap test: N = 5
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera", 4, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera", 4,
     "--micro-batch-size 1 --global-batch-size 8"),  # N = 2D, direct concatenation
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
     "--chimera-variant forward-doubling", 4, "--micro-batch-size 1 --global-batch-size 8"),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
     "--chimera-variant backward-halving", 4, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --chimera-pipelines 4", 4,
     BATCH_N4),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera", 4,
     "--micro-batch-size 4 --global-batch-size 8"),  # N = 2 < D
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
     "--pipeline-schedule chimera", 4, BATCH_N4),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
     "--pipeline-schedule 1f1b", 4, BATCH_N4),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
     "--num-layers-per-virtual-pipeline-stage 2", 4, BATCH_N4),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--chimera-variant forward-doubling", 4, BATCH_N4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 4, BATCH_N4),  # DP 2
    ("--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b", 4, BATCH_N4),  # DP 2
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2", 4,
     BATCH_N4),  # DP 2
    # Split backward (input half now, weight half in idle slots).
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera --split-backward", 2, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --split-backward", 4, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --chimera-variant "
     "forward-doubling --split-backward", 4, "--micro-batch-size 1 --global-batch-size 8"),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule 1f1b --split-backward", 4, BATCH_N4),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--split-backward", 4, BATCH_N4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera --split-backward", 4,
     BATCH_N4),  # DP 2
    # Interleaved Chimera (2D half-size stages per direction), alone and with split backward.
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera --chimera-variant interleaved",
     2, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --chimera-variant interleaved "
     "--split-backward", 4, "--micro-batch-size 1 --global-batch-size 8"),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --chimera-variant interleaved "
     "--split-backward", 4, "--micro-batch-size 4 --global-batch-size 12"),  # N = 3 < D
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera --chimera-variant interleaved "
     "--split-backward", 4, BATCH_N4),  # DP 2
    # Latency-tolerant orders (planned for message latency > 0: W placement and eager sends).
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --split-backward "
     + LATENCY_COSTS, 4, BATCH_N4),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --chimera-variant interleaved "
     "--split-backward " + LATENCY_COSTS, 4, "--micro-batch-size 1 --global-batch-size 8"),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --chimera-variant interleaved "
     "--split-backward " + LATENCY_COSTS, 4, "--micro-batch-size 4 --global-batch-size 12"),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera --split-backward "
     + LATENCY_COSTS, 4, BATCH_N4),  # DP 2
]


@pytest.mark.parametrize("flags,world_size,batch", LAYOUTS,
                         ids=[f"{w}ranks:{f.replace('--', '').replace(LATENCY_COSTS[2:], 'latency-costs')}:"
                              f"{b.replace('--', '')}" for f, w, b in LAYOUTS])
def test_layout_reproduces_single_process(flags, world_size, batch):
    results = run_distributed(train_one_step, world_size, (flags + " " + batch).split(),
                              timeout=240)
    assert_matches_reference(results, reference(batch))
    # on gloo every plan sends each message right after its producer (PipelineRuntime)
    assert all(result["eager_sends"] for result in results)


@pytest.mark.parametrize("extra", [
    "--chimera-grad-sync eager", "--chimera-grad-sync end",
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "--recompute-granularity selective",
    "--p2p-packing off", "--p2p-packing python",
])
def test_chimera_options_do_not_change_numbers(extra):
    flags = f"--pipeline-model-parallel-size 4 --pipeline-schedule chimera {BATCH_N4} {extra}"
    results = run_distributed(train_one_step, 4, flags.split(), timeout=240)
    assert_matches_reference(results, reference(BATCH_N4))


@pytest.mark.parametrize("schedule", [
    "--pipeline-schedule 1f1b", "--pipeline-schedule gpipe",
    "--num-layers-per-virtual-pipeline-stage 2",
    "--pipeline-schedule chimera --chimera-variant forward-doubling"])
def test_recomputation_under_every_schedule_does_not_change_numbers(schedule):
    flags = (f"--pipeline-model-parallel-size 2 {schedule} {BATCH_N4} --recompute-granularity full "
             f"--recompute-method block --recompute-num-layers 1")
    results = run_distributed(train_one_step, 2, flags.split(), timeout=240)
    assert_matches_reference(results, reference(BATCH_N4))


def test_bf16_under_chimera_matches_bf16_single_process():
    # Same bf16 kernels on the same micro-batches; only gradient summation order differs.
    batch = f"{BATCH_N4} --bf16"
    expected = train_one_step(0, 1, batch.split())
    results = run_distributed(train_one_step, 2, (batch + " --pipeline-model-parallel-size 2 "
                                                          "--pipeline-schedule chimera").split(),
                              timeout=240)
    for result in results:
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert result["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    for name, copies in merge_copies(results, "params").items():
        want = expected["params"][(0, name)]
        for value in copies:
            assert (value - want).abs().max().item() <= 1e-6 * want.abs().max().item(), name


def test_fp16_overflow_under_chimera_skips_the_step_on_every_rank():
    # The first step at the initial loss scale 2**32 overflows: every rank skips it, as one process does.
    batch = f"{BATCH_N4} --fp16"
    expected = train_one_step(0, 1, batch.split())
    results = run_distributed(train_one_step, 4, (batch + " --pipeline-model-parallel-size 4 "
                                                          "--pipeline-schedule chimera").split(),
                              timeout=240)
    assert expected["skipped"] and all(result["skipped"] for result in results)
    for name, copies in merge_copies(results, "params").items():
        for value in copies:
            assert torch.equal(value, expected["params"][(0, name)]), name


def test_untied_output_layer_under_chimera():
    flags = f"--untie-embeddings-and-output-weights {BATCH_N4}"
    expected = train_one_step(0, 1, flags.split())
    results = run_distributed(
        train_one_step, 2, (flags + " --pipeline-model-parallel-size 2 --pipeline-schedule "
                                    "chimera").split(), timeout=240)
    assert_matches_reference(results, expected)
    assert any(name == "output_layer.weight" for result in results
               for (_, name) in result["params"])


def test_tied_embedding_copies_stay_identical_after_the_step():
    flags = f"--pipeline-model-parallel-size 4 --pipeline-schedule chimera {BATCH_N4}"
    results = run_distributed(train_one_step, 4, flags.split(), timeout=240)
    copies = merge_copies(results, "params")["embedding.word_embeddings.weight"]
    assert len(copies) == 4  # Chimera D=4: stage 0 and stage 3 of both pipelines
    for copy in copies[1:]:
        assert torch.equal(copy, copies[0])


# The modern block (issue 27): the Llama-style combination and the remaining options, alone and
# with sequence parallelism, under 1F1B, Chimera and data parallelism (float64, dropout on).
LLAMA_FLAGS = ("--position-embedding-type rope --swiglu --normalization RMSNorm "
               "--disable-bias-linear --group-query-attention --num-query-groups 2 "
               "--ffn-hidden-size 48")
OTHER_FLAGS = ("--position-embedding-type rope --rotary-percent 0.5 --rotary-interleaved "
               "--rotary-base 500 --squared-relu --apply-layernorm-1p --qk-layernorm "
               "--disable-bias-linear --add-qkv-bias --kv-channels 12")
TP2_PP2 = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
MODERN_LAYOUTS = [
    (LLAMA_FLAGS, f"{TP2_PP2} --pipeline-schedule 1f1b", 4),
    (LLAMA_FLAGS, "--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 2),
    (LLAMA_FLAGS, "--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 4),  # DP 2
    (LLAMA_FLAGS, f"{TP2_PP2} --pipeline-schedule chimera --sequence-parallel", 4),
    (OTHER_FLAGS, f"{TP2_PP2} --pipeline-schedule 1f1b", 4),
    (OTHER_FLAGS, "--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 4),  # DP 2
    (OTHER_FLAGS, f"{TP2_PP2} --pipeline-schedule chimera --sequence-parallel", 4),
    ("", f"{TP2_PP2} --pipeline-schedule 1f1b --sequence-parallel", 4),
    ("", f"{TP2_PP2} --pipeline-schedule chimera --sequence-parallel", 4),
    ("", f"{TP2_PP2} --pipeline-schedule chimera --sequence-parallel "
         "--use-distributed-optimizer", 4),
    ("", f"{TP2_PP2} --num-layers-per-virtual-pipeline-stage 2 --sequence-parallel", 4),
    ("", f"{TP2_PP2} --pipeline-schedule gpipe --sequence-parallel", 4),
    (LLAMA_FLAGS, f"{TP2_PP2} --pipeline-schedule chimera --sequence-parallel "
                  "--split-backward", 4),
    (LLAMA_FLAGS, f"{TP2_PP2} --pipeline-schedule chimera --chimera-variant backward-halving "
                  "--sequence-parallel --recompute-granularity selective", 4),
    (LLAMA_FLAGS, "--tensor-model-parallel-size 2 --sequence-parallel "
                  "--use-distributed-optimizer", 4),  # TP 2 x DP 2, no pipeline
]


@pytest.mark.parametrize("model_flags,flags,world_size", MODERN_LAYOUTS,
                         ids=[f"{w}ranks:{'llama' if m == LLAMA_FLAGS else 'other' if m else 'gpt2'}"
                              f":{f.replace('--', '')}" for m, f, w in MODERN_LAYOUTS])
def test_modern_block_and_sequence_parallel_reproduce_single_process(model_flags, flags,
                                                                     world_size):
    results = run_distributed(train_one_step, world_size,
                              f"{model_flags} {flags} {BATCH_N4}".split(), timeout=240)
    # The distributed optimizer leaves each rank only its shard's reduced gradient: compare the
    # gradient norm and the stepped parameters.
    fields = ("params",) if "distributed-optimizer" in flags else ("grads", "params")
    assert_matches_reference(results, reference(f"{model_flags} {BATCH_N4}"), fields)
