"""Tier 0: cross-flag validation before any process group — each bad combination gives its own
message, derived fields are filled as Megatron does, and the pipeline-schedule flags of issue 4."""

import dataclasses
import sys
import types

import pytest

from megatron.core.config import ModelConfig
from megatron.training.arguments import parse_args
from megatron.training.config_validation import DEFAULT_MOCK_VOCAB_SIZE, pad_vocab_size, \
    set_padded_vocab_size

TINY = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --train-iters 5 --mock-data").split()


def without(argv, *flags_with_values):
    """argv minus the given flags and the value following each."""
    result, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in flags_with_values:
            skip = item != "--mock-data"
        else:
            result.append(item)
    return result


def replaced(argv, flag, value):
    return without(argv, flag) + [flag, value]


BAD_COMBINATIONS = [
    # (argv, world size, words the message must contain)
    (replaced(TINY, "--tensor-model-parallel-size", "2"), 3,
     ["world size 3", "tensor-model-parallel-size 2", "launch a multiple of 2"]),
    (TINY + "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2".split(), 6,
     ["world size 6", "= 4"]),
    (replaced(TINY, "--tensor-model-parallel-size", "8"), 8,
     ["--num-attention-heads 4", "not divisible by", "--tensor-model-parallel-size 8"]),
    (replaced(TINY, "--num-attention-heads", "5") + ["--hidden-size", "64"], 1,
     ["--hidden-size 64", "--num-attention-heads 5"]),
    (TINY + ["--max-position-embeddings", "32"], 1,
     ["--max-position-embeddings 32", "--seq-length 64"]),
    (replaced(TINY, "--global-batch-size", "10"), 2,
     ["--global-batch-size 10", "--micro-batch-size 2", "data-parallel size 2", "multiple of 4"]),
    (without(TINY, "--train-iters"), 1, ["--train-iters", "--train-samples"]),
    (without(TINY, "--train-iters") + ["--train-samples", "8"], 1, ["smaller than one global"]),
    (TINY + ["--train-samples", "160"], 1, ["disagree", "give only one"]),
    (TINY + ["--fp16", "--bf16"], 1, ["--fp16 and --bf16"]),
    (without(TINY, "--lr"), 1, ["--lr", "required"]),
    (TINY + ["--min-lr", "0.1"], 1, ["--min-lr"]),
    (TINY + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], 1,
     ["only one of --lr-warmup-fraction and --lr-warmup-iters"]),
    (TINY + ["--lr-warmup-iters", "50"], 1, ["--lr-warmup-iters 50", "--lr-decay-iters 5"]),
    (TINY + ["--lr-warmup-fraction", "1.5"], 1, ["--lr-warmup-fraction 1.5"]),
    (without(TINY, "--num-layers"), 1, ["--num-layers is required"]),
    (replaced(TINY, "--num-layers", "6") + ["--pipeline-model-parallel-size", "4"], 4,
     ["--num-layers 6", "--pipeline-model-parallel-size 4"]),
    (TINY + ["--pipeline-model-parallel-size", "2",
             "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     ["--num-layers 8", "x --num-layers-per-virtual-pipeline-stage 3"]),
    (TINY + ["--num-layers-per-virtual-pipeline-stage", "2", "--pipeline-schedule", "chimera",
             "--pipeline-model-parallel-size", "2"], 2,
     ["selects the interleaved-1f1b schedule", "conflicts with --pipeline-schedule chimera"]),
    (TINY + ["--pipeline-schedule", "interleaved-1f1b", "--pipeline-model-parallel-size", "2"], 2,
     ["needs --num-layers-per-virtual-pipeline-stage"]),
    (TINY + ["--num-layers-per-virtual-pipeline-stage", "2"], 1,
     ["interleaved-1f1b schedule needs --pipeline-model-parallel-size >= 2"]),
    (replaced(TINY, "--num-layers", "6") + "--pipeline-model-parallel-size 3 "
                                           "--pipeline-schedule chimera".split(), 3,
     ["Chimera needs an even pipeline depth", "--pipeline-model-parallel-size 3"]),
    (TINY + "--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
            "--chimera-pipelines 3".split(), 4, ["--chimera-pipelines 3", "even"]),
    (TINY + "--pipeline-model-parallel-size 4 --pipeline-schedule chimera "
            "--chimera-pipelines 6".split(), 4, ["f = 3", "D/2 = 2"]),
    (replaced(TINY, "--micro-batch-size", "1") + "--pipeline-model-parallel-size 2 "
     "--pipeline-schedule chimera --chimera-variant backward-halving".split(), 2,
     ["backward-halving", "even --micro-batch-size"]),
    (TINY + "--pipeline-model-parallel-size 2 --chimera-variant forward-doubling".split(), 2,
     ["--chimera-variant only applies to --pipeline-schedule chimera"]),
    (TINY + ["--chimera-grad-sync", "end"], 1, ["--chimera-grad-sync only applies"]),
    (without(TINY, "--mock-data"), 1, ["no data source given", "--mock-data or --data-path"]),
    (TINY + ["--data-path", "prefix", "--vocab-file", "v", "--merge-file", "m"], 1,
     ["--mock-data and --data-path are both given"]),
    (without(TINY, "--mock-data") + ["--data-path", "prefix"], 1,
     ["--data-path needs a tokenizer"]),
    (without(TINY, "--mock-data") + ["--data-path", "prefix", "--vocab-file", "v"], 1,
     ["needs both --vocab-file and --merge-file"]),
    (without(TINY, "--mock-data") + ["--data-path", "0.5", "a", "b", "--vocab-file", "v",
                                     "--merge-file", "m"], 1, ["weight-prefix pairs"]),
    (without(TINY, "--mock-data") + ["--data-path", "heavy", "a", "0.5", "b", "--vocab-file", "v",
                                     "--merge-file", "m"], 1, ["weight 'heavy'"]),
    (without(TINY, "--mock-data") + ["--data-path", '0', "a", '0', "b", "--vocab-file", "v",
                                     "--merge-file", "m"], 1, ['are all zero']),
    (without(TINY, "--mock-data") + ["--data-path", 'nan', "a", '1', "b", "--vocab-file", "v",
                                     "--merge-file", "m"], 1, ["weight 'nan' is not a finite number >= 0"]),
    (without(TINY, "--mock-data") + ["--data-path", 'inf', "a", '1', "b", "--vocab-file", "v",
                                     "--merge-file", "m"], 1, ["weight 'inf' is not a finite number >= 0"]),
    (without(TINY, "--mock-data") + ["--data-path", '-1', "a", '1', "b", "--vocab-file", "v",
                                     "--merge-file", "m"], 1, ["weight '-1' is not a finite number"]),
    (TINY + ["--tokenizer-type", "SentencePieceTokenizer"], 1, ["needs --tokenizer-model"]),
    (TINY + ["--tokenizer-type", "GPT2BPETokenizer"], 1, ["needs --vocab-file and --merge-file"]),
    (TINY + ["--tokenizer-type", "NullTokenizer"], 1, ["NullTokenizer needs --vocab-size"]),
    (TINY + ["--tokenizer-type", "HuggingFaceTokenizer"], 1, ["needs --tokenizer-model"]),
    (TINY + ["--tokenizer-type", "Llama2Tokenizer"], 1, ["needs --tokenizer-model"]),
    (TINY + ["--split", "90,x"], 1, ["--split '90,x'"]),
    (TINY + ["--checkpoint-activations", "--recompute-granularity", "selective"], 1,
     ["--checkpoint-activations means --recompute-granularity full"]),
    (TINY + ["--checkpoint-activations", "--recompute-activations"], 1, ["contradict"]),
    (TINY + ["--recompute-granularity", "full"], 1, ["needs --recompute-method"]),
    (TINY + ["--recompute-granularity", "selective", "--recompute-method", "block"], 1,
     ["only applies to --recompute-granularity full"]),
    (TINY + "--recompute-granularity full --recompute-method block --recompute-num-layers 5 "
            "--pipeline-model-parallel-size 2".split(), 2, ["exceeds the 4 layers"]),
    (replaced(TINY, "--micro-batch-size", "0"), 1, ["--micro-batch-size must be a positive"]),
    (TINY + ["--hidden-dropout", "1.5"], 1, ["--hidden-dropout 1.5"]),
    (TINY + ["--distributed-timeout-minutes", "0"], 1, ["--distributed-timeout-minutes"]),
    # Features that are flags but not implemented: rejected, never silently ignored.
    (TINY + ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "63",
             "--max-position-embeddings", "64"], 2,
     ["--seq-length 63 is not divisible by --tensor-model-parallel-size 2"]),
    (TINY + ["--rampup-batch-size", "4", "5", "100"], 1, ["not a multiple of the increment 5"]),
    (TINY + ["--rampup-batch-size", "4", "4"], 1, ["takes three numbers"]),
    (TINY + ["--rampup-batch-size", "4", "4", "100"], 4, ["must be multiples of --micro-batch"]),
    (TINY + ("--rampup-batch-size 2 2 100 --pipeline-model-parallel-size 2 "
             "--num-layers-per-virtual-pipeline-stage 2").split(), 2,
     ["global batch size 2 of the --rampup-batch-size ramp", "1 micro-batches per iteration",
      "needs at least --pipeline-model-parallel-size (2) micro-batches"]),
    (replaced(TINY, "--train-iters", "5") + ["--lr-decay-samples", "10"], 1,
     ["--lr-decay-samples / --lr-warmup-samples belong to samples-based"]),
    (replaced(TINY, "--train-iters", "5") + ["--train-samples", "80", "--lr-warmup-iters", "1"], 1,
     ["with --train-samples use --lr-decay-samples"]),
    (TINY + ["--position-embedding-type", "rope", "--rotary-percent", "0"], 1,
     ["--rotary-percent 0.0 must lie in (0, 1]"]),
    (TINY + ["--swiglu", "--squared-relu"], 1, ["--swiglu and --squared-relu"]),
    (TINY + ["--group-query-attention"], 1, ["--group-query-attention needs --num-query-groups"]),
    (TINY + ["--group-query-attention", "--num-query-groups", "3"], 1,
     ["--num-attention-heads 4 is not divisible by --num-query-groups 3"]),
    (TINY + ["--group-query-attention", "--num-query-groups", "2",
             "--tensor-model-parallel-size", "4"], 4,
     ["--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"]),
]


