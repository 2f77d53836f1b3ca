"""Running a scenario in a fresh process. RPC, and torch's process-wide settings, start once
per process: so each multi-process test runs its coordinator as a script of its own, a
scenario being one function of that script, named on its command line.

    done = scenario("dropin_runs.py", "transformer", out)   # asserts it exited 0
    proc = start("remote_failure_runs.py", "interrupted", "forward", pid_file, cwd=tmp_path)
    daemon = start("-m", "somatize.worker", "--listen", "127.0.0.1:7000")

    if __name__ == "__main__":                              # a scenario script's last lines
        play(globals(), sys.argv)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from forks import Forks, forkable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FORKS = os.environ.get("SOMATIZE_TEST_FORKS", "1") != "0"  # 0: a fresh interpreter each time


def env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this environment) with ``extra`` set, and the repository and
    tests/ importable (the one place ``PYTHONPATH`` is written)."""
    e = {**(os.environ if base is None else base), **extra}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), e.get("PYTHONPATH", "")])
    e.setdefault("SOMATIZE_TOKEN", TOKEN)  # what standing workers and coordinators share
    return e


def own_children(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: ``env()``) whose embedded workers start as the coordinator's
    own child processes, not forked from conftest's warm process: for a scenario that
    finds its workers by their parent's pid."""
    e = dict(environ) if environ else env()
    e["SOMATIZE_FORKS"] = "off"  # no fork server, nor one the strategy would start
    return e


TOKEN = "tests-standing-token-3f9a2c"  # scanned for in test_secret.py: it must leak nowhere


def command(script: str | Path, *args) -> list[str]:
    """This Python's command line for ``script`` (under tests/ unless a path elsewhere; or
    an option: ``"-m", "somatize.worker"``, ``"-c", code``) with ``args``."""
    if str(script).startswith("-"):
        return [sys.executable, str(script), *map(str, args)]
    path = Path(script)
    return [sys.executable, str(path if path.is_absolute() else HERE / path), *map(str, args)]


def scenario(script: str | Path, *args, cwd: str | Path = ROOT, timeout: float = 240,
             expect_rc: int | None = 0, environ: Mapping[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """Run ``script args...`` to its end in a fresh process; assert its exit code (unless
    ``expect_rc`` is None); answer it, stdout and stderr as text. The process is forked
    from a warm one that has imported torch and Lightning (tests/forks.py) where it can
    be, so that each scenario does not pay for those imports again."""
    argv = command(script, *args)
    environ = dict(environ) if environ else env()
    warm = Forks.get(env()) if FORKS else None
    if warm is not None and not forkable(argv[1:], environ, warm.env):
        warm = None
    if warm is not None:
        done = warm.run(argv[1:], cwd, environ, timeout)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=environ)
    if expect_rc is not None:
        assert done.returncode == expect_rc, (
            f"{Path(script).name} {' '.join(map(str, args))}: exit code {done.returncode}, "
            f"not {expect_rc}\n--- stdout ---\n{done.stdout[-2000:]}\n"
            f"--- stderr ---\n{done.stderr[-4000:]}")
    return done


def start(script: str | Path, *args, cwd: str | Path = ROOT,
          environ: Mapping[str, str] | None = None, **popen: object):
    """``script args...`` started in a process of its own (stdout and stderr piped, as
    text, unless ``popen`` says otherwise); the caller waits for it, with a timeout. A
    Popen, or where it can be forked from the warm process (tests/forks.py), a ``Forked``,
    which answers as one."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    argv = command(script, *args)
    environ = dict(environ) if environ else env()
    if FORKS and set(popen) <= {"stdout", "stderr", "text"}:
        warm = Forks.get(env())
        if warm is not None and forkable(argv[1:], environ, warm.env):
            return warm.start(argv[1:], cwd, environ, **popen)
    return subprocess.Popen(argv, cwd=cwd, env=environ, **popen)


def play(namespace: Mapping[str, object], argv: list[str] | None = None) -> None:
    """Call the scenario ``argv[1]`` of a script's ``namespace`` with ``argv[2:]``."""
    argv = sys.argv if argv is None else argv
    name = argv[1] if len(argv) > 1 else ""
    fn = namespace.get(name)
    if name.startswith("_") or not callable(fn) or isinstance(fn, type):
        known = sorted(n for n, f in namespace.items() if callable(f) and not n.startswith("_")
                       and not isinstance(f, type)
                       and getattr(f, "__module__", None) == namespace.get("__name__"))
        raise SystemExit(f"{argv[0]}: no scenario {name!r}; its scenarios are {known}")
    fn(*argv[2:])
