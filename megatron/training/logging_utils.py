"""Megatron-LM's log lines, formatted exactly as its users' log parsers expect.

Training (one line every ``--log-interval`` iterations, printed by the last rank)::

     [2026-11-30 12:00:00] iteration       10/     100 | consumed samples:          640 | elapsed time
     per iteration (ms): 412.3 | throughput per GPU (TFLOP/s/GPU): 1.2 | learning rate: 3.000000E-04 |
     global batch size:    64 | lm loss: 7.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number
     of skipped iterations:   0 | number of nan iterations:   0 |

(one line). The throughput field is always printed (Megatron prints it only with
``--log-throughput``; the flag is accepted and changes nothing). Losses are averaged over the
iterations of the interval that were not skipped; grad norm, loss scale and learning rate are those
after the interval's last iteration (the learning rate is the one the *next* iteration will use, as in
Megatron); skipped and nan counts are per interval.

Validation::

     validation loss at iteration 10 | lm loss value: 6.543210E+00 | lm loss PPL: 6.952042E+02 |

between two lines of dashes.

Warnings about the command line (accepted-but-ignored flags, flags switched off as Megatron does)
are the same on every rank, so the entry point shows them once, on rank 0
(:class:`CommandLineWarningsOnce`), as Megatron's ``warn_rank_0`` does.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional


# Loggers whose warnings are about the command line alone: every rank parses the same flags, so
# every rank would print the same lines.
COMMAND_LINE_LOGGERS = frozenset({"megatron.training.arguments",
                                  "megatron.training.config_validation",
                                  "megatron.training.megatron_leniency"})


class CommandLineWarningsOnce(logging.Filter):
    """A handler filter that keeps the command-line loggers' records on rank 0 only.

    Under torchrun or srun every rank parses the same flags; without it a launch of 4 processes
    printed each "accepted and ignored" warning 4 times. Records of every other logger (rank-specific
    faults, checkpoint notes) pass on every rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.name not in COMMAND_LINE_LOGGERS


