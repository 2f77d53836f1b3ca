"""Tracing: where the time goes, as Chrome trace events (Perfetto, chrome://tracing).

Each process records its own spans (a node's forward or backward, a transfer with its
bytes, an optimizer step, a wait) with its own clock; the coordinator collects the
workers' spans at the end and shifts them onto its clock by the offset measured when
tracing started (the midpoint of the quickest of a few round trips, NTP's way). One lane
per process, named (the coordinator, each worker by its host name).

    tracing = start("coordinator")          # this process records from now on
    with span("forward body", "node"): ...
    write("run.json", tracing.events + their_events)

No torch here: a tensor's bytes are counted by whoever knows tensors (``bytes_of``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any


class Tracing:
    """The spans this process recorded since ``start``."""

    def __init__(self, lane: str):
        self.lane = lane
        self.pid = os.getpid()
        self.events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0,
             "args": {"name": lane}}]
        self.lock = threading.Lock()

    def add(self, name: str, cat: str, start_us: float, dur_us: float, **args: Any) -> None:
        event = {"ph": "X", "name": name, "cat": cat, "ts": start_us, "dur": dur_us,
                 "pid": self.pid, "tid": threading.get_ident() % 100000}
        if args:
            event["args"] = args
        with self.lock:
            self.events.append(event)

    def take(self) -> list[dict]:
        """What was recorded, handed over and forgotten (the metadata stays)."""
        with self.lock:
            out, self.events = self.events, self.events[:1]
        return out


_current: Tracing | None = None


def start(lane: str) -> Tracing:
    """Record spans in this process from now on, in the lane called ``lane``."""
    global _current
    if _current is None or _current.lane != lane:
        _current = Tracing(lane)
    return _current


def stop() -> None:
    global _current
    _current = None


def current() -> Tracing | None:
    return _current


def now_us() -> float:
    return time.time_ns() / 1000.0


class _Quiet:
    """What ``span`` is when this process is not tracing: its block's ``args``, nothing
    recorded (a class, not a generator: a span on every message costs two calls)."""

    __slots__ = ("args",)

    def __init__(self, args: dict):
        self.args = args

    def __enter__(self) -> dict:
        return self.args

    def __exit__(self, *exc: Any) -> None:
        return None


class _Span(_Quiet):
    __slots__ = ("name", "cat", "tracing", "t")

    def __init__(self, tracing: Tracing, name: str, cat: str, args: dict):
        self.args, self.tracing, self.name, self.cat = args, tracing, name, cat

    def __enter__(self) -> dict:
        self.t = now_us()
        return self.args  # the block may add to args (bytes it learned of)

    def __exit__(self, *exc: Any) -> None:
        self.tracing.add(self.name, self.cat, self.t, now_us() - self.t, **self.args)


def span(name: str, cat: str, **args: Any) -> _Quiet:
    """Record the time the block takes (nothing, when this process is not tracing):
    ``with span("send", "transfer", bytes=n) as said: ...``, ``said`` its ``args``."""
    tracing = _current
    if tracing is None:
        return _Quiet(args)
    return _Span(tracing, name, cat, args)


def shifted(events: Iterable[dict], offset_us: float) -> list[dict]:
    """Events of another process moved onto this one's clock."""
    return [dict(e, ts=e["ts"] + offset_us) if "ts" in e else e for e in events]


def write(path: str | os.PathLike, events: list[dict]) -> None:
    """Write a Chrome trace-event file (a JSON object with a ``traceEvents`` list)."""
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
