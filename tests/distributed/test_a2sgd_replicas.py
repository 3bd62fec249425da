"""A2SGD as the data-parallel reducer on gloo ranks: DP=2 and DP=4, with 1F1B, Chimera and TP.

Between syncs the data-parallel replicas drift (each applies its own two-mean update); what must
stay exact does: Chimera's two copies of a stage in one replica, the tied embedding copies, and the
tensor-parallel-replicated parameters. Right after the exact average the replicas are identical.
"""

import pytest
import torch

import pretrain_gpt
from dist_harness import run_distributed
from megatron.core.distributed.reduction import synchronize_reducers
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer, checkpoint_file, load_file
from megatron.core.parallel_state import RankLayout, create_parallel_state
from megatron.core.runtimes import select_runtime_class
from megatron.training.training import pretrain

pytestmark = pytest.mark.distributed

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
        "--mock-data --seed 7 --micro-batch-size 1 --global-batch-size 8 --lr 1e-2 "
        "--log-interval 1 --eval-iters 0 --dp-gradient-reducer a2sgd")


def _snapshot(components):
    """Every chunk's parameters by (stage or 0, name), with which are shared or TP-replicated."""
    keys = getattr(components.runtime, "keys", [None] * len(components.model_chunks))
    params, shared, replicated = {}, set(), set()
    for key, chunk in zip(keys, components.model_chunks):
        stage = 0 if key is None else key.stage
        for name, param in chunk.named_parameters():
            params[(stage, name)] = param.detach().clone().numpy()
            if getattr(param, "shared_embedding", False):
                shared.add((stage, name))
            if not getattr(param, "tensor_model_parallel", False):
                replicated.add((stage, name))
    return params, shared, replicated


def _pretrain(rank, world_size, argv):
    config = parse_args(argv.split(), world_size=world_size)
    runtime_class = select_runtime_class(config)
    layout = RankLayout.from_world_size(world_size, config.parallel.tensor_model_parallel_size,
                                        config.parallel.pipeline_model_parallel_size)
    state = create_parallel_state(layout, rank, "gloo",
                                  extra_group_ranks=runtime_class.required_group_ranks(config, layout))
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=state, log=lambda _: None,
                      checkpointing=Checkpointer(config, log=lambda _: None))
    return result, state


def _rank_run(rank, world_size, argv):
    result, state = _pretrain(rank, world_size, argv)
    components = result.components
    before = _snapshot(components)
    synchronize_reducers(components.gradient_reducers)
    after, _, _ = _snapshot(components)
    coords = state.coords
    return {"coords": (coords.tp, coords.dp, coords.pp), "before": before, "after": after,
            "losses": [r.losses["lm loss"] for r in result.history]}


def _copies(results, snapshot, where=lambda coords, key: True):
    """(tp, stage, name) -> [(coords, value)] over every rank holding that parameter."""
    copies = {}
    for result in results:
        values = result[snapshot][0] if snapshot == "before" else result[snapshot]
        for key, value in values.items():
            if where(result, key):
                copies.setdefault((result["coords"][0],) + key, []).append(
                    (result["coords"], value))
    return copies


def _all_equal(entries) -> bool:
    first = entries[0][1]
    return all((value == first).all() for _, value in entries[1:])


LAYOUTS = [
    ("", 4),  # DP=2 without a pipeline: test_the_training_loop_syncs_at_the_interval
    ("--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b", 4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 4),
    ("--tensor-model-parallel-size 2", 4),
]


@pytest.mark.parametrize("flags,world_size", LAYOUTS,
                         ids=[f"{w}ranks:{f.replace('--', '') or 'dp'}" for f, w in LAYOUTS])
def test_replicas_drift_only_where_allowed_and_are_identical_after_a_sync(flags, world_size):
    argv = f"{TINY} {flags} --train-iters 3 --a2sgd-sync-interval 2"  # iteration 3: no sync
    results = run_distributed(_rank_run, world_size, argv, timeout=240)

    # Before the sync: data-parallel replicas differ ...
    drifted = [key for key, entries in _copies(results, "before").items()
               if not _all_equal(entries)]
    assert drifted, "no parameter differs between data-parallel replicas after a non-sync step"
    # ... but never a copy within one replica (Chimera directions), a tied embedding copy, or a
    # TP-replicated parameter between the TP ranks of one replica.
    for result_key, entries in _copies(results, "before").items():
        by_replica = {}
        for coords, value in entries:
            by_replica.setdefault(coords[1], []).append((coords, value))
        for replica_entries in by_replica.values():
            assert _all_equal(replica_entries), f"{result_key} differs inside one replica"
    shared = set().union(*(r["before"][1] for r in results))
    shared_values = [(r["coords"], r["before"][0][key]) for r in results
                     for key in r["before"][0] if key in shared]
    if shared_values:
        assert all((v == shared_values[0][1]).all() for _, v in shared_values)
    if "tensor-model-parallel-size 2" in flags:
        for result in results:
            peer = next(r for r in results if r["coords"][1:] == result["coords"][1:]
                        and r is not result)
            for key in result["before"][2]:
                assert (result["before"][0][key] == peer["before"][0][key]).all(), key

    # After the exact average every copy of every parameter is identical.
    for key, entries in _copies(results, "after").items():
        assert _all_equal(entries), f"{key} differs after the sync"


