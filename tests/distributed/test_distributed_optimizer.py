"""--use-distributed-optimizer trains the same model as the replicated optimizer.

Three iterations (float64 model, dropout on, clipping and weight decay active) with and without the
distributed optimizer on DP 2, Chimera PP 2 and Chimera PP 2 x DP 2 (4 ranks), and on one process:
every iteration's gradient norm and every final parameter agree to 1e-9 relative (the reduce-scatter
sums in another order than the all-reduce), the reported loss (float32) to 1e-6. Each rank steps only its shard: a Chimera
rank's optimizer covers 1/(2W) of each of its stages.
"""

from __future__ import annotations

import pytest

import pretrain_gpt
from dist_harness import run_distributed
from pipeline_reference import test_model_provider as float64_model
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.utils import gather_full_state
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
        "--mock-data --seed 7 --micro-batch-size 2 --global-batch-size 8 --lr 1e-2 "
        "--train-iters 3 --log-interval 1 --eval-iters 0 --clip-grad 0.05 --weight-decay 0.1 "
        "--layout-invariant-attention-dropout")


def _train(rank, world_size, argv):
    config = parse_args(argv.split(), world_size=world_size)
    state = ParallelState.single_process() if world_size == 1 else None
    result = pretrain(config, float64_model, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=state, log=lambda _: None)
    components = result.components
    params = {}
    for chunk in components.model_chunks:
        for name, value in gather_full_state(chunk, components.parallel_state).items():
            params[name] = value.numpy()
    records = [(r.losses["lm loss"], r.grad_norm) for r in result.history]
    optimizer = components.optimizer
    whole = sum(p.numel() for p in getattr(optimizer, "replicated", optimizer.params))
    sharded = sum(p.numel() for p in getattr(optimizer, "shards", []))
    return records, params, (sharded, whole)


def _close(a, b, what, tolerance=1e-9):
    assert a == pytest.approx(b, rel=tolerance), what


@pytest.mark.parametrize("layout,world_size", [
    ("", 2), ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 2),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b", 4),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1", 4),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--chimera-variant forward-doubling", 4),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--sequence-parallel", 4),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--decoder-first-pipeline-num-layers 1", 4)],  # uneven stages: 1 and 3 layers
    ids=["dp2", "chimera-pp2", "chimera-pp2xdp2", "1f1b-pp2xdp2", "interleaved-pp2xdp2",
         "chimera-fd-tp2xpp2", "chimera-tp2xpp2-sequence-parallel", "uneven-chimera-pp2xdp2"])
def test_distributed_optimizer_matches_the_replicated_one(layout, world_size):
    argv = f"{TINY} {layout}"
    replicated = run_distributed(_train, world_size, argv, timeout=240)
    sharded = run_distributed(_train, world_size, argv + " --use-distributed-optimizer",
                              timeout=240)
    single, single_params, _ = _train(0, 1, TINY)
    for (records, params, stepped), (ref_records, ref_params, ref_stepped) in zip(sharded,
                                                                                  replicated):
        for (loss, norm), (ref_loss, ref_norm), (one_loss, _) in zip(records, ref_records, single):
            _close(loss, ref_loss, "loss")
            _close(norm, ref_norm, "grad norm")
            _close(loss, one_loss, "loss vs one process", 1e-6)  # reported in float32
        for name, value in params.items():
            scale = abs(ref_params[name]).max() + 1e-12
            assert abs(value - ref_params[name]).max() / scale < 1e-9, name
            assert abs(value - single_params[name]).max() / scale < 1e-9, name
        # Every element of a stage is stepped by one of its R replicas (R = DP, and under Chimera
        # 2 x DP); only the tied embedding's copies are stepped whole. Shards are padded to R.
        tensor = 2 if "tensor-model" in layout else 1
        data = world_size // tensor // (2 if "pipeline" in layout else 1)
        replicas = data * (2 if "chimera" in layout else 1)
        sharded_numel, whole_numel = stepped
        expected = (ref_stepped[1] - whole_numel) / replicas
        assert expected <= sharded_numel <= expected + 8 * replicas, (stepped, ref_stepped)


