#!/usr/bin/env python
"""Our pipeline schedules against torch.distributed.pipelining's, on the identical model and ranks.

    python benchmarks/vs_torch_pipelining.py                  # D = 2, N = 2, 4, 8 (several minutes)
    python benchmarks/vs_torch_pipelining.py --quick          # a tiny model, N = 2 (seconds)

Both sides train the same GPT (our model code: 8 layers, hidden 256, 4 heads, sequence 128,
vocabulary 1024, untied output layer, no dropout, micro-batch 4, AdamW) on D = 2 gloo ranks, one per
core. Ours: 1F1B, interleaved 1F1B (2 chunks per rank), every Chimera variant with every
gradient-sync policy, and 1F1B / Chimera with split backward (``--split-backward``). PyTorch: Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble and ScheduleDualPipeV over ``PipelineStage``s built from the same model chunks
(2 stages per rank for the multi-stage schedules, placed in a loop or a V as those schedules expect).
Every iteration includes the optimizer step. All configurations run in interleaved rounds inside one
process group, so a slow phase of the machine hits all of them.

Printed per N: tokens/s (median, and min-max over rounds), efficiency = tokens/s / (D x the tokens/s
of the same code on one process), our simulated bubble ratio (the plan, B = 2F) next to the measured
one (1 - efficiency), and our peak stored activations per rank. The single-process line also compares
our `pretrain_gpt` training step with a plain nanoGPT-style PyTorch model of the same shape, written
here, measured in the same rounds (the framework-overhead check).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.path.dirname(__file__)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _harness import format_table, oversubscription_note, torch_stage_ids  # noqa: E402
from dist_harness import run_distributed  # noqa: E402

DEPTH = 2


def model_flags(quick: bool) -> list:
    if quick:
        size = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 " \
               "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64"
    else:
        size = "--num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 128 " \
               "--max-position-embeddings 128 --vocab-size 1024 --make-vocab-size-divisible-by 128"
    return (size + " --micro-batch-size 4 --hidden-dropout 0 --attention-dropout 0 --clip-grad 1.0 "
            "--untie-embeddings-and-output-weights --lr 1e-4 --mock-data --seed 1234 "
            "--eval-iters 0 --train-iters 1000").split()


CHIMERA_VARIANTS = ("direct", "forward-doubling", "backward-halving")
GRAD_SYNC = ("eager-opt", "eager", "end")


def our_variants(quick: bool) -> list:
    """(label, extra flags) of our configurations."""
    variants = [("ours 1f1b", ["--pipeline-schedule", "1f1b"]),
                ("ours interleaved-1f1b", ["--num-layers-per-virtual-pipeline-stage",
                                           "1" if quick else "2"])]
    for variant in CHIMERA_VARIANTS:
        for policy in (GRAD_SYNC[:1] if quick else GRAD_SYNC):
            variants.append((f"ours chimera {variant} {policy}",
                             ["--pipeline-schedule", "chimera", "--chimera-variant", variant,
                              "--chimera-grad-sync", policy]))
    variants += [("ours 1f1b split-backward", ["--pipeline-schedule", "1f1b", "--split-backward"]),
                 ("ours chimera direct split-backward",
                  ["--pipeline-schedule", "chimera", "--split-backward"]),
                 ("ours chimera forward-doubling split-backward",
                  ["--pipeline-schedule", "chimera", "--chimera-variant", "forward-doubling",
                   "--split-backward"])]
    return variants


TORCH_SCHEDULES = ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                   "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


# ------------------------------------------------------------------------------ the plain model

class PlainBlock(torch.nn.Module):
    """nanoGPT's block: pre-LN causal self-attention and a GeLU MLP."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc, self.fc_proj = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden,
                                                                                    hidden)

    def forward(self, x):
        batch, sequence, hidden = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(hidden, dim=2)
        q, k, v = (t.view(batch, sequence, self.heads, hidden // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, sequence, hidden))
        return x + self.fc_proj(torch.nn.functional.gelu(self.fc(self.ln_2(x))))


class PlainGPT(torch.nn.Module):
    """A nanoGPT-style GPT of the benchmark's shape (learned positions, untied head)."""

    def __init__(self, layers: int, hidden: int, heads: int, sequence: int, vocabulary: int):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocabulary, hidden)
        self.positions = torch.nn.Embedding(sequence, hidden)
        self.blocks = torch.nn.ModuleList(PlainBlock(hidden, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocabulary, bias=False)

    def forward(self, tokens, labels):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


# ------------------------------------------------------------------------------ configurations

class OurConfiguration:
    """One of our schedules, built through the real training code."""

    def __init__(self, label, flags, parallel_state, num_microbatches, quick):
        import pretrain_gpt
        from _harness import build_variant
        from megatron.core.pipeline_parallel.planning.plan import plan_from_config
        from megatron.core.pipeline_parallel.planning.simulator import simulate_plan
        batch = ["--global-batch-size", str(4 * num_microbatches)]
        self.label = label
        self.components, self.microbatches = build_variant(
            DEPTH, model_flags(quick) + flags + batch + ["--pipeline-model-parallel-size",
                                                        str(DEPTH)], parallel_state)
        self.simulated_bubble = simulate_plan(plan_from_config(self.components.config)).bubble_ratio
        self.forward_step = pretrain_gpt.forward_step

    def step(self) -> None:
        from megatron.training.training import train_step
        train_step(self.components, self.forward_step, self.microbatches)

    def peak_stored_mb(self) -> float:
        return self.components.runtime.peak_bytes / 2**20


class TorchConfiguration:
    """One torch.distributed.pipelining schedule over PipelineStages of our model chunks."""

    def __init__(self, name, rank, num_microbatches, quick):
        import pretrain_gpt
        from torch.distributed import pipelining
        from megatron.core.parallel_state import ParallelState
        from megatron.training.arguments import parse_args
        config = parse_args(model_flags(quick) + ["--global-batch-size",
                                                  str(4 * num_microbatches)])
        num_stages, stage_ids = torch_stage_ids(name, rank, DEPTH)
        multi = len(stage_ids) > 1
        per_stage = config.model.num_layers // num_stages
        self.stages, params = [], []
        for stage_id in stage_ids:
            chunk = pretrain_gpt.model_provider(
                config, ParallelState.single_process(), pre_process=stage_id == 0,
                post_process=stage_id == num_stages - 1,
                layer_range=range(stage_id * per_stage, (stage_id + 1) * per_stage))
            params += list(chunk.parameters())
            self.stages.append(pipelining.PipelineStage(chunk, stage_id, num_stages,
                                                        torch.device("cpu")))
        schedule_class = getattr(pipelining, name)
        self.schedule = schedule_class(self.stages if multi else self.stages[0],
                                       n_microbatches=num_microbatches, loss_fn=_loss)
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
        generator = torch.Generator().manual_seed(1234)
        batch = 4 * num_microbatches
        self.tokens = torch.randint(0, config.model.vocab_size, (batch, config.model.seq_length),
                                    generator=generator)
        self.labels = torch.randint(0, config.model.vocab_size, (batch, config.model.seq_length),
                                    generator=generator)
        self.first = 0 in stage_ids
        self.last = num_stages - 1 in stage_ids
        self.label = f"torch {name}"
        self.simulated_bubble = None

    def step(self) -> None:
        self.optimizer.zero_grad()
        args = (self.tokens,) if self.first else ()
        kwargs = {"target": self.labels, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)
        # Clipping by the global norm needs the norm over both ranks' parameters, as ours does.
        squares = torch.stack([p.grad.norm() ** 2 for p in self.params if p.grad is not None]).sum()
        torch.distributed.all_reduce(squares)
        coefficient = 1.0 / (float(squares.sqrt()) + 1e-6)
        if coefficient < 1.0:
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], coefficient)
        self.optimizer.step()

    @staticmethod
    def peak_stored_mb():
        return None


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class SingleProcess:
    """Our code on one process (the efficiency reference) and the plain model, on rank 0."""

    def __init__(self, num_microbatches, quick):
        import pretrain_gpt
        from _harness import build_variant
        from megatron.core.parallel_state import ParallelState
        batch = ["--global-batch-size", str(4 * num_microbatches)]
        self.ours, self.microbatches = build_variant(1, model_flags(quick) + batch,
                                                     ParallelState.single_process())
        self.forward_step = pretrain_gpt.forward_step
        model = self.ours.config.model
        torch.manual_seed(0)
        self.plain = PlainGPT(model.num_layers, model.hidden_size, model.num_attention_heads,
                              model.seq_length, model.padded_vocab_size)
        self.plain_optimizer = torch.optim.AdamW(self.plain.parameters(), lr=1e-4, fused=True)

    def ours_step(self) -> None:
        from megatron.training.training import train_step
        train_step(self.ours, self.forward_step, self.microbatches)

    def plain_step(self) -> None:
        self.plain_optimizer.zero_grad()
        for microbatch in self.microbatches:
            loss = self.plain(microbatch["tokens"], microbatch["labels"]) / len(self.microbatches)
            loss.backward()
        # nanoGPT clips at 1.0, as Megatron's default --clip-grad does for ours.
        torch.nn.utils.clip_grad_norm_(self.plain.parameters(), 1.0)
        self.plain_optimizer.step()


