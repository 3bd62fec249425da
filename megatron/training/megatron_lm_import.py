"""Import a Megatron-LM GPT checkpoint (torch format, legacy or mcore layout, or Megatron-core's
torch_dist format) as our checkpoint.

torch_dist (``--ckpt-format torch_dist``, Megatron-LM's default): ``iter_NNNNNNN/`` holds DCP
files of global tensors under mcore key names, each transformer-layer parameter stacked over the
layers (``decoder.layers.mlp.linear_fc1.weight`` of shape ``[num_layers, ...]``), and
``common.pt`` with ``args``; :func:`read_megatron_core_dist` reads each tensor whole.

Megatron-LM writes ``ROOT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` (or ``release/``),
each holding ``args`` (its argparse namespace) and ``model``: in the legacy layout a nested
``language_model`` dict (``embedding``, ``encoder`` or ``transformer`` with ``layers.i.…``,
``output_layer``) and ``word_embeddings_for_head`` on the last stage; in the mcore layout flat
``embedding.…`` / ``decoder.layers.i.…`` / ``output_layer.weight`` names like ours (Transformer
Engine's fused ``layer_norm_weight`` names are accepted, ``_extra_state`` entries are dropped).
Layer numbers are local to each pipeline stage. Tensor-parallel shards are merged with Megatron's
partitioning (the same as ours: the QKV rows are ``[groups, heads/groups + 2, head_dim]``, i.e.
``[heads, 3, head_dim]`` without grouped-query attention), except SwiGLU's ``linear_fc1``: a
Megatron-LM rank holds ``[gate_r; up_r]`` stacked along the rows, which becomes its block of our
``[2, ffn, h]`` (gate, up). The modern block's options (RoPE, SwiGLU, RMSNorm, GQA, ...) carry over
from the checkpoint's ``args``.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from megatron.core.pipeline_parallel.planning.stage_split import (StageSplit, stage_layer_counts,
                                                                  stage_layer_ranges)
from megatron.training.checkpoint_conversion import (
    DEFAULT_CKPT_FORMAT, ConversionError, TargetLayout, write_weights)

LEGACY_LAYER_NAMES = {
    "input_layernorm": "input_layernorm", "post_attention_layernorm": "pre_mlp_layernorm",
    "self_attention.query_key_value": "self_attention.linear_qkv",
    "self_attention.dense": "self_attention.linear_proj",
    "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
TE_FUSED_NORMS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
                  "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}
# partition dim of our parameters split over TP (None: replicated)
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                   "word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def _partition_dim(name: str) -> Optional[int]:
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def _iteration_dir(root: str, iteration: Optional[int]) -> str:
    if iteration is None:
        tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
        if not os.path.isfile(tracker):
            raise ConversionError(f"{root} has no latest_checkpointed_iteration.txt; pass "
                                  f"--iteration N or point --load at a Megatron-LM checkpoint")
        text = open(tracker).read().strip()
        return os.path.join(root, "release" if text == "release" else f"iter_{int(text):07d}")
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_files(iteration_dir: str) -> dict:
    """``{(tp_rank, pp_rank): path}`` of the ``mp_rank_TT[_PPP]`` directories."""
    if not os.path.isdir(iteration_dir):
        raise ConversionError(f"{iteration_dir} does not exist; pass an existing --iteration")
    files = {}
    for name in os.listdir(iteration_dir):
        match = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?", name)
        if match:
            key = (int(match.group(1)), int(match.group(2) or 0))
            files[key] = os.path.join(iteration_dir, name, "model_optim_rng.pt")
    if not files:
        raise ConversionError(f"{iteration_dir} has no mp_rank_* directories; is it a "
                              f"Megatron-LM checkpoint in torch format (not torch_dist)?")
    return files


def _flatten(prefix: str, tree: dict, out: dict) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _flatten(f"{name}.", value, out)
        elif isinstance(value, torch.Tensor):
            out[name] = value


def _our_name(name: str, layer_offset: int) -> Optional[str]:
    """Our full-model name of a Megatron-LM (legacy or mcore) state-dict name; None to drop."""
    if name.endswith("_extra_state") or ".inv_freq" in name:
        return None
    name = re.sub(r"^language_model\.(encoder|transformer)\.", "decoder.", name)
    name = name.replace("language_model.embedding.", "embedding.")
    name = name.replace("language_model.output_layer.", "output_layer.")
    name = name.replace("word_embeddings_for_head.", "output_layer.")
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if match is None:
        return name
    index, rest = int(match.group(1)) + layer_offset, match.group(2)
    for fused, plain in TE_FUSED_NORMS.items():
        rest = rest.replace(fused, plain)
    for legacy, ours in LEGACY_LAYER_NAMES.items():
        if rest.startswith(legacy + "."):
            rest = ours + rest[len(legacy):]
    return f"decoder.layers.{index}.{rest}"


def _check_args(args) -> None:
    def get(name, default=None):
        return getattr(args, name, default)
    problems = []
    if get("virtual_pipeline_model_parallel_size"):
        problems.append("a virtual (interleaved) pipeline checkpoint: convert it to "
                        "--virtual-pipeline-model-parallel-size 1 with Megatron-LM first")
    if get("num_experts"):
        problems.append("mixture of experts")
    if get("multi_latent_attention"):
        problems.append("multi-latent attention")
    if get("position_embedding_type", "learned_absolute") not in ("learned_absolute", "rope",
                                                                 "none"):
        problems.append(f"position embedding {get('position_embedding_type')!r}")
    if get("rotary_seq_len_interpolation_factor"):
        problems.append("rotary position interpolation")
    if get("apply_residual_connection_post_layernorm"):
        problems.append("residual connections after the LayerNorm")
    if problems:
        raise ConversionError(f"this Megatron-LM checkpoint cannot be imported: "
                              f"{'; '.join(problems)}")


def _unstacked(name: str, tensor: torch.Tensor, num_layers: int) -> dict:
    """Megatron-core's dist checkpoints key every layer's parameter once, with the layer number as
    a leading axis (``decoder.layers.mlp.linear_fc1.weight`` of shape ``[num_layers, ...]``):
    ``{decoder.layers.i.rest: tensor[i]}``. Other names (and per-layer ones) pass unchanged."""
    match = re.fullmatch(r"decoder\.layers\.([A-Za-z_].*)", name)
    if match is None:
        return {name: tensor}
    if tensor.dim() == 0 or tensor.shape[0] != num_layers:
        raise ConversionError(f"{name} has shape {tuple(tensor.shape)}: a stacked layer "
                              f"parameter needs a leading axis of --num-layers {num_layers}")
    return {f"decoder.layers.{index}.{match.group(1)}": tensor[index].clone()
            for index in range(num_layers)}


def read_megatron_core_dist(iteration_dir: str) -> tuple:
    """(``args``, ``{our name: full tensor}``) of a Megatron-core ``torch_dist`` checkpoint: DCP
    files (``.metadata``, ``__R_N.distcp``) of global tensors under mcore key names, and
    ``common.pt`` with ``args``. Each tensor is read whole, whatever its saved shards (TP, PP,
    distributed-optimizer layout); optimizer state and ``_extra_state`` entries are skipped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.training.checkpointing.dcp_io import PieceLoadPlanner, single_process_dcp
    from megatron.training.checkpointing.global_keys import Piece

    common = os.path.join(iteration_dir, "common.pt")
    if not os.path.isfile(common):
        raise ConversionError(f"{common} is missing: a Megatron-core torch_dist checkpoint keeps "
                              f"its args there; point --load at the checkpoint's root")
    args = torch.load(common, map_location="cpu", weights_only=False).get("args")
    if args is None:
        raise ConversionError(f"{common} has no 'args'; it is not a Megatron-LM checkpoint")
    _check_args(args)
    try:
        saved = FileSystemReader(iteration_dir).read_metadata().state_dict_metadata
    except Exception as error:
        raise ConversionError(f"{os.path.join(iteration_dir, '.metadata')} cannot be read "
                              f"({type(error).__name__}: {error}); the checkpoint is corrupt") from error
    pieces = [Piece(key, tuple(entry.size), (0,) * len(entry.size),
                    torch.empty(tuple(entry.size), dtype=entry.properties.dtype))
              for key, entry in saved.items() if isinstance(entry, TensorStorageMetadata)
              and not key.startswith(("optimizer.", "rng_state")) and
              not key.endswith("_extra_state")]
    try:
        with single_process_dcp():
            dcp.load({}, storage_reader=FileSystemReader(iteration_dir),
                     planner=PieceLoadPlanner(pieces, []), no_dist=True)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise ConversionError(f"reading {iteration_dir} failed: {error}") from None
    full = {}
    for piece in pieces:
        key = piece.key[len("model."):] if piece.key.startswith("model.") else piece.key
        for name, tensor in _unstacked(key, piece.tensor, args.num_layers).items():
            ours = _our_name(name, 0)
            if ours is not None:
                full[ours] = tensor
    return args, full


