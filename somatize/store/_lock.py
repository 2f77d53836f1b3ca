"""The store's lock: writers hold ``PATH/lock`` shared from writing a blob to naming it,
``gc`` holds it exclusive, so gc never removes a blob a writer is about to name.

    with Lock(store, timeout=60.0, exclusive=False):
        ...  # write a blob, then its name

It is ``flock``: on NFS, run gc only where every writer runs.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Any

from ._files import open_lock

try:
    import fcntl
except ImportError:  # pragma: no cover - no flock on this platform: gc is not guarded
    fcntl = None


class Lock:
    """``flock`` on PATH/lock: shared for writers, exclusive for gc; waits up to a timeout
    (then raises ``OSError(EAGAIN)``). Entering makes the store's directories."""

    def __init__(self, store: Any, timeout: float, exclusive: bool):
        self.store, self.timeout, self.exclusive, self.fd = store, timeout, exclusive, None

    def __enter__(self) -> Lock:
        self.store.setup()
        if fcntl is None:
            return self
        self.fd = open_lock(self.store.path, "lock", self.store.shared)
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
