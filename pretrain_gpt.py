"""Pretrain GPT: the flat entry point Megatron-LM users launch with torchrun or srun.

    torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2 --num-layers 2 \
        --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
        --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 5 --log-interval 1 \
        --mock-data --seed 1234

It supplies what :func:`megatron.training.training.pretrain` needs: the model provider, the dataset
provider and the forward step (with its loss function), as Megatron's pretrain_gpt.py does, gathered
with GPT's loss keys, config section, FLOPs and Hugging Face adapter in one model spec, ``GPT_SPEC``
(:func:`megatron.training.gpt_spec.gpt_model_spec`).

``pretrain_gpt.py --crossover-config jobs.json`` instead trains several jobs on the same ranks under
crossover scheduling, each job's flags taken from the file (see :mod:`megatron.training.crossover`).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys

import torch

from megatron.core.datasets.mock_dataset import build_mock_datasets
from megatron.core.models.gpt import GPTModel
from megatron.training.arguments import parse_args, print_arguments, set_padded_vocab_size
from megatron.training.checkpointing import Checkpointer, check_checkpoint_directories
from megatron.training.crossover import load_crossover_jobs, run_crossover
from megatron.training.gpt_spec import gpt_model_spec
from megatron.training.initialize import shutdown_distributed
from megatron.training.launch_env import read_launch_environment
from megatron.training.logging_utils import check_logging_packages, configure_entry_point_logging
from megatron.training.restarts import StopWatchdog
from megatron.training.training import pretrain


def model_provider(config, parallel_state, *, pre_process: bool = True, post_process: bool = True,
                   layer_range=None) -> GPTModel:
    """The GPT model, or the chunk of it a pipeline stage holds."""
    return GPTModel(config.model, config.recompute, parallel_state, config.training.seed,
                    layer_range=layer_range, pre_process=pre_process, post_process=post_process,
                    sequence_parallel=config.parallel.sequence_parallel)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token loss over the loss mask; returns it and the value to report."""
    losses = output_tensor.float().reshape(-1)
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step(microbatch: dict, model):
    """Run the model on one micro-batch; return the per-token loss and the loss function."""
    output_tensor = model(microbatch["tokens"], microbatch["labels"],
                          sample_ids=microbatch["sample_ids"])
    return output_tensor, functools.partial(loss_func, microbatch["loss_mask"])


def datasets_provider(config, parallel_state, num_samples, tokenizer=None):
    """Train, validation and test datasets: synthetic with --mock-data, else from --data-path."""
    seq_length, seed = config.model.seq_length, config.training.seed
    if config.data.mock_data:
        vocab_size = tokenizer.vocab_size if tokenizer is not None else config.model.vocab_size
        return build_mock_datasets(num_samples, seq_length, vocab_size, seed)
    from megatron.core.datasets.builder import build_gpt_datasets
    train, valid, test = build_gpt_datasets(config.data, seq_length, seed, num_samples, tokenizer)
    if config.data.fim_data:
        from megatron.core.datasets.fim_dataset import wrap_fim_datasets
        train, valid, test = wrap_fim_datasets((train, valid, test), config.data, tokenizer, seed)
    if train is None or len(train) == 0:
        # Caught here, before the first iteration: a missing train split used to end in a bare
        # TypeError inside the micro-batch builder.
        raise ValueError(f"there is no training data: --data-path {' '.join(config.data.data_path)} "
                         f"with --split {config.data.split} leaves the train split empty; give the "
                         f"train split a non-zero weight or use data with more documents")
    return train, valid, test


GPT_SPEC = gpt_model_spec(model_provider, forward_step, datasets_provider)


def build_run_tokenizer(config):
    """The tokenizer named by the flags (None for --mock-data without one); fills the padded
    vocabulary size when only the tokenizer's files know it."""
    if config.data.tokenizer_type is None:
        return None
    from megatron.training.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(config.data, config.model)
    if config.model.padded_vocab_size is None:
        set_padded_vocab_size(config, tokenizer.vocab_size)
    return tokenizer