def configure_entry_point_logging(rank: int) -> logging.Handler:
    """The entry point's logging: warnings to stderr as ``LEVEL logger: message``, the
    command-line ones on rank 0 only. Returns the handler (it is the root logger's)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(CommandLineWarningsOnce(rank))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    return handler


def format_iteration_line(*, iteration: int, train_iters: int, consumed_samples: int,
                          elapsed_ms: float, throughput_tflops: Optional[float],
                          learning_rate: float, global_batch_size: int, losses: dict,
                          loss_scale: float, grad_norm: Optional[float], skipped_iterations: int,
                          nan_iterations: int, now: Optional[datetime.datetime] = None,
                          num_zeros_in_grad: Optional[float] = None,
                          params_norm: Optional[float] = None) -> str:
    """One Megatron training log line (``losses`` maps a name such as "lm loss" to its average)."""
    now = now or datetime.datetime.now()
    line = f" [{now.strftime('%Y-%m-%d %H:%M:%S')}]"
    line += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    line += " consumed samples: {:12d} |".format(consumed_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
    if throughput_tflops is not None:
        # Megatron's one decimal, except below 1 TFLOP/s (CPU runs), where it would print 0.0.
        shown = f"{throughput_tflops:.1f}" if throughput_tflops >= 1.0 else \
            f"{throughput_tflops:.6f}"
        line += f" throughput per GPU (TFLOP/s/GPU): {shown} |"
    line += " learning rate: {:.6E} |".format(learning_rate)
    line += " global batch size: {:5d} |".format(global_batch_size)
    for name, value in losses.items():
        if value > 0.0 or math.isnan(value):  # Megatron omits an all-skipped (zero) average
            line += " {}: {:.6E} |".format(name, value)
    line += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        line += " grad norm: {:.3f} |".format(grad_norm)
    if num_zeros_in_grad is not None:
        line += " num zeros: {:.1f} |".format(num_zeros_in_grad)
    if params_norm is not None:
        line += " params norm: {:.3f} |".format(params_norm)
    line += " number of skipped iterations: {:3d} |".format(skipped_iterations)
    line += " number of nan iterations: {:3d} |".format(nan_iterations)
    return line


def format_validation_lines(prefix: str, losses: dict) -> list[str]:
    """Megatron's evaluation block: dashes, ``validation loss at PREFIX | ...``, dashes.

    ``prefix`` is e.g. ``"iteration 10"`` or ``"iteration 100 on test set"``. Perplexity is
    ``exp(min(20, loss))`` as in Megatron.
    """
    line = " validation loss at {} | ".format(prefix)
    for name, value in losses.items():
        line += "{} value: {:.6E} | ".format(name, value)
        line += "{} PPL: {:.6E} | ".format(name, math.exp(min(20.0, value)))
    dashes = "-" * (len(line) + 1)
    return [dashes, line, dashes]


@dataclass
class IntervalStats:
    """Accumulates what one log line reports over the iterations since the previous line."""

    loss_sums: dict = field(default_factory=dict)
    advanced_iterations: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    iterations: int = 0

    def add(self, losses: dict, skipped: bool, got_nan: bool) -> None:
        """Record one iteration; skipped iterations do not enter the loss average."""
        self.iterations += 1
        self.skipped_iterations += int(skipped)
        self.nan_iterations += int(got_nan)
        if not skipped:
            self.advanced_iterations += 1
            for name, value in losses.items():
                self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value
        else:
            for name in losses:
                self.loss_sums.setdefault(name, 0.0)

    def average_losses(self) -> dict:
        return {name: total / max(1, self.advanced_iterations)
                for name, total in self.loss_sums.items()}


def format_memory_report(rank: int, iteration: int, stats: dict) -> str:
    """Megatron's memory line from ``torch.cuda.memory_stats``-style byte counts."""
    megabyte = 1024.0 * 1024.0
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | "
            f"allocated: {stats['allocated_bytes.all.current'] / megabyte} | "
            f"max allocated: {stats['allocated_bytes.all.peak'] / megabyte} | "
            f"reserved: {stats['reserved_bytes.all.current'] / megabyte} | "
            f"max reserved: {stats['reserved_bytes.all.peak'] / megabyte}")


def memory_report(rank: int, iteration: int, device) -> Optional[str]:
    """The memory line for a CUDA device; None on other devices (no allocator statistics)."""
    import torch
    if device.type != "cuda":
        return None
    return format_memory_report(rank, iteration, torch.cuda.memory_stats(device))


def check_logging_packages(logging_config) -> None:
    """Fail with the fix when --tensorboard-dir / --wandb-project need a package that is missing.

    Call it on every rank before any process group exists, so a missing package stops the run at
    once instead of after the rendezvous."""
    if logging_config.tensorboard_dir is not None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ValueError("--tensorboard-dir needs the tensorboard package; install it (pip "
                             "install tensorboard, or the project's [tensorboard] extra) or drop "
                             "--tensorboard-dir") from None
    if logging_config.wandb_project is not None:
        try:
            import wandb
        except ImportError:
            raise ValueError("--wandb-project needs the wandb package; install it (pip install "
                             "wandb) or drop --wandb-project") from None
        if wandb_login_missing(wandb):
            raise ValueError("--wandb-project: W&B is in online mode but finds no API key on this "
                             "machine (WANDB_API_KEY, ~/.netrc, wandb settings), so wandb.init "
                             "would stop the run once the model is built; run `wandb login` (or "
                             "set WANDB_API_KEY) where the job runs, or set WANDB_MODE=offline to "
                             "write the run locally and `wandb sync` it later")


