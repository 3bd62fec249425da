"""Seeing what a pipeline iteration did: measured timelines, bubble ratios and stored activations.

``--pipeline-timeline DIR`` records one chosen training iteration on every rank (each executed op
with its start and end, measured after a barrier so the ranks share an origin), gathers the records
on the first rank and writes them as one Chrome-trace JSON (open it in Perfetto or chrome://tracing),
then prints each rank's measured bubble ratio (1 - compute time / iteration span) next to the
simulator's prediction for the same lowered schedule with the measured mean forward and backward
times as costs. At the end of training the runtime reports each rank's peak stored-activation bytes
(what autograd kept for the backward, counted by the interpreter) and, on GPUs, CUDA's peak memory.

Message hops: with the timeline on, the interpreter also keeps a
:class:`~.interpreter.MessageRecord` per message it sends or consumes (absolute CLOCK_MONOTONIC
seconds, comparable between the processes of one host). :func:`message_hops` pairs each send with
its receive: the delay from the producer's send post to the moment the consumer had the tensor,
and on the producer's side the lag from the producing op's end to the post and how long posting
took. Where the consumer actually waited (:data:`WAITED_SECONDS`), the delay is the message's
real latency through our runtime; where it did not, it is only an upper bound.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from statistics import mean, median
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..planning.simulator import simulate


def _gather(value) -> list:
    """``value`` from every rank of the world, in rank order (a one-element list alone)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _is_compute(name: str) -> bool:
    return name[:1] in ("F", "B", "I", "W") and name[1:2].isdigit()


# Thread ids of a rank's lanes in the trace: compute ops, and communication (posting groups,
# waiting for received tensors and, at the end, for the sends), so overlap is visible.
_LANES = ("compute", "communication")


