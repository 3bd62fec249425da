"""Tier 0: Megatron flags generated from the config — golden flag set, round trips, real launch
scripts, ignored and unsupported flags, --help groups, and docs/flags.md in sync."""

import dataclasses
import logging
import os
import pathlib

import pytest

from megatron.core.config import MegatronConfig
from megatron.training import arguments
from megatron.training.config_validation import ConfigurationError
from megatron.training.arguments import (COMPATIBILITY_FLAGS, accepted_flags, config_fields,
                                         config_to_argv, flags_markdown, format_arguments,
                                         parse_args, parse_args_unvalidated)

REPO = pathlib.Path(__file__).resolve().parents[2]

GPT_345M_SCRIPT = """
--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
--max-position-embeddings 1024 --tensor-model-parallel-size 2 --micro-batch-size 4
--global-batch-size 16 --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01
--clip-grad 1.0 --fp16 --split 949,50,1 --data-path my-gpt2_text_document
--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --data-impl mmap --log-interval 100
--save-interval 10000 --eval-interval 1000 --eval-iters 10 --distributed-backend nccl
--save ckpt --load ckpt
""".split()

TINY = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --train-iters 5 --mock-data").split()


def test_golden_flag_set():
    golden = (REPO / "tests/golden/flags.txt").read_text().split()
    current = accepted_flags()
    added, removed = sorted(set(current) - set(golden)), sorted(set(golden) - set(current))
    assert current == sorted(golden), (
        f"the accepted flag set changed (added {added}, removed {removed}); if intended, update "
        f"tests/golden/flags.txt and docs/flags.md")


def test_flags_follow_field_names_and_skip_derived():
    flags = set(accepted_flags())
    for spec in config_fields():
        flag = "--" + spec.name.replace("_", "-")
        if spec.derived:
            assert flag not in flags, f"derived field {spec.name} must not be a flag"
        else:
            assert flag in flags
    names = [spec.name for spec in config_fields()]
    assert len(names) == len(set(names)), "config field names must be unique across sections"


def test_345m_launch_script_parses_with_megatron_semantics():
    config = parse_args(GPT_345M_SCRIPT, world_size=2)
    assert config.parallel.tensor_model_parallel_size == 2
    assert config.parallel.data_parallel_size == 1
    assert config.parallel.pipeline_schedule == "1f1b"
    assert config.training.fp16 and not config.training.bf16
    assert config.training.num_microbatches == 4
    assert config.model.ffn_hidden_size == 4096
    assert config.optimizer.lr == 0.00015 and config.optimizer.min_lr == 1.0e-5
    assert config.optimizer.lr_warmup_fraction == 0.01
    assert config.optimizer.lr_decay_iters == 320000
    assert config.data.tokenizer_type == "GPT2BPETokenizer"  # inferred from vocab + merge files
    assert config.data.data_path == ["my-gpt2_text_document"]
    assert config.data.split == "949,50,1"
    assert config.model.padded_vocab_size is None  # known once the tokenizer has been built


ISSUE_COMMANDS = [
    # (argv, world size, schedule, data-parallel size, micro-batches per iteration)
    ("--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
     "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 "
     "--lr 1e-3 --train-iters 5 --log-interval 1 --mock-data --seed 1234", 2, "1f1b", 1, 4),
    ("--tensor-model-parallel-size 1 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
     "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 "
     "--lr 1e-3 --train-iters 5 --log-interval 1 --mock-data --seed 1234", 2, "1f1b", 2, 2),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera --num-layers 8 --hidden-size 64 "
     "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 "
     "--global-batch-size 16 --lr 1e-3 --train-iters 5 --log-interval 1 --mock-data --seed 1234",
     4, "chimera", 1, 8),
    ("--pipeline-model-parallel-size 4 --pipeline-schedule 1f1b --num-layers 8 --hidden-size 64 "
     "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 "
     "--global-batch-size 16 --lr 1e-3 --train-iters 5 --log-interval 1 --mock-data --seed 1234",
     4, "1f1b", 1, 8),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule chimera "
     "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
     "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 "
     "--train-iters 5 --log-interval 1 --mock-data --seed 1234", 4, "chimera", 1, 8),
]


@pytest.mark.parametrize("command,world_size,schedule,data_parallel,microbatches", ISSUE_COMMANDS)
def test_issue_demo_commands_parse(command, world_size, schedule, data_parallel, microbatches):
    config = parse_args(command.split(), world_size=world_size)
    assert config.parallel.pipeline_schedule == schedule
    assert config.parallel.data_parallel_size == data_parallel
    assert config.training.num_microbatches == microbatches
    assert config.model.padded_vocab_size == 1024 and config.training.seed == 1234


