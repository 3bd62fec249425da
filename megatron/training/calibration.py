"""Calibrate the performance model on the present device (``tools/performance_model.py --measure``).

Measures, with torch and this project's own GPT code (:class:`megatron.core.models.gpt.GPTModel`):

* one pipeline stage's forward and backward time (a middle stage: transformer layers only, hidden
  state in and out) for a few micro-batch sizes and two stage sizes, and fits the compute terms of
  :class:`~megatron.performance_model.specs.HardwareSpec` by least squares:
  ``T(F+Bk) = 3·flops/R + 3·flops·t½/(R·B·s) + 2·o`` (the model's F + Bk without recomputation,
  rate ``R·t/(t + t½)``, per-op overhead ``o``), with every constant kept >= 0;
* point-to-point and all-reduce micro-benchmarks between 2 local processes (fastest of the
  repeats, like the compute timings) (gloo on CPU, NCCL on
  GPUs when there are two), fitting ``t = α + β·L`` on the p2p times; skipped, with a message, when
  only one process can run (one GPU) or when asked to.

The result is a :class:`HardwareSpec` plus the raw measurements, written as a JSON profile by
:func:`megatron.performance_model.profiles.save_profile`. Torch is imported here only, never in
``megatron/performance_model`` (which must stay torch-free).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import multiprocessing
import os
import tempfile
import time

import torch

from megatron.core.pipeline_parallel.execution.instruction_timing import synchronized_clock
from megatron.performance_model.costs import layer_forward_flops
from megatron.performance_model.specs import HardwareSpec, ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--measure-device cuda asked for, but torch sees no CUDA device; "
                         "use --measure-device cpu")
    return torch.device(name)


def build_stage(model: ModelSpec, num_layers: int, device: torch.device, dtype: torch.dtype):
    """A middle pipeline stage of ``num_layers`` layers of ``model`` (no embedding, no output
    layer), dropout off, parameters in ``dtype`` on ``device``."""
    from megatron.core.config import ModelConfig, RecomputeConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import ParallelState

    config = ModelConfig(num_layers=num_layers, hidden_size=model.hidden_size,
                         ffn_hidden_size=model.ffn, num_attention_heads=model.num_attention_heads,
                         seq_length=model.seq_length,
                         max_position_embeddings=max(model.positions, model.seq_length),
                         padded_vocab_size=model.vocab_size, attention_dropout=0.0,
                         hidden_dropout=0.0)
    stage = GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234,
                     layer_range=range(num_layers), pre_process=False, post_process=False,
                     params_dtype=dtype, device=device)
    return stage.train()


def time_stage(stage, model: ModelSpec, micro_batch_size: int, device: torch.device,
               dtype: torch.dtype, repeats: int = 5, warmup: int = 2) -> tuple:
    """(forward seconds, backward seconds) of one micro-batch, the fastest of ``repeats`` (the
    minimum is the least disturbed by other work on a shared machine)."""
    shape = (model.seq_length, micro_batch_size, model.hidden_size)
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype)
    grad = torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype)
    forwards, backwards = [], []
    for step in range(warmup + repeats):
        inputs = hidden.detach().requires_grad_(True)
        start = synchronized_clock(device)
        output = stage(inputs)
        middle = synchronized_clock(device)
        output.backward(grad)
        end = synchronized_clock(device)
        stage.zero_grad(set_to_none=True)
        if step >= warmup:
            forwards.append(middle - start)
            backwards.append(end - middle)
    return min(forwards), min(backwards)


def measure_compute(model: ModelSpec, stage_layers, micro_batch_sizes, device: torch.device,
                    dtype: torch.dtype, repeats: int = 5) -> list:
    """One record per (stage layers, micro-batch size): times and the model's FLOP count."""
    records = []
    for layers in stage_layers:
        stage = build_stage(model, layers, device, dtype)
        for size in micro_batch_sizes:
            forward, backward = time_stage(stage, model, size, device, dtype, repeats)
            records.append({"layers": layers, "micro_batch_size": size, "forward_s": forward,
                            "backward_s": backward,
                            "forward_flops": layers * layer_forward_flops(model, size)})
        del stage
    return records