# ------------------------------------------------------------------------------ measuring

def _timed(step, barrier) -> float:
    barrier()
    start = time.perf_counter()
    step()
    barrier()
    return time.perf_counter() - start


def _build_configurations(rank, num_microbatches, quick, parallel_state):
    configurations = [OurConfiguration(label, flags, parallel_state, num_microbatches, quick)
                      for label, flags in our_variants(quick)]
    for name in TORCH_SCHEDULES:
        try:
            configurations.append(TorchConfiguration(name, rank, num_microbatches, quick))
        except Exception as error:  # a schedule that refuses this N (e.g. DualPipeV, N < 2D)
            configurations.append(f"torch {name}: {type(error).__name__}: {error}"[:160])
    return configurations


def _measure_rank(rank, world_size, microbatch_counts, rounds, iterations, quick):
    import logging

    import torch.distributed as dist
    from _harness import parallel_state_for
    logging.getLogger("megatron.training.config_validation").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    results = {}
    for num_microbatches in microbatch_counts:
        flags = [model_flags(quick) + f + ["--global-batch-size", str(4 * num_microbatches),
                                           "--pipeline-model-parallel-size", str(DEPTH)]
                 for _, f in our_variants(quick)]
        parallel_state = parallel_state_for(rank, world_size, flags)
        configurations = _build_configurations(rank, num_microbatches, quick, parallel_state)
        single = SingleProcess(num_microbatches, quick) if rank == 0 else None
        runnable = [c for c in configurations if not isinstance(c, str)]
        times = {c.label: [] for c in runnable}
        single_times = {"ours single process": [], "plain model": []}
        for configuration in runnable:  # warm-up: shape inference, allocator
            configuration.step()
        for _ in range(rounds):
            for configuration in runnable:
                times[configuration.label].append(
                    statistics.median(_timed(configuration.step, dist.barrier)
                                      for _ in range(iterations)))
            for label, step in (("ours single process", single and single.ours_step),
                                ("plain model", single and single.plain_step)):
                dist.barrier()  # rank 1 idles while rank 0 runs alone
                if single is not None:
                    single_times[label].append(statistics.median(
                        _timed(step, lambda: None) for _ in range(iterations)))
                dist.barrier()
        results[num_microbatches] = {
            "times": times, "single": single_times,
            "skipped": [c for c in configurations if isinstance(c, str)],
            "simulated": {c.label: c.simulated_bubble for c in runnable},
            "peaks": {c.label: c.peak_stored_mb() for c in runnable}}
    return results


