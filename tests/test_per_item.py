"""Per-item memory under a real lightning.Trainer: ``SomatizeCache(per_item=True)`` on
shuffled data computes each item once (counted inside the module's own forward), a second
fit in another order computes nothing, and the head trains to the numbers of the
hand-written oracle that keeps each item's output the first time it is seen; here and
placed on a worker (tests/item_runs.py, in its own process)."""

import csv
import os
import subprocess
import sys

import torch
from item_runs import Reordered, computed, fit
from oracle import same

from examples.digits import DigitsData
from somatize.lightning import SomatizeCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def distinct_items() -> int:
    data = DigitsData(batch_size=16, limit=64)
    data.setup()
    seen = [*data.train_set.tensors[0], *data.val_set.tensors[0][:256]]
    rows = {r.numpy().tobytes() for r in seen}
    return len(rows)  # 64 training items and the 256 validation items of one batch


def test_a_shuffled_fit_computes_each_item_once_and_trains_as_the_oracle(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    oracle = fit(str(tmp_path / "oracle.log"), oracle=True)
    cache = SomatizeCache(tmp_path / "store", modules=["body"], per_item=True)
    got = fit(str(tmp_path / "cached.log"), callbacks=[cache],
              logger=CSVLogger(tmp_path, name="csv"))
    assert same(got, oracle) and len(got[0]) == 12
    n = 64 + 256
    assert computed(tmp_path / "cached.log") == {os.getpid(): distinct_items()}
    assert (cache.hits, cache.misses) == (2 * n, n)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        logged = list(csv.DictReader(f))
    # counted in items, each stage in its own names: 64 training items, 256 validation ones
    for prefix, items in (("", 64), ("val_", 256)):
        rows = [r for r in logged if r.get(f"cache/{prefix}hits")]
        assert [(float(r[f"cache/{prefix}hits"]), float(r[f"cache/{prefix}misses"]))
                for r in rows] == [(0, items), (items, 0), (items, 0)], prefix
    # a second fit on the same store, in another order, computes nothing (the same log
    # path: the body's attributes are settings, in the name of what it computes)
    open(tmp_path / "cached.log", "w").close()
    again = fit(str(tmp_path / "cached.log"), data=Reordered,
                callbacks=[SomatizeCache(tmp_path / "store", modules=["body"], per_item=True)])
    assert computed(tmp_path / "cached.log") == {}
    assert again[0] != got[0]  # another order: other losses, from the same kept rows
    assert same(again, fit(str(tmp_path / "oracle2.log"), oracle=True, data=Reordered))


def test_per_item_placed_on_a_worker_computes_each_item_once_over_there(tmp_path):
    out = tmp_path / "placed.pt"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "item_runs.py"),
                           "placed", str(out), str(tmp_path / "store"),
                           str(tmp_path / "body.log")],
                          capture_output=True, text=True, timeout=400, cwd=ROOT, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert same(got["first"], got["oracle"])
    [(pid, rows)] = got["computed"].items()
    assert pid != got["pid"] and rows == distinct_items()  # on the worker, each item once
    assert got["counts"] == (2 * 320, 320)  # counted over there, read at each epoch's end
    assert got["computed_again"] == {}
