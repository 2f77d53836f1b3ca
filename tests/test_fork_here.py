"""Embedded workers forked from a server forked from the coordinator at the fit's start
(somatize/remote/_fork_here.py), where no fork server is named: the fit trains to plain
Lightning's numbers, the worker sees of itself what a fresh one does, a coordinator that
cannot fork safely (another thread) starts a fresh server instead, and killing the
coordinator ends its worker and the server."""

import json
import os
import signal
import time

from scenario import env, own_children, scenario, start

from somatize.remote._death import process_state


def _no_server(environ=None) -> dict:
    e = env() if environ is None else environ
    e.pop("SOMATIZE_FORKS", None)  # conftest's server: none named, so the fit forks its own
    return e


def _fit(tmp_path, name, environ, *how):
    out = tmp_path / f"{name}.json"
    done = scenario("fork_here_runs.py", "fit", out, *how, cwd=tmp_path, environ=environ)
    assert "closed" in done.stdout
    return json.loads(out.read_text()), done.stdout + done.stderr


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_worker_forked_from_the_coordinator_trains_and_sees_what_a_fresh_one_does(tmp_path):
    forked, _ = _fit(tmp_path, "forked", _no_server())
    fresh, _ = _fit(tmp_path, "fresh", own_children(env()))
    assert forked["server"] is not None and fresh["server"] is None
    assert forked["seen"]["ppid"] == forked["server"]  # the server forked from the coordinator
    assert fresh["seen"]["ppid"] == fresh["me"]  # the coordinator's own child
    assert forked["placed"] == forked["plain"] == fresh["placed"]
    for got in (forked, fresh):
        got["seen"].pop("ppid"), got["seen"].pop("pid")
    assert forked["seen"] == fresh["seen"]
    assert forked["seen"]["marked"] is False  # somatize imported afresh over there
    assert forked["seen"]["sigusr1"] is True  # the coordinator's handler is not its


def test_a_coordinator_running_another_thread_starts_a_fresh_server_and_trains_the_same(
        tmp_path):
    got, said = _fit(tmp_path, "thread", _no_server(), "thread")
    assert got["server"] is None
    assert "not from this process: 2 Python threads run here" in said
    assert got["placed"] == got["plain"]


def test_killing_the_coordinator_ends_its_forked_worker_and_server(tmp_path):
    pids = tmp_path / "pids.json"
    proc = start("fork_here_runs.py", "killed", pids, cwd=tmp_path, environ=_no_server())
    deadline = time.monotonic() + 120
    while not pids.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    got = json.loads(pids.read_text())
    assert _parent(got["server"]) == got["me"] and _parent(got["worker"]) == got["server"]
    os.kill(got["me"], signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(process_state(got[k]) not in ("?", "Z") for k in ("server", "worker")):
        assert time.monotonic() < deadline, {k: process_state(got[k]) for k in got}
        time.sleep(0.1)
