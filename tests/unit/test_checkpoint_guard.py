"""Checks before training: a run never starts afresh over checkpoints it does not resume, and an
unusable --save is reported before any work is done (tier 0: files only, no processes)."""

import os
from types import SimpleNamespace

import pytest

from megatron.training.checkpointing import (TRACKER_FILENAME, check_checkpoint_directories,
                                             iteration_dir_name, saved_iterations, write_tracker)


def _checkpoint_config(save=None, load=None, finetune=False, allow=False):
    return SimpleNamespace(save=save, load=load, finetune=finetune,
                           allow_overwrite_checkpoints=allow)


def _saved_run(root, iterations=(2, 4), tracker=True):
    for iteration in iterations:
        os.makedirs(os.path.join(root, iteration_dir_name(iteration)))
    if tracker:
        write_tracker(str(root), iterations[-1])
    return str(root)


def test_fresh_and_resuming_runs_pass(tmp_path):
    check_checkpoint_directories(_checkpoint_config(save=str(tmp_path / "new")))
    assert os.path.isdir(tmp_path / "new")
    save = _saved_run(tmp_path / "run")
    check_checkpoint_directories(_checkpoint_config(save=save, load=save))
    check_checkpoint_directories(_checkpoint_config(save=save + "/", load=save))  # same directory
    assert saved_iterations(save) == ["iter_0000002", "iter_0000004"]


def test_missing_tracker_stops(tmp_path):
    save = _saved_run(tmp_path / "run", tracker=False)
    with pytest.raises(ValueError, match=f"no {TRACKER_FILENAME}.*--allow-overwrite-checkpoints"):
        check_checkpoint_directories(_checkpoint_config(save=save, load=save))


def test_unreadable_tracker_stops(tmp_path):
    save = _saved_run(tmp_path / "run")
    with open(os.path.join(save, TRACKER_FILENAME), "w") as handle:
        handle.write("garbage")
    with pytest.raises(ValueError, match="unreadable"):
        check_checkpoint_directories(_checkpoint_config(save=save, load=save))


def test_mistyped_load_stops(tmp_path):
    save = _saved_run(tmp_path / "run")
    with pytest.raises(ValueError, match=r"finds no checkpoint in --load .*runn.*mistyped"):
        check_checkpoint_directories(_checkpoint_config(save=save, load=str(tmp_path / "runn")))


def test_no_load_and_finetune_over_checkpoints_stop(tmp_path):
    save = _saved_run(tmp_path / "run")
    with pytest.raises(ValueError, match="does not load them"):
        check_checkpoint_directories(_checkpoint_config(save=save))
    with pytest.raises(ValueError, match="--finetune"):
        check_checkpoint_directories(_checkpoint_config(save=save, load=save, finetune=True))


def test_the_flag_allows_a_fresh_start(tmp_path):
    save = _saved_run(tmp_path / "run", tracker=False)
    check_checkpoint_directories(_checkpoint_config(save=save, allow=True))


def test_unwritable_save_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for save in (str(blocker), str(blocker / "sub")):  # a file; a path below a file
        with pytest.raises(ValueError, match=f"--save {save} is not a writable directory"):
            check_checkpoint_directories(_checkpoint_config(save=save))
    assert not any(name.startswith(".write-probe") for name in os.listdir(tmp_path))


def test_an_offline_writer_never_overwrites_an_iteration_and_clears_a_leftover_staging_dir(tmp_path):
    from megatron.training.checkpointing.files import fresh_staging_dir
    final_dir, staging_dir = fresh_staging_dir(str(tmp_path), 7)
    assert final_dir.endswith("iter_0000007") and staging_dir == final_dir + ".tmp"
    os.makedirs(os.path.join(staging_dir, "leftover"))
    assert fresh_staging_dir(str(tmp_path), 7) == (final_dir, staging_dir)
    assert not os.path.exists(staging_dir)  # the interrupted writer's files are gone
    os.makedirs(final_dir)
    with pytest.raises(KeyError, match="iter_0000007 already exists; choose an empty --save"):
        fresh_staging_dir(str(tmp_path), 7, KeyError)


def test_an_offline_writer_publishes_only_what_it_finished(tmp_path):
    """published_iteration_dir: a block that raises leaves no iteration and no tracker behind;
    one that ends renames its staging directory into place and then writes the tracker."""
    from megatron.training.checkpointing.files import published_iteration_dir, read_tracker
    root = str(tmp_path)
    with pytest.raises(RuntimeError, match="disk full"):
        with published_iteration_dir(root, 3) as (final_dir, staging_dir):
            os.makedirs(staging_dir)
            (tmp_path / os.path.basename(staging_dir) / "part").write_text("half")
            raise RuntimeError("disk full")
    assert sorted(os.listdir(root)) == []
    with published_iteration_dir(root, 3) as (final_dir, staging_dir):
        os.makedirs(staging_dir)
        (tmp_path / os.path.basename(staging_dir) / "part").write_text("whole")
        assert not os.path.exists(final_dir)
    assert open(os.path.join(final_dir, "part")).read() == "whole"
    assert read_tracker(root) == 3 and not os.path.exists(staging_dir)
