"""A process that writes to a store, for tests/test_store_processes.py (imports no torch).

    python tests/store_writer.py put DIR NAME SEED SIZE [--kill-at STEP]
    python tests/store_writer.py put DIR NAME SEED SIZE --pause-at STEP READY GO
    python tests/store_writer.py many DIR PREFIX COUNT SIZE
"""

import os
import random
import signal
import sys
import time
from pathlib import Path

from somatize import store as store_module
from somatize.store import Store


def value(seed: int, size: int) -> dict:
    """The value a writer keeps for ``seed``: bytes and a nested structure around them."""
    return {"data": random.Random(seed).randbytes(size), "seed": seed, "tags": ["a", (1, None)]}


def _kill_at(step: str):
    def hook(what: str) -> None:
        if what == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _pause_at(step: str, ready: str, go: str):
    def hook(what: str) -> None:
        if what == step:
            Path(ready).touch()
            deadline = time.monotonic() + 60
            while not Path(go).exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    return hook


def main(argv: list[str]) -> int:
    cmd, path = argv[0], argv[1]
    store = Store(path)
    if cmd == "put":
        name, seed, size = argv[2], int(argv[3]), int(argv[4])
        if "--kill-at" in argv:
            store_module._at_step = _kill_at(argv[argv.index("--kill-at") + 1])
        if "--pause-at" in argv:
            i = argv.index("--pause-at")
            store_module._at_step = _pause_at(*argv[i + 1:i + 4])
        return 0 if store.put(name, value(seed, size), meta={"seed": str(seed)}) else 1
    if cmd == "many":
        prefix, count, size = argv[2], int(argv[3]), int(argv[4])
        for i in range(count):
            # the same names and bytes as the other writers, and names of its own
            assert store.put(f"value/shared{i % 5}", value(i % 5, size))
            assert store.put(f"value/{prefix}{i}", value(1000 + i, size))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
