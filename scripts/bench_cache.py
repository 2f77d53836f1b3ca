"""What caching costs and saves, measured side by side in one run (medians of repeats).

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_cache.py     # ~15-30 s on 2 cores
    python scripts/bench_cache.py --quick                      # fewer repeats
    python scripts/bench_cache.py --per-item                   # per-item memory instead

1. Reading a kept 64 MB value and summing it, against ``safetensors.torch.load_file`` and
   the same sum (target: >= 0.5x its speed): the first read in a process hashes the blob,
   later ones trust its file while its stat is unchanged; and a 64 MB write with and
   without fsync (the store's fsync policy).
2. Computing the keys on a miss, against the whole step (target: <= 5%); and the input
   hash against BLAKE3 alone on the same bytes (never through a copy).
3. A frozen cached encoder (MLP 784->2048->2048->256) under a trained head (256->10),
   batch 256, 20 batches, through ``somatize.torch.Trainer``: epoch 2+ against training
   the head alone on precomputed features (target: <= 1.15x), and the speedup over not
   caching. Beside it, the input keyed elsewhere than in the step (measured here only, by
   patching the engine's ``key_of_input``; not built, see docs/performance.md): in a
   thread while the step before runs, or in the DataLoader worker process that made the
   batch.

The last lines put the two targets side by side, with the load average.
"""

from __future__ import annotations

import argparse
import os
import random
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
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

