"""The JIT build lock: one process builds while another waits; stale locks (dead owner, too old)
and a live owner that never finishes raise errors naming the lock file. No C++ is compiled: the
build is a fake function, and load_jit_extension's torch call is replaced."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron.core.pipeline_parallel.execution import build_lock, packing


def write_lock(path, pid, host=None, started=None, pid_namespace=None):
    path.write_text(json.dumps({
        "pid": pid, "host": host or socket.gethostname(),
        "started": time.time() if started is None else started,
        "pid_namespace": build_lock._this_pid_namespace() if pid_namespace is None
        else pid_namespace}))


def dead_pid() -> int:
    """The pid of a process that has exited (reuse within the test is vanishingly unlikely)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _builder_process(lock_path, artifact, events_path, started, release):
    """One rank: build the artifact under the lock unless it exists; record what it did."""
    def record(line):
        with open(events_path, "a") as handle:
            handle.write(f"{os.getpid()} {line}\n")

    def fake_build():
        if not os.path.exists(artifact):
            record("compiled")
            started.set()
            release.wait(30)
            with open(artifact, "w") as handle:
                handle.write("built")
        else:
            record("loaded cached build")
        with open(artifact) as handle:
            return handle.read()

    result = build_lock.run_exclusively(lock_path, fake_build, what="the fake build",
                                        timeout_s=30, poll_s=0.02, log=lambda _: record("waited"))
    record(f"result {result}")


@pytest.mark.distributed  # starts a process
def test_two_processes_build_once(tmp_path):
    lock_path, artifact = tmp_path / "build.lock", tmp_path / "artifact"
    events = tmp_path / "events.txt"
    context = multiprocessing.get_context("fork")
    started, release = context.Event(), context.Event()
    arguments = (str(lock_path), str(artifact), str(events), started, release)
    first = context.Process(target=_builder_process, args=arguments)
    first.start()
    try:
        assert started.wait(30), "the first process never started building"
        owner = build_lock.read_lock_owner(lock_path)
        assert owner is not None and owner.pid == first.pid
        second = context.Process(target=_builder_process, args=arguments)
        second.start()
        deadline = time.monotonic() + 30
        while "waited" not in (events.read_text() if events.exists() else ""):
            assert time.monotonic() < deadline, "the second process did not wait for the lock"
            time.sleep(0.02)
    finally:
        release.set()
    first.join(30)
    second.join(30)
    assert first.exitcode == 0 and second.exitcode == 0
    lines = events.read_text().splitlines()
    assert lines.count(f"{first.pid} compiled") == 1
    assert f"{second.pid} waited" in lines and f"{second.pid} loaded cached build" in lines
    assert sum("compiled" in line for line in lines) == 1
    assert sum("result built" in line for line in lines) == 2
    assert not lock_path.exists()


@pytest.mark.distributed  # starts a process
def test_lock_of_a_dead_process_is_reported_with_the_file_to_delete(tmp_path):
    lock_path = tmp_path / "build.lock"
    pid = dead_pid()
    write_lock(lock_path, pid)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"pid {pid} on host .* is no longer running") as error:
        build_lock.run_exclusively(lock_path, lambda: "never", timeout_s=30)
    assert time.monotonic() - started < 5
    assert f"rm {lock_path}" in str(error.value) and "stale" in str(error.value)
    assert lock_path.exists()  # reported, never removed behind the user's back


@pytest.mark.distributed  # starts a process
def test_dead_pid_in_another_container_is_judged_by_age_only(tmp_path):
    """Same host name, other pid namespace: the pid means nothing here, so a young lock waits."""
    lock_path = tmp_path / "build.lock"
    write_lock(lock_path, dead_pid(), pid_namespace="pid:[1]")
    with pytest.raises(RuntimeError, match="waited"):
        build_lock.run_exclusively(lock_path, lambda: "never", timeout_s=0.2, poll_s=0.02)


def test_old_lock_from_another_host_is_stale(tmp_path):
    lock_path = tmp_path / "build.lock"
    write_lock(lock_path, os.getpid(), host="some-other-node", started=time.time() - 7200)
    with pytest.raises(RuntimeError, match="some-other-node 7200 s ago.*rm "):
        build_lock.run_exclusively(lock_path, lambda: "never", stale_after_s=1800)


def test_unreadable_old_lock_is_stale_by_its_age(tmp_path):
    lock_path = tmp_path / "build.lock"
    lock_path.write_text("")
    os.utime(lock_path, (time.time() - 100, time.time() - 100))
    with pytest.raises(RuntimeError, match="unknown process"):
        build_lock.run_exclusively(lock_path, lambda: "never", stale_after_s=50)


def test_waiting_on_a_live_owner_times_out_with_a_clear_message(tmp_path):
    lock_path = tmp_path / "build.lock"
    write_lock(lock_path, os.getpid())  # alive, on this host: a build in progress
    messages = []
    with pytest.raises(RuntimeError, match=f"waited .* for pid {os.getpid()} .*rm {lock_path}"):
        build_lock.run_exclusively(lock_path, lambda: "never", what="the fake build",
                                   timeout_s=0.2, poll_s=0.02, log=messages.append)
    assert messages == [f"waiting for pid {os.getpid()} on host {socket.gethostname()} to finish "
                        f"the fake build (lock file {lock_path})"]


def test_lock_is_released_when_the_build_fails(tmp_path):
    lock_path = tmp_path / "build.lock"

    def failing_build():
        assert build_lock.read_lock_owner(lock_path).pid == os.getpid()
        raise RuntimeError("compiler error")

    with pytest.raises(RuntimeError, match="compiler error"):
        build_lock.run_exclusively(lock_path, failing_build)
    assert not lock_path.exists()
    assert build_lock.run_exclusively(lock_path, lambda: 42) == 42


@pytest.fixture
def fake_jit(monkeypatch, tmp_path):
    """load_jit_extension with the build directory in tmp_path and torch's compiler call faked."""
    from torch.utils import cpp_extension

    calls = []

    def fake_load(**kwargs):
        calls.append(kwargs)
        return "fake module"

    monkeypatch.setattr(cpp_extension, "get_cxx_compiler", lambda: sys.executable)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(packing, "jit_build_directory", lambda: tmp_path)
    monkeypatch.setattr(packing, "_check_extension", lambda module: None)
    return calls


def test_load_jit_extension_builds_under_the_lock(fake_jit, tmp_path):
    assert packing.load_jit_extension.__wrapped__() == "fake module"
    assert fake_jit[0]["build_directory"] == str(tmp_path)
    assert not (tmp_path / packing.JIT_BUILD_LOCK_NAME).exists()


@pytest.mark.distributed  # starts a process
def test_load_jit_extension_reports_a_stale_lock_instead_of_hanging(fake_jit, tmp_path):
    lock_path = tmp_path / packing.JIT_BUILD_LOCK_NAME
    write_lock(lock_path, dead_pid())
    with pytest.raises(RuntimeError, match=f"compiling packing.cpp .*stale.*rm {lock_path}"):
        packing.load_jit_extension.__wrapped__()
    assert fake_jit == []


def test_load_jit_extension_reports_a_leftover_torch_baton(fake_jit, tmp_path):
    baton = tmp_path / packing.TORCH_BATON_NAME
    baton.write_text("")
    with pytest.raises(RuntimeError, match=f"torch's build lock .*forever.*rm {baton}"):
        packing.load_jit_extension.__wrapped__()
    assert fake_jit == [] and not (tmp_path / packing.JIT_BUILD_LOCK_NAME).exists()
