"""``tools/performance_model.py --measure``: the fits of megatron/training/calibration.py on
hand-made timings, and a tiny CPU calibration whose profile ``--profile`` reads back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from megatron.performance_model import ModelSpec, layer_forward_flops, load_profile  # noqa: E402
from megatron.training.calibration import fit_alpha_beta, fit_compute  # noqa: E402

TOOL = Path(__file__).resolve().parents[2] / "tools" / "performance_model.py"
TINY = ModelSpec(4, 64, 4, 64, 256)
TINY_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "64", "--vocab-size", "256"]


def synthetic_records(rate, half_tokens, overhead):
    """Timings that follow the model exactly: F + Bk = 3·flops·(t + t½)/(R·t) + 2·o."""
    records = []
    for layers in (1, 4):
        for size in (1, 2, 4):
            flops = layers * layer_forward_flops(TINY, size)
            tokens = size * TINY.seq_length
            total = 3 * flops * (tokens + half_tokens) / (rate * tokens) + 2 * overhead
            records.append({"layers": layers, "micro_batch_size": size, "forward_flops": flops,
                            "forward_s": total / 3, "backward_s": 2 * total / 3})
    return records


def test_fit_compute_recovers_the_constants_of_exact_timings():
    fitted = fit_compute(synthetic_records(1e10, 100.0, 1e-4), TINY.seq_length)
    assert fitted["flops_per_second"] == pytest.approx(1e10)
    assert fitted["half_efficiency_tokens"] == pytest.approx(100.0)
    assert fitted["op_overhead_seconds"] == pytest.approx(1e-4)
    flat = fit_compute(synthetic_records(2e10, 0.0, 0.0), TINY.seq_length)
    assert flat["flops_per_second"] == pytest.approx(2e10)
    assert flat["half_efficiency_tokens"] == pytest.approx(0.0, abs=1e-6)
    assert flat["op_overhead_seconds"] == pytest.approx(0.0, abs=1e-12)


def test_fit_compute_keeps_constants_non_negative():
    # Per-FLOP timings minus a constant would fit a negative overhead: that term is dropped and
    # the rest refitted, so every constant stays >= 0.
    records = synthetic_records(1e10, 0.0, 0.0)
    for record in records:
        record["forward_s"] -= 1e-6
    fitted = fit_compute(records, TINY.seq_length)
    assert fitted["op_overhead_seconds"] >= 0 and fitted["half_efficiency_tokens"] >= 0
    assert fitted["flops_per_second"] == pytest.approx(1e10, rel=0.05)


def test_fit_alpha_beta_hand_case():
    records = [{"bytes": size, "seconds": 2e-5 + size * 1e-9} for size in (1e3, 1e5, 1e6)]
    assert fit_alpha_beta(records) == pytest.approx({"alpha": 2e-5, "beta": 1e-9})
    with pytest.raises(ValueError, match="bandwidth"):
        fit_alpha_beta([{"bytes": 1e3, "seconds": 1e-3}, {"bytes": 1e6, "seconds": 1e-4}])


@pytest.mark.distributed  # starts a process
def test_measure_on_cpu_writes_a_profile_that_profile_reads_back(tmp_path):
    out = tmp_path / "cpu_profile.json"
    measured = subprocess.run(
        [sys.executable, str(TOOL), *TINY_FLAGS, "--measure", "--out", str(out),
         "--measure-device", "cpu", "--measure-micro-batch-sizes", "1,2",
         "--measure-layers", "2", "--measure-repeats", "3", "--measure-threads", "1"],
        capture_output=True, text=True, timeout=120)
    assert measured.returncode == 0, measured.stderr
    assert f"wrote {out}" in measured.stdout
    data = json.loads(out.read_text())
    assert data["measurements"]["device"] == "cpu"
    assert len(data["measurements"]["compute"]) == 4  # 2 stage sizes x 2 micro-batch sizes
    collectives = data["measurements"]["collectives"]
    assert "skipped" in collectives or collectives["backend"] == "gloo"
    hardware = load_profile(str(out))
    assert hardware.flops_per_second > 0 and hardware.nodes_per_group == 0
    assert hardware.flops_per_second == data["hardware"]["flops_per_second"]
    # this project's runtime recomputes as Megatron does, not as the paper's authors' did
    assert not hardware.recompute_whole_stage and hardware.last_stage_kept == ()
    ranked = subprocess.run(
        [sys.executable, str(TOOL), *TINY_FLAGS, "--profile", str(out), "--world-size", "4",
         "--global-batch-size", "8", "--schemes", "chimera-direct,1f1b", "--top", "3"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    assert ranked.splitlines()[0].split()[:3] == ["scheme", "W", "D"]
    assert "pretrain_gpt.py flags" in ranked.splitlines()[-1]


@pytest.mark.distributed  # starts a process
def test_profile_flag_overrides_and_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hardware": {"flops": 1}}))
    completed = subprocess.run(
        [sys.executable, str(TOOL), *TINY_FLAGS, "--profile", str(bad), "--world-size", "4",
         "--global-batch-size", "8"], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2 and "unknown hardware field" in completed.stderr
    missing = subprocess.run([sys.executable, str(TOOL), *TINY_FLAGS],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--world-size and --global-batch-size" in missing.stderr