def _configure(argv):
    """The validated config and tokenizer of one run; a bad flag exits with status 2."""
    try:
        config = parse_args(argv, model_spec=GPT_SPEC)
        # Before any process group, model or iteration: a run that would overwrite checkpoints it
        # does not resume, or could not save at all, stops now instead of at its first save.
        check_checkpoint_directories(config.checkpoint)
        check_logging_packages(config.logging)  # --tensorboard-dir / --wandb-project usable here
        tokenizer = build_run_tokenizer(config)
        if not config.data.mock_data and config.data.data_path:
            # Missing .bin/.idx: one line now, instead of a traceback per rank after the rendezvous.
            from megatron.core.datasets.builder import check_data_path_files
            check_data_path_files(config.data.data_path)
        if config.data.fim_data:  # its tokens must be in the vocabulary: say so before any work
            from megatron.core.datasets.fim_dataset import fim_settings_from_config
            fim_settings_from_config(config.data, tokenizer)
        return config, tokenizer
    except (ValueError, FileNotFoundError) as error:
        # A bad flag combination, a missing tokenizer or data file, an unusable --load tracker:
        # the message says how to fix it, a traceback would only bury it (argparse's convention:
        # usage error, exit status 2).
        print(f"pretrain_gpt.py: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def train_one_job(argv, log, after_compute=None):
    """Parse ``argv``, then build, train and evaluate the model as Megatron's pretrain does."""
    config, tokenizer = _configure(argv)
    if read_launch_environment().rank == 0:
        print_arguments(config)  # as Megatron, once, after the derived sizes are known
    return pretrain(config, GPT_SPEC, functools.partial(datasets_provider, tokenizer=tokenizer),
                    checkpointing=Checkpointer(config, log=log), log=log,
                    after_compute=after_compute)


def crossover_config_path(argv) -> str | None:
    """The file of ``--crossover-config FILE`` (then the only flag), or None."""
    if "--crossover-config" not in argv:
        return None
    if len(argv) != 2 or argv[0] != "--crossover-config":
        print("pretrain_gpt.py: error: --crossover-config FILE takes every job's flags from the "
              "file; give no other flag", file=sys.stderr, flush=True)
        sys.exit(2)
    return argv[1]


def _raise_on_sigterm(signum, frame):
    """SIGTERM (scancel, torchrun stopping its workers) unwinds like an error: the teardown in
    :func:`main` runs, and the exit status is 143 as for a plain SIGTERM."""
    raise SystemExit(128 + signum)


def _run(argv, log) -> int:
    """One run, or several jobs under crossover scheduling (``--crossover-config FILE``); returns
    the exit status (the re-run engine's 16 or 17 when it stopped the run, else 0)."""
    path = crossover_config_path(argv)
    if path is None:
        return train_one_job(argv, log).exit_code
    try:
        jobs = load_crossover_jobs(path)
    except ValueError as error:
        print(f"pretrain_gpt.py: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    for job in jobs:
        _configure(list(job.args))  # every job's flags are checked before any job starts
    run_crossover(jobs, lambda job, after_compute, job_log: train_one_job(
        list(job.args), job_log, after_compute), log=log)
    return 0


def _launch_rank() -> int:
    """This process's rank from the launcher's variables; 0 when they cannot be read (the
    configuration step then reports why, so that message must not be filtered away)."""
    try:
        return read_launch_environment().rank
    except ValueError:
        return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_entry_point_logging(_launch_rank())
    log = functools.partial(print, flush=True)
    previous_handler = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    # A rank blocked in C++ (a collective, process-group creation) stops within seconds of
    # torchrun's SIGTERM; with --exit-signal-handler the signal asks for a save instead.
    watchdog = None if "--exit-signal-handler" in argv else StopWatchdog().install()
    finished = False
    try:
        exit_code = _run(argv, log)
        finished = True
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        if watchdog is not None:
            watchdog.uninstall()
        # A finished run waits for every rank and tears the process groups down, so no
        # communication thread is alive at interpreter exit (an abort there would turn a finished
        # run into a failed one for torchrun, SLURM and CI); a failed run only tears down.
        shutdown_distributed(finished)
        sys.stdout.flush()
        sys.stderr.flush()
    return exit_code


def exit_after_finished_run(status: int = 0) -> None:
    """End the process with ``status`` (0, or the re-run engine's 16/17: the run stopped in order
    on its verdict) without the interpreter's own teardown.

    By now the run is complete and shut down in order: every rank passed the final barrier, the
    process groups are destroyed, checkpoints are fsynced and published, the TensorBoard/W&B
    writers are closed. What remains is interpreter finalization, where gloo's C++ threads were
    torn down in arbitrary order: in about 1 launch in 100 (stress campaign, docs/reliability.md)
    both ranks printed ``terminate called without an active exception`` there and died with
    SIGABRT, turning a finished run into a failed one for torchrun, SLURM and CI. Flushing the
    logs and leaving through ``os._exit`` makes the exit status exactly "training finished".
    Only the script's entry point does this; ``main`` returns normally to callers in-process.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_after_finished_run(main(sys.argv[1:]))