def wandb_login_missing(wandb) -> bool:
    """True only when ``wandb`` (the module ``import wandb`` gave) would certainly refuse to start
    a run: online mode and wandb's own credential lookup (environment, .netrc, settings; no
    prompt) finds nothing. Any doubt (offline or disabled mode, a wandb version without these
    internals, a stand-in module) gives False, leaving it to ``wandb.init``: a check that stopped
    a run wandb would have started would be worse. The internals are read as attributes of that
    module, never imported by name: a stand-in ``wandb`` in ``sys.modules`` must not be paired
    with the real package's submodules that an earlier import left there."""
    try:
        authenticate = wandb.sdk.lib.wbauth.authenticate
        settings = wandb.sdk.wandb_setup.singleton().settings
        if settings.mode not in ("online", "run"):
            return False
        return authenticate.authenticate_session(host=settings.base_url, source="--wandb-project",
                                                 prompt=False, update_session=False) is None
    except Exception:  # wandb's internals moved: no opinion
        return False


class WandbWriter:
    """``add_scalar(tag, value, step)`` on a Weights & Biases run (the TensorBoard tags)."""

    def __init__(self, logging_config, save_dir: Optional[str], run_config: Optional[dict]):
        import wandb
        directory = logging_config.wandb_save_dir or os.path.join(save_dir or ".", "wandb")
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=logging_config.wandb_project,
                              name=logging_config.wandb_exp_name, dir=directory,
                              config=run_config)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def flush(self) -> None:
        """wandb writes as it goes."""

    def close(self) -> None:
        """Finish the run (writes its summary; in offline mode the run directory is complete)."""
        self.run.finish()


class ScalarWriters:
    """Sends each scalar to every configured writer (TensorBoard and/or Weights & Biases)."""

    def __init__(self, writers: list):
        self.writers = writers

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        for writer in self.writers:
            if hasattr(writer, "flush"):
                writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            close_writer(writer)


def close_writer(writer) -> None:
    """Flush and close a scalar writer at the end of training (None: nothing to do)."""
    if writer is None:
        return
    if hasattr(writer, "flush"):
        writer.flush()
    if hasattr(writer, "close"):
        writer.close()


def build_tensorboard_writer(logging_config, is_writer_rank: bool, save_dir: Optional[str] = None,
                             run_config: Optional[dict] = None):
    """The scalar writer of the logging rank: TensorBoard for ``--tensorboard-dir`` and Weights &
    Biases for ``--wandb-project`` (both when both are given); None elsewhere or without either.

    Every rank checks the packages, so a missing one stops the run everywhere with the fix.
    """
    check_logging_packages(logging_config)
    if not is_writer_rank:
        return None
    writers = []
    if logging_config.tensorboard_dir is not None:
        from torch.utils.tensorboard import SummaryWriter
        writers.append(SummaryWriter(log_dir=logging_config.tensorboard_dir, max_queue=1000))
    if logging_config.wandb_project is not None:
        writers.append(WandbWriter(logging_config, save_dir, run_config))
    if not writers:
        return None
    return writers[0] if len(writers) == 1 else ScalarWriters(writers)


def write_training_scalars(writer, iteration: int, *, losses: dict, learning_rate: float,
                           global_batch_size: int, loss_scale: float,
                           grad_norm: Optional[float]) -> None:
    """Megatron's TensorBoard tags for one log interval (``writer`` may be None)."""
    if writer is None:
        return
    writer.add_scalar("learning-rate", learning_rate, iteration)
    writer.add_scalar("batch-size", global_batch_size, iteration)
    for name, value in losses.items():
        writer.add_scalar(name, value, iteration)
    writer.add_scalar("loss-scale", loss_scale, iteration)
    if grad_norm is not None:
        writer.add_scalar("grad-norm", grad_norm, iteration)


def write_validation_scalars(writer, iteration: int, losses: dict) -> None:
    """``<name> validation`` and ``<name> validation ppl`` as Megatron writes them."""
    if writer is None:
        return
    for name, value in losses.items():
        writer.add_scalar(f"{name} validation", value, iteration)
        writer.add_scalar(f"{name} validation ppl", math.exp(min(20.0, value)), iteration)
