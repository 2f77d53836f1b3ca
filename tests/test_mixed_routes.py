"""Both routes in one LightningModule: a submodule placed by name and a GraphModule with
a node placed by ``.at(...)``, trained together under SomatizeStrategy to plain
Lightning's numbers, bit for bit (tests/mixed_runs.py, in a fresh process)."""

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "tests", "mixed_runs.py")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def test_a_placed_submodule_and_a_graph_node_placed_in_one_model_both_train_exactly(tmp_path):
    out = tmp_path / "mixed.pt"
    done = subprocess.run([sys.executable, RUNS, "mixed", str(out)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    plain_losses, plain = got["plain"]
    split_losses, split = got["split"]
    assert len(plain_losses) == 12 and split_losses == plain_losses
    assert plain.keys() == split.keys()
    for k in plain:
        assert torch.equal(split[k], plain[k]), k
        assert not torch.equal(plain[k], got["fresh"][k]), k  # every weight trained
    # each route's work ran in a worker process, every step
    where = got["where"]
    assert got["pid"] not in where[""]["encoder"] and sum(where[""]["encoder"].values()) >= 12
    assert got["pid"] not in where["net"]["body"] and sum(where["net"]["body"].values()) >= 12
