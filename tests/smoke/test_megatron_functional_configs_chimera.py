"""Smoke (tier 3): eight current Megatron-LM functional-test configurations of the classic GPT
architecture (tests/data/megatron_gpt_launch_configs.jsonl, from d98e8a6) train under torchrun with
``--pipeline-schedule chimera`` added. Only what must shrink to fit two CPU ranks changes: model
sizes, TP x PP (1 x 2; the interleaved schedule's virtual-stage flag goes with the pipeline size,
uneven first/last stage sizes shrink with the layers),
batch and run lengths, mock data instead of the corpus and tokenizer files, gloo instead of nccl,
and paths under the test's directory. Every other flag (deterministic mode, the distributed
optimizer with overlapped parameter gathers, recomputation, fp16/bf16, checkpoint-format and
logging flags, the scheduler flags, ...) is passed as the test case has it; grouped-query attention
keeps 2 query groups of the 4 heads (8 channels each, feed-forward 64)."""

import json
import re
from pathlib import Path

import pytest

from megatron_scripts import overridden
from torchrun_helpers import LOSS, finish, launch

pytestmark = pytest.mark.smoke

COLLECTION = Path(__file__).resolve().parents[1] / "data" / "megatron_gpt_launch_configs.jsonl"
CONFIGS = {config["name"]: config
           for config in map(json.loads, COLLECTION.read_text().splitlines())}
CASES = ["gpt3_mcore_te_tp1_pp1_uniform_full_recompute",
         "gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather",
         "gpt3_mcore_tp1_pp2_fp16",
         "gpt3_mcore_te_tp2_pp2_resume_torch_dist",
         "gpt3_mcore_tp4_pp1_resume_torch",
         "gpt3_mcore_te_tp1_pp1_mup",
         "gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline",
         "gpt3_mcore_reruns_disable"]
TRAIN_ITERS = 4
SHRUNK = {"--num-layers": "4", "--hidden-size": "32", "--num-attention-heads": "4",
          "--seq-length": "16", "--max-position-embeddings": "16", "--micro-batch-size": "1",
          "--global-batch-size": "4", "--tensor-model-parallel-size": "1",
          "--pipeline-model-parallel-size": "2", "--train-iters": str(TRAIN_ITERS),
          "--lr-decay-iters": "4", "--log-interval": "1", "--eval-interval": "2",
          "--eval-iters": "1", "--save-interval": "2", "--distributed-backend": "gloo",
          "--distributed-timeout-minutes": "2", "--mock-data": "", "--vocab-size": "64",
          "--pipeline-schedule": "chimera"}
DROPPED = ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-type", "--data-cache-path",
           "--num-layers-per-virtual-pipeline-stage", "--recompute-num-layers")


@pytest.mark.parametrize("case", CASES)
def test_functional_config_trains_with_chimera(case, tmp_path):
    argv = CONFIGS[f"functional-2026/{case}"]["argv"]
    paths = {flag: str(tmp_path / name) for flag, name in
             (("--save", "ckpt"), ("--load", "ckpt"), ("--tensorboard-dir", "tb"))
             if flag in argv}
    shrunk = dict(SHRUNK)
    train_iters = TRAIN_ITERS
    if "--fp16" in argv:
        # The dynamic loss scale starts at 2^32 and halves on each of the first overflows,
        # skipping those steps (as Megatron); enough iterations for it to come down and train.
        train_iters = 40
        shrunk.update({"--train-iters": "40", "--lr-decay-iters": "40", "--eval-interval": "20",
                       "--save-interval": "20"})
    if "--recompute-num-layers" in argv:
        shrunk["--recompute-num-layers"] = "1"  # a stage holds 2 of the 4 layers
    if "--num-query-groups" in argv:  # grouped-query attention: 2 groups of the 4 heads
        shrunk.update({"--num-query-groups": "2", "--kv-channels": "8", "--ffn-hidden-size": "64"})
    if "--decoder-first-pipeline-num-layers" in argv:
        # uneven stages of the 4 layers over PP 2: 1 and 3 (the case's 2 + 8 + 2 of 12 over 4)
        shrunk.update({"--decoder-first-pipeline-num-layers": "1",
                       "--decoder-last-pipeline-num-layers": "3"})
    command = overridden(argv, {**shrunk, **paths}, drop=DROPPED)
    output = finish(launch(2, command), 300)
    assert "> pipeline schedule: chimera" in output
    if "--decoder-first-pipeline-num-layers" in argv:
        assert "> transformer layers per pipeline stage: [1, 3]" in output
    iterations = [int(i) for i, _, _ in LOSS.findall(output)]
    losses = [float(value) for _, _, value in LOSS.findall(output)]
    assert iterations and iterations[-1] == train_iters, output[-3000:]
    assert all(0 < loss < 10 for loss in losses), losses
    if "--log-params-norm" in argv:  # the whole model's norm (was 0 with the distributed optimizer)
        norms = [float(norm) for norm in re.findall(r"\| params norm: ([0-9.]+) \|", output)]
        assert len(norms) == train_iters and all(norm > 5 for norm in norms), norms
    if "--save" in argv:
        assert f"successfully saved checkpoint at iteration {train_iters:7d}" in output
