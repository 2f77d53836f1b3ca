"""Run a coordinator of tests/remote_*_runs.py in a process of its own (RPC starts once
per process), and what the remote tests ask of the processes they leave behind.

    out = coordinate("seeds_graph", cwd=tmp_path)      # its stdout; asserts it exited 0
    assert no_worker_left([out.split("PID")[1].split()[0]])
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from scenario import HERE, ROOT, env, scenario
from scenario import start as _start

SCRIPTS = [HERE / f"remote_{topic}_runs.py" for topic in ("graph", "failure", "standing",
                                                          "trainer", "shm")]
__all__ = ["HERE", "ROOT", "SCRIPTS", "coordinate", "env", "listeners", "listening",
           "no_worker_left", "said", "script_of", "start"]


def script_of(name: str) -> Path:
    """The script of ``SCRIPTS`` whose coordinator ``name`` is."""
    for path in SCRIPTS:
        if f"\ndef {name}(" in path.read_text():
            return path
    raise LookupError(f"no coordinator {name!r} in {[p.name for p in SCRIPTS]}")


def start(name: str, *args, cwd) -> subprocess.Popen:
    """``<name>(*args)`` in a coordinator process of its own, in ``cwd``."""
    return _start(script_of(name), name, *args, cwd=cwd)


def coordinate(name: str, *args, cwd, timeout: float = 90, expect_rc: int = 0) -> str:
    """Run ``<name>(*args)`` to its end; assert its exit code; answer its stdout."""
    return scenario(script_of(name), name, *args, cwd=cwd, timeout=timeout,
                    expect_rc=expect_rc).stdout


def said(name: str, *args, cwd, timeout: float = 120) -> dict:
    """Run ``<name>(*args)`` to its end; everything it said (one JSON object a line), in
    one dict."""
    got: dict = {}
    for line in coordinate(name, *args, cwd=cwd, timeout=timeout).splitlines():
        got.update(json.loads(line))
    return got


def no_worker_left(pids) -> bool:
    """True when none of ``pids`` is a live process."""
    for pid in pids:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{int(pid)}/stat") as f:  # a zombie is not alive
            if f.read().split()[2] != "Z":
                return False
    return True


def listeners(pid, protos: tuple[str, ...] = ("tcp", "tcp6")) -> list[tuple[str, int]]:
    """The sockets process ``pid`` listens on (/proc, as ``ss -ltnp`` reads them): each
    its address (hex, as /proc/net/tcp writes it) and port."""
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    out = {}
    # every thread's network namespace: an isolated run listens in one of its own threads'
    for task in os.listdir(f"/proc/{pid}/task"):
        for proto in protos:
            try:
                with open(f"/proc/{pid}/task/{task}/net/{proto}") as f:
                    lines = f.readlines()[1:]
            except OSError:
                continue  # the thread ended meanwhile
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in mine:  # 0A: LISTEN
                    addr, port = fields[1].split(":")
                    out[fields[9]] = (addr, int(port, 16))
    return list(out.values())


def listening(pid) -> list[str]:
    """The addresses (hex, as /proc/net/tcp writes them) process ``pid`` listens on."""
    return [addr for addr, _ in listeners(pid)]

