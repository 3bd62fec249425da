"""Checkpoint-level Hugging Face export and import (``tools/convert_checkpoint.py --target-format
hf`` / ``--source-format hf``).

Export merges our checkpoint in any layout (TP, PP, interleaved, Chimera) to full weights with
:func:`~megatron.training.checkpoint_conversion.merge_full_state` and writes a ``GPT2LMHeadModel``
directory (``config.json``, ``model.safetensors``, and ``vocab.json`` / ``merges.txt`` when the run
used the GPT-2 BPE tokenizer); a Llama-style model (RoPE, SwiGLU, RMSNorm) becomes a
``LlamaForCausalLM`` instead (:mod:`megatron.training.hf_llama`). Import reads such a directory
(GPT-2 or Llama), builds our config from its ``config.json`` and writes a weights-only checkpoint
of the chosen layout, loadable with ``--finetune``.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, ScheduleRegistry
from megatron.training.checkpoint_conversion import (
    DEFAULT_CKPT_FORMAT, ConversionError, TargetLayout, merge_full_state, read_checkpoint,
    write_weights)
from megatron.training.hf_conversion import (
    HFConversionError, hf_config_dict, hf_to_ours_state, model_flags_from_hf, ours_to_hf_state,
    read_hf_directory, write_hf_directory)
from megatron.training.hf_llama import (
    LlamaConversionError, is_llama_style, llama_config_dict, llama_to_ours_state,
    model_flags_from_llama, ours_to_llama_state)

HF_TOKENIZER_FILES = ("vocab.json", "merges.txt")
# validation needs a batch size, an iteration count and a learning rate; the written checkpoint is
# weights only, so these do not matter
PLACEHOLDER_TRAINING_FLAGS = ["--micro-batch-size", "1", "--global-batch-size", "1",
                              "--train-iters", "1", "--lr", "1e-4"]


def vocabulary_size(config) -> int:
    """The unpadded vocabulary of a run: the tokenizer's, ``--vocab-size`` (+1 for the
    NullTokenizer's end-of-document id), or the padded size when the tokenizer files are gone."""
    from megatron.training.tokenizer import build_tokenizer

    data, model = config.data, config.model
    if data.tokenizer_type in ("GPT2BPETokenizer", "SentencePieceTokenizer",
                               "GPTSentencePieceTokenizer"):
        try:
            return build_tokenizer(data, model).vocab_size
        except (OSError, ValueError):
            return model.padded_vocab_size
    if data.tokenizer_type == "NullTokenizer":
        return model.vocab_size + 1
    return model.vocab_size or model.padded_vocab_size


def layout_flags(target: TargetLayout,
                 registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> list[str]:
    """The parallel-layout flags of ``target``: sizes, schedule and the options the family's
    record names as deciding what a checkpoint holds (``checkpoint_options``)."""
    flags = ["--tensor-model-parallel-size", str(target.tensor_model_parallel_size),
             "--pipeline-model-parallel-size", str(target.pipeline_model_parallel_size)]
    if target.pipeline_schedule is not None:
        flags += ["--pipeline-schedule", target.pipeline_schedule]
        family = registry.family(target.pipeline_schedule)
        for name in family.checkpoint_options:
            field_name = family.option(name).config_field
            value = getattr(target, field_name, None)
            if value is not None:
                flags += ["--" + field_name.replace("_", "-"), str(value)]
    for name in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(target, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(target, name))]
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(target, name):
            flags.append("--" + name.replace("_", "-"))
    return flags


def _tokenizer_files(config) -> list[tuple[str, str]]:
    data = config.data
    if data.tokenizer_type != "GPT2BPETokenizer":
        return []
    sources = (data.vocab_file, data.merge_file)
    if not all(path and os.path.isfile(path) for path in sources):
        return []
    return list(zip(sources, HF_TOKENIZER_FILES))