def test_round_trip_of_realistic_configs():
    command_lines = [
        (GPT_345M_SCRIPT, 2),
        (TINY, 1),
        (TINY + "--pipeline-model-parallel-size 4 --pipeline-schedule chimera".split(), 8),
        (TINY + "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
                "--tensor-model-parallel-size 2".split(), 4),
        ([arg for arg in TINY if arg not in ("--train-iters", "5")] + ["--train-samples", "100"],
         2),
        (TINY + "--checkpoint-activations --bf16 --vocab-size 300 --seed 7".split(), 1),
        (TINY[:-1] + "--data-path 0.3 a_text 0.7 b_text --tokenizer-type SentencePieceTokenizer "
                     "--tokenizer-model spm.model --local_rank 3".split(), 1),
    ]
    for argv, world_size in command_lines:
        config = parse_args(argv, world_size=world_size)
        again = parse_args(config_to_argv(config), world_size=world_size)
        assert again == config, f"round trip changed the config of {' '.join(argv)}"
        assert config_to_argv(again) == config_to_argv(config)


def _non_default_value(spec):
    """A value different from the field's default, of the field's type."""
    choices = spec.field.metadata.get("choices")
    default = spec.default()
    if choices:
        # A field with a single choice (--data-impl mmap) can only keep its default.
        return next((choice for choice in choices if choice != default), default)
    if spec.value_type is bool:
        return True
    if spec.value_type is list:
        return [spec.element_type(7), spec.element_type(9)]
    if spec.value_type is int:
        return (default or 0) + 3
    if spec.value_type is float:
        return (default or 0.0) + 0.125
    return f"{spec.name}-value"


def test_every_field_survives_flags_round_trip():
    """Unvalidated round trip with every non-derived field at a non-default value."""
    config = MegatronConfig()
    for spec in config_fields():
        if not spec.derived:
            setattr(getattr(config, spec.section), spec.name, _non_default_value(spec))
    parsed, _ = parse_args_unvalidated(config_to_argv(config))
    assert parsed == config


def test_legacy_spellings():
    local = parse_args(TINY + ["--local_rank", "1"], world_size=1)
    assert local.parallel.local_rank == 1
    assert parse_args(TINY + ["--local-rank", "2"], world_size=1).parallel.local_rank == 2

    checkpointed = parse_args(TINY + ["--checkpoint-activations"], world_size=1).recompute
    assert (checkpointed.recompute_granularity, checkpointed.recompute_method,
            checkpointed.recompute_num_layers) == ("full", "uniform", 1)
    assert not checkpointed.checkpoint_activations  # normalised to the modern spelling

    selective = parse_args(TINY + ["--recompute-activations"], world_size=1).recompute
    assert selective.recompute_granularity == "selective"
    assert parse_args(TINY + ["--data-impl", "mmap"], world_size=1).data.data_impl == "mmap"


def test_abbreviations_are_not_accepted(capsys):
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--tensor-model-parallel", "1"], world_size=1)


def test_unsupported_flag_is_rejected_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TINY + ["--frobnicate-widgets", "--num-layer", "3"], world_size=1)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "unsupported by Megatron-Chimera, 2 problems" in message
    assert "unknown flag --frobnicate-widgets: neither Megatron-LM" in message
    assert "--frobnicate-widgets (did you mean" not in message  # nothing close: no guess
    # A look-alike is not a rename: no guess either (it could be a flag of another meaning).
    assert "unknown flag --num-layer: neither Megatron-LM" in message


def test_every_problem_is_reported_in_one_message(capsys):
    """Unknown flags, unimplemented Megatron flags, unsupported config features and invalid
    combinations: all in one exit, each saying which kind of problem it is."""
    argv = [item for item in TINY if item not in ("--lr", "1e-3")]
    argv += ["--num-experts", "8", "--context-parallel-size", "2",
             "--fp8-format", "hybrid", "--hiden-size", "64", "--fp16", "--bf16"]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=2)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "6 problems" in message, message
    for expected in ("--num-experts is not implemented: mixture of experts",
                     "unknown flag --hiden-size: neither Megatron-LM",
                     "--context-parallel-size is not implemented: context parallelism",
                     "--fp8-format is not implemented: FP8 training",
                     "--fp16 and --bf16 are mutually exclusive", "--lr (peak learning rate) is "
                     "required"):
        assert expected in message, expected