@pytest.mark.parametrize("argv,world_size,expected", BAD_COMBINATIONS,
                         ids=[" ".join(words[:1]) for _, _, words in BAD_COMBINATIONS])
def test_bad_combination_gives_its_message(argv, world_size, expected):
    with pytest.raises(ValueError) as error:
        parse_args(argv, world_size=world_size)
    for words in expected:
        assert words in str(error.value), f"{words!r} not in: {error.value}"


def test_messages_are_distinct():
    """Each rule has its own message (no catch-all)."""
    messages = set()
    for argv, world_size, _ in BAD_COMBINATIONS:
        with pytest.raises(ValueError) as error:
            parse_args(argv, world_size=world_size)
        messages.add(str(error.value))
    assert len(messages) == len(BAD_COMBINATIONS)


def test_megatron_defaults_are_derived():
    config = parse_args(TINY, world_size=2)
    assert config.model.ffn_hidden_size == 4 * 64
    assert config.model.max_position_embeddings == 64
    assert config.parallel.data_parallel_size == 2
    assert config.parallel.pipeline_schedule == "1f1b"
    assert config.training.num_microbatches == 16 // (2 * 2)
    assert config.optimizer.lr_decay_iters == 5  # defaults to --train-iters
    assert config.model.vocab_size == DEFAULT_MOCK_VOCAB_SIZE
    assert config.model.padded_vocab_size == 1024

    no_global = parse_args(without(TINY, "--global-batch-size"), world_size=4)
    assert no_global.training.global_batch_size == 2 * 4
    assert no_global.training.num_microbatches == 1

    samples = parse_args(without(TINY, "--train-iters") + ["--train-samples", "100"], world_size=1)
    assert samples.training.train_iters == 100 // 16


