"""--pipeline-op-costs: a per-stage cost file reaches the split-backward planner."""

import json

import pytest

from megatron.core.pipeline_parallel.planning.op_cost_profile import load_stage_costs
from megatron.core.pipeline_parallel.planning.op_costs import StageCosts
from megatron.core.pipeline_parallel.planning.plan import make_plan, plan_from_config
from megatron.training.arguments import parse_args


def _flags(depth, count, *extra):
    return (f"--num-layers {2 * depth} --hidden-size 32 --num-attention-heads 4 --seq-length 8 "
            f"--max-position-embeddings 8 --vocab-size 64 --lr 1e-3 --train-iters 1 --mock-data "
            f"--micro-batch-size 1 --global-batch-size {count} "
            f"--pipeline-model-parallel-size {depth}").split() + list(extra)


def _write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def test_stage_list_per_stage_or_per_rank_split_over_chunks(tmp_path):
    path = _write(tmp_path / "c.json", {"stages": [[1, 2, 3], [4, 5, 6]]})
    costs = load_stage_costs(path, 2, 2)
    assert costs.per_stage == {0: (1.0, 2.0, 3.0), 1: (4.0, 5.0, 6.0)}
    assert costs.forward_input_weight(0) == (1.0, 0.0, 5.0)  # first stage: I runs in W
    halves = load_stage_costs(path, 4, 2)  # interleaved: 2 chunks per rank
    assert halves.per_stage[1] == (0.5, 1.0, 1.5) and halves.per_stage[2] == (2.0, 2.5, 3.0)
    with pytest.raises(ValueError, match="gives 2 stage entries"):
        load_stage_costs(path, 3, 3)


def test_measure_output_scaled_by_layers_and_split_by_input_share(tmp_path):
    records = [{"layers": 1, "micro_batch_size": 1, "forward_s": 0.5, "backward_s": 1.5},
               {"layers": 2, "micro_batch_size": 1, "forward_s": 1.0, "backward_s": 2.0},
               {"layers": 2, "micro_batch_size": 2, "forward_s": 9.0, "backward_s": 9.0}]
    path = _write(tmp_path / "m.json", {"measurements": {"compute": records}})
    costs = load_stage_costs(path, 2, 2, stage_layers=[3, 3], input_share=0.25)
    assert costs.per_stage[1] == pytest.approx((1.5, 0.75, 2.25))
    with pytest.raises(ValueError, match="no record for micro-batch size 4"):
        load_stage_costs(path, 2, 2, micro_batch_size=4)
    with pytest.raises(ValueError, match="neither 'stages' nor"):
        load_stage_costs(_write(tmp_path / "e.json", {}), 2, 2)
    with pytest.raises(ValueError, match="cannot read"):
        load_stage_costs(str(tmp_path / "missing.json"), 2, 2)


def test_plan_from_config_places_split_backward_with_the_file(tmp_path):
    depth, count = 4, 8
    # A table far from the default (expensive weight halves on the last stage) changes placement.
    stages = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.2, 5.0]]
    path = _write(tmp_path / "c.json", {"stages": stages})
    flags = ["--pipeline-schedule", "chimera", "--split-backward"]
    config = parse_args(_flags(depth, count, *flags, "--pipeline-op-costs", path),
                        world_size=depth)
    plan = plan_from_config(config)
    expected = make_plan("chimera", depth, count, {"num_pipelines": 2, "variant": "direct"},
                         split_backward=0,
                         stage_costs=StageCosts(depth, per_stage=dict(enumerate(
                             tuple(s) for s in stages))))
    assert plan.schedule == expected.schedule
    assert plan.stage_costs.per_stage[3] == (1.0, 0.2, 5.0)
    default = plan_from_config(parse_args(_flags(depth, count, *flags), world_size=depth))
    assert default.stage_costs.per_stage == {}
    assert default.schedule != plan.schedule


def test_flag_refused_without_split_backward_or_file(tmp_path):
    path = _write(tmp_path / "c.json", {"stages": [[1, 1, 1]] * 4})
    with pytest.raises(ValueError, match="add --split-backward"):
        parse_args(_flags(4, 8, "--pipeline-op-costs", path), world_size=4)
    with pytest.raises(ValueError, match="is not a file"):
        parse_args(_flags(4, 8, "--split-backward", "--pipeline-op-costs",
                          str(tmp_path / "nope.json")), world_size=4)


def test_latency_plan_refused_off_gloo(tmp_path):
    """Eager sends deadlock under a blocking exchange (simulated below); a file with
    message_latency is therefore refused with NCCL and accepted with gloo."""
    from megatron.core.pipeline_parallel.planning.simulator import DeadlockError, simulate
    path = _write(tmp_path / "c.json", {"stages": [[1, 1, 1]] * 4, "message_latency": 0.004})
    flags = ("--pipeline-schedule", "chimera", "--split-backward", "--pipeline-op-costs", path,
             "--distributed-backend")
    with pytest.raises(ValueError, match="message_latency .* only on gloo"):
        parse_args(_flags(4, 8, *flags, "nccl"), world_size=4)
    plan = plan_from_config(parse_args(_flags(4, 8, *flags, "gloo"), world_size=4))
    with pytest.raises(DeadlockError):
        simulate(plan.lowered, p2p_semantics="rendezvous", stage_costs=plan.stage_costs)
    simulate(plan.lowered, p2p_semantics="async", stage_costs=plan.stage_costs)
