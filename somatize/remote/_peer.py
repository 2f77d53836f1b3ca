"""A worker process in this process's RPC group, as the group and its runtimes see it."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass, field

from ._death import why_exited


@dataclass
class Peer:
    """A worker process in the group, shared by the runtimes that use it."""

    name: str  # its RPC name
    host: str  # the host name the graph places nodes on
    kind: str
    timeout: float
    proc: subprocess.Popen | None = None
    conn: socket.socket | None = None  # to a standing daemon, held for the run
    keeps: bool = False
    pid: int | None = None
    device: str = "cpu"  # where placed modules compute over there
    unanswered: bool = False  # a call to it timed out: nothing more is waited for
    rank: int | None = None
    users: int = 0
    dead: str | None = None  # why it is gone, once it is
    key: tuple = field(default=())

    def why_dead(self, grace: float = 0.0) -> str | None:
        """Why this worker is gone (None while it may be alive); ``grace``: seconds to
        wait for a local process to end (its pipes close a moment before it is reaped)."""
        if self.dead is None and self.proc is not None and grace > 0:
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if self.dead is None and self.proc is not None and self.proc.poll() is not None:
            self.dead = why_exited(self.proc.pid, self.proc.returncode)
        return self.dead
