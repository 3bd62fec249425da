"""Checkpoint layout conversion in one process: Chimera / TP x PP / single-process checkpoints are
merged to full weights, written in another layout, loaded there by the Checkpointer, and give the
same weights (exactly) and the same loss; diverged replicas and broken checkpoints are refused."""

import dataclasses
import json
import os
import types

import pytest
import torch

import pretrain_gpt
from megatron.core.parallel_state import ParallelState, RankCoords, RankLayout
from megatron.core.pipeline_parallel.execution.model_chunks import build_model_chunks
from megatron.core.pipeline_parallel.planning.plan import layout_from_config as layout_for
from megatron.core.tensor_parallel.utils import shard_of
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_conversion import (
    ConversionError, TargetLayout, convert_checkpoint, merge_full_state, read_checkpoint)
from megatron.training.checkpointing import (
    CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION, METADATA_FILENAME, Checkpointer,
    capture_rng_state, checkpoint_file, file_crc32, iteration_dir_name, model_keys,
    parallel_layout, rank_dir_name, read_tracker, write_tracker)
from megatron.training.training import TrainingState, pretrain

torch.set_num_threads(1)

# 4 layers: splits over 1, 2 and 4 stages. The vocabulary pads to 64 for TP 1 and TP 2 alike.
TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 60 --make-vocab-size-divisible-by 32 "
        "--mock-data --seed 1234 --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 "
        "--train-iters 3 --log-interval 1")
CPU = torch.device("cpu")
ITERATION, CONSUMED = 7, (28, 4)


def _config(tp=1, pp=1, schedule=None, extra=""):
    flags = f"{TINY} --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} {extra}"
    if schedule:
        flags += f" --pipeline-schedule {schedule}"
    return parse_args(flags.split(), world_size=tp * pp)


def _rank_state(config, tp_rank, pp_rank):
    parallel = config.parallel
    layout = RankLayout(parallel.tensor_model_parallel_size, 1,
                        parallel.pipeline_model_parallel_size)
    return ParallelState(layout=layout, rank=layout.rank(RankCoords(tp=tp_rank, dp=0, pp=pp_rank)))


def _rank_chunks(config, tp_rank, pp_rank):
    """The chunks (and their (pipeline, stage) keys) of one rank, built as training builds them."""
    return build_model_chunks(pretrain_gpt.model_provider, config,
                              _rank_state(config, tp_rank, pp_rank), layout_for(config), CPU)


def _random_full_weights(config):
    """Full weights that are not the initial values (a conversion that re-initialised would show)."""
    model = pretrain_gpt.model_provider(config, ParallelState.single_process())
    generator = torch.Generator().manual_seed(99)
    return {name: torch.randn(value.shape, generator=generator)
            for name, value in model.state_dict().items()}


def _load_shards(chunk, full):
    """Set every parameter of ``chunk`` to its TP block of ``full`` (using the chunk's own
    tensor-parallel attributes, independently of the converter)."""
    tp_size = chunk.parallel_state.tp_size
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            value = full[name]
            if param.tensor_model_parallel:
                value = shard_of(value, param.partition_dim, chunk.parallel_state.tp_rank, tp_size)
            param.copy_(value)


