"""Launch a ``pretrain_gpt.py`` configuration K times, optionally injecting a fault, and count outcomes.

    python tools/stress.py --launches 50 --nproc 2 --preset chimera-pp2-eager-opt
    python tools/stress.py --launches 10 --nproc 2 --preset 1f1b-pp2 --fault stop --fault-after 8 \\
        --distributed-timeout-minutes 1
    python tools/stress.py --launches 20 --nproc 4 -- --pipeline-model-parallel-size 4 ...

Each launch runs ``torchrun --nproc-per-node N pretrain_gpt.py`` (one thread per rank) with the
preset's flags, then any flags after ``--``. Faults, applied to one worker (local rank
``--fault-rank``) ``--fault-after`` seconds after its first logged iteration (give enough
``--train-iters`` that training is still running then):

- ``none``: the run must finish: exit status 0 and its last iteration logged;
- ``stop``: SIGSTOP (a stalled peer); the run must end, with a non-zero status, within the
  distributed timeout plus ``--grace`` seconds of the signal;
- ``kill``: SIGKILL (a lost rank); the run must end with a non-zero status.

A launch that outlives ``--launch-timeout`` is a hang: its whole process group is killed. The report
(stdout, and JSON with ``--json PATH``) counts exit statuses, hangs, ``terminate called`` aborts at
exit, launches that met the expectation, and wall times (min / median / max). The exit status of the
tool is 0 exactly when every launch met the expectation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from megatron.training.process_tree import child_pids

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --log-interval 1 --eval-iters 0 "
        "--train-iters 4")
PRESETS = {
    "1f1b-pp2": "--pipeline-model-parallel-size 2",
    "1f1b-pp4": "--pipeline-model-parallel-size 4",
    "interleaved-pp2": "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
    "interleaved-pp4": "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
                       "--num-layers 8",
    **{f"chimera-pp{depth}-{sync}": f"--pipeline-model-parallel-size {depth} --pipeline-schedule "
                                    f"chimera --chimera-grad-sync {sync}"
       for depth in (2, 4) for sync in ("eager-opt", "eager", "end")},
}
ABORT_MARKER = "terminate called"
# Lines kept in the report: exception messages ("...Error: ...", "...CommunicationTimeout: ...",
# not the source lines of a traceback) and aborts.
ERROR_MARKERS = ("Error: ", "Exception: ", "Timeout: ", ABORT_MARKER)
FIRST_ITERATION = " iteration        1/"


@dataclass
class LaunchOutcome:
    """One launch: exit status (None for a hang), wall time and what its output showed."""

    returncode: Optional[int]
    wall_s: float
    aborted_at_exit: bool
    finished_training: bool
    met_expectation: bool
    fault_injected: bool = False
    ended_after_fault_s: Optional[float] = None  # from the signal to the end of the launch
    error_lines: list = field(default_factory=list, repr=False)  # first lines naming an error
    tail: str = field(default="", repr=False)


def _inject(process: subprocess.Popen, fault: str, rank: int, after: float,
            log_path: str) -> Optional[float]:
    """Once the run logged its first iteration, wait ``after`` seconds and signal worker
    ``rank``; returns the time of the signal (``time.monotonic``), None when the run ended first.
    Counting from the first iteration (not the launch) puts the fault inside training even when
    start-up is slow on a busy machine."""
    while FIRST_ITERATION not in _read(log_path):
        if process.poll() is not None:
            return None
        time.sleep(0.2)
    deadline = time.monotonic() + after
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return None
        time.sleep(0.2)
    workers = child_pids(process.pid)
    if len(workers) <= rank:
        return None
    os.kill(workers[rank], signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    return time.monotonic()


def _read(path: str) -> str:
    with open(path, errors="replace") as handle:
        return handle.read()


def _expected(fault: str, returncode: Optional[int], finished: bool, ended_after_fault: float,
              limit: float) -> bool:
    """No fault: exit 0 with the last iteration logged. A fault (``ended_after_fault`` is the
    seconds from the signal to the end, None when it was not injected): non-zero within ``limit``."""
    if returncode is None:
        return False
    if fault == "none":
        return returncode == 0 and finished
    return ended_after_fault is not None and returncode != 0 and ended_after_fault <= limit


def run_launch(command: list[str], options, log_path: str) -> LaunchOutcome:
    """One torchrun launch with the fault of ``options``; output goes to ``log_path``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        injected_at = None
        if options.fault != "none":
            injected_at = _inject(process, options.fault, options.fault_rank,
                                  options.fault_after, log_path)
        try:
            returncode = process.wait(timeout=max(1.0, options.launch_timeout
                                                  - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the agent and every worker, stopped or not
            process.wait()
            returncode = None
    ended = time.monotonic()
    wall = ended - started
    output = _read(log_path)
    finished = f" iteration {options.train_iters:8d}/" in output
    ended_after_fault = None if injected_at is None else ended - injected_at
    limit = options.distributed_timeout_minutes * 60 + options.grace
    return LaunchOutcome(returncode=returncode, wall_s=round(wall, 2),
                         aborted_at_exit=ABORT_MARKER in output, finished_training=finished,
                         fault_injected=injected_at is not None,
                         ended_after_fault_s=(None if ended_after_fault is None
                                              else round(ended_after_fault, 2)),
                         met_expectation=_expected(options.fault, returncode, finished,
                                                   ended_after_fault, limit),
                         error_lines=[line for line in output.splitlines()
                                      if any(marker in line for marker in ERROR_MARKERS)][:10],
                         tail=output[-1500:])


def summarize(outcomes: list[LaunchOutcome]) -> dict:
    """Counts of exit statuses, hangs, aborts and met expectations; wall-time statistics."""
    statuses: dict = {}
    for outcome in outcomes:
        key = "hang" if outcome.returncode is None else str(outcome.returncode)
        statuses[key] = statuses.get(key, 0) + 1
    walls = [outcome.wall_s for outcome in outcomes]
    after_fault = [outcome.ended_after_fault_s for outcome in outcomes
                   if outcome.ended_after_fault_s is not None]
    return {"launches": len(outcomes), "exit_statuses": statuses,
            "hangs": sum(outcome.returncode is None for outcome in outcomes),
            "aborted_at_exit": sum(outcome.aborted_at_exit for outcome in outcomes),
            "met_expectation": sum(outcome.met_expectation for outcome in outcomes),
            "wall_s": _spread(walls),
            "ended_after_fault_s": _spread(after_fault)}


def _spread(values: list) -> dict:
    """min / median / max of ``values`` (empty when there are none)."""
    return {"min": min(values), "median": statistics.median(values),
            "max": max(values)} if values else {}


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Presets: " + ", ".join(PRESETS))
    parser.add_argument("--launches", type=int, default=10, help="launches (K)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="pipeline configuration")
    parser.add_argument("--fault", choices=("none", "stop", "kill"), default="none")
    parser.add_argument("--fault-rank", type=int, default=1, help="local rank that gets the fault")
    parser.add_argument("--fault-after", type=float, default=2.0,
                        help="seconds after the first logged iteration")
    parser.add_argument("--train-iters", type=int, default=4)
    parser.add_argument("--distributed-timeout-minutes", type=float, default=1.0)
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds past the timeout a faulted run may take to end")
    parser.add_argument("--launch-timeout", type=float, default=300.0,
                        help="seconds after which a launch counts as a hang and is killed")
    parser.add_argument("--json", help="also write the report (and each launch) here")
    parser.add_argument("--keep-failed-logs", metavar="DIR",
                        help="copy the whole output of every launch that did not meet the "
                             "expectation into DIR (launchK.log)")
    parser.add_argument("extra", nargs="*", help="further pretrain_gpt.py flags (after --)")
    options = parser.parse_args(argv)
    if options.launches < 1 or options.nproc < 1:
        parser.error("--launches and --nproc must be >= 1")
    if options.fault != "none" and not 0 <= options.fault_rank < options.nproc:
        parser.error(f"--fault-rank {options.fault_rank} is not a rank of --nproc {options.nproc}")
    return options


def build_command(options) -> list[str]:
    flags = TINY.split() + (PRESETS[options.preset].split() if options.preset else [])
    flags += ["--train-iters", str(options.train_iters),
              "--distributed-timeout-minutes", str(options.distributed_timeout_minutes),
              *options.extra]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
            str(options.nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            os.path.join(REPO, "pretrain_gpt.py"), *flags]


def main(argv=None) -> int:
    options = parse_options(argv)
    command = build_command(options)
    print("command:", " ".join(command), flush=True)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="stress-") as logs:
        for index in range(options.launches):
            outcome = run_launch(command, options, os.path.join(logs, f"launch{index}.log"))
            outcomes.append(outcome)
            status = "hang" if outcome.returncode is None else outcome.returncode
            print(f"launch {index + 1}/{options.launches}: exit {status}, {outcome.wall_s:.1f} s"
                  f"{', ABORT at exit' if outcome.aborted_at_exit else ''}"
                  f"{'' if outcome.met_expectation else ', UNEXPECTED'}", flush=True)
            if not outcome.met_expectation:
                print(outcome.tail, flush=True)
                if options.keep_failed_logs:
                    os.makedirs(options.keep_failed_logs, exist_ok=True)
                    shutil.copy(os.path.join(logs, f"launch{index}.log"),
                                options.keep_failed_logs)
    report = {"preset": options.preset, "fault": options.fault, "nproc": options.nproc,
              **summarize(outcomes)}
    print(json.dumps(report, indent=2), flush=True)
    if options.json:
        with open(options.json, "w") as handle:
            json.dump({**report, "command": command,
                       "outcomes": [asdict(outcome) for outcome in outcomes]}, handle, indent=2)
    return 0 if report["met_expectation"] == report["launches"] else 1


if __name__ == "__main__":
    sys.exit(main())
