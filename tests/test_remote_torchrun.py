"""torchrun: rank 0 coordinates, rank 1 serves the graph's "gpu" (the same script,
tests/remote_scripts.py's ``torchrun``)."""

from __future__ import annotations

import socket
import subprocess
import sys

from remote_run import SCRIPTS, env


def test_the_seeds_graph_on_a_torchrun_rank_equals_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPTS), "torchrun"],
        capture_output=True, text=True, timeout=120, env=env(), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "EQUAL" in r.stdout