def _write_source(root, config, full, tamper=None):
    """A training checkpoint of ``config``'s layout holding ``full``, in the Checkpointer's format
    (one file per (tp, pp) position, metadata with CRCs, tracker). ``tamper(tp, pp, key, state)``
    may edit a chunk's state before it is written."""
    parallel = config.parallel
    tp_size, pp_size = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    staging = os.path.join(root, iteration_dir_name(ITERATION))
    files, layout = {}, None
    for tp_rank in range(tp_size):
        for pp_rank in range(pp_size):
            chunks, _ = _rank_chunks(config, tp_rank, pp_rank)
            layout = parallel_layout(config, len(chunks))
            payload = {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_FORMAT_VERSION,
                       "iteration": ITERATION, "consumed_train_samples": CONSUMED[0],
                       "consumed_valid_samples": CONSUMED[1], "layout": layout,
                       "data_parallel_size": 1, "config": dataclasses.asdict(config),
                       "optimizer": {}, "opt_param_scheduler": {},
                       "rng_state": [capture_rng_state()]}
            for key, chunk in zip(model_keys(len(chunks)), chunks):
                _load_shards(chunk, full)
                state = chunk.state_dict()
                if tamper:
                    tamper(tp_rank, pp_rank, key, state)
                payload[key] = state
            relative = os.path.join(rank_dir_name(tp_rank, pp_rank, pp_size), "model_optim_rng.pt")
            path = os.path.join(staging, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(payload, path)
            files[relative] = {"size": os.path.getsize(path), "crc32": file_crc32(path)}
    with open(os.path.join(staging, METADATA_FILENAME), "w") as handle:
        json.dump({"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_FORMAT_VERSION,
                   "iteration": ITERATION, "layout": layout, "files": files}, handle)
    write_tracker(str(root), ITERATION)


def _batch(config):
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, config.model.vocab_size, (2, config.model.seq_length + 1),
                           generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(chunks_in_stage_order, config):
    tokens, labels = _batch(config)
    hidden = tokens
    with torch.no_grad():
        for chunk in chunks_in_stage_order[:-1]:
            hidden = chunk.eval()(hidden)
        return chunks_in_stage_order[-1].eval()(hidden, labels).mean()


def _reference_loss(config, full):
    model = pretrain_gpt.model_provider(config, ParallelState.single_process())
    _load_shards(model, full)
    return _loss([model], config)


def _load_target(root, config, flags="--finetune", model_flags=""):
    """Build every rank of ``config``'s layout (with ``model_flags``) and load ``root`` into it with
    the Checkpointer. Returns ({(pipeline, stage): chunk}, {(tp, pp): chunks}, training states,
    log lines)."""
    parallel = config.parallel
    load_config = _config(parallel.tensor_model_parallel_size,
                          parallel.pipeline_model_parallel_size, parallel.pipeline_schedule,
                          f"--load {root} {flags} {model_flags}")
    modules, by_rank, states, lines = {}, {}, [], []
    for tp_rank in range(parallel.tensor_model_parallel_size):
        for pp_rank in range(parallel.pipeline_model_parallel_size):
            chunks, keys = _rank_chunks(load_config, tp_rank, pp_rank)
            components = types.SimpleNamespace(
                config=load_config, model_chunks=chunks, optimizer=None, lr_scheduler=None,
                parallel_state=_rank_state(load_config, tp_rank, pp_rank))
            states.append(Checkpointer(load_config, log=lines.append).load(components))
            by_rank[(tp_rank, pp_rank)] = chunks
            if tp_rank == 0:
                modules.update({(key.pipeline, key.stage): chunk for key, chunk in zip(keys, chunks)})
    return modules, by_rank, states, lines


def _assert_full_equal(merged, full):
    assert merged.keys() == full.keys()
    for name in full:
        assert torch.equal(merged[name], full[name]), name


# ---- conversions ------------------------------------------------------------------------------

def _written_format(root) -> str:
    """The format of the tracker's iteration in ``root`` ("torch_dist" or "torch")."""
    iteration_dir = os.path.join(str(root), iteration_dir_name(read_tracker(str(root))))
    with open(os.path.join(iteration_dir, METADATA_FILENAME)) as handle:
        return json.load(handle).get("ckpt_format", "torch")


@pytest.mark.parametrize("ckpt_format", [None, "torch"], ids=["default", "torch"])
@pytest.mark.parametrize("source", [(1, 2, "chimera"), (2, 2, "1f1b")],
                         ids=["chimera-pp2", "tp2-pp2-1f1b"])
def test_pipeline_checkpoint_to_single_process(tmp_path, source, ckpt_format):
    config = _config(*source)
    full = _random_full_weights(config)
    _write_source(tmp_path / "src", config, full)
    _assert_full_equal(merge_full_state(read_checkpoint(str(tmp_path / "src"))), full)

    options = {"ckpt_format": ckpt_format} if ckpt_format else {}
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), TargetLayout(), log=print,
                       **options)
    assert read_tracker(str(tmp_path / "dst")) == ITERATION
    # the default is the training default (torch_dist: whole tensors); torch: the layout's files
    assert _written_format(tmp_path / "dst") == (ckpt_format or "torch_dist")
    assert os.path.isfile(checkpoint_file(str(tmp_path / "dst"), ITERATION, 0, 0, 1)) == \
        (ckpt_format == "torch")
    target = _config()
    modules, _, states, lines = _load_target(tmp_path / "dst", target, "--no-load-optim")
    assert states == [TrainingState(ITERATION, *CONSUMED)]
    assert any("weights only" in line for line in lines)
    for name, value in modules[(0, 0)].state_dict().items():
        assert torch.equal(value, full[name]), name
    assert torch.equal(_loss([modules[(0, 0)]], target), _reference_loss(target, full))


def test_llama_style_sequence_parallel_checkpoint_to_single_process(tmp_path):
    """Stacked SwiGLU weights, GQA rows and sequence-parallel runs convert like any other."""
    llama = ("--position-embedding-type rope --swiglu --normalization RMSNorm "
             "--disable-bias-linear --group-query-attention --num-query-groups 2 "
             "--ffn-hidden-size 48 --untie-embeddings-and-output-weights")
    config = _config(2, 2, "chimera", extra=f"{llama} --sequence-parallel")
    full = _random_full_weights(config)
    assert full["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2, 48, 32)
    _write_source(tmp_path / "src", config, full)
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), TargetLayout(), log=print)
    target = _config(extra=llama)
    modules, _, _, _ = _load_target(tmp_path / "dst", target, "--no-load-optim", llama)
    for name, value in modules[(0, 0)].state_dict().items():
        assert torch.equal(value, full[name]), name
    assert torch.equal(_loss([modules[(0, 0)]], target), _reference_loss(target, full))