def _solve(columns, targets):
    """Least squares of the relative residuals of ``targets`` on the given columns (lists), in
    float64 (each row divided by its target: a 1 ms and a 100 ms timing count alike)."""
    weights = [1.0 / target for target in targets]
    matrix = torch.tensor([[value * w for value in row] for row, w in zip(zip(*columns), weights)],
                          dtype=torch.float64)
    vector = torch.tensor([1.0] * len(targets), dtype=torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(matrix, vector).solution.squeeze(1)
    residual = float(((matrix @ solution.unsqueeze(1)).squeeze(1) - vector.squeeze(1)).norm())
    return solution.tolist(), residual


def fit_compute(records, tokens_per_sample: int) -> dict:
    """Fit 1/R, t½/R and o (all >= 0) to F + Bk = 3·flops/R + 3·flops·t½/(R·tokens) + 2·o.

    Tries every subset of the two optional terms (t½, o) with 1/R always in and keeps the best
    fit whose coefficients are all non-negative (a tiny non-negative least squares)."""
    flops = [3 * r["forward_flops"] for r in records]
    per_token = [f / (r["micro_batch_size"] * tokens_per_sample) for f, r in zip(flops, records)]
    targets = [r["forward_s"] + r["backward_s"] for r in records]
    optional = {"half": per_token, "overhead": [2.0] * len(records)}
    best = None
    for count in range(len(optional) + 1):
        for names in itertools.combinations(optional, count):
            if len(records) < 1 + len(names):
                continue
            solution, residual = _solve([flops] + [optional[n] for n in names], targets)
            if any(value < 0 for value in solution):
                continue
            if best is None or residual < best[1] - 1e-15:
                best = (dict(zip(("inverse_rate",) + names, solution)), residual)
    if best is None or best[0]["inverse_rate"] <= 0:
        raise ValueError("the stage timings do not grow with the FLOPs: cannot fit a compute "
                         "rate (measure larger micro-batches or more layers)")
    fitted = best[0]
    rate = 1.0 / fitted["inverse_rate"]
    return {"flops_per_second": rate,
            "half_efficiency_tokens": fitted.get("half", 0.0) * rate,
            "op_overhead_seconds": fitted.get("overhead", 0.0)}


def fit_alpha_beta(records) -> dict:
    """Fit t = α + β·L to p2p records (``bytes``, ``seconds``), α and β >= 0."""
    sizes = [float(r["bytes"]) for r in records]
    seconds = [r["seconds"] for r in records]
    (alpha, beta), _ = _solve([[1.0] * len(sizes), sizes], seconds)
    if beta <= 0:
        raise ValueError("p2p times do not grow with the message size: cannot fit a bandwidth")
    if alpha < 0:
        (beta,), _ = _solve([sizes], seconds)
        alpha = 0.0
    return {"alpha": alpha, "beta": beta}


def _collective_worker(rank: int, world_size: int, store_path: str, backend: str,
                       sizes, repeats: int, results) -> None:
    """One rank of the p2p / all-reduce micro-benchmark (run in a child process)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        p2p, allreduce = [], []
        for size in sizes:
            buffer = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                start = synchronized_clock(device)
                if rank == 0:  # ping-pong: half the round trip is one message
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                else:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
                times.append((synchronized_clock(device) - start) / 2)
            p2p.append({"bytes": buffer.numel() * 4, "seconds": min(times[1:])})
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                start = synchronized_clock(device)
                dist.all_reduce(buffer)
                times.append(synchronized_clock(device) - start)
            allreduce.append({"bytes": buffer.numel() * 4, "ranks": world_size,
                              "seconds": min(times[1:])})
        dist.destroy_process_group()
        results.put((rank, "ok", {"p2p": p2p, "allreduce": allreduce}))
    except BaseException as error:  # report, never hang the parent
        results.put((rank, "error", f"{type(error).__name__}: {error}"))


def measure_collectives(device: torch.device, sizes=(1 << 12, 1 << 18, 1 << 22),
                        repeats: int = 3, timeout: float = 120.0) -> dict:
    """p2p ping-pong and all-reduce between 2 local processes: gloo on CPU (forked), NCCL on two
    GPUs (spawned). Returns {"p2p": [...], "allreduce": [...], "backend": ...} or
    {"skipped": reason} when it cannot run here."""
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            return {"skipped": "one GPU only: p2p and all-reduce need two processes with a "
                               "device each; the profile keeps the default alpha and beta"}
        backend, context = "nccl", multiprocessing.get_context("spawn")
    else:
        backend, context = "gloo", multiprocessing.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        processes = [context.Process(target=_collective_worker, daemon=True,
                                     args=(rank, 2, store, backend, tuple(sizes), repeats,
                                           results)) for rank in range(2)]
        for process in processes:
            process.start()
        outcomes, deadline = {}, time.monotonic() + timeout
        while len(outcomes) < 2 and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
                outcomes[rank] = (status, value)
            except Exception:  # queue.Empty: a rank may have died without a word
                if all(not p.is_alive() for p in processes) and len(outcomes) < 2:
                    break
        for process in processes:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()
    if len(outcomes) < 2 or any(status != "ok" for status, _ in outcomes.values()):
        reasons = "; ".join(f"rank {r}: {v}" for r, (s, v) in sorted(outcomes.items())
                            if s != "ok") or f"no answer within {timeout:.0f} s"
        return {"skipped": f"{backend} micro-benchmark failed ({reasons}); the profile keeps "
                           "the default alpha and beta"}
    measured = outcomes[0][1]
    measured["backend"] = backend
    return measured


def device_memory_bytes(device: torch.device, default: float) -> float:
    """Total memory of the device (physical memory on CPU where the OS says it)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return default


def calibrate(model: ModelSpec, base: HardwareSpec, stage_layers: int, micro_batch_sizes,
              device_name: str = "auto", dtype_name: str = "fp32", collectives: bool = True,
              repeats: int = 5, threads: int | None = None) -> tuple:
    """Measure and fit; returns (HardwareSpec, measurements dict, notes list).

    Compute: ``stage_layers`` layers and, when > 1, a 1-layer stage too (two stage sizes
    separate the per-op overhead from the per-layer part of the small-batch penalty).
    Constants not measured here (memory overhead, dragonfly contention, overlap slowdown) keep
    the values of ``base``, except that a single machine is a flat network (no groups), the
    measured α–β include any host staging (``host_staging_bandwidth`` 0) and the optimizer
    step is not costed (``memory_bandwidth`` 0: the base profile's is another device's).
    ``threads``: torch's CPU threads for the compute timings (None: torch's default; 1 gives
    stable numbers on a shared machine)."""
    device = resolve_device(device_name)
    dtype = DTYPES[dtype_name]
    notes = []
    layers = sorted({stage_layers, 1}) if stage_layers > 1 else [1]
    if len(micro_batch_sizes) * len(layers) < 3:
        notes.append("fewer than 3 timings: the fit drops the terms it cannot separate")
    collective = measure_collectives(device, repeats=repeats) if collectives else {
        "skipped": "not asked for (--measure-collectives off)"}
    if threads is not None:  # after the forked collective benchmark (fork needs one thread)
        torch.set_num_threads(threads)
    compute = measure_compute(model, layers, micro_batch_sizes, device, dtype, repeats)
    fitted = fit_compute(compute, model.seq_length)
    # The measured α–β already include any host copies, and the base profile's memory
    # bandwidth is another device's: no separate staging term, a free optimizer step. The
    # runtime measured is this project's: Megatron's full recomputation (the layers only, on
    # every stage), not the authors' that the paper profile models.
    changes = dict(fitted, nodes_per_group=0, global_bandwidth_fraction=1.0,
                   host_staging_bandwidth=0.0, memory_bandwidth=0.0,
                   recompute_whole_stage=False, last_stage_kept=(),
                   device_memory_bytes=device_memory_bytes(device, base.device_memory_bytes))
    if "skipped" in collective:
        notes.append(f"p2p/all-reduce skipped: {collective['skipped']}")
    else:
        changes.update(fit_alpha_beta(collective["p2p"]))
    hardware = dataclasses.replace(base, **changes)
    measurements = {"device": str(device), "dtype": dtype_name, "compute": compute,
                    "threads": torch.get_num_threads(),
                    "collectives": collective, "torch": torch.__version__}
    if device.type == "cuda":
        measurements["device_name"] = torch.cuda.get_device_name(device)
    return hardware, measurements, notes