def chrome_trace(records_by_rank: Sequence[dict]) -> dict:
    """Chrome-trace events: one process per global rank, one thread per lane (see _LANES)."""
    events = []
    for entry in records_by_rank:
        events.append({"name": "process_name", "ph": "M", "pid": entry["rank"],
                       "args": {"name": f"rank {entry['rank']} (pipeline rank {entry['pp_rank']})"}})
        for record in entry["records"]:
            lane = "compute" if _is_compute(record[0]) else "communication"
            events.append({
                "name": record[0], "ph": "X", "pid": entry["rank"], "tid": _LANES.index(lane),
                "ts": record[1] * 1e6, "dur": max(record[2] - record[1], 0.0) * 1e6,
                "cat": lane, "args": {"pipeline rank": entry["pp_rank"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def measured_bubble_ratios(records_by_rank: Sequence[dict]) -> list[float]:
    """Per rank: 1 - compute time / iteration span (span = latest end over all ranks)."""
    span = max((record[2] for entry in records_by_rank for record in entry["records"]),
               default=0.0)
    ratios = []
    for entry in records_by_rank:
        busy = sum(r[2] - r[1] for r in entry["records"] if _is_compute(r[0]))
        ratios.append(1 - busy / span if span > 0 else 0.0)
    return ratios


def predicted_bubble_ratios(lowered, records_by_rank: Sequence[dict]) -> list[float]:
    """The simulator's per-pipeline-rank bubble ratios, costed with the measured mean F and B."""
    durations = {"F": [], "B": []}
    for entry in records_by_rank:
        for name, start, end in entry["records"]:
            if _is_compute(name) and name[0] in durations:
                durations[name[0]].append(end - start)
    forward = mean(durations["F"]) if durations["F"] else 1.0
    backward = mean(durations["B"]) if durations["B"] else 2.0
    result = simulate(lowered, forward_cost=forward, backward_cost=backward,
                      p2p_semantics="async")
    return [1 - busy / result.makespan if result.makespan > 0 else 0.0
            for busy in result.compute_time]


# A consumer "waited" for a message when its wait lasted longer than this (seconds; shorter waits
# are the wait call and unpacking, not the message arriving); only then is
# the moment it had the tensor the message's arrival.
WAITED_SECONDS = 1e-3


@dataclass(frozen=True)
class MessageHop:
    """One pipeline message, producer and consumer records paired (absolute seconds)."""

    key: tuple  # (kind, pipeline, stage, micro-batch)
    producer_rank: int
    consumer_rank: int
    produced: Optional[float]  # the producing op's end (None: not produced by a compute op)
    posted: float  # the send was posted
    post_returned: float  # posting returned
    asked: float  # the consuming op asked for the tensor
    ready: float  # ... and had it
    receive_posted: Optional[float] = None  # the consumer posted its receive

    @property
    def delay(self) -> float:
        """Send post (sender's clock) to the consumer having the tensor (receiver's clock)."""
        return self.ready - self.posted

    @property
    def waited(self) -> bool:
        return self.ready - self.asked > WAITED_SECONDS


def message_hops(messages_by_rank: Sequence[Sequence]) -> list[MessageHop]:
    """Pair every rank's send records with the consumer's receive records, by message key.

    ``messages_by_rank[r]`` holds rank r's :class:`~.interpreter.MessageRecord` list; a key sent
    or received twice, or a send without its receive, is an error (the records are of one
    iteration of one lowered schedule)."""
    sends, receives = {}, {}
    for rank, records in enumerate(messages_by_rank):
        for record in records:
            table = sends if record.side == "send" else receives
            if record.key in table:
                raise ValueError(f"message {record.key} recorded twice as a {record.side}; pass "
                                 f"the records of one iteration")
            table[record.key] = (rank, record)
    if set(sends) != set(receives):
        missing = sorted(map(str, set(sends) ^ set(receives)))[:4]
        raise ValueError(f"messages sent but not received or received but not sent: {missing}")
    hops = []
    for key, (producer, send) in sends.items():
        consumer, receive = receives[key]
        hops.append(MessageHop(key, producer, consumer, send.produced, send.posted,
                               send.returned, receive.posted, receive.returned, receive.produced))
    return hops


def _quantile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def hop_summary(hops: Sequence[MessageHop]) -> dict:
    """Seconds: ``delay_median`` / ``delay_p90`` over the hops whose consumer waited (``waited``
    of ``messages``), ``post_lag_median`` / ``post_lag_max`` (producing op's end to send post),
    ``post_max`` (longest time posting a send took), ``late_receives`` (waited hops whose receive
    was posted after the send) and ``transfer_median`` (waited hops: input ready minus the later
    of the two posts, the time the transport took once both sides had posted)."""
    waited = [hop.delay for hop in hops if hop.waited]
    both_posted = [(hop, hop.receive_posted) for hop in hops
                   if hop.waited and hop.receive_posted is not None]
    transfers = [hop.ready - max(hop.posted, received) for hop, received in both_posted]
    lags = [hop.posted - hop.produced for hop in hops if hop.produced is not None]
    return {"messages": len(hops), "waited": len(waited),
            "delay_median": median(waited) if waited else 0.0,
            "delay_p90": _quantile(waited, 0.9),
            "post_lag_median": median(lags) if lags else 0.0,
            "post_lag_max": max(lags, default=0.0),
            "post_max": max((hop.post_returned - hop.posted for hop in hops), default=0.0),
            "late_receives": sum(received > hop.posted for hop, received in both_posted),
            "transfer_median": median(transfers) if transfers else 0.0,
            "slowest": [_describe_hop(hop) for hop in sorted(
                (hop for hop in hops if hop.waited), key=lambda hop: -hop.delay)[:3]]}


def _describe_hop(hop: MessageHop) -> str:
    """One waited hop in words, times in ms after the send post."""
    def since_post(moment: Optional[float]) -> str:
        return "?" if moment is None else f"{(moment - hop.posted) * 1e3:+.1f}"
    kind, pipeline, stage, microbatch = hop.key
    return (f"{kind[0]}{pipeline}.{stage}.{microbatch} rank {hop.producer_rank}->"
            f"{hop.consumer_rank}: receive posted {since_post(hop.receive_posted)}, asked "
            f"{since_post(hop.asked)}, ready {since_post(hop.ready)} ms")


def describe_hops(summary: dict) -> str:
    return (f"message hops: {summary['waited']} of {summary['messages']} consumers waited, send "
            f"post -> input ready median {summary['delay_median'] * 1e3:.2f} ms, p90 "
            f"{summary['delay_p90'] * 1e3:.2f} ms; producing op end -> send post median "
            f"{summary['post_lag_median'] * 1e3:.3f} ms, max "
            f"{summary['post_lag_max'] * 1e3:.3f} ms; posting a send at most "
            f"{summary['post_max'] * 1e3:.3f} ms; {summary['late_receives']} waited hops had "
            f"their receive posted after the send, both posted -> input ready median "
            f"{summary['transfer_median'] * 1e3:.2f} ms; slowest: "
            + ("; ".join(summary["slowest"]) or "-"))


def gather_message_hops(messages, group=None) -> list[MessageHop]:
    """Collective over ``group`` (default: the world; it must hold one pipeline, so that message
    keys are unique): every rank's message records of one iteration, paired, on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return message_hops([messages])
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(messages), group=group)
    return message_hops(gathered)


def write_timeline(directory: str, iteration: int, records, parallel_state, lowered,
                   log) -> None:
    """Collective: gather every rank's records; the first rank writes the trace and logs ratios."""
    entry = {"rank": parallel_state.rank, "pp_rank": parallel_state.pp_rank,
             "records": [(r.op, r.start, r.end) for r in records]}
    gathered = _gather(entry)
    if parallel_state.rank != 0:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"pipeline_timeline_iter{iteration:07d}.json")
    with open(path, "w") as handle:
        json.dump(chrome_trace(gathered), handle)
    measured = measured_bubble_ratios(gathered)
    predicted = predicted_bubble_ratios(lowered, gathered)
    log(f"> pipeline timeline of iteration {iteration} written to {path} (open in Perfetto)")
    for entry, ratio in zip(gathered, measured):
        log(f">   rank {entry['rank']:3d} (pipeline rank {entry['pp_rank']}): measured bubble "
            f"ratio {ratio:.3f} | simulated {predicted[entry['pp_rank']]:.3f}")


def report_memory(peak_bytes: int, peak_stored: int, device: torch.device, log) -> None:
    """Collective: log every rank's peak stored activations (and CUDA peak memory on GPUs)."""
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    gathered = _gather((peak_bytes, peak_stored, cuda_peak))
    if log is None:
        return
    parts = [f"{index}: {nbytes / 2**20:.2f} MB ({count} micro-batches)"
             for index, (nbytes, count, _) in enumerate(gathered)]
    log("> peak stored activations per rank: " + " | ".join(parts))
    if cuda_peak is not None:
        log("> CUDA peak memory per rank (MB): " + " | ".join(
            f"{index}: {peak / 2**20:.1f}" for index, (_, _, peak) in enumerate(gathered)))
