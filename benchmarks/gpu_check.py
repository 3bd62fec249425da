#!/usr/bin/env python
"""The Python steps of benchmarks/gpu_check.sh (run that script, not this one, on a GPU machine).

Subcommands, each printing one summary line and writing a JSON file:

* ``stage OUT.json``: one GPT-2 1.3B-like pipeline stage (this project's GPTModel, transformer layers
  only) forward and backward time per micro-batch size, in bf16, and its model-FLOPs utilisation
  = 3 x forward FLOPs (Megatron's count, megatron/performance_model/costs.py) / (F + Bk) / peak.
  Peak: ``GPU_PEAK_TFLOPS`` if set, else a table of dense bf16 peaks by device name (H200/H100
  SXM 989, A100 312); unknown devices report time and TFLOP/s without MFU.
* ``p2p OUT.json``: NCCL point-to-point ping-pong between two GPUs (gloo between two processes in
  CPU dry mode); bandwidth of the largest message. Skipped, with the reason, on one GPU.
* ``compare-losses CUDA_LOG CPU_LOG OUT.json``: the ``lm loss`` values two pretrain_gpt.py logs
  printed, compared iteration by iteration within ``--rtol``.

Sizes come from the environment (defaults = the GPU sizes): ``STAGE_HIDDEN`` (2048),
``STAGE_HEADS`` (16), ``STAGE_LAYERS`` (4), ``STAGE_SEQ`` (1024), ``STAGE_MICRO_BATCHES`` (1,2,4),
``STAGE_DTYPE`` (bf16), ``GPU_CHECK_DEVICE`` (cuda, or cpu for the dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

#: Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by a substring of the device name.
BF16_PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("GH200", 989.0), ("A100", 312.0),
                    ("L40S", 362.0), ("A10", 125.0))
LOSS_PATTERN = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|")


def environment_int_list(name: str, default: str) -> list:
    return [int(value) for value in os.environ.get(name, default).split(",") if value]


def peak_flops(device) -> tuple:
    """(peak FLOP/s or None, where the number came from)."""
    import torch

    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"]) * 1e12, "GPU_PEAK_TFLOPS"
    if device.type != "cuda":
        return None, "CPU dry run: no peak, no MFU"
    name = torch.cuda.get_device_name(device)
    for key, tflops in BF16_PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12, f"dense bf16 peak of {key} ({tflops:.0f} TFLOP/s)"
    return None, f"unknown peak for {name!r}: set GPU_PEAK_TFLOPS for MFU"


def stage_check(out_path: str) -> int:
    import torch

    from megatron.performance_model import ModelSpec, layer_forward_flops
    from megatron.training.calibration import DTYPES, build_stage, resolve_device, time_stage

    device = resolve_device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))
    dtype_name = os.environ.get("STAGE_DTYPE", "bf16")
    hidden = int(os.environ.get("STAGE_HIDDEN", "2048"))
    model = ModelSpec(num_layers=int(os.environ.get("STAGE_LAYERS", "4")), hidden_size=hidden,
                      num_attention_heads=int(os.environ.get("STAGE_HEADS", "16")),
                      seq_length=int(os.environ.get("STAGE_SEQ", "1024")), vocab_size=50304,
                      bytes_per_value=2 if dtype_name != "fp32" else 4)
    peak, peak_source = peak_flops(device)
    stage = build_stage(model, model.num_layers, device, DTYPES[dtype_name])
    rows = []
    for size in environment_int_list("STAGE_MICRO_BATCHES", "1,2,4"):
        forward, backward = time_stage(stage, model, size, device, DTYPES[dtype_name], repeats=5)
        flops = 3 * model.num_layers * layer_forward_flops(model, size)
        achieved = flops / (forward + backward)
        rows.append({"micro_batch_size": size, "forward_s": forward, "backward_s": backward,
                     "model_flops": flops, "tflops": achieved / 1e12,
                     "mfu": achieved / peak if peak else None})
        mfu = f", MFU {achieved / peak:.1%}" if peak else ""
        print(f"stage {model.num_layers} layers h={hidden} s={model.seq_length} {dtype_name} "
              f"B={size}: forward {forward * 1e3:.2f} ms, backward {backward * 1e3:.2f} ms, "
              f"{achieved / 1e12:.1f} TFLOP/s{mfu}")
    result = {"device": str(device), "dtype": dtype_name, "peak_source": peak_source,
              "layers": model.num_layers, "hidden_size": hidden, "seq_length": model.seq_length,
              "heads": model.num_attention_heads, "rows": rows, "torch": torch.__version__}
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    write_json(out_path, result)
    return 0


def p2p_check(out_path: str) -> int:
    from megatron.training.calibration import measure_collectives, resolve_device

    device = resolve_device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))
    sizes = (1 << 20, 1 << 24, 1 << 26) if device.type == "cuda" else (1 << 12, 1 << 18)
    measured = measure_collectives(device, sizes=sizes, repeats=5, timeout=100)
    if "skipped" in measured:
        print(f"p2p: skipped: {measured['skipped']}")
    else:
        largest = max(measured["p2p"], key=lambda r: r["bytes"])
        bandwidth = largest["bytes"] / largest["seconds"] / 1e9
        measured["p2p_bandwidth_gb_per_s"] = bandwidth
        print(f"p2p ({measured['backend']}): {largest['bytes'] / 2**10:.0f} KiB message in "
              f"{largest['seconds'] * 1e3:.3f} ms = {bandwidth:.1f} GB/s one way")
    write_json(out_path, measured)
    return 0


def logged_losses(path: str) -> dict:
    """{iteration: lm loss} from a pretrain_gpt.py log."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return {int(m.group(1)): float(m.group(2)) for m in LOSS_PATTERN.finditer(handle.read())}


def compare_losses(first_log: str, second_log: str, out_path: str, rtol: float) -> int:
    first, second = logged_losses(first_log), logged_losses(second_log)
    common = sorted(set(first) & set(second))
    if not common:
        print(f"loss comparison: FAILED, no 'lm loss' lines in both logs "
              f"({len(first)} in {first_log}, {len(second)} in {second_log})")
        write_json(out_path, {"ok": False, "first": first, "second": second})
        return 1
    worst = max(abs(first[i] - second[i]) / abs(second[i]) for i in common)
    ok = worst <= rtol and len(common) == len(first) == len(second)
    print(f"loss comparison over {len(common)} iterations: largest relative difference "
          f"{worst:.2e} (tolerance {rtol:.0e}): {'OK' if ok else 'FAILED'}; "
          + ", ".join(f"{i}: {first[i]:.6f}/{second[i]:.6f}" for i in common))
    write_json(out_path, {"ok": ok, "rtol": rtol, "largest_relative_difference": worst,
                          "first": first, "second": second})
    return 0 if ok else 1


def write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=2, sort_keys=True)
        handle.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("stage").add_argument("out")
    commands.add_parser("p2p").add_argument("out")
    compare = commands.add_parser("compare-losses")
    compare.add_argument("first_log")
    compare.add_argument("second_log")
    compare.add_argument("out")
    compare.add_argument("--rtol", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if args.command == "stage":
        return stage_check(args.out)
    if args.command == "p2p":
        return p2p_check(args.out)
    return compare_losses(args.first_log, args.second_log, args.out, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
