"""The store's lock: writers hold ``PATH/lock`` shared from writing a blob to naming it,
``gc`` holds it exclusive, so gc never removes a blob a writer is about to name.

    with Lock(store.path, timeout=60.0, exclusive=False):
        ...  # write a blob, then its name

It is ``flock``: on NFS, run gc only where every writer runs.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - no flock on this platform: gc is not guarded
    fcntl = None


class Lock:
    """``flock`` on PATH/lock: shared for writers, exclusive for gc; waits up to a timeout
    (then raises ``OSError(EAGAIN)``). Entering creates the store's directories."""

    def __init__(self, path: Path, timeout: float, exclusive: bool):
        self.path, self.timeout, self.exclusive, self.fd = path, timeout, exclusive, None

    def __enter__(self) -> Lock:
        for d in ("tmp", "blobs", "names"):
            (self.path / d).mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            return self
        self.fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o666)
        mode = fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, mode | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise OSError(errno.EAGAIN, "the store stayed locked (a gc running?) "
                                  f"for {self.timeout:.0f} s") from None
                time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
