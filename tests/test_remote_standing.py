"""A standing worker: a daemon that starts a fresh serving process for each run."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from remote_run import coordinate, env, no_worker_left, script_of


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
        while "refused a run" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        grew = _peak_rss(daemon.pid) - before
        assert grew < 8 << 20, f"the daemon's peak memory grew by {grew >> 20} MB"
        # junk is no proof of the token: refused before any of it is read as a request
        assert "refused a run from 127.0.0.1" in log.read_text()
        assert "did not prove it holds the run's secret" in log.read_text()
        assert len(reply) <= 64, reply[:200]  # a nonce and a proof, nothing more
        assert _listening(port, time.monotonic() + 5) and daemon.poll() is None  # serves on
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, log.read_text()


def test_a_standing_worker_refuses_a_coordinator_with_another_token(tmp_path):
    port, log = _free_port(), tmp_path / "daemon.log"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "somatize.worker", "--name", "gpu", "--listen",
         f"127.0.0.1:{port}"], env={**env(), "SOMATIZE_TOKEN": "the-workers-own-token-1"},
        stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        assert _listening(port, time.monotonic() + 30), "the daemon never listened"
        wrong = subprocess.run(
            [sys.executable, str(script_of("nobody_standing")), "nobody_standing",
             f"127.0.0.1:{port}"],
            env={**env(), "SOMATIZE_TOKEN": "not-the-workers-token-2"}, cwd=tmp_path,
            capture_output=True, text=True, timeout=90)
        assert "do not hold the same token" in wrong.stdout, wrong.stdout + wrong.stderr
        assert "SOMATIZE_TOKEN_FILE" in wrong.stdout
        assert "refused a run from 127.0.0.1" in log.read_text()
        assert "run joined" not in log.read_text()  # nothing was started for it
        # and the right token is served on, by the same daemon
        right = subprocess.run(
            [sys.executable, str(script_of("standing")), "standing", f"127.0.0.1:{port}"],
            env={**env(), "SOMATIZE_TOKEN": "the-workers-own-token-1"}, cwd=tmp_path,
            capture_output=True, text=True, timeout=90)
        assert right.returncode == 0 and "PID" in right.stdout, right.stderr[-3000:]
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, log.read_text()


def test_a_standing_worker_started_without_a_token_makes_one_only_its_owner_reads(tmp_path):
    port, log = _free_port(), tmp_path / "daemon.log"
    e = {k: v for k, v in env().items() if k != "SOMATIZE_TOKEN"}
    e["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "somatize.worker", "--name", "gpu", "--listen",
         f"127.0.0.1:{port}"], env=e, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        assert _listening(port, time.monotonic() + 30), "the daemon never listened"
        path = tmp_path / "config" / "somatize" / "worker-gpu.token"
        assert path.stat().st_mode & 0o777 == 0o600
        token = path.read_text().strip()
        assert len(token) == 64 and token not in log.read_text()
        assert str(path) in log.read_text()
        r = subprocess.run(  # a coordinator given a copy of the file is served
            [sys.executable, str(script_of("standing")), "standing", f"127.0.0.1:{port}"],
            env={**e, "SOMATIZE_TOKEN_FILE": str(path)}, cwd=tmp_path,
            capture_output=True, text=True, timeout=90)
        assert r.returncode == 0 and "PID" in r.stdout, r.stderr[-3000:]
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, log.read_text()