def test_vocabulary_padding():
    model = ModelConfig()  # make-vocab-size-divisible-by 128
    assert pad_vocab_size(50257, model, 1) == 50304
    assert pad_vocab_size(50257, model, 2) == 50432  # multiple of 256
    assert pad_vocab_size(256, model, 2) == 256
    with pytest.raises(ValueError):
        pad_vocab_size(0, model, 1)

    mock = parse_args(TINY + ["--vocab-size", "300", "--tensor-model-parallel-size", "2",
                              "--make-vocab-size-divisible-by", "64"], world_size=2)
    assert mock.model.padded_vocab_size == 384
    null = parse_args(TINY + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"],
                      world_size=1)
    assert null.model.padded_vocab_size == 384  # 256 ids + the end-of-document id, padded

    gpt2 = parse_args(TINY + ["--vocab-file", "v.json", "--merge-file", "m.txt"], world_size=1)
    assert gpt2.model.padded_vocab_size is None
    assert set_padded_vocab_size(gpt2, 50257) == 50304 and gpt2.model.padded_vocab_size == 50304


def test_input_config_is_not_modified():
    from megatron.training.arguments import parse_args_unvalidated
    from megatron.training.config_validation import validate_config
    raw, _ = parse_args_unvalidated(TINY + ["--checkpoint-activations"])
    validated = validate_config(raw, world_size=1)
    assert raw.model.ffn_hidden_size is None and raw.recompute.checkpoint_activations
    assert validated.model.ffn_hidden_size == 256