def test_the_training_loop_syncs_at_the_interval():
    argv = f"{TINY} --train-iters 2 --a2sgd-sync-interval 2"  # iteration 2 is a sync
    results = run_distributed(_rank_run, 2, argv, timeout=120)
    for key, entries in _copies(results, "before").items():
        assert _all_equal(entries), f"{key} differs right after the loop's sync"


def _rank_resume(rank, world_size, argv, save_dir):
    """A straight run, and the same run saved at iteration 3 and resumed in new groups."""
    straight, _ = _pretrain(rank, world_size, argv)
    _pretrain(rank, world_size, f"{argv} --save {save_dir} --exit-interval 3")
    resumed, _ = _pretrain(rank, world_size, f"{argv} --load {save_dir}")

    def summary(result):
        params = _snapshot(result.components)[0]
        return [r.losses["lm loss"] for r in result.history], params
    return summary(straight), summary(resumed)


# With Adam's second moment from exact steps (exact steps 1, 4 and 7): iteration 4 stands for the
# 3 steps since iteration 1, which the resumed run knows only from the checkpoint, and its keeper
# must act on the optimizer state the resume loads.
SECOND_MOMENT = ("--train-iters 7 --a2sgd-sync-flushes-errors "
                 "--a2sgd-second-moment-from-exact-steps")


@pytest.mark.parametrize("ckpt_format,extra", [("torch", "--train-iters 5"),
                                               ("torch_dist", "--train-iters 5"),
                                               ("torch", SECOND_MOMENT),
                                               ("torch_dist", SECOND_MOMENT)])
def test_checkpoint_holds_every_replicas_error_and_resume_is_exact(tmp_path, ckpt_format, extra):
    # Saves and syncs coincide (interval 3, save at 3), so the straight run is the reference.
    argv = f"{TINY} {extra} --a2sgd-sync-interval 3 --ckpt-format {ckpt_format}"
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_rank_resume, 2, argv, save_dir, timeout=180)
    if ckpt_format == "torch":  # the legacy layout's per-rank file holds every rank's errors
        payload = load_file(checkpoint_file(save_dir, 3, 0, 0, 1))
        errors = [state[0]["errors"]["torch.float32"]
                  for state in payload["gradient_reducer_state"]]
        assert len(errors) == 2 and errors[0].abs().sum() > 0
        assert not torch.equal(errors[0], errors[1])  # each data-parallel rank's own error
    for (straight_losses, straight_params), (resumed_losses, resumed_params) in results:
        assert resumed_losses == straight_losses[3:]
        for key, value in straight_params.items():
            assert (resumed_params[key] == value).all(), key


def _rank_losses_and_overlap(rank, world_size, argv):
    from megatron.core.distributed.a2sgd import a2sgd_reducers
    result, _ = _pretrain(rank, world_size, argv)
    return {"losses": [r.losses["lm loss"] for r in result.history],
            "overlapped": [r.overlapped_last_step
                           for r in a2sgd_reducers(result.components.gradient_reducers)]}


def test_overlapped_statistics_train_like_the_whole_gradient_path():
    """--overlap-grad-reduce (DP 2, four micro-batches per rank): the statistics are formed in the
    backward, and training follows the same losses as without overlap (float32 summation order)."""
    argv = f"{TINY} --train-iters 4 --a2sgd-sync-interval 2"
    plain = run_distributed(_rank_losses_and_overlap, 2, argv, timeout=240)
    overlapped = run_distributed(_rank_losses_and_overlap, 2, f"{argv} --overlap-grad-reduce",
                                 timeout=240)
    assert all(not any(r["overlapped"]) for r in plain)
    assert all(r["overlapped"] and all(r["overlapped"]) for r in overlapped)
    for rank in range(2):
        assert overlapped[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5)
