"""`torchrun --standalone --nproc-per-node=2 train.py +somatize=split`: rank 0 trains,
rank 1 serves the body, both exit 0, and Hydra writes one output directory."""

import os
import re

from scenario import ROOT, env, scenario

# what starting an embedded worker logs when these are unset (test_hydra shows it does)
EMBEDDED_SAYS = "shares this machine's cores"
EMBEDDED_SAYS_UNLESS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def test_torchrun_runs_the_coordinator_and_the_worker_from_one_script(tmp_path):
    environ = env(OMP_NUM_THREADS="1")
    for name in EMBEDDED_SAYS_UNLESS:  # so that an embedded worker, if started, says so
        environ.pop(name, None)
    done = scenario("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    ROOT / "train.py", "+somatize=split", "trainer.max_epochs=1",
                    "data.limit=64", "test=false", cwd=tmp_path, environ=environ)
    out = done.stdout + done.stderr
    assert EMBEDDED_SAYS not in out  # no local worker was started: rank 1 was the worker
    body = re.search(r"module 'body' ran in process (\d+) \(worker 'worker'\)", out)
    head = re.search(r"module 'head' ran in process (\d+) \(here\)", out)
    assert body and head and body.group(1) != head.group(1), out[-3000:]
    runs = [r for r, _, files in os.walk(tmp_path / "outputs") if "train.log" in files]
    assert len(runs) == 1, runs  # one output directory, rank 0's
