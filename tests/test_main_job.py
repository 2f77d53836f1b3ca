"""The README's first command, the main job, runs end to end and says what it did."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_main_job_trains_split_then_reuses_the_cached_body(tmp_path):
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run.sh"), "trainer.max_epochs=2", "data.limit=256"],
        env={**os.environ, "SOMATIZE_OUT": str(tmp_path / "job")}, capture_output=True,
        text=True, timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    # the split run: the body ran in the worker's process, the head in the coordinator's
    body = re.search(r"module 'body' ran in process (\d+) \(worker 'worker'\) \d+ times", out)
    head = re.search(r"module 'head' ran in process (\d+) \(here\) \d+ times", out)
    assert body and head and body.group(1) != head.group(1), out[-3000:]
    accuracies = [float(a) for a in re.findall(r"accuracy on held-out digits: ([0-9.]+)", out)]
    assert len(accuracies) == 2 and all(0.1 < a <= 1.0 for a in accuracies)
    # the cached run: epoch 2 read the body's output from the store instead of running it
    assert re.search(r"module 'body' was called in process \d+ \(here\) \d+ times; it computed "
                     r"its output for \d+ of those calls and read it from the store for "
                     r"[1-9]\d*", out), out[-3000:]
    assert "blobs" in r.stdout.splitlines()[-1]  # the store's size, last
    assert (tmp_path / "job" / "split" / "checkpoints" / "last.ckpt").exists()
