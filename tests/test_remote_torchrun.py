"""torchrun: rank 0 coordinates, rank 1 serves the graph's "gpu" (the same script,
tests/remote_standing_runs.py's ``torchrun``)."""

from __future__ import annotations

import socket

from remote_run import script_of
from scenario import scenario


def test_the_seeds_graph_on_a_torchrun_rank_equals_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = scenario("-m", "torch.distributed.run", "--nproc-per-node=2",
                 "--master-addr=127.0.0.1", f"--master-port={port}", script_of("torchrun"),
                 "torchrun",
                 timeout=120, cwd=tmp_path)
    assert "EQUAL" in r.stdout
