"""The README's first command, the main job, runs end to end and says what it did."""

import csv
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
    # each run started its worker once: the test after the fit ran on it
    assert out.count("shares this machine's cores") <= 1, out[-3000:]  # the split run's
    # the cached run, on shuffled data: each digit's body output computed once in epoch 1
    # and read back by its own key from epoch 2 on, in whatever batch it lands
    said = re.search(r"SomatizeCache: modules \['body'\] computed their output for (\d+) "
                     r"items and read it from the store \S+ for (\d+)", out)
    assert said, out[-3000:]
    assert re.search(r"module 'body' was called in process \d+ \(here\) \d+ times", out)
    # per epoch, as logged to Lightning's CSV logger (not printed: it went into the bar)
    metrics = (tmp_path / "job" / "cached" / "logs" / "version_0" / "metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    epochs = [(int(r["epoch"]), float(r["cache/hits"]), float(r["cache/misses"]))
              for r in rows if r.get("cache/hits")]
    # epoch 1: the 256 training digits are new; epoch 2: every one is read from the store
    assert epochs == [(0, 0.0, 256.0), (1, 256.0, 0.0)], epochs
    # validation, counted apart: its digits were computed by the sanity check, then read
    val = [(float(r["cache/val_hits"]), float(r["cache/val_misses"])) for r in rows
           if r.get("cache/val_hits")]
    assert len(val) == 2 and all(f > 0 and c == 0 for f, c in val), val
    assert int(said.group(2)) >= 256 + sum(f for f, _ in val)
    assert out.count("SomatizeCache: modules") == 1  # said once, not per epoch
    # the store's size, last: on disk, then its packs (not a file per item)
    before, last = r.stdout.splitlines()[-2:]
    assert "blobs" in before and "on disk" in before, before
    assert re.search(r"per item: 1 modules, \d+ items in \d+ packs", last), last
    assert (tmp_path / "job" / "split" / "checkpoints" / "last.ckpt").exists()