def test_single_process_training_checkpoint_to_chimera_pp4(tmp_path):
    # a real training checkpoint (optimizer state, RNG states) written by the Checkpointer
    source = _config(extra=f"--save {tmp_path / 'src'}")
    result = pretrain(source, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      checkpointing=Checkpointer(source, log=lambda _: None), log=lambda _: None)
    full = {name: value.clone() for name, value in result.components.model_chunks[0].state_dict().items()}
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"),
                       TargetLayout(pipeline_model_parallel_size=4, pipeline_schedule="chimera"),
                       log=print)
    target = _config(1, 4, "chimera")
    modules, by_rank, states, _ = _load_target(tmp_path / "dst", target, "--finetune")
    assert states == [TrainingState()] * 4
    assert all(len(chunks) == 2 for chunks in by_rank.values())  # down and up stage per rank
    for chunk in modules.values():
        for name, value in chunk.state_dict().items():
            assert torch.equal(value, full[name]), name
    reference = _reference_loss(_config(), full)
    for pipeline in (0, 1):  # both Chimera pipelines compute the original model
        assert torch.equal(_loss([modules[(pipeline, stage)] for stage in range(4)], target),
                           reference)


def test_single_to_tensor_parallel_and_back(tmp_path):
    source = _config()
    full = _random_full_weights(source)
    _write_source(tmp_path / "src", source, full)
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "tp2"),
                       TargetLayout(tensor_model_parallel_size=2), log=print)
    target = _config(2, 1)
    _, by_rank, _, _ = _load_target(tmp_path / "tp2", target)
    for (tp_rank, _), chunks in by_rank.items():  # each rank holds exactly its blocks
        for name, param in chunks[0].named_parameters():
            expected = full[name]
            if param.tensor_model_parallel:
                expected = shard_of(expected, param.partition_dim, tp_rank, 2)
                assert param.shape != full[name].shape
            assert torch.equal(param.detach(), expected), (tp_rank, name)
    convert_checkpoint(str(tmp_path / "tp2"), str(tmp_path / "back"), TargetLayout(), log=print)
    _assert_full_equal(merge_full_state(read_checkpoint(str(tmp_path / "back"))), full)


def test_cli_converts_interleaved_checkpoint(tmp_path):
    from tools.convert_checkpoint import main
    config = _config(1, 2, extra="--num-layers-per-virtual-pipeline-stage 1")
    full = _random_full_weights(config)
    _write_source(tmp_path / "src", config, full)
    target = ["--iteration", str(ITERATION), "--tensor-model-parallel-size", "2",
              "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]
    assert main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst"), *target]) == 0
    assert _written_format(tmp_path / "dst") == "torch_dist"  # the CLI's default too
    _assert_full_equal(merge_full_state(read_checkpoint(str(tmp_path / "dst"))), full)
    assert main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst")]) == 1  # exists
    assert main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "files"), *target,
                 "--ckpt-format", "torch"]) == 0
    assert _written_format(tmp_path / "files") == "torch"
    for tp_rank in range(2):  # TP 2 x Chimera PP 2: every position's file
        for pp_rank in range(2):
            assert os.path.isfile(checkpoint_file(str(tmp_path / "files"), ITERATION, tp_rank,
                                                  pp_rank, 2))
    _assert_full_equal(merge_full_state(read_checkpoint(str(tmp_path / "files"))), full)


def test_uneven_stages_convert_and_load_in_another_split(tmp_path):
    """Chimera PP2 with stages [1, 3] converts (CLI, uneven target flags) to 1F1B PP2 with
    stages [3, 1]: every rank holds exactly its layers, with the source's weights and loss; the
    source loaded directly with even stages gets the same weights (through the global keys)."""
    from tools.convert_checkpoint import main
    config = _config(1, 2, "chimera", extra="--decoder-first-pipeline-num-layers 1")
    full = _random_full_weights(config)
    _write_source(tmp_path / "src", config, full)
    _assert_full_equal(merge_full_state(read_checkpoint(str(tmp_path / "src"))), full)
    assert main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "dst"),
                 "--pipeline-model-parallel-size", "2", "--ckpt-format", "torch",
                 "--decoder-last-pipeline-num-layers", "1"]) == 0
    last_one = "--decoder-last-pipeline-num-layers 1"
    target = _config(1, 2, extra=last_one)
    modules, by_rank, _, _ = _load_target(tmp_path / "dst", target, f"--finetune {last_one}")
    layers = [{name.split(".")[2] for name in chunks[0].state_dict() if ".layers." in name}
              for _, chunks in sorted(by_rank.items())]
    assert layers == [{"0", "1", "2"}, {"3"}]
    for chunk in modules.values():
        for name, value in chunk.state_dict().items():
            assert torch.equal(value, full[name]), name
    assert torch.allclose(_loss([modules[(0, 0)], modules[(0, 1)]], target),
                          _reference_loss(_config(), full), rtol=1e-6)
    # loaded directly with even stages (another layout): read through the global keys
    modules, _, _, lines = _load_target(tmp_path / "src", _config(1, 2, "chimera"))
    assert any("resharding from [TP=1, PP=2, schedule=chimera (2 pipelines), 2 model chunks per "
               "rank, layers per stage [1, 3]]" in line for line in lines), lines
    for chunk in modules.values():
        for name, value in chunk.state_dict().items():
            assert torch.equal(value, full[name]), name


