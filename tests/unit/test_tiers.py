"""The test tiers of tests/conftest.py: markers come from the directory, and a fast-tier test that
starts a process fails instead of quietly making the fast tier slow."""

import multiprocessing
import os
import pathlib
import subprocess

import pytest

import conftest


class FakeItem:
    def __init__(self, relative_path):
        self.path = pathlib.Path(conftest.TESTS_DIR) / relative_path
        self.markers = []

    def add_marker(self, marker):
        self.markers.append(marker)


def test_markers_follow_the_directory():
    items = [FakeItem(path) for path in ("distributed/test_x.py", "smoke/test_y.py",
                                         "unit/test_z.py", "numerics/test_w.py",
                                         "unit/test_lint.py")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.markers for item in items] == [["distributed"], ["smoke"], [], [], ["lint"]]


def test_this_fast_tier_test_carries_no_process_marker(request):
    assert not any(request.node.get_closest_marker(name) for name in conftest.PROCESS_MARKERS)


def test_a_fast_tier_test_cannot_start_a_process():
    with pytest.raises(RuntimeError, match="starts a process .subprocess.*tests/distributed"):
        subprocess.run(["true"], check=True)
    with pytest.raises(RuntimeError, match="starts a process .multiprocessing"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(RuntimeError, match="starts a process .os.fork"):
        os.fork()
