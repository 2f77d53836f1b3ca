"""What a stranger on the network reaches of a run across machines: the coordinator on
test host a, its standing worker on host b, a stranger on host c, as another user
(tests/hosts.py; docs/security.md, "A run across machines").

    bash scripts/test.sh tests/test_hosts_exposure.py      # as root, with `ip` and `tc`
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from remote_run import HERE, env, listeners

RUNS = str(HERE / "exposure_runs.py")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user (root only)")


def _ip(hexaddr: str) -> str:
    # /proc/net/tcp{,6} writes an address as 32-bit words in the host's byte order
    raw = b"".join(struct.pack("=I", int(hexaddr[i:i + 8], 16))
                   for i in range(0, len(hexaddr), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _daemon(host, tmp_path: Path, e: dict):
    log = tmp_path / "daemon.log"
    with open(log, "w") as out:
        proc = host.popen([sys.executable, "-m", "somatize.worker", "--name", "gpu", "--listen",
                           f"{host.addr}:7000"], env=e, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while "listening on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, log


@as_root
def test_a_stranger_on_the_network_reaches_no_tensorpipe_listener_of_a_run_across_hosts(
        hosts, tmp_path):
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    e = env()
    daemon = _daemon(b, tmp_path, e)
    ready, go = tmp_path / "ready.json", tmp_path / "go"
    target = a.popen([sys.executable, RUNS, "target", str(ready), str(go), a.addr,
                      f"{b.addr}:7000"], env=e, cwd=tmp_path, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    victim = tmp_path / "made-by-a-stranger"  # in a directory only root enters
    seen = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert target.poll() is None and time.monotonic() < deadline, target.communicate()
            time.sleep(0.05)
        got = json.loads(ready.read_text())
        # every port the coordinator (on a) and its serving process (on b) listen on
        addrs = {f"{h.addr if _ip(x) in ('0.0.0.0', '::') else _ip(x)}:{port}"
                 for pid, h in ((got["pid"], a), (got["worker_pid"], b))
                 for x, port in listeners(pid)}
        beyond = sorted(x for x in addrs if x.startswith("198.18."))
        gate = f"{a.addr}:{got['gate']}"
        assert gate in beyond and len(beyond) >= 10, addrs  # TensorPipe's, on both hosts
        before = _digest(got["ckpt"])
        os.chmod(seen, 0o777)  # the stranger writes what it saw here
        out = seen / "stranger.json"
        r = c.run([sys.executable, RUNS, "reach", ",".join(beyond), ",".join(got["tp"]),
                   got["gate"], str(victim),
                   got["ckpt"], str(out), "--as-nobody"], timeout=120,
                  env={k: v for k, v in e.items() if k != "SOMATIZE_TOKEN"})
        assert out.exists(), r.stderr[-3000:]
        seen_by = json.loads(out.read_text())
    finally:
        go.touch()
        stdout, stderr = target.communicate(timeout=90)
        daemon[0].send_signal(signal.SIGTERM)
        daemon[0].wait(timeout=30)
    # the gate answers (and refuses the junk); every TensorPipe listener drops the SYN
    assert list(seen_by["reached"]) == [gate], seen_by
    assert sorted(seen_by["no answer"]) == [x for x in beyond if x != gate], seen_by
    assert not victim.exists() and not list(seen.glob("*.ran"))  # no built-in, no Python
    assert _digest(got["ckpt"]) == before
    assert target.returncode == 0 and "SAME True" in stdout, stderr[-3000:]
    assert f"refused a join from {c.addr}:" in stderr
    assert "cut a connection" not in stderr + daemon[1].read_text()