def test_pipeline_schedule_selection():
    interleaved = parse_args(TINY + ["--pipeline-model-parallel-size", "2",
                                     "--num-layers-per-virtual-pipeline-stage", "2"], world_size=2)
    assert interleaved.parallel.pipeline_schedule == "interleaved-1f1b"
    assert interleaved.parallel.virtual_pipeline_model_parallel_size == 2
    chimera = parse_args(TINY + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                                 "chimera", "--chimera-pipelines", "4", "--chimera-grad-sync", "end",
                                 "--tensor-model-parallel-size", "2"], world_size=8)
    assert chimera.parallel.pipeline_schedule == "chimera"
    assert chimera.parallel.chimera_pipelines == 4
    assert chimera.parallel.chimera_grad_sync == "end"
    assert chimera.parallel.data_parallel_size == 1
    assert chimera.training.num_microbatches == 8
    halving = parse_args(TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                 "chimera", "--chimera-variant", "backward-halving"], world_size=4)
    assert halving.parallel.chimera_variant == "backward-halving"
    assert halving.training.num_microbatches == 4
    gpipe = parse_args(TINY + ["--pipeline-schedule", "gpipe"], world_size=1)
    assert gpipe.parallel.pipeline_schedule == "gpipe"


@pytest.fixture
def recording_schedule_check(monkeypatch):
    """Stand-in for megatron.core.pipeline_parallel.planning.schedules.check_schedule_options."""
    calls = []

    from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES

    def check_schedule_options(name, pipeline_size, num_microbatches, **options):
        assert options.pop("registry") is BUILTIN_SCHEDULES  # parse_args' default registry
        calls.append((name, pipeline_size, num_microbatches, options))
        if num_microbatches == 3:
            raise ValueError("3 micro-batches do not fill the schedule; use a multiple of 2")

    from megatron.core.pipeline_parallel.planning.schedules import schedule_from_config
    fake = types.ModuleType("megatron.core.pipeline_parallel.planning.schedules")
    fake.check_schedule_options = check_schedule_options
    fake.schedule_from_config = schedule_from_config  # the real flags -> options mapping
    monkeypatch.setitem(sys.modules, "megatron.core.pipeline_parallel.planning.schedules", fake)
    return calls


