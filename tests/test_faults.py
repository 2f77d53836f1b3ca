"""Faults named: a worker out of memory, killed, or stopped while it starts, each said
as what it is."""

import os
import subprocess
import sys

import pytest
from remote_run import HERE, env
from scenario import own_children

RUNS = HERE / "fault_runs.py"


def _run(tmp_path, *args) -> str:
    # the scenarios that stop or kill "the coordinator's children" find workers as them
    children = args[0] in ("stopped", "placed_lost")
    try:
        r = subprocess.run([sys.executable, str(RUNS), *args],
                           env=own_children(env()) if children else env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:  # what it printed, the stacks of a hang among it
        said = [(s.decode(errors="replace") if isinstance(s, bytes) else s) or ""
                for s in (e.stdout, e.stderr)]
        pytest.fail(f"{args[0]} did not end within 180 s:\n{said[0]}\n{said[1][-6000:]}")
    assert r.returncode == 0 and "ERROR" in r.stdout, r.stdout + r.stderr[-3000:]
    return r.stdout


def _memory_cgroup():
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, kinds, path = line.strip().split(":", 2)
            if "memory" in kinds.split(","):
                return f"/sys/fs/cgroup/memory{path}"
    return None


@pytest.fixture
def small_cgroup():
    base = _memory_cgroup()
    if base is None or not os.access(base, os.W_OK):
        pytest.skip("needs a writable cgroup v1 memory hierarchy")
    d = os.path.join(base, f"somatize-test-{os.getpid()}")
    os.mkdir(d)
    with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
        f.write(str(400 << 20))
    try:
        yield d
    finally:
        os.rmdir(d)


def test_a_worker_killed_by_the_out_of_memory_killer_is_said_to_be_out_of_memory(
        tmp_path, small_cgroup):
    out = _run(tmp_path, "oom", small_cgroup)
    assert "out-of-memory killer" in out and "ran out of memory" in out, out
    assert "Killed process" in out  # the kernel's own words


def test_a_worker_killed_with_sigkill_names_the_likely_cause(tmp_path):
    out = _run(tmp_path, "killed")
    assert "killed (SIGKILL, exit code -9): most likely out of memory" in out, out
    assert "exited with code -9" not in out


def test_a_worker_stopped_while_it_starts_is_not_said_to_be_unreachable(tmp_path):
    out = _run(tmp_path, "stopped")
    assert "did not join the run within 10 s" in out, out
    assert "is stopped (SIGSTOP" in out, out
    assert "check that it can reach" not in out


def test_a_traceback_over_there_shows_the_users_file_and_line(tmp_path):
    out = _run(tmp_path, "traceback_there")
    assert "fault_runs.py\", line" in out and "x / undefined_name" in out, out
    assert "<dynamic-code>" not in out


def test_a_lost_worker_on_the_placed_route_is_not_told_to_close_a_graph(tmp_path):
    out = _run(tmp_path, "placed_lost")
    assert "was lost" in out and "run the fit again (it starts fresh workers)" in out, out
    assert ".close()" not in out
