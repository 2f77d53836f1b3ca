"""A standing worker: a daemon that starts a fresh serving process for each run."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from remote_run import coordinate, env, no_worker_left


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def test_the_seeds_graph_on_a_standing_worker_equals_one_process(tmp_path):
    port = _free_port()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "somatize.worker", "--name", "gpu", "--listen",
         f"127.0.0.1:{port}"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        assert _listening(port, time.monotonic() + 30), "the daemon never listened"
        # a fresh process per run
        first = coordinate("standing", f"127.0.0.1:{port}", cwd=tmp_path)
        second = coordinate("standing", f"127.0.0.1:{port}", cwd=tmp_path)
        pids = [first.split("PID")[1].split()[0], second.split("PID")[1].split()[0]]
        assert pids[0] != pids[1]
        deadline = time.monotonic() + 30
        while not no_worker_left(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert no_worker_left(pids)
        assert daemon.poll() is None, "a run took the daemon with it"
    finally:
        daemon.send_signal(signal.SIGTERM)
        out, _ = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, out
    assert "listening on 127.0.0.1" in out


def test_a_standing_worker_nobody_listens_for_is_a_clear_error(tmp_path):
    out = coordinate("nobody_standing", f"127.0.0.1:{_free_port()}", cwd=tmp_path)
    assert "no standing worker answered" in out and "python -m somatize.worker" in out


def _peak_rss(pid: int) -> int:
    """The most memory process ``pid`` has held so far, in bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    return int(kb) * 1024


def test_a_request_that_never_ends_is_dropped_without_filling_the_daemons_memory(tmp_path):
    port, log = _free_port(), tmp_path / "daemon.log"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "somatize.worker", "--name", "gpu", "--listen",
         f"127.0.0.1:{port}"], env=env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        assert _listening(port, time.monotonic() + 30), "the daemon never listened"
        before = _peak_rss(daemon.pid)
        reply = b""
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            try:
                for _ in range(50):  # 50 MB and no newline
                    s.sendall(b"x" * (1 << 20))
                s.shutdown(socket.SHUT_WR)
                while chunk := s.recv(1 << 16):
                    reply += chunk
            except OSError:  # dropped while we still sent: what should happen
                pass
        deadline = time.monotonic() + 30
        while "bad request" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        grew = _peak_rss(daemon.pid) - before
        assert grew < 8 << 20, f"the daemon's peak memory grew by {grew >> 20} MB"
        assert "more than 65536 bytes without a newline" in log.read_text()
        assert not reply or b"more than 65536 bytes" in reply, reply[:200]
        assert _listening(port, time.monotonic() + 5) and daemon.poll() is None  # serves on
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, log.read_text()