def read_megatron_lm(root: str, iteration: Optional[int] = None) -> tuple:
    """(Megatron-LM ``args``, ``{our name: full tensor}``) of a Megatron-LM GPT checkpoint, in
    torch format (per-rank files) or Megatron-core's torch_dist format (DCP)."""
    iteration_dir = _iteration_dir(root, iteration)
    if os.path.isfile(os.path.join(iteration_dir, ".metadata")):
        return read_megatron_core_dist(iteration_dir)
    files = _rank_files(iteration_dir)
    payloads = {key: torch.load(path, map_location="cpu", weights_only=False)
                for key, path in sorted(files.items())}
    args = payloads[(0, 0)].get("args")
    if args is None:
        raise ConversionError(f"{files[(0, 0)]} has no 'args'; it is not a Megatron-LM checkpoint")
    _check_args(args)
    tp_size = max(tp for tp, _ in files) + 1
    pp_size = max(pp for _, pp in files) + 1
    try:  # the stage sizes the checkpoint was saved with (even, or Megatron's uneven flags)
        stage_layers = stage_layer_ranges(stage_layer_counts(
            args.num_layers, pp_size, pp_size, StageSplit.from_parallel_config(args)))
    except ValueError as error:
        raise ConversionError(f"the checkpoint's layers do not split over its {pp_size} "
                              f"pipeline stages: {error}") from None
    shards: dict = {}
    for (tp_rank, pp_rank), payload in payloads.items():
        flat: dict = {}
        _flatten("", payload["model"], flat)
        for name, value in flat.items():
            ours = _our_name(name, stage_layers[pp_rank].start)
            if ours is not None:
                shards.setdefault(ours, {})[tp_rank] = value
    full = {}
    for name, by_rank in shards.items():
        if len(by_rank) != tp_size:
            raise ConversionError(f"{name} is held by TP ranks {sorted(by_rank)} of {tp_size}; "
                                  f"the checkpoint is incomplete")
        ordered = [by_rank[rank] for rank in range(tp_size)]
        dim = _partition_dim(name)
        if getattr(args, "swiglu", False) and name.endswith(("linear_fc1.weight",
                                                              "linear_fc1.bias")):
            # each rank's [gate_r; up_r] rows -> its block of our [2, ffn, ...]
            full[name] = torch.cat([shard.reshape(2, -1, *shard.shape[1:]) for shard in ordered],
                                   dim=1)
            continue
        full[name] = ordered[0] if dim is None else torch.cat(ordered, dim=dim)
    return args, full


