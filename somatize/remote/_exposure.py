"""Who can reach a run's listeners, said once: the run is kept in a network namespace of
its own where it can be (``configure(isolate=...)``), and what is refused is counted.

    netns = isolate("127.0.0.1", [Worker()])   # a Namespace, or None (said once, or refused)
    if refused("a join", "127.0.0.1"): log...  # True the first time an address is refused
    closing()                                  # at the end: how many were refused

``isolate="auto"`` (the default) keeps a run whose processes are all on this machine (the
coordinator and embedded workers, listening on loopback) in a namespace of its own where
the system allows it, and otherwise says once what is exposed and how to fix it;
``"require"`` refuses to start instead; ``"off"`` never isolates and says nothing.
"""

from __future__ import annotations

import logging
import threading

from .._errors import WorkerError
from ._isolation import CannotIsolate, Namespace
from ._settings import loopback, settings

log = logging.getLogger(__name__)

MODES = ("auto", "require", "off")
FIX = ("start it where it may make a network namespace: as root, in a container, or as "
       "`unshare --user --map-current-user --keep-caps python ...` where the kernel allows "
       "user namespaces; or reject other users' loopback traffic to its ports with an "
       "owner-match firewall rule (docs/security.md)")


def isolate(host: str, specs, torchrun: bool = False) -> Namespace | None:
    """The run's own network namespace, or None: said once (``auto``), refused
    (``require``), or not asked for (``off``)."""
    mode = settings["isolate"]
    if mode not in MODES:
        raise WorkerError(f"configure(isolate={mode!r}): give one of {', '.join(MODES)}")
    if mode == "off":
        return None
    if torchrun and _only_loopback():  # the job was started in a namespace of its own
        return None
    why, fix = _why_not(host, specs, torchrun)
    if why is None:
        try:
            return Namespace.make()
        except CannotIsolate as e:
            why = (f"this process may not make a network namespace ({e.strerror}: it needs "
                   "CAP_SYS_ADMIN in its user namespace)")
    if mode == "require":
        raise WorkerError(f"configure(isolate='require'): this run's listeners cannot be kept "
                          f"to the run: {why}. To keep them to it, {fix}; or configure("
                          "isolate='auto') to run it exposed, said once")
    if loopback(host):  # a network address is the user's own choice (a private network)
        log.warning("this run's RPC listeners (TensorPipe and the rendezvous, on %s) can be "
                    "reached by every user of this machine, because %s: one who connects can "
                    "call torch's built-in operators as you (read, create and overwrite "
                    "files) or abort the run. To keep them to the run, %s. "
                    "somatize.remote.configure(isolate='require') refuses to start instead; "
                    "isolate='off' says nothing", host, why, fix)
    return None


TORCHRUN_FIX = ("start the whole torchrun job in a network namespace of its own, e.g. "
                "`unshare --net sh -c 'ip link set lo up && torchrun ...'` (docs/workers.md, "
                "\"What torchrun exposes\")")


def _only_loopback() -> bool:
    import socket

    return all(name.startswith("lo") for _, name in socket.if_nameindex())


def _why_not(host: str, specs, torchrun: bool) -> tuple[str | None, str]:
    # why this run cannot be isolated (None: it can), and what would keep it to the run
    if torchrun:
        return "its ranks are torchrun's processes, each on its own", TORCHRUN_FIX
    if not loopback(host):
        return (f"it listens on {host}, for workers on other machines",
                "run it on a private network (WireGuard, ssh -w: docs/security.md)")
    return None, FIX


_lock = threading.Lock()
_refused: dict[str, dict[str, int]] = {}  # what was refused -> address -> how many times


def refused(what: str, address: str) -> bool:
    """Count a refused ``what`` ("a join", "a call") from ``address``; True the first time
    that address is refused that way in this run (say it then, and only then)."""
    with _lock:
        seen = _refused.setdefault(what, {})
        seen[address] = seen.get(address, 0) + 1
        return seen[address] == 1


def closing() -> None:
    """Say how many calls and joins were refused in this run (nothing when none were)."""
    with _lock:
        counts = {w: (sum(a.values()), len(a)) for w, a in _refused.items() if a}
        _refused.clear()
    for what, (n, where) in counts.items():
        log.warning("refused %d %s%s from %d %s in this run (each said once, above)", n,
                    what.removeprefix("a "), "" if n == 1 else "s", where,
                    "address" if where == 1 else "addresses")
