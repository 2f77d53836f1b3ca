"""A process that writes to a store, for tests/test_store_processes.py (imports no torch).

    python tests/store_writer.py put DIR NAME SEED SIZE [--kill-at STEP]
    python tests/store_writer.py put DIR NAME SEED SIZE --pause-at STEP READY GO
    python tests/store_writer.py many DIR PREFIX COUNT SIZE

``--kill-at`` and ``--pause-at`` use a Store whose ``_step`` (called at each step of a
write, a no-op in the library) SIGKILLs this process or waits there.
"""

import os
import random
import signal
import sys
import time
from pathlib import Path

from somatize.store import Store


def value(seed: int, size: int) -> dict:
    """The value a writer keeps for ``seed``: bytes and a nested structure around them."""
    return {"data": random.Random(seed).randbytes(size), "seed": seed, "tags": ["a", (1, None)]}


class KilledAt(Store):
    """A store whose writer dies (SIGKILL: no cleanup runs) at one step of a write."""

    def __init__(self, path: str, step: str):
        super().__init__(path)
        self.step = step

    def _step(self, what: str) -> None:
        if what == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PausedAt(Store):
    """A store whose writer touches READY at one step of a write, then waits for GO."""

    def __init__(self, path: str, step: str, ready: str, go: str):
        super().__init__(path)
        self.step, self.ready, self.go = step, Path(ready), Path(go)

    def _step(self, what: str) -> None:
        if what == self.step:
            self.ready.touch()
            deadline = time.monotonic() + 60
            while not self.go.exists() and time.monotonic() < deadline:
                time.sleep(0.01)


def main(argv: list[str]) -> int:
    cmd, path = argv[0], argv[1]
    if cmd == "put":
        name, seed, size = argv[2], int(argv[3]), int(argv[4])
        store = Store(path)
        if "--kill-at" in argv:
            store = KilledAt(path, argv[argv.index("--kill-at") + 1])
        if "--pause-at" in argv:
            i = argv.index("--pause-at")
            store = PausedAt(path, *argv[i + 1:i + 4])
        return 0 if store.put(name, value(seed, size), meta={"seed": str(seed)}) else 1
    if cmd == "many":
        store = Store(path)
        prefix, count, size = argv[2], int(argv[3]), int(argv[4])
        for i in range(count):
            # the same names and bytes as the other writers, and names of its own
            assert store.put(f"value/shared{i % 5}", value(i % 5, size))
            assert store.put(f"value/{prefix}{i}", value(1000 + i, size))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
