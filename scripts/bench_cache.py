"""What caching costs and saves, measured side by side in one run (medians of repeats).

    python scripts/bench_cache.py            # all three figures, ~1-2 minutes on 2 cores
    python scripts/bench_cache.py --quick    # fewer repeats

1. Reading a kept 64 MB value (checked against its hash, mmapped copy-on-write) against
   plain file I/O of the same bytes (target: >= 50% of its throughput); and a 64 MB
   write with and without fsync (the store's fsync policy).
2. Computing the keys on a miss, against the whole step (target: <= 5%); and the input
   hash against BLAKE3 alone on the same bytes (never through a copy).
3. A frozen cached encoder (MLP 784->2048->2048->256) under a trained head (256->10),
   batch 256, 20 batches, through ``somatize.torch.Trainer``: epoch 2+ against training
   the head alone on precomputed features (target: <= 1.15x), and the speedup over not
   caching; and what hashing the next input in a thread, while the head trains on this
   one, would save (the pipelining a hit could use; it needs a core left free).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from blake3 import blake3
from torch import nn

from somatize import Done, Graph, Node, Opaque
from somatize._engine import _name, look_up, walk
from somatize._keys import key_of_input
from somatize._values import bare
from somatize.store import Store
from somatize.torch import Trainer, freeze


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def side_by_side(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each function, run interleaved so that noise hits them alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def bench_read(root: Path, repeats: int) -> None:
    store = Store(root / "read")
    t = torch.randn(16 * 1024 * 1024)  # 64 MB
    store.put("value/big", t)
    path = store.blob_path(store.entry("value/big").blob)
    size = path.stat().st_size

    def plain():
        with open(path, "rb") as f:
            return f.read()

    def kept():
        return store.get("value/big").value

    ms = side_by_side({"plain": plain, "kept": kept}, repeats)
    gbs = {k: size / v / 1e6 for k, v in ms.items()}
    print(f"1. read 64 MB: plain file I/O {ms['plain']:.1f} ms ({gbs['plain']:.2f} GB/s), "
          f"kept value {ms['kept']:.1f} ms ({gbs['kept']:.2f} GB/s): "
          f"{gbs['kept'] / gbs['plain']:.0%} of plain (target >= 50%)")
    n = [0]

    def put(store):
        n[0] += 1
        store.put(f"value/w{n[0]}", t + n[0])  # new bytes each time: a real write

    w = side_by_side({"no fsync": lambda: put(Store(root / "w1")),
                      "fsync": lambda: put(Store(root / "w2", fsync=True))},
                     max(3, repeats // 2))
    print(f"   write 64 MB (hash + tmp + rename): {w['no fsync']:.0f} ms, "
          f"with fsync {w['fsync']:.0f} ms ({w['fsync'] / w['no fsync']:.2f}x)")


class Encoder(Node):
    def __init__(self):
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                                 nn.ReLU(), nn.Linear(2048, 256))

    def forward(self, x, ctx):
        return Done(Opaque(self.mlp(x)))

    def parameters(self):
        return list(self.mlp.parameters())


class Head(Node):
    def __init__(self):
        torch.manual_seed(1)
        self.lin = nn.Linear(256, 10)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


def bench_keys(root: Path, repeats: int) -> None:
    x = torch.randn(256, 784)
    big = torch.randn(16 * 1024 * 1024)
    raw = side_by_side({
        "blake3": lambda: blake3(memoryview(big.numpy()).cast("B")).digest(),
        "key": lambda: key_of_input(big),
    }, repeats)
    print(f"2. hash 64 MB: BLAKE3 alone {raw['blake3']:.1f} ms "
          f"({64 * 1.048576 / raw['blake3']:.2f} GB/s), key_of_input {raw['key']:.1f} ms "
          f"({raw['blake3'] / raw['key']:.0%} of BLAKE3's throughput)")
    threads = []
    for mb in (0.75, 4, 64):  # BLAKE3's own threads: where they start to pay, on this machine
        mv = memoryview(big.numpy()).cast("B")[:int(mb * 2**20)]
        t = side_by_side({"1": lambda mv=mv: blake3(mv).digest(),
                          "auto": lambda mv=mv: blake3(mv, max_threads=blake3.AUTO).digest()},
                         repeats * (20 if mb < 1 else 3 if mb < 64 else 1))
        threads.append(f"{mb:g} MB {t['1']:.2f} -> {t['auto']:.2f} ms")
    print(f"   BLAKE3 one thread -> max_threads=AUTO: {'; '.join(threads)}")
    g = freeze(Graph.somatize(Encoder().frozen().cached() >> Head()))
    head = g["head"]
    trainer = Trainer(g, objective=F.cross_entropy,
                      optimizer=torch.optim.Adam(head.parameters(), lr=1e-3),
                      store=Store(root / "keys"))
    y = torch.randint(0, 10, (256,))
    fresh = [torch.randn(256, 784) for _ in range(repeats + 1)]
    trainer.step((fresh[-1], y))
    it = iter(fresh)
    step = median_ms(lambda: trainer.step((next(it), y)), repeats)  # every step a miss
    naming = median_ms(lambda: _name(g, g.plan.order, {"encoder": x}, {}), repeats * 5)
    print(f"   keys on a miss: {naming:.2f} ms of a {step:.1f} ms step = "
          f"{naming / step:.2%} (target <= 5%)")


def bench_cached_encoder(root: Path, repeats: int) -> None:
    torch.manual_seed(2)
    data = [(torch.randn(256, 784), torch.randint(0, 10, (256,))) for _ in range(20)]

    def trainer(cached: bool, store):
        enc = Encoder().frozen()
        g = freeze(Graph.somatize((enc.cached() if cached else enc) >> Head()))
        opt = torch.optim.Adam(g["head"].parameters(), lr=1e-3)
        return Trainer(g, objective=F.cross_entropy, optimizer=opt, store=store)

    cached = trainer(True, Store(root / "cached"))
    plain = trainer(False, None)
    with torch.no_grad():
        features = [(cached.graph["encoder"].mlp(x), y) for x, y in data]
    head = Head().lin
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)

    def head_alone():
        for f, y in features:
            loss = F.cross_entropy(head(f), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()

    def epoch(trainer):
        for batch in data:  # what fit does, without its progress bar
            trainer.step(batch)

    first = median_ms(lambda: epoch(cached), 1)  # epoch 1: every batch a miss
    ms = side_by_side({
        "head alone": head_alone,
        "cached": lambda: epoch(cached),
        "not cached": lambda: epoch(plain),
    }, repeats)
    print(f"3. cached encoder, 20 batches of 256: epoch 1 (misses) {first:.0f} ms; epoch 2+ "
          f"{ms['cached']:.1f} ms vs head alone on precomputed features "
          f"{ms['head alone']:.1f} ms = {ms['cached'] / ms['head alone']:.2f}x (target <= 1.15x); "
          f"not cached {ms['not cached']:.0f} ms: caching is "
          f"{ms['not cached'] / ms['cached']:.1f}x faster")
    x = data[0][0]
    name = f"value/{_name(cached.graph, cached.graph.plan.order, {'encoder': x}, {})['encoder']}"
    store = cached.keeper.keeper
    part = side_by_side({"key": lambda: key_of_input(x), "get": lambda: store.get(name)},
                        repeats * 20)
    per = ms["head alone"] / len(data)
    print(f"   per batch: head alone {per:.2f} ms; a hit adds the input's key "
          f"{part['key']:.2f} ms (BLAKE3 over 784 KB), the lookup {part['get']:.2f} ms, "
          f"and the engine/trainer the rest "
          f"({ms['cached'] / len(data) - per - part['key'] - part['get']:.2f} ms)")
    hit_step(cached, data[0], repeats)
    overlap(data, features, repeats)


def hit_step(trainer, batch, repeats: int) -> None:
    """One hit step taken apart, each piece timed alone on the same batch (warm): the
    input's key, the lookup as the engine asks it (keys of every node, the store, the code's
    fingerprint), the head's forward, and what the walk and the trainer add around them."""
    g, x = trainer.graph, batch[0]
    inputs = {"encoder": x}
    feature = bare(look_up(g, g.plan.order, inputs=inputs, keeper=trainer.keeper)
                   .hits["encoder"])
    head = g["head"]
    ms = side_by_side({
        "step": lambda: trainer.step(batch),
        "key": lambda: key_of_input(x),
        "look_up": lambda: look_up(g, g.plan.order, inputs=inputs, keeper=trainer.keeper),
        "walk": lambda: walk(g, g.plan.order, inputs=inputs, keeper=trainer.keeper,
                             naming=True, training=True, wanted=g.sinks),
        "head": lambda: head.forward(feature, None),
    }, repeats * 40)
    rest = ms["walk"] - ms["look_up"] - ms["head"]
    print(f"   one hit step {ms['step']:.3f} ms: the input's key {ms['key']:.3f}, the rest of "
          f"the lookup (node keys, store, fingerprint) {ms['look_up'] - ms['key']:.3f}, the "
          f"head's forward {ms['head']:.3f}, the walk around them {rest:.3f}, the trainer "
          f"(objective, backward, Adam, item) {ms['step'] - ms['walk']:.3f}")