def _config_flags(args, seq_length: Optional[int]) -> list[str]:
    flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(args.num_attention_heads),
             "--ffn-hidden-size", str(getattr(args, "ffn_hidden_size", None)
                                      or 4 * args.hidden_size),
             "--max-position-embeddings", str(args.max_position_embeddings),
             "--seq-length", str(seq_length or args.seq_length),
             "--layernorm-epsilon", repr(getattr(args, "norm_epsilon", None)
                                         or getattr(args, "layernorm_epsilon", 1e-5)),
             "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
             "--lr", "1e-4", "--mock-data", "--vocab-size", str(args.padded_vocab_size),
             "--make-vocab-size-divisible-by", "1"]
    if getattr(args, "openai_gelu", False):
        flags.append("--openai-gelu")
    if getattr(args, "untie_embeddings_and_output_weights", False):
        flags.append("--untie-embeddings-and-output-weights")
    return flags + _modern_block_flags(args)


def _modern_block_flags(args) -> list[str]:
    """Our flags for the checkpoint's RoPE / SwiGLU / RMSNorm / GQA / bias options."""
    def get(name, default=None):
        return getattr(args, name, default)
    flags = []
    position = get("position_embedding_type", "learned_absolute")
    if position != "learned_absolute":
        flags += ["--position-embedding-type", position]
    if position == "rope":
        flags += ["--rotary-percent", repr(float(get("rotary_percent", 1.0))),
                  "--rotary-base", str(int(get("rotary_base", 10000)))]
        if get("rotary_interleaved"):
            flags.append("--rotary-interleaved")
    if get("add_position_embedding", True) is False:
        flags.append("--no-position-embedding")
    switches = {"swiglu": "--swiglu", "squared_relu": "--squared-relu",
                "apply_layernorm_1p": "--apply-layernorm-1p", "qk_layernorm": "--qk-layernorm",
                "add_qkv_bias": "--add-qkv-bias"}
    flags += [flag for name, flag in switches.items() if get(name)]
    if get("normalization", "LayerNorm") != "LayerNorm":
        flags += ["--normalization", get("normalization")]
    if get("add_bias_linear", True) is False:
        flags.append("--disable-bias-linear")
    groups = get("num_query_groups")
    if get("group_query_attention") and groups and groups != args.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    kv_channels = get("kv_channels")
    if kv_channels and kv_channels * args.num_attention_heads != args.hidden_size:
        flags += ["--kv-channels", str(kv_channels)]
    return flags


