"""Run a coordinator of tests/remote_scripts.py in a process of its own (RPC starts once
per process), and what the remote tests ask of the processes they leave behind.

    out = coordinate("seeds_graph", cwd=tmp_path)      # its stdout; asserts it exited 0
    assert no_worker_left([out.split("PID")[1].split()[0]])
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = HERE / "remote_scripts.py"


def env() -> dict[str, str]:
    """This environment with the repository and tests/ importable."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), e.get("PYTHONPATH", "")])
    e.setdefault("SOMATIZE_TOKEN", TOKEN)  # what standing workers and coordinators share
    return e


TOKEN = "tests-standing-token-3f9a2c"  # scanned for in test_secret.py: it must leak nowhere


def start(name: str, *args, cwd: Path) -> subprocess.Popen:
    """``remote_scripts.<name>(*args)`` in a coordinator process of its own, in ``cwd``."""
    return subprocess.Popen([sys.executable, str(SCRIPTS), name, *map(str, args)], cwd=cwd,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def coordinate(name: str, *args, cwd: Path, timeout: float = 90, expect_rc: int = 0) -> str:
    """Run ``remote_scripts.<name>(*args)`` to its end; assert its exit code; answer its
    stdout."""
    r = subprocess.run([sys.executable, str(SCRIPTS), name, *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, env=env(), cwd=cwd)
    assert r.returncode == expect_rc, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout


def said(name: str, *args, cwd: Path, timeout: float = 120) -> dict:
    """Run ``remote_scripts.<name>(*args)`` to its end; everything it said (one JSON
    object a line), in one dict."""
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


def listening(pid) -> list[str]:
    """The addresses (hex, as /proc/net/tcp writes them) process ``pid`` listens on."""
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    out = []
    for proto in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{proto}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in mine:  # 0A: LISTEN
                    out.append(fields[1].split(":")[0])
    return out