def overlap(data, features, repeats: int) -> None:
    """What hashing the next batch in a thread, while the head trains on this one, would
    save: the head alone, then with each input hashed before its step, then in a thread."""
    head = Head().lin
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)

    def step(f, y):
        loss = F.cross_entropy(head(f), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()

    def hashed(x):
        return blake3(memoryview(x.numpy()).cast("B")).digest()

    def before():
        for (f, y), (x, _) in zip(features, data, strict=True):
            hashed(x)
            step(f, y)

    def in_thread():
        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(hashed, data[0][0])
            for k, (f, y) in enumerate(features):
                job.result()
                if k + 1 < len(data):
                    job = pool.submit(hashed, data[k + 1][0])
                step(f, y)

    ms = side_by_side({"head": lambda: [step(f, y) for f, y in features], "before": before,
                       "thread": in_thread}, repeats)
    print(f"   hashing each input before its step: {ms['before'] / ms['head']:.2f}x the head "
          f"alone; in a thread while the previous step trains: "
          f"{ms['thread'] / ms['head']:.2f}x (load average {os.getloadavg()[0]:.1f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine, a 2-thread op "
                        "stalls a whole time slice whenever one core is taken)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    print(f"$ python scripts/bench_cache.py{' --quick' if args.quick else ''}"
          f"{f' --threads {args.threads}' if args.threads != 1 else ''}   "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    root = Path(tempfile.mkdtemp(prefix="soma-bench-"))
    try:
        bench_read(root, repeats)
        bench_keys(root, repeats)
        bench_cached_encoder(root, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
