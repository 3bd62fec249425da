"""``--async-save``'s cached save plans on two gloo ranks (``checkpointing/background.py``): a
rank whose local plan is unchanged writes with its cached part of the global plan, without a
collective of its own; when one rank's plan changed (another shape) while the other's did not,
every rank plans again through DCP and the published checkpoint holds the new shapes and values
(a stale plan would record the old shape in ``.metadata`` and fail to load them)."""

from __future__ import annotations

import os

import torch

from dist_harness import run_distributed


def _save(rank: int, group, plans, directory: str, tensors: dict, iteration: int):
    """One background save of this rank's ``tensors`` (the 1-D ones under 100 elements packed)
    into ``directory``; returns (outcome, published files on rank 0)."""
    from megatron.training.checkpointing.background import SaveJob
    from megatron.training.checkpointing.dcp_io import PieceSavePlanner
    from megatron.training.checkpointing.global_keys import Piece

    pieces = [Piece(key, tuple(value.shape), (0,) * value.dim(), value.clone())
              for key, value in tensors.items()]
    small = [piece for piece in pieces if piece.tensor.numel() < 100]
    planner = PieceSavePlanner([piece for piece in pieces if piece.tensor.numel() >= 100],
                               {"progress": {"iteration": iteration}}, packed=small,
                               packed_key=f"packed_tensors.rank_{rank:05d}")
    published = []
    job = SaveJob(rank, group, False, directory, lambda files: published.append(files) or [])
    return job.write_and_complete(planner, plans), published


def _read_back(directory: str, files: dict, shapes: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    from megatron.training.checkpointing.dcp_io import PieceLoadPlanner, VerifyingReader
    from megatron.training.checkpointing.global_keys import Piece
    from megatron.training.checkpointing.torch_dist import read_packed

    reader = VerifyingReader(directory, files)
    packed = {piece.key: piece.tensor for piece in read_packed(directory, files,
                                                               reader.read_metadata())}
    targets = [Piece(key, shape, (0,) * len(shape), torch.empty(shape))
               for key, shape in shapes.items() if key not in packed]
    dcp.load({}, storage_reader=VerifyingReader(directory, files),
             planner=PieceLoadPlanner(targets, ["progress"]), no_dist=True)
    return {**packed, **{piece.key: piece.tensor for piece in targets}}


def _three_saves_then_one_rank_reshapes(rank: int, world_size: int, root: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron.training.checkpointing.background import PlanCache

    planned = []
    dcp_save = dcp.save

    def counting_save(*args, **kwargs):
        planned.append(1)
        return dcp_save(*args, **kwargs)
    dcp.save = counting_save
    group = dist.new_group(backend="gloo")
    plans = PlanCache()
    torch.manual_seed(rank)
    tensors = {f"model.r{rank}.w": torch.randn(20, 10), f"model.r{rank}.b": torch.randn(10),
               "model.shared": torch.arange(6.0)}  # held by both ranks: packed once
    results = []
    for iteration in (1, 2, 3, 4):
        if iteration == 4 and rank == 1:  # only rank 1's local plan changes
            tensors = {**tensors, "model.r1.w": torch.randn(20, 12),
                       "model.r1.b": torch.randn(12)}
        tensors = {key: value + 1 for key, value in tensors.items()}
        directory = os.path.join(root, f"iter_{iteration}")
        outcome, published = _save(rank, group, plans, directory, tensors, iteration)
        assert outcome.error is None and not outcome.replan, (iteration, outcome)
        results.append((len(planned), published[0] if published else None,
                        {key: value for key, value in tensors.items()}))
    return results


def test_a_rank_whose_plan_changed_makes_every_rank_plan_again(tmp_path):
    ranks = run_distributed(_three_saves_then_one_rank_reshapes, 2, str(tmp_path), timeout=120)
    for rank_results in ranks:  # planned at the first save, reused twice, planned again
        assert [count for count, _, _ in rank_results] == [1, 1, 1, 2]
    for iteration in (1, 2, 3, 4):
        files = ranks[0][iteration - 1][1]
        tensors = {**ranks[0][iteration - 1][2], **ranks[1][iteration - 1][2]}
        loaded = _read_back(str(tmp_path / f"iter_{iteration}"), files,
                            {key: tuple(value.shape) for key, value in tensors.items()})
        for key, value in tensors.items():
            assert loaded[key].shape == value.shape and torch.equal(loaded[key], value), \
                (iteration, key)
