"""Smoke (tier 3): issue 4's "Done when" commands. ``torchrun pretrain_gpt.py`` with Chimera on 4 pipeline
ranks, with 1F1B on 4, and with Chimera on TP 2 x PP 2 prints the same five lm loss values as one process
on the same model and global batch (relative 1e-4; dropout stays at its default 0.1), and Chimera's
evaluation prints the single-process validation and test losses."""

import pytest

from torchrun_helpers import finish, launch, logged_losses, validation_losses

pytestmark = pytest.mark.smoke

COMMAND = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
           "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 "
           "--train-iters 5 --log-interval 1 --mock-data --seed 1234 --eval-iters 1 "
           "--layout-invariant-attention-dropout").split()  # TP x PP reproduces one process


def test_chimera_1f1b_and_tp_chimera_print_the_single_process_losses(tmp_path):
    single = launch(1, COMMAND)
    chimera = launch(4, COMMAND + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                                   "chimera", "--pipeline-timeline", str(tmp_path)])
    single_output = finish(single)
    expected = logged_losses(single_output, 5)
    chimera_output = finish(chimera)
    assert logged_losses(chimera_output, 5) == pytest.approx(expected, rel=1e-4)
    # Evaluation runs the forward-only lists of the schedule: same validation and test losses.
    expected_validation = validation_losses(single_output)
    assert len(expected_validation) == 2  # validation and test set at the end
    assert validation_losses(chimera_output) == pytest.approx(expected_validation, rel=1e-4)
    assert "> p2p packing: " in chimera_output and "> pipeline schedule: chimera" in chimera_output
    assert "> peak stored activations per rank: " in chimera_output
    assert "measured bubble ratio" in chimera_output
    assert list(tmp_path.glob("pipeline_timeline_iter*.json"))

    one_f_one_b = launch(4, COMMAND + ["--pipeline-model-parallel-size", "4",
                                       "--pipeline-schedule", "1f1b"])
    tp_chimera = launch(4, COMMAND + ["--tensor-model-parallel-size", "2",
                                      "--pipeline-model-parallel-size", "2",
                                      "--pipeline-schedule", "chimera"])
    assert logged_losses(finish(one_f_one_b), 5) == pytest.approx(expected, rel=1e-4)
    assert logged_losses(finish(tp_chimera), 5) == pytest.approx(expected, rel=1e-4)