def export_to_hf(load: str, save: str, iteration: Optional[int] = None, log=print,
                 registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> str:
    """Write ``load``'s iteration (default: the tracker's) as a Hugging Face GPT-2 (or, for a
    Llama-style model, Llama) into ``save`` (``registry``: the schedule families the checkpoint's
    layout may name)."""
    source = read_checkpoint(load, iteration)
    full = merge_full_state(source, registry)
    vocab = vocabulary_size(source.config)
    model_config = source.config.model
    llama = is_llama_style(model_config)
    try:
        if llama:
            hf_state = ours_to_llama_state(full, model_config, vocab)
            hf_config = llama_config_dict(model_config, vocab)
        else:
            hf_state = ours_to_hf_state(full, model_config, vocab)
            hf_config = hf_config_dict(model_config, vocab)
        tokenizer_files = _tokenizer_files(source.config)
        write_hf_directory(save, hf_state, hf_config, tokenizer_files)
    except (HFConversionError, LlamaConversionError) as error:
        raise ConversionError(str(error)) from None
    log(f"exported {load} iteration {source.iteration} to {save}: "
        f"{'LlamaForCausalLM' if llama else 'GPT2LMHeadModel'}, vocabulary "
        f"{vocab}, {len(hf_state)} tensors"
        + (", tokenizer files" if tokenizer_files else ", no tokenizer files"))
    return save


def _import_config(hf_config: dict, hf_dir: str, save: str, target: TargetLayout,
                   seq_length: Optional[int], divisible_by: int,
                   registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """(our validated config in ``target``'s layout, the model / data flags to train it with)."""
    from megatron.training.arguments import parse_args
    from megatron.training.config_validation import set_padded_vocab_size
    from megatron.training.tokenizer import build_tokenizer

    if hf_config["model_type"] == "llama":
        flags = model_flags_from_llama(hf_config) + [
            "--seq-length", str(seq_length or hf_config["max_position_embeddings"])]
    else:
        flags = model_flags_from_hf(hf_config) + [
            "--seq-length", str(seq_length or hf_config["n_positions"])]
    flags += ["--make-vocab-size-divisible-by", str(divisible_by)]
    if all(os.path.isfile(os.path.join(hf_dir, name)) for name in HF_TOKENIZER_FILES):
        tokenizer_dir = os.path.join(save, "tokenizer")
        os.makedirs(tokenizer_dir, exist_ok=True)
        for name in HF_TOKENIZER_FILES:
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(tokenizer_dir, name))
        flags += ["--tokenizer-type", "GPT2BPETokenizer",
                  "--vocab-file", os.path.join(tokenizer_dir, "vocab.json"),
                  "--merge-file", os.path.join(tokenizer_dir, "merges.txt")]
    else:
        flags += ["--mock-data", "--vocab-size", str(hf_config["vocab_size"])]
    try:
        # with tokenizer files the data source is the user's (--data-path); validating the
        # weights-only checkpoint's config needs one, so mock data stands in
        data = [] if "--mock-data" in flags else ["--mock-data"]
        config = parse_args(flags + PLACEHOLDER_TRAINING_FLAGS + data + layout_flags(target, registry),
                            world_size=target.tensor_model_parallel_size
                            * target.pipeline_model_parallel_size, registry=registry)
    except (ValueError, SystemExit) as error:
        raise ConversionError(f"the Hugging Face config gives invalid flags {flags}: {error}"
                              ) from None
    if config.model.padded_vocab_size is None:
        tokenizer = build_tokenizer(config.data, config.model)
        if tokenizer.vocab_size != hf_config["vocab_size"]:
            raise ConversionError(f"the tokenizer files in {hf_dir} hold {tokenizer.vocab_size} "
                                  f"tokens but config.json says vocab_size "
                                  f"{hf_config['vocab_size']}; the directory is inconsistent")
        set_padded_vocab_size(config, tokenizer.vocab_size)
    return config, flags


def import_from_hf(hf_dir: str, save: str, target: TargetLayout, *,
                   seq_length: Optional[int] = None, make_vocab_size_divisible_by: int = 128,
                   log=print, registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                   ckpt_format: str = DEFAULT_CKPT_FORMAT) -> str:
    """Write the Hugging Face GPT-2 or Llama in ``hf_dir`` as a weights-only checkpoint (iteration 0) of
    ``target``'s layout into ``save``, in ``ckpt_format`` (``torch_dist``, the default, loads in
    any layout; ``torch`` is the per-rank files of ``target``). Returns the iteration directory."""
    try:
        hf_config, hf_state = read_hf_directory(hf_dir)
        config, train_flags = _import_config(hf_config, hf_dir, save, target, seq_length,
                                             make_vocab_size_divisible_by, registry)
        if hf_config["model_type"] == "llama":
            full = llama_to_ours_state(hf_state, config.model)
        else:
            full = hf_to_ours_state(hf_state, config.model)
    except (HFConversionError, LlamaConversionError) as error:
        raise ConversionError(str(error)) from None
    written, _ = write_weights(save, 0, config, full, {}, note=f"hf:{hf_dir}",
                               ckpt_format=ckpt_format, registry=registry)
    log(f"imported {hf_dir} into {written}; train on with --load {save} --finetune "
        f"{' '.join(train_flags)}")
    return written
