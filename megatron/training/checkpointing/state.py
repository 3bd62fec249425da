"""What a checkpoint's contents depend on and are checked against: the parallel layout, RNG states,
optimizer state (current hyper-parameters win), and the model/optimizer compatibility checks run
before anything is loaded (so a mismatch cannot leave a half-loaded model).
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from megatron.core.pipeline_parallel.planning.plan import layout_from_config
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, ScheduleRegistry
from megatron.core.pipeline_parallel.planning.stage_split import StageSplit, stage_layer_counts
from megatron.training.checkpointing.files import CheckpointError

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Parallel layout
# ----------------------------------------------------------------------------------------------

def parallel_layout(config, num_chunks: int,
                    registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> dict:
    """What a checkpoint's files depend on: TP and PP sizes, schedule and chunks per rank, and the
    schedule family's ``checkpoint_options`` (its record in ``registry`` says which).

    The data-parallel size is not part of it (weights and optimizer state are replicated over
    data-parallel ranks, so a checkpoint loads with any DP size).
    """
    parallel = config.parallel
    pipeline = parallel.pipeline_model_parallel_size
    schedule = parallel.pipeline_schedule if pipeline > 1 else "none"
    layout = {"tensor_model_parallel_size": parallel.tensor_model_parallel_size,
              "pipeline_model_parallel_size": pipeline,
              "pipeline_schedule": schedule or registry.default_name,
              "model_chunks_per_rank": num_chunks}
    if pipeline > 1:  # options that change which weights a rank's files hold (e.g. 2f pipelines)
        family = registry.family(layout["pipeline_schedule"])
        for name in family.checkpoint_options:
            field_name = family.option(name).config_field
            layout[field_name] = getattr(parallel, field_name)
        split = StageSplit.from_parallel_config(parallel)
        if not split.is_even:  # uneven stages: which layers each file holds (even: no entry)
            num_stages = layout_from_config(config, registry).num_stages
            layout["stage_layer_counts"] = list(stage_layer_counts(
                config.model.num_layers, pipeline, num_stages, split))
    return layout


def runtime_registry(components) -> ScheduleRegistry:
    """The schedule registry the run's runtime plans with (the built-in one without a pipeline)."""
    return getattr(getattr(components, "runtime", None), "registry", BUILTIN_SCHEDULES)


def describe_layout(layout: dict) -> str:
    """``TP=2, PP=4, schedule=chimera (2 pipelines), 2 model chunks per rank``."""
    schedule = layout["pipeline_schedule"]
    if "chimera_pipelines" in layout:  # the chimera family's checkpoint option
        schedule += f" ({layout['chimera_pipelines']} pipelines)"
    chunks = layout["model_chunks_per_rank"]
    stages = (f", layers per stage {layout['stage_layer_counts']}"
              if "stage_layer_counts" in layout else "")
    return (f"TP={layout['tensor_model_parallel_size']}, "
            f"PP={layout['pipeline_model_parallel_size']}, schedule={schedule}, "
            f"{chunks} model chunk{'s' if chunks != 1 else ''} per rank{stages}")


# ----------------------------------------------------------------------------------------------
# RNG states (plain tensors and tuples, so weights_only loading accepts them)
# ----------------------------------------------------------------------------------------------

def capture_rng_state() -> dict:
    """This process's python, numpy, torch CPU and (if available) CUDA generator states."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    # python's state as one tensor: torch.save pays per Python object it pickles (625 ints)
    state = {"random": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next},
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "position": int(position), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached_gaussian)},
             "torch": torch.get_rng_state(),
             "cuda": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state` (the CUDA state goes to the current device)."""
    saved = state["random"]
    if isinstance(saved, dict):
        random.setstate((saved["version"], tuple(saved["internal"].tolist()),
                         saved["gauss_next"]))
    else:  # the tuple that checkpoints written before hold
        random.setstate(_as_tuple(saved))
    saved = state["numpy"]
    np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32),
                         saved["position"], saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        else:
            logger.warning("the checkpoint holds a CUDA RNG state but CUDA is not available; "
                           "it is not restored")


def _as_tuple(value):
    """``random.setstate`` needs tuples; a round trip may have turned them into lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(item) for item in value)
    return value



# ----------------------------------------------------------------------------------------------
# Optimizer: state from the checkpoint, hyper-parameters from the current flags
# ----------------------------------------------------------------------------------------------

def _load_optimizer_state(optimizer, state: dict) -> None:
    """Load ``optimizer`` (a MegatronOptimizer) but keep the current param-group settings.

    torch's ``load_state_dict`` would also restore the saved groups' settings (betas, eps, weight
    decay, fused/foreach); the current flags win instead, as they do for the LR schedule's shape.
    """
    current = [{key: value for key, value in group.items() if key != "params"}
               for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, current):
        group.update(settings)



# the same kind of list); the other flags may change on resume.
ARCHITECTURE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                      "max_position_embeddings", "padded_vocab_size",
                      "untie_embeddings_and_output_weights", "normalization",
                      "position_embedding_type", "swiglu", "disable_bias_linear",
                      "squared_relu", "rotary_percent", "rotary_base", "rotary_interleaved",
                      "no_position_embedding", "apply_layernorm_1p", "qk_layernorm",
                      "add_qkv_bias", "group_query_attention", "num_query_groups", "kv_channels",
                      # same shapes, other forward scales: a MuP checkpoint needs the same flags
                      "use_mup", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
                      "mup_base_head_dim", "mup_attn_scale_power")


def _check_model_flags(path: str, saved: dict, current: dict) -> None:
    """Name the architecture flags that differ from the saved run's, before any shape check."""
    differences = [f"--{name.replace('_', '-')} {saved[name]} (this run: {current[name]})"
                   for name in ARCHITECTURE_FLAGS
                   if name in saved and name in current and saved[name] != current[name]]
    if differences:
        raise CheckpointError(f"checkpoint file {path} was saved with a different model: "
                              f"{'; '.join(differences)}; use the saved run's model flags")


def _check_optimizer_groups(path: str, saved: dict, optimizer) -> None:
    """Same parameter groups (count and sizes) as this run's optimizer."""
    saved_sizes = [len(group["params"]) for group in saved["optimizer"]["param_groups"]]
    current_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != current_sizes:
        raise CheckpointError(
            f"checkpoint file {path}: the optimizer has parameter groups of sizes {saved_sizes}, "
            f"this run's optimizer {current_sizes}; pass --no-load-optim to start the optimizer "
            f"afresh")


def _check_model_state(path: str, key: str, saved: dict, chunk: torch.nn.Module) -> None:
    """Same parameter names and shapes as the chunk, so loading cannot fail halfway."""
    current = chunk.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint file {path}: {key!r} does not match this run's model (missing "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}); the model flags differ "
            f"from the saved run's")
    for name, tensor in current.items():
        if tuple(saved[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint file {path}: {key}.{name} has shape {tuple(saved[name].shape)}, "
                f"this run's model has {tuple(tensor.shape)}; the model flags differ from the "
                f"saved run's")
