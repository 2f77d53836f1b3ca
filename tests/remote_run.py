"""Run a coordinator script in its own process (RPC starts once per process), for the
remote tests: the script sees tests/ on its path, so ``from models import Body`` works.

    out = coordinate('''print(Graph.somatize(Body()).forward(x))''', tmp_path)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PRELUDE = """\
import os, sys, time
import torch
from somatize import Graph, Node, Done, Opaque, Lost, WorkerError, Refused
from somatize.remote import Worker, runtime_for
from models import *
torch.manual_seed(0)
x = torch.randn(5, 8)
def worker_error(g, x, **kw):  # g.forward must raise: its message, the seconds it took
    t = time.monotonic()
    try:
        g.forward(x, **kw)
    except WorkerError as e:
        return str(e), time.monotonic() - t
    raise SystemExit("no error")
"""


def env() -> dict[str, str]:
    """This environment with the repository and tests/ importable."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), e.get("PYTHONPATH", "")])
    return e


def coordinate(code: str, tmp_path: Path, timeout: float = 90, expect_rc: int = 0,
               name: str = "coordinator.py") -> str:
    """Run ``PRELUDE + code`` as a script; assert its exit code; return its stdout."""
    script = tmp_path / name
    script.write_text(PRELUDE + textwrap.dedent(code))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=timeout, env=env(), cwd=tmp_path)
    assert r.returncode == expect_rc, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout


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