from somatize import Done, Graph, Node, Opaque, _keys, _naming
from somatize._engine import walk
from somatize._keys import key_of_input
from somatize._naming import _name, look_up
from somatize._values import bare
from somatize.store import Store, _recent
from somatize.torch import Trainer, freeze


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def side_by_side(fns: dict, repeats: int, shuffled: bool = False) -> dict[str, float]:
    """Median ms of each function, run interleaved so that noise hits them alike (in a new
    order each round when ``shuffled``: on a shared machine one may slow the next)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = random.Random(0)
    for _ in range(repeats):
        items = list(fns.items())
        if shuffled:
            order.shuffle(items)
        for k, fn in items:
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def bench_read(root: Path, repeats: int) -> float:
    """Returns the kept value's speed as a fraction of load_file's, both summed."""
    store = Store(root / "read")
    t = torch.randn(16 * 1024 * 1024)  # 64 MB
    store.put("value/big", t)
    path = store.blob_path(store.entry("value/big").blob)
    size = path.stat().st_size
    n = [0]

    def put(store):
        n[0] += 1
        store.put(f"value/w{n[0]}", t + n[0])  # new bytes each time: a real write

    w = side_by_side({"no fsync": lambda: put(Store(root / "w1")),
                      "fsync": lambda: put(Store(root / "w2", fsync=True))},
                     max(3, repeats // 2))
    # a blob's stat is trusted once its times are older than a filesystem's clock tick
    age = time.time_ns() - path.stat().st_ctime_ns
    time.sleep(max(0.0, (_recent.SETTLED_NS - age) / 1e9 + 0.1))
    t0 = time.perf_counter()
    store.get("value/big").value.sum()
    first = (time.perf_counter() - t0) * 1e3

    def plain():
        with open(path, "rb") as f:
            return f.read()

    def safetensors():
        return max(load_file(path).values(), key=lambda v: v.numel()).sum()  # not the pads

    def kept():
        return store.get("value/big").value.sum()

    ms = side_by_side({"load_file": safetensors, "kept": kept, "plain": plain}, repeats)
    gbs = {k: size / v / 1e6 for k, v in ms.items()}
    print(f"1. read 64 MB and sum it: kept value {ms['kept']:.1f} ms ({gbs['kept']:.2f} GB/s) "
          f"vs safetensors.torch.load_file {ms['load_file']:.1f} ms "
          f"({gbs['load_file']:.2f} GB/s): {gbs['kept'] / gbs['load_file']:.2f}x its speed "
          f"(target >= 0.5x)")
    print(f"   the first read in this process (hashes the blob) {first:.1f} ms; plain file "
          f"I/O, no sum {ms['plain']:.1f} ms ({gbs['plain']:.2f} GB/s)")
    print(f"   write 64 MB (hash + tmp + rename): {w['no fsync']:.0f} ms, "
          f"with fsync {w['fsync']:.0f} ms ({w['fsync'] / w['no fsync']:.2f}x)")
    return gbs["kept"] / gbs["load_file"]


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


class Early:
    """Input keys computed off the step, for this bench only: the engine's ``key_of_input``
    is patched to take the key computed elsewhere for the very tensor it is handed, if it
    is unchanged since (version counter, data pointer), else to key it itself as usual."""

    def __init__(self):
        self.keys: dict[int, tuple] = {}

    def put(self, x, key) -> None:
        self.keys[id(x)] = (x, (x._version, x.data_ptr()), key)  # stamped before hashing

    def __call__(self, value):
        got = self.keys.pop(id(value), None)
        if got is not None and got[0] is value and got[1] == (value._version, value.data_ptr()):
            return got[2]()
        return key_of_input(value)

    def __enter__(self):
        _naming.key_of_input = self
        return self

    def __exit__(self, *exc):
        _naming.key_of_input = key_of_input
        self.keys.clear()


class _Pieces(list):
    update = list.append  # what _feed hands a hasher, kept in order


def key_in_thread(pool: ThreadPoolExecutor, x):
    """``key_of_input(x)``, its tensor's bytes hashed in ``pool`` (BLAKE3 lets go of the
    GIL) and the few small pieces here: a thread that ran the whole of it held the GIL for
    its Python and stalled the step more."""
    pieces = _Pieces()
    _keys._feed(pieces, x)
    big = max(range(len(pieces)), key=lambda i: memoryview(pieces[i]).nbytes)
    h = blake3()
    for p in pieces[:big]:
        h.update(p)
    job = pool.submit(h.update, pieces[big])

    def key():
        job.result()
        for p in pieces[big + 1:]:
            h.update(p)
        return _keys.digest(["input", h.hexdigest()])

    return key


def ahead_in_thread(data, early: Early, pool: ThreadPoolExecutor):
    """The batches as they are, batch k+1 taken and keyed in ``pool`` while step k runs."""
    it = iter(data)
    batch = next(it, None)
    if batch is not None:
        early.put(batch[0], key_in_thread(pool, batch[0]))
    while batch is not None:
        following = next(it, None)
        if following is not None:
            early.put(following[0], key_in_thread(pool, following[0]))
        yield batch
        batch = following


class Batches(Dataset):
    """The batches as a DataLoader worker makes them (a fresh tensor each), keyed there
    when ``keyed``: the key carried beside the batch."""

    def __init__(self, data, keyed: bool):
        self.data, self.keyed = data, keyed

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        x = x.clone()
        return (x, y, key_of_input(x)) if self.keyed else (x, y)


def carried(loader, early: Early):
    """Batches whose key came with them, handed to the engine."""
    for x, y, key in loader:
        early.put(x, lambda key=key: key)
        yield x, y


def bench_cached_encoder(root: Path, repeats: int) -> float:
    """Returns epoch 2+ of the cached encoder over the head alone."""
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

    def epoch(trainer, batches):
        for batch in batches:  # what fit does, without its progress bar
            trainer.step(batch)

    first = median_ms(lambda: epoch(cached, data), 1)  # epoch 1: every batch a miss
    early, pool = Early(), ThreadPoolExecutor(1)
    with ThreadPoolExecutor(1) as check:
        assert key_in_thread(check, data[0][0])() == key_of_input(data[0][0])
    loader = dict(batch_size=None, num_workers=1, persistent_workers=True)
    made_there = DataLoader(Batches(data, keyed=False), **loader)
    keyed_there = DataLoader(Batches(data, keyed=True), **loader)

    def elsewhere(batches):
        with early:
            epoch(cached, batches())

    epoch(cached, made_there)  # the workers started
    ms = side_by_side({
        "head alone": head_alone,
        "cached": lambda: epoch(cached, data),
        "thread": lambda: elsewhere(lambda: ahead_in_thread(data, early, pool)),
        "loader": lambda: epoch(cached, made_there),
        "loader keyed": lambda: elsewhere(lambda: carried(keyed_there, early)),
        "not cached": lambda: epoch(plain, data),
    }, repeats, shuffled=True)
    pool.shutdown()
    ratio = ms["cached"] / ms["head alone"]
    print(f"3. cached encoder, 20 batches of 256: epoch 1 (misses) {first:.0f} ms; epoch 2+ "
          f"{ms['cached']:.1f} ms vs head alone on precomputed features "
          f"{ms['head alone']:.1f} ms = {ratio:.2f}x (target <= 1.15x); "
          f"not cached {ms['not cached']:.0f} ms: caching is "
          f"{ms['not cached'] / ms['cached']:.1f}x faster")
    print(f"   the input keyed elsewhere (measured, not built): in a thread while the step "
          f"before runs {ms['thread'] / ms['head alone']:.2f}x (in the step "
          f"{ratio:.2f}x); batches made in a DataLoader worker "
          f"{ms['loader'] / ms['head alone']:.2f}x, keyed there too "
          f"{ms['loader keyed'] / ms['head alone']:.2f}x")
    x = data[0][0]
    name = f"value/{_name(cached.graph, cached.graph.plan.order, {'encoder': x}, {})['encoder']}"
    store = cached._step.keeper.keeper
    part = side_by_side({"key": lambda: key_of_input(x), "get": lambda: store.get(name)},
                        repeats * 20)
    per = ms["head alone"] / len(data)
    print(f"   per batch: head alone {per:.2f} ms; a hit adds the input's key "
          f"{part['key']:.2f} ms (BLAKE3 over 784 KB), the lookup {part['get']:.2f} ms, "
          f"and the engine/trainer the rest "
          f"({ms['cached'] / len(data) - per - part['key'] - part['get']:.2f} ms)")
    hit_step(cached, data[0], repeats)
    return ratio


def hit_step(trainer, batch, repeats: int) -> None:
    """One hit step taken apart, each piece timed alone on the same batch (warm): the
    input's key, the lookup as the engine asks it (keys of every node, the store, the code's
    fingerprint), the head's forward, and what the walk and the trainer add around them."""
    g, x = trainer.graph, batch[0]
    inputs = {"encoder": x}
    feature = bare(look_up(g, g.plan.order, inputs=inputs, keeper=trainer._step.keeper)
                   .hits["encoder"])
    head = g["head"]
    ms = side_by_side({
        "step": lambda: trainer.step(batch),
        "key": lambda: key_of_input(x),
        "look_up": lambda: look_up(g, g.plan.order, inputs=inputs, keeper=trainer._step.keeper),
        "walk": lambda: walk(g, g.plan.order, inputs=inputs, keeper=trainer._step.keeper,
                             naming=True, training=True, wanted=g.sinks),
        "head": lambda: head.forward(feature, None),
    }, repeats * 40)
    rest = ms["walk"] - ms["look_up"] - ms["head"]
    print(f"   one hit step {ms['step']:.3f} ms: the input's key {ms['key']:.3f}, the rest of "
          f"the lookup (node keys, store, fingerprint) {ms['look_up'] - ms['key']:.3f}, the "
          f"head's forward {ms['head']:.3f}, the walk around them {rest:.3f}, the trainer "
          f"(objective, backward, Adam, item) {ms['step'] - ms['walk']:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine, a 2-thread op "
                        "stalls a whole time slice whenever one core is taken)")
    p.add_argument("--per-item", action="store_true",
                   help="per-item memory instead (scripts/bench_items.py): a cached shuffled "
                        "epoch, per-item keys, an index of 1M items")
    args, rest = p.parse_known_args(argv)
    if args.per_item:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_items import main as per_item

        return per_item(rest + (["--quick"] if args.quick else []))
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    print(f"$ python scripts/bench_cache.py{' --quick' if args.quick else ''}"
          f"{f' --threads {args.threads}' if args.threads != 1 else ''}   "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    root = Path(tempfile.mkdtemp(prefix="soma-bench-"))
    try:
        read = bench_read(root, repeats)
        bench_keys(root, repeats)
        epoch = bench_cached_encoder(root, repeats)
        print(f"side by side: cached encoder epoch 2+ {epoch:.2f}x the head alone (target <= "
              f"1.15x); kept 64 MB read + sum {read:.2f}x load_file's speed (target >= 0.5x); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
