"""torchrun: rank 0 coordinates, rank 1 serves the graph's "gpu" (the same script)."""

from __future__ import annotations

import socket
import subprocess
import sys

from remote_run import PRELUDE, env

SCRIPT = """
from somatize.remote import serve_if_worker
assert serve_if_worker()                       # rank 1 serves and never returns
""" + PRELUDE + """
here = Graph.somatize(Body() >> Head()).forward(x)
with Graph.somatize(Body().at("gpu") >> Head()) as g:
    y = g.forward(x)
    assert runtime_for(g).peers["gpu"].kind == "torchrun"
    assert runtime_for(g).call("gpu", lambda live: int(os.environ["RANK"])) == 1
assert torch.equal(y, here)
print("EQUAL", flush=True)
"""


def test_the_seeds_graph_on_a_torchrun_rank_equals_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--master-addr=127.0.0.1", f"--master-port={port}", str(script)],
        capture_output=True, text=True, timeout=120, env=env(), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "EQUAL" in r.stdout