# The embedding and output layer's peak is 5x --lr, their floor 10x --min-lr (linear decay).
DECOUPLED = " --decoupled-lr 5e-2 --decoupled-min-lr 1e-3 --min-lr 1e-4"


@pytest.mark.parametrize("layout,world_size", [
    ("", 2),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--untie-embeddings-and-output-weights", 4)],
    ids=["dp2-tied", "chimera-pp2xdp2-untied"])
def test_distributed_optimizer_with_decoupled_lr_matches_the_replicated_one(layout, world_size):
    """The embedding and output weights get shards of their own, stepped with the decoupled
    schedule: the same model as the replicated optimizer and one process with --decoupled-lr, and
    not the model trained without it."""
    argv = f"{TINY} {layout}{DECOUPLED}"
    sharded = run_distributed(_train, world_size, argv + " --use-distributed-optimizer",
                              timeout=240)
    replicated = run_distributed(_train, world_size, argv, timeout=240)
    single, single_params, _ = _train(0, 1, f"{TINY}{DECOUPLED}"
                                      + (" --untie-embeddings-and-output-weights"
                                         if "untie" in layout else ""))
    plain = run_distributed(_train, world_size,
                            argv.replace(" --decoupled-lr 5e-2 --decoupled-min-lr 1e-3", "")
                            + " --use-distributed-optimizer", timeout=240)
    for (records, params, _), (ref_records, ref_params, _), (_, plain_params, _) in zip(
            sharded, replicated, plain):
        for (loss, norm), (ref_loss, ref_norm), (one_loss, _) in zip(records, ref_records, single):
            _close(loss, ref_loss, "loss")
            _close(norm, ref_norm, "grad norm")
            _close(loss, one_loss, "loss vs one process", 1e-6)  # reported in float32
        embedding_or_output = [name for name in params
                               if name.endswith(("word_embeddings.weight", "output_layer.weight"))]
        assert embedding_or_output, sorted(params)
        for name, value in params.items():
            scale = abs(ref_params[name]).max() + 1e-12
            assert abs(value - ref_params[name]).max() / scale < 1e-9, name
            assert abs(value - single_params[name]).max() / scale < 1e-9, name
        # The decoupled lr changed the embedding/output weights (not a no-op).
        for name in embedding_or_output:
            scale = abs(plain_params[name]).max()
            assert abs(params[name] - plain_params[name]).max() / scale > 1e-4, name


# the legacy layout (distrib_optim_dpNNN.pt shard files); torch_dist: test_checkpointing_reshard
RESUME = TINY.replace("--train-iters 3", "--train-iters 4") + " --ckpt-format torch"


def _run_with_checkpoints(rank, world_size, argv, save_dir):
    from megatron.training.checkpointing import Checkpointer

    def run(flags):
        config = parse_args(flags.split(), world_size=world_size)
        result = pretrain(config, float64_model, pretrain_gpt.datasets_provider,
                          pretrain_gpt.forward_step, checkpointing=Checkpointer(
                              config, log=lambda _: None), log=lambda _: None)
        params = {name: value.numpy().copy() for chunk in result.components.model_chunks
                  for name, value in chunk.state_dict().items()}
        return [(r.losses["lm loss"], r.grad_norm) for r in result.history], params

    straight = run(argv)
    first, _ = run(f"{argv} --save {save_dir} --exit-interval 2")
    second, params = run(f"{argv} --load {save_dir} --save {save_dir}")
    return straight, first + second, params


@pytest.mark.parametrize("layout", ["", "--pipeline-model-parallel-size 2 --pipeline-schedule "
                                        "chimera", "--untie-embeddings-and-output-weights"
                                    + DECOUPLED], ids=["dp2", "chimera-pp2", "dp2-decoupled-lr"])
def test_resume_with_sharded_optimizer_state_is_bitwise(layout, tmp_path):
    argv = f"{RESUME} {layout} --use-distributed-optimizer"
    results = run_distributed(_run_with_checkpoints, 2, argv, str(tmp_path / "ckpt"),
                              timeout=240)
    for (straight_records, straight_params), resumed_records, resumed_params in results:
        assert resumed_records == straight_records
        for name, value in straight_params.items():
            assert (resumed_params[name] == value).all(), name
    shards = sorted(path.name for path in (tmp_path / "ckpt").rglob("distrib_optim_dp*.pt"))
    assert shards  # every rank wrote its own optimizer shard


def _load(rank, world_size, argv, save_dir):
    from megatron.training.checkpointing import Checkpointer
    config = parse_args(f"{argv} --load {save_dir}".split(), world_size=world_size)
    pretrain(config, float64_model, pretrain_gpt.datasets_provider, pretrain_gpt.forward_step,
             checkpointing=Checkpointer(config, log=lambda _: None), log=lambda _: None)


def test_sharded_checkpoint_refuses_a_replicated_optimizer_with_the_fix(tmp_path):
    argv = f"{RESUME} --use-distributed-optimizer"
    run_distributed(_run_with_checkpoints, 2, argv, str(tmp_path / "ckpt"), timeout=240)
    with pytest.raises(AssertionError, match="--no-load-optim"):
        run_distributed(_load, 2, RESUME, str(tmp_path / "ckpt"), timeout=240)
    run_distributed(_load, 2, RESUME + " --no-load-optim", str(tmp_path / "ckpt"), timeout=240)


def _checkpointed_run(flags: str, world_size: int):
    """One run with a Checkpointer: its (loss, grad norm) records and its full parameters."""
    from megatron.training.checkpointing import Checkpointer
    config = parse_args(flags.split(), world_size=world_size)
    state = ParallelState.single_process() if world_size == 1 else None
    result = pretrain(config, float64_model, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=state,
                      checkpointing=Checkpointer(config, log=lambda _: None), log=lambda _: None)
    components = result.components
    params = {name: value.numpy().copy() for chunk in components.model_chunks
              for name, value in gather_full_state(chunk, components.parallel_state).items()}
    return [(r.losses["lm loss"], r.grad_norm) for r in result.history], params


def _straight_and_saved(rank, world_size, argv, save_dir):
    """The uninterrupted run, and the same run saved at iteration 2 (exit there)."""
    straight = _checkpointed_run(argv, world_size)
    _checkpointed_run(f"{argv} --save {save_dir} --exit-interval 2", world_size)
    return straight


def _resume_only(rank, world_size, argv, save_dir):
    return _checkpointed_run(f"{argv} --load {save_dir}", world_size)


@pytest.mark.parametrize("layout,saved_world,resumed_world", [
    ("", 2, 1),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 4, 2),
    ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera", 2, 4)],
    ids=["dp2-to-dp1", "chimera-pp2xdp2-to-dp1", "chimera-pp2-to-pp2xdp2"])
def test_sharded_optimizer_state_resumes_at_another_data_parallel_size(
        layout, saved_world, resumed_world, tmp_path):
    """Saved at iteration 2 with W replicas per stage, resumed with another W: iterations 3-4
    match the uninterrupted run (1e-9, float64: only the summation order of the gradient
    reduction differs), so the optimizer state was cut into the new shards exactly."""
    argv = f"{RESUME} {layout} --use-distributed-optimizer"
    save_dir = str(tmp_path / "ckpt")
    straight_records, straight_params = run_distributed(_straight_and_saved, saved_world, argv,
                                                        save_dir, timeout=240)[0]
    resumed = (run_distributed(_resume_only, resumed_world, argv, save_dir, timeout=240)
               if resumed_world > 1 else [_resume_only(0, 1, argv, save_dir)])
    for records, params in resumed:
        for (loss, norm), (ref_loss, ref_norm) in zip(records, straight_records[2:]):
            _close(loss, ref_loss, "loss after resume")
            _close(norm, ref_norm, "grad norm after resume")
        assert len(records) == 2
        for name, value in straight_params.items():
            scale = abs(value).max() + 1e-12
            assert abs(params[name] - value).max() / scale < 1e-9, name


def _train_overlapped(rank, world_size, argv):
    """Train; record, after every optimizer step, how many parameter gathers were still in flight
    and whether they had all finished by the time the next forward pass ran."""
    from megatron.core.optimizer.distributed import DistributedOptimizer
    in_flight_after_step, settled_at_forward = [], []
    original_after_update = DistributedOptimizer.after_update

    def after_update(self):
        original_after_update(self)
        in_flight_after_step.append(len(self.pending_gathers))
        if not getattr(self, "_probe_attached", False):
            self._probe_attached = True
            for chunk in self._probe_chunks:
                ids = {id(p) for p in chunk.parameters()}
                own = {index for index, reducer in enumerate(self.sharded_reducers)
                       if any(id(p) in ids for p in reducer.params)}
                # Registered after the optimizer's own wait hook, so it runs after it: the
                # chunk's own gathers are done (another chunk's may still be in flight).
                chunk.register_forward_pre_hook(
                    lambda module, args, own=own: settled_at_forward.append(
                        not own & set(self.pending_gathers)))

    DistributedOptimizer.after_update = after_update
    try:
        config = parse_args(argv.split(), world_size=world_size)
        original_init = DistributedOptimizer.__init__

        def init(self, *args, model_chunks=(), **kwargs):
            original_init(self, *args, model_chunks=model_chunks, **kwargs)
            self._probe_chunks = list(model_chunks)

        DistributedOptimizer.__init__ = init
        result = pretrain(config, float64_model, pretrain_gpt.datasets_provider,
                          pretrain_gpt.forward_step, log=lambda _: None)
    finally:
        DistributedOptimizer.after_update = original_after_update
        DistributedOptimizer.__init__ = original_init
    params = {name: value.numpy() for chunk in result.components.model_chunks
              for name, value in gather_full_state(chunk, result.components.parallel_state).items()}
    return ([r.losses["lm loss"] for r in result.history], params, in_flight_after_step,
            settled_at_forward)


@pytest.mark.parametrize("layout", ["", "--pipeline-model-parallel-size 2 --pipeline-schedule "
                                        "chimera"], ids=["dp2", "chimera-pp2"])
def test_overlap_param_gather_defers_the_gather_to_the_next_forward_and_trains_the_same(layout):
    argv = f"{TINY} {layout} --use-distributed-optimizer"
    waited = run_distributed(_train_overlapped, 2, argv, timeout=240)
    overlapped = run_distributed(_train_overlapped, 2, argv + " --overlap-param-gather",
                                 timeout=240)
    for (losses, params, in_flight, settled), (ref_losses, ref_params, ref_in_flight, _) in zip(
            overlapped, waited):
        assert losses == ref_losses  # bitwise: the same gathers, only waited for later
        for name, value in params.items():
            assert (value == ref_params[name]).all(), name
        assert ref_in_flight == [0, 0, 0]          # without the flag: waited inside the step
        assert in_flight == [1 if not layout else in_flight[0]] * 3 and in_flight[0] >= 1
        assert settled and all(settled)            # every forward ran on the gathered weights


def test_overlap_param_gather_needs_the_distributed_optimizer():
    with pytest.raises(ValueError, match="add --use-distributed-optimizer"):
        parse_args(f"{TINY} --overlap-param-gather".split(), world_size=2)
    config = parse_args(f"{TINY} --overlap-param-gather --use-distributed-optimizer".split(),
                        world_size=2)
    assert config.parallel.overlap_param_gather
