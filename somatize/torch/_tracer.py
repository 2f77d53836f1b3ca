"""A run's trace file: this process's spans and its workers', written as one Chrome
trace-event file (``Trainer(trace=...)``, ``SomatizeStrategy(trace=...)``).

    tracer = Tracer("run.json")          # this process records from now on
    tracer.add(runtime)                  # and so do the workers of this runtime
    tracer.write()                       # collected so far, written whole
"""

from __future__ import annotations

import os
from typing import Any

from .. import _holes, _trace


class Tracer:
    """Where a run's spans go: ``path``, written whole each time ``write`` is called."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.here = _trace.start("coordinator")
        self.events: list[dict] = []
        self.runtimes: list[tuple[Any, dict]] = []

    def add(self, runtime: Any) -> None:
        """Record on ``runtime``'s workers too, their clocks aligned to this one."""
        if runtime is not None and all(r is not runtime for r, _ in self.runtimes):
            self.runtimes.append((runtime, _holes.transport().trace_start(runtime)))

    def write(self, end: bool = False) -> None:
        """Collect what every process recorded and write the file (``end``: stop)."""
        for runtime, offsets in self.runtimes:
            if not runtime.closed:
                self.events += _holes.transport().trace_collect(runtime, offsets, end)
        self.events += self.here.take()[1:]
        meta = [self.here.events[0]]
        for e in self.events:
            if e.get("ph") == "M" and e not in meta:
                meta.append(e)
        spans = [e for e in self.events if e.get("ph") != "M"]
        _trace.write(self.path, meta + sorted(spans, key=lambda e: e["ts"]))
        if end:
            self.runtimes.clear()
            _trace.stop()