def test_values_outside_the_choices_are_reported_with_the_other_problems(capsys):
    """A Megatron value of a feature we lack says "not implemented" with the reason; any other
    value outside the choices lists them; neither stops the parser before the other problems."""
    argv = TINY + ["--lr-decay-style", "inverse-square-root", "--tokenizer-type",
                   "TikTokenizer", "--dataloader-type", "cyclic", "--timing-log-level",
                   "5", "--num-experts", "8", "--bogus"]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=1)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "6 problems" in message, message
    for expected in ("--lr-decay-style inverse-square-root is not implemented: only constant, "
                     "linear and cosine", "--tokenizer-type TikTokenizer is not "
                     "implemented", "--dataloader-type cyclic is not implemented",
                     "--timing-log-level 5: not a valid choice; choose from 0, 1, 2",
                     "--num-experts is not implemented", "unknown flag --bogus"):
        assert expected in message, expected
    config = parse_args(TINY + ["--lr-decay-style", "linear", "--dataloader-type", "single"],
                        world_size=1)
    assert config.optimizer.lr_decay_style == "linear"


def test_validation_problems_alone_are_one_value_error():
    argv = [item for item in TINY if item not in ("--lr", "1e-3")] + ["--fp16", "--bf16"]
    with pytest.raises(ValueError) as error:
        parse_args(argv, world_size=1)
    assert error.value.problems == [
        "--fp16 and --bf16 are mutually exclusive; choose one",
        "--lr (peak learning rate) is required, e.g. --lr 1.5e-4"]
    assert str(error.value).startswith("2 problems in the flags:")


def test_compatibility_flags_are_logged_as_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.training.arguments"):
        parse_args(TINY + ["--no-masked-softmax-fusion", "--DDP-impl", "local",
                           "--num-workers", "8"], world_size=1)
    ignored = [record.getMessage() for record in caplog.records if "ignored" in record.getMessage()]
    assert len(ignored) == 3
    for flag in ("--no-masked-softmax-fusion", "--DDP-impl", "--num-workers"):
        assert any(message.startswith(flag) for message in ignored), flag


def test_nothing_is_logged_as_ignored_without_such_flags(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.training.arguments"):
        parse_args(GPT_345M_SCRIPT, world_size=2)
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]


def test_every_compatibility_flag_parses_and_is_reported():
    for flag in COMPATIBILITY_FLAGS:
        argv = [flag.flag] + ([flag.choices[0]] if flag.choices else
                              ["7"] if flag.takes_value else
                              ["0", "1"] if flag.takes_list else [])
        _, messages = parse_args_unvalidated(TINY + argv)
        assert len(messages) == 1 and flag.flag in messages[0] and "ignored" in messages[0]


def test_help_has_one_group_per_section(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for section in ("model", "recompute", "parallel", "training", "optimizer", "data",
                    "checkpoint", "logging"):
        assert f"\n{section}:" in text
    assert "Number of transformer layers." in text
    assert "{1f1b,gpipe,interleaved-1f1b,chimera}" in text
    assert "PADDED_VOCAB_SIZE" not in text  # derived: no flag (Megatron's own is rejected)


def test_world_size_defaults_to_launcher_environment(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert parse_args(TINY).parallel.world_size == 1
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # an srun task step
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node1")
    assert parse_args(TINY).parallel.data_parallel_size == 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun inside a SLURM allocation wins
    assert parse_args(TINY).parallel.world_size == 4


def test_arguments_block_matches_megatron_format():
    config = parse_args(TINY, world_size=1)
    lines = format_arguments(config).splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    assert "  num_layers " + "." * (48 - len("num_layers")) + " 8" in lines
    assert "  padded_vocab_size " + "." * (48 - len("padded_vocab_size")) + " 1024" in lines
    names = [line.split()[0] for line in lines[1:-1]]
    assert names == sorted(names, key=str.lower)
    assert len(names) == len(list(config_fields()))


def test_flags_doc_is_in_sync():
    text = (REPO / "docs/flags.md").read_text()
    begin, end = "<!-- BEGIN GENERATED FLAGS -->", "<!-- END GENERATED FLAGS -->"
    assert begin in text and end in text, "docs/flags.md lost its generated-section markers"
    generated = text.split(begin, 1)[1].split(end, 1)[0]
    assert generated.strip() == flags_markdown().strip(), (
        "docs/flags.md is out of date: regenerate the block between the markers with "
        "megatron.training.arguments.flags_markdown()")


def test_the_legacy_rotary_spelling_means_rope():
    legacy = parse_args(TINY + ["--use-rotary-position-embeddings"], world_size=1)
    today = parse_args(TINY + ["--position-embedding-type", "rope"], world_size=1)
    assert legacy == today and legacy.model.position_embedding_type == "rope"
    with pytest.raises(ConfigurationError, match="--use-rotary-position-embeddings means"):
        parse_args(TINY + ["--use-rotary-position-embeddings", "--position-embedding-type",
                           "none"], world_size=1)