def import_megatron_lm(load: str, save: str, target: TargetLayout, *,
                       iteration: Optional[int] = None, seq_length: Optional[int] = None,
                       log=print, ckpt_format: str = DEFAULT_CKPT_FORMAT) -> str:
    """Write a Megatron-LM GPT checkpoint as our weights-only checkpoint (iteration 0) of
    ``target``'s layout, in ``ckpt_format`` (default ``torch_dist``: loads in any layout). The vocabulary keeps Megatron-LM's padded size (``--vocab-size`` of the
    written config); a tokenizer is not carried over: pass the run's tokenizer flags when training."""
    from megatron.training.arguments import parse_args
    from megatron.training.hf_checkpoint import layout_flags

    args, full = read_megatron_lm(load, iteration)
    if "output_layer.weight" in full and not getattr(args, "untie_embeddings_and_output_weights",
                                                      False):
        del full["output_layer.weight"]  # the last stage's copy of the tied embedding
    flags = _config_flags(args, seq_length) + layout_flags(target)
    try:
        config = parse_args(flags, world_size=target.tensor_model_parallel_size
                            * target.pipeline_model_parallel_size)
    except (ValueError, SystemExit) as error:
        raise ConversionError(f"the Megatron-LM model does not fit the target layout: {error}"
                              ) from None
    written, _ = write_weights(save, 0, config, full, {}, note=f"megatron-lm:{load}",
                               ckpt_format=ckpt_format)
    log(f"imported Megatron-LM checkpoint {load} into {written}; model flags: "
        f"{' '.join(flags[:14] + _modern_block_flags(args))}")
    return written
