"""A process that keeps per-item rows, for tests/test_items_processes.py (store layer only,
no torch: it starts fast).

    python items_writer.py write STORE FIRST LAST BATCH SEED   # rows FIRST..LAST, shuffled
    python items_writer.py check STORE FIRST LAST              # exit 0 when all are kept

An item's row is a function of its number alone (``row_of``), so any process can tell a
right row from a wrong one.
"""

import random
import sys

from blake3 import blake3

from somatize.store._items import Items

MODULE = "ab" * 32  # the module key the tests keep under
ROW = (8,)  # 8 float32: 32 bytes


def key_of(i: int) -> bytes:
    return blake3(f"item {i}".encode()).digest(16)


def row_of(i: int) -> bytes:
    return blake3(f"row {i}".encode()).digest(32)


def write(store, first: int, last: int, batch: int, seed: int) -> None:
    space = Items(store).space(MODULE, {"module": "writer"})
    ids = list(range(first, last))
    random.Random(seed).shuffle(ids)
    print("writing", flush=True)  # (imports done: a killer times its signal from here)
    for at in range(0, len(ids), batch):
        chunk = ids[at:at + batch]
        locs = space.lookup([key_of(i) for i in chunk])
        todo = [i for i, loc in zip(chunk, locs, strict=True) if loc is None]
        if todo:
            assert space.put([key_of(i) for i in todo], "F32", ROW,
                             b"".join(row_of(i) for i in todo))


def missing(store, first: int, last: int) -> list[int]:
    """The items not readable, after checking every row read is the right one."""
    space = Items(store).space(MODULE)
    ids = list(range(first, last))
    keys = [key_of(i) for i in ids]
    locs = space.lookup(keys)
    rows = space.read(keys, locs)
    out = []
    for n, i in enumerate(ids):
        if rows.ok[n]:
            assert rows.slot(n) == row_of(i), f"item {i}: wrong row"
        else:
            out.append(i)
    return out


if __name__ == "__main__":
    cmd, store, *rest = sys.argv[1:]
    if cmd == "write":
        write(store, *map(int, rest))
        first, last = int(rest[0]), int(rest[1])
        sys.exit(1 if missing(store, first, last) else 0)
    sys.exit(1 if missing(store, *map(int, rest)) else 0)