def _spread(values):
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def report(per_rank: list, quick: bool) -> str:
    tokens_per_microbatch = 4 * (16 if quick else 128)
    lines = []
    for num_microbatches, measured in per_rank[0].items():
        tokens = tokens_per_microbatch * num_microbatches
        single = measured["single"]
        single_rate = tokens / statistics.median(single["ours single process"])
        plain_rate = tokens / statistics.median(single["plain model"])
        rows, best = [], {}
        for label, seconds in measured["times"].items():
            rates = [tokens / s for s in seconds]
            efficiency = statistics.median(rates) / (DEPTH * single_rate)
            simulated = measured["simulated"][label]
            peaks = [rank_results[num_microbatches]["peaks"][label] for rank_results in per_rank]
            rows.append([label, _spread(rates), f"{efficiency:.2f}", f"{1 - efficiency:.2f}",
                         "-" if simulated is None else f"{simulated:.2f}",
                         "-" if peaks[0] is None else " ".join(f"{p:.1f}" for p in peaks)])
            side = "ours" if label.startswith("ours") else "torch"
            best[side] = max(best.get(side, (0, "")), (statistics.median(rates), label))
        lines.append(f"== D = {DEPTH}, N = {num_microbatches} ({tokens} tokens per iteration) ==")
        lines.append(format_table(["configuration", "tokens/s", "efficiency", "measured bubble",
                                   "simulated bubble", "peak stored MB per rank"], rows))
        for note in measured["skipped"]:
            lines.append(f"not run: {note}")
        lines.append(f"single process: ours {single_rate:.0f} tokens/s, plain nanoGPT-style model "
                     f"{plain_rate:.0f} tokens/s, ours / plain = {single_rate / plain_rate:.3f}")
        if "ours" in best and "torch" in best:
            ours_rate, ours_label = best["ours"]
            torch_rate, torch_label = best["torch"]
            lines.append(f"best ours: {ours_label} {ours_rate:.0f}; best torch: {torch_label} "
                         f"{torch_rate:.0f}; ratio {ours_rate / torch_rate:.2f}")
        ours_1f1b = statistics.median(measured["times"]["ours 1f1b"])
        torch_1f1b = statistics.median(measured["times"].get("torch Schedule1F1B", [math.nan]))
        lines.append(f"our 1F1B / torch 1F1B tokens/s: {torch_1f1b / ours_1f1b:.2f}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, N = 2, one round")
    parser.add_argument("--microbatches", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed iterations per configuration and round (median kept)")
    args = parser.parse_args(argv)
    counts = args.microbatches or ([2] if args.quick else [2, 4, 8])
    rounds = args.rounds or (1 if args.quick else 2)
    iterations = args.iterations or (1 if args.quick else 3)
    torch.set_num_threads(1)
    per_rank = run_distributed(_measure_rank, DEPTH, counts, rounds, iterations, args.quick,
                               timeout=7200)
    print(report(per_rank, args.quick))
    print(f"{rounds} interleaved round(s) of {iterations} timed iteration(s) per configuration; "
          f"medians with (min-max) over rounds.")
    print(oversubscription_note(DEPTH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