# ---- errors -----------------------------------------------------------------------------------

def _diverge(parameter, pp_rank, key):
    def tamper(_, rank, chunk_key, state):
        if rank == pp_rank and chunk_key == key and parameter in state:
            state[parameter] = state[parameter] + 1e-6
    return tamper


@pytest.mark.parametrize("case", [
    ((1, 2, "chimera"), "decoder.layers.0.mlp.linear_fc1.weight", 1, "model1"),  # stage replica
    ((2, 2, "1f1b"), "embedding.word_embeddings.weight", 1, "model"),  # tied embedding copy
    ((2, 1, None), "decoder.final_layernorm.weight", 0, "model"),  # replicated over TP (rank 0)
], ids=["chimera-replica", "tied-embedding-copy", "tp-replicated"])
def test_inconsistent_replicas_raise_naming_the_parameter(tmp_path, case):
    layout, parameter, pp_rank, key = case
    config = _config(*layout)
    tamper = _diverge(parameter, pp_rank, key)
    if layout[0] == 2 and layout[1] == 1:  # only TP rank 1 differs
        inner = tamper
        tamper = lambda tp, pp, k, state: inner(tp, pp, k, state) if tp == 1 else None  # noqa: E731
    _write_source(tmp_path / "src", config, _random_full_weights(config), tamper)
    with pytest.raises(ConversionError, match=parameter.replace(".", r"\.")):
        convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), TargetLayout(),
                           log=print)
    assert not (tmp_path / "dst").exists()


@pytest.fixture()
def single_checkpoint(tmp_path):
    config = _config()
    _write_source(tmp_path / "src", config, _random_full_weights(config))
    return tmp_path / "src"


def test_missing_iteration_and_corrupt_file_are_named(single_checkpoint, tmp_path):
    with pytest.raises(ConversionError, match="iteration 3 does not exist.*iter_0000007"):
        convert_checkpoint(str(single_checkpoint), str(tmp_path / "dst"), TargetLayout(),
                           iteration=3, log=print)
    with pytest.raises(ConversionError, match="no latest_checkpointed_iteration"):
        convert_checkpoint(str(tmp_path / "nothing"), str(tmp_path / "dst"), TargetLayout(),
                           log=print)
    path = checkpoint_file(str(single_checkpoint), ITERATION, 0, 0, 1)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ConversionError, match="CRC-32"):
        convert_checkpoint(str(single_checkpoint), str(tmp_path / "dst"), TargetLayout(),
                           log=print)


def test_invalid_target_layouts_are_refused(single_checkpoint, tmp_path):
    with pytest.raises(ConversionError, match="not valid for the source run"):  # 4 layers, PP 3
        convert_checkpoint(str(single_checkpoint), str(tmp_path / "dst"),
                           TargetLayout(pipeline_model_parallel_size=3), log=print)
    # the default padding (128 x TP) gives another embedding shape for TP 2
    config = _config(extra="--make-vocab-size-divisible-by 128")
    _write_source(tmp_path / "wide", config, _random_full_weights(config))
    with pytest.raises(ConversionError, match="padded vocabulary differs"):
        convert_checkpoint(str(tmp_path / "wide"), str(tmp_path / "dst"),
                           TargetLayout(tensor_model_parallel_size=2), log=print)


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_weights_only_checkpoint_needs_finetune_or_no_load_optim(single_checkpoint, tmp_path,
                                                                  ckpt_format):
    convert_checkpoint(str(single_checkpoint), str(tmp_path / "dst"),
                       TargetLayout(pipeline_model_parallel_size=2), log=print,
                       ckpt_format=ckpt_format)
    with pytest.raises(RuntimeError, match="weights only.*--finetune or --no-load-optim"):
        _load_target(tmp_path / "dst", _config(1, 2), flags="")
