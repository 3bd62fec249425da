"""Tier 2 (2 gloo ranks): the re-run engine in parallel layouts. Under Chimera (PP 2, two
pipelines in opposite directions, so each rank computes the loss of half the micro-batches) the
losses without faults are bit-identical to a run without the engine (with the per-bucket
gradient checks too, and with every iteration run twice by report_stats), and an error injected on one
rank makes both ranks re-run the iteration and stop with the same Megatron exit status. Under
Chimera, 1F1B, the distributed optimizer with overlapped communication and Chimera with
--overlap-grad-reduce (buckets launched from the backward, re-armed by the re-run) and the
per-bucket gradient checks, re-running every iteration and continuing trains exactly as a run
without re-runs."""

from __future__ import annotations

import pytest

import pretrain_gpt
from dist_harness import run_distributed
from megatron.training.arguments import parse_args
from megatron.training.rerun import (EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                     EXIT_CODE_RESUME_TO_DISAMBIGUATE)
from megatron.training.training import pretrain

CHIMERA = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
           "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
           "--mock-data --seed 7 --micro-batch-size 1 --global-batch-size 4 --lr 1e-2 "
           "--train-iters 3 --log-interval 1 --eval-iters 0 --attention-dropout 0 "
           "--hidden-dropout 0 --pipeline-model-parallel-size 2 --pipeline-schedule chimera")


def _train(rank, world_size, argv):
    config = parse_args(argv.split(), world_size=world_size)
    result = pretrain(config, pretrain_gpt.GPT_SPEC, log=lambda _: None)
    return [record.losses["lm loss"] for record in result.history], result.exit_code


def test_validation_leaves_chimera_losses_bit_identical():
    plain = run_distributed(_train, 2, CHIMERA, timeout=240)
    validated = run_distributed(_train, 2, f"{CHIMERA} --rerun-mode validate_results "
                                           f"--check-for-spiky-loss --check-for-large-grads "
                                           f"--check-for-nan-in-loss-and-grad", timeout=240)
    reported = run_distributed(_train, 2, f"{CHIMERA} --rerun-mode report_stats", timeout=240)
    assert validated == plain == reported  # report_stats: every iteration twice, same losses
    assert len(plain[0][0]) == 3 and plain[0][1] == 0


@pytest.mark.parametrize("kind, code", [("transient_error", EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
                                        ("persistent_error", EXIT_CODE_RESUME_TO_DISAMBIGUATE)])
def test_an_error_injected_on_one_rank_stops_both_ranks_alike(kind, code):
    # Rate 2: (draw + rank) % 2 == 0 holds on exactly one of the two ranks.
    runs = run_distributed(_train, 2, f"{CHIMERA} --rerun-mode validate_results "
                                      f"--error-injection-rate 2 --error-injection-type {kind}",
                           timeout=240)
    assert [exit_code for _, exit_code in runs] == [code, code]
    assert [len(losses) for losses, _ in runs] == [1, 1]  # stopped before iteration 2's update


def _train_rerunning_every_iteration(rank, world_size, argv):
    """Every loss from the second iteration on counts as a spike (one sample sets the scale, any
    multiple of it is a spike): each iteration is re-run and training continues with the re-run."""
    import megatron.training.checkpointing.state as state
    import megatron.training.rerun as rerun
    rerun.SPIKY_LOSS_SAMPLES, rerun.SPIKY_LOSS_FACTOR = 1, 0.0
    restores = []
    restore = state.restore_rng_state
    state.restore_rng_state = lambda saved: (restores.append(1), restore(saved))
    losses, exit_code = _train(rank, world_size, f"{argv} --rerun-mode validate_results "
                                                 f"--check-for-spiky-loss")
    assert len(restores) == 2, "iterations 2 and 3 must each have been re-run on every rank"
    return losses, exit_code


@pytest.mark.parametrize("layout", [
    "--pipeline-model-parallel-size 2 --pipeline-schedule chimera",
    "--pipeline-model-parallel-size 2",
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
    "--pipeline-model-parallel-size 2 --pipeline-schedule chimera --overlap-grad-reduce "
    "--check-for-large-grads --check-for-nan-in-loss-and-grad"],
    ids=["chimera-pp2", "1f1b-pp2", "dp2-distopt-overlap", "chimera-pp2-overlap-grad-checks"])
def test_a_rerun_that_continues_trains_exactly_as_one_run(layout):
    """The re-run starts from the iteration's own state (gradients zeroed, reducers and parameter
    gathers settled), so stepping with its gradients gives the losses of a run without re-runs."""
    base = CHIMERA.replace(" --pipeline-model-parallel-size 2 --pipeline-schedule chimera", "")
    plain = run_distributed(_train, 2, f"{base} {layout}", timeout=240)
    rerunning = run_distributed(_train_rerunning_every_iteration, 2, f"{base} {layout}",
                                timeout=240)
    assert rerunning == plain and len(plain[0][0]) == 3
