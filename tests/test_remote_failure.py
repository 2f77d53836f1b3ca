"""A worker killed in the middle of a run: a clear error within the timeout, and the
coordinator exits cleanly, leaving no process behind."""

from __future__ import annotations

from remote_run import coordinate, no_worker_left


def test_killing_a_worker_mid_run_raises_and_the_coordinator_exits_cleanly(tmp_path):
    out = coordinate("killed_mid_run", cwd=tmp_path)
    assert "was lost while running" in out, out
    assert no_worker_left([out.split("PID")[1].split()[0]])