def test_validation_asks_the_schedule_builders(recording_schedule_check):
    parse_args(TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
                       "--chimera-variant", "forward-doubling"], world_size=2)
    parse_args(TINY + ["--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "1"], world_size=2)
    assert recording_schedule_check == [
        ("chimera", 2, 8, {"num_pipelines": 2, "variant": "forward-doubling",
                           "micro_batch_size": 2}),
        ("interleaved-1f1b", 2, 8, {"num_model_chunks": 4, "micro_batch_size": 2}),
    ]
    with pytest.raises(ValueError) as error:
        parse_args(replaced(TINY, "--global-batch-size", "6") + [
            "--pipeline-model-parallel-size", "2"], world_size=2)
    assert "--pipeline-schedule 1f1b" in str(error.value)
    assert "3 micro-batches do not fill the schedule" in str(error.value)


def test_real_schedule_options_reject_bad_microbatch_counts():
    """Exercises the real check of the schedules package (it must exist: no fallback here)."""
    from megatron.core.pipeline_parallel.planning.schedules import check_schedule_options  # noqa: F401
    chimera = ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "chimera"]
    doubling = chimera + ["--chimera-variant", "forward-doubling"]
    # D = 4 with N = 4 (one basic unit) and N = 8 (two units) are valid for every variant.
    assert parse_args(replaced(TINY, "--global-batch-size", "8") + doubling,
                      world_size=4).training.num_microbatches == 4
    assert parse_args(TINY + doubling, world_size=4).training.num_microbatches == 8
    # Direct concatenation takes any N; the doubling variants need N to be a multiple of D.
    assert parse_args(replaced(TINY, "--global-batch-size", "12") + chimera,
                      world_size=4).training.num_microbatches == 6
    with pytest.raises(ValueError, match="--pipeline-schedule chimera .* 6 micro-batches"):
        parse_args(replaced(TINY, "--global-batch-size", "12") + doubling, world_size=4)
    with pytest.raises(ValueError, match="variant .* 2 pipelines only"):
        parse_args(TINY + doubling + ["--chimera-pipelines", "4"], world_size=4)
    # Interleaved 1F1B (as Megatron) runs micro-batches in groups of G (default D) with
    # D <= G <= N and N mod G 0 or >= D; at least two chunks per rank.
    interleaved = ["--pipeline-model-parallel-size", "2"]
    three = replaced(TINY, "--global-batch-size", "6") + interleaved + [
        "--num-layers-per-virtual-pipeline-stage", "2"]
    with pytest.raises(ValueError, match="--pipeline-schedule interleaved-1f1b .* 3 micro-batches"
                                         ".* last group of 1 < 2.*"
                                         "--microbatch-group-size-per-virtual-pipeline-stage"):
        parse_args(three, world_size=2)
    group = ["--microbatch-group-size-per-virtual-pipeline-stage"]
    assert parse_args(three + group + ["3"], world_size=2).training.num_microbatches == 3
    with pytest.raises(ValueError, match="must lie between .* \\(2\\) and .* \\(3\\)"):
        parse_args(three + group + ["4"], world_size=2)
    with pytest.raises(ValueError, match="only applies to --pipeline-schedule interleaved-1f1b"):
        parse_args(TINY + interleaved + group + ["2"], world_size=2)
    with pytest.raises(ValueError, match="num_model_chunks >= 2"):
        parse_args(TINY + interleaved + ["--num-layers-per-virtual-pipeline-stage", "4"],
                   world_size=2)


def test_overlap_grad_reduce_with_a_pipeline_is_kept_and_its_ineffective_cases_named(caplog):
    """With a pipeline the flag launches each module's buckets during its last backward op (the
    interpreter); only the reductions that cannot start earlier are reported."""
    import logging
    argv = TINY + ["--overlap-grad-reduce", "--pipeline-model-parallel-size", "2"]
    with caplog.at_level(logging.WARNING):
        assert parse_args(argv, world_size=2).parallel.overlap_grad_reduce
    assert not any("overlap-grad-reduce" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.WARNING):
        parse_args(argv + ["--use-distributed-optimizer"], world_size=4)
    assert any("--overlap-grad-reduce does not overlap the distributed optimizer" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("tokenizer", ["SentencePieceTokenizer", "Llama2Tokenizer",
                                       "HuggingFaceTokenizer"])
def test_vocab_size_with_a_file_tokenizer_is_ignored_as_in_megatron(caplog, tokenizer):
    """Megatron-LM pads the tokenizer's own vocabulary size; --vocab-size is not read."""
    import logging
    argv = without(TINY, "--mock-data") + ["--data-path", "d", "--tokenizer-type", tokenizer,
                                           "--tokenizer-model", "tok", "--vocab-size", "100"]
    with caplog.at_level(logging.WARNING):
        config = parse_args(argv, world_size=1)
    assert config.model.vocab_size is None and config.model.padded_vocab_size is None
    assert any(f"--vocab-size 100 is ignored (as in Megatron-LM): the {tokenizer} reads" in
               r.getMessage() for r in caplog.records)


def test_model_feature_gates_are_one_table_for_validation_and_the_model():
    """Argument validation and GPTModel refuse exactly the features of MODEL_FEATURE_GATES."""
    from megatron.core.config import MODEL_FEATURE_GATES, ModelConfig, refused_model_features
    from megatron.training.config_validation import NOT_SUPPORTED_YET
    gated = {(gate.field, gate.shown) for gate in MODEL_FEATURE_GATES}
    refused_by_validation = {(feature.field, feature.shown) for feature in NOT_SUPPORTED_YET
                             if feature.section == "model"}
    assert refused_by_validation == gated
    assert refused_model_features(ModelConfig()) == []
    # every gate's own feature is refused (the table is empty now that the modern block exists)
    assert all(refused_model_features(dataclasses.replace(
        ModelConfig(), **{gate.field: True})) for gate in MODEL_FEATURE_GATES
               if gate.is_used(True))


def test_sequence_parallel_without_tensor_parallelism_is_turned_off_with_a_warning(caplog):
    import logging
    with caplog.at_level(logging.WARNING):
        config = parse_args(TINY + ["--sequence-parallel"], world_size=1)
    assert config.parallel.sequence_parallel is False
    assert any("--sequence-parallel is switched off" in r.getMessage() for r in caplog.records)
    config = parse_args(TINY + ["--sequence-parallel", "--tensor-model-parallel-size", "2"],
                        world_size=2)
    assert config.parallel.sequence_parallel is True
