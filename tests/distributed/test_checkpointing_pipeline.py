"""Checkpointing with a pipeline layout on four gloo ranks (PP=2 x DP=2): Chimera ranks hold two
model chunks each, saved as ``model0``/``model1`` in ``mp_rank_00_{pp:03d}``; a fresh set of
components restores them exactly; another pipeline schedule reads them by name (and refuses stage
replicas that differ). The chunks are
built by hand (stage r and stage D-1-r, as Chimera places them), so no pipeline runtime is needed."""

import pytest
import torch

import pretrain_gpt
from dist_harness import run_distributed
from megatron.core.optimizer import build_lr_scheduler, build_optimizer
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer, checkpoint_file, read_tracker
from megatron.training.initialize import initialize_megatron
from megatron.core.runtimes import model_parameters
from megatron.training.training import TrainingComponents, TrainingState

pytestmark = pytest.mark.distributed

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --micro-batch-size 1 "
        "--global-batch-size 8 --lr 1e-3 --train-iters 10 --pipeline-model-parallel-size 2 "
        "--distributed-timeout-minutes 0.5 --ckpt-format torch")  # the legacy layout
CHIMERA = "--pipeline-schedule chimera"


def _components(config, parallel_state, chunks_per_rank: int):
    stages = config.parallel.pipeline_model_parallel_size
    per_stage = config.model.num_layers // stages
    rank = parallel_state.pp_rank
    hosted = [rank, stages - 1 - rank][:chunks_per_rank]  # Chimera: down stage r, up stage D-1-r
    chunks = [pretrain_gpt.model_provider(config, parallel_state, pre_process=stage == 0,
                                          post_process=stage == stages - 1,
                                          layer_range=range(stage * per_stage,
                                                            (stage + 1) * per_stage))
              for stage in hosted]
    optimizer = build_optimizer(config, model_parameters(chunks), parallel_state)
    scheduler = build_lr_scheduler(optimizer.optimizer, config.optimizer, config.training)
    return TrainingComponents(config=config, parallel_state=parallel_state, runtime=None,
                              device=torch.device("cpu"), model_chunks=chunks,
                              gradient_reducers=[], optimizer=optimizer, lr_scheduler=scheduler,
                              autocast=None)


def _snapshot(components) -> dict:
    """Weights and Adam moments as numpy arrays (picklable across the harness pipe)."""
    weights = {f"{index}.{name}": value.numpy().copy()
               for index, chunk in enumerate(components.model_chunks)
               for name, value in chunk.state_dict().items()}
    moments = [components.optimizer.optimizer.state[param]["exp_avg"].numpy().copy()
               for param in components.optimizer.params]
    return {"weights": weights, "moments": moments,
            "num_steps": components.lr_scheduler.num_steps}


def _save_then_load(rank, world_size, save_dir):
    config = parse_args(f"{TINY} {CHIMERA} --save {save_dir} --load {save_dir}".split(),
                        world_size=world_size)
    parallel_state = initialize_megatron(config, env={})
    saved = _components(config, parallel_state, chunks_per_rank=2)
    generator = torch.Generator().manual_seed(rank)  # replicas diverge: only DP rank 0's is saved
    for param in saved.optimizer.params:
        param.grad = torch.randn(param.shape, generator=generator)
    saved.optimizer.optimizer.step()
    saved.lr_scheduler.step(8)
    Checkpointer(config, log=lambda _: None).save(
        saved, TrainingState(iteration=7, consumed_train_samples=56, consumed_valid_samples=0))

    fresh = _components(config, parallel_state, chunks_per_rank=2)
    state = Checkpointer(config, log=lambda _: None).load(fresh)
    assert state == TrainingState(iteration=7, consumed_train_samples=56)
    payload_keys = sorted(torch.load(
        checkpoint_file(save_dir, 7, 0, parallel_state.pp_rank, 2), weights_only=True))
    return parallel_state.dp_rank, _snapshot(saved), _snapshot(fresh), payload_keys


def test_chimera_ranks_save_and_restore_both_chunks(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_save_then_load, 4, save_dir, timeout=120)
    assert read_tracker(save_dir) == 7
    files = sorted(str(p.relative_to(tmp_path / "ckpt" / "iter_0000007"))
                   for p in (tmp_path / "ckpt" / "iter_0000007").rglob("*.pt"))
    assert files == ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"]
    # ranks 0, 1 are pipeline rank 0 (DP 0, 1); ranks 2, 3 pipeline rank 1
    for rank, (dp_rank, _saved, fresh, payload_keys) in enumerate(results):
        assert {"model0", "model1"} <= set(payload_keys) and "model" not in payload_keys
        writer = results[rank - dp_rank][1]  # DP rank 0 of this pipeline rank wrote the file
        assert fresh["weights"].keys() == writer["weights"].keys()
        for name, value in writer["weights"].items():
            assert (fresh["weights"][name] == value).all(), (rank, name)
        for loaded, reference in zip(fresh["moments"], writer["moments"]):
            assert (loaded == reference).all()
        assert fresh["num_steps"] == 8
    # the chunk names are the full model's: pipeline rank 1 holds stage 1 first, then stage 0
    assert any(name.startswith("0.decoder.layers.2.") for name in results[2][2]["weights"])
    assert any(name.startswith("1.decoder.layers.0.") for name in results[2][2]["weights"])


def _load_with_another_schedule(rank, world_size, save_dir):
    config = parse_args(f"{TINY} --load {save_dir}".split(), world_size=world_size)  # 1f1b
    parallel_state = initialize_megatron(config, env={})
    try:
        Checkpointer(config, log=lambda _: None).load(
            _components(config, parallel_state, chunks_per_rank=1))
    except RuntimeError as error:
        return str(error)
    return None


def test_another_pipeline_schedule_refuses_diverged_stage_replicas_naming_them(tmp_path):
    """1F1B reads the Chimera checkpoint by parameter name (another layout); the two replicas of
    each stage were stepped apart here (different gradients per rank), so which copy to take is
    ambiguous: refused with the fix (in-sync replicas resume exactly:
    test_checkpointing_reshard.py)."""
    save_dir = str(tmp_path / "ckpt")
    run_distributed(_save_then_load, 4, save_dir, timeout=120)
    for message in run_distributed(_load_with_another_schedule, 4, save_dir, timeout=120):
        assert message is not None
        assert "differs between its copies" in message
        assert "resume in the saved layout" in message
