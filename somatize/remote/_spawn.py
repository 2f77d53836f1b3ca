"""Starting a serving process: embedded on this machine, or by a standing daemon there.

    proc = spawn(["--name", "gpu", "--rank", "1", "--join", join, ...])
    conn, reply = ask_daemon("node3:7000", "gpu", request, timeout)   # {"pid": ...}

A serving process starts with ``_settings.SERVING_ENV`` unless the environment says otherwise:
huge pages (large tensors are received faster) and ``OMP_WAIT_POLICY=PASSIVE`` (idle
math threads sleep instead of spinning on the cores the coordinator computes on). Both
are read once, before torch is imported, so only a process somatize starts can be given
them (docs/performance.md, "libgomp busy-wait").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from .._errors import WorkerError
from ._fork_here import current as forked_here
from ._forks import Forked
from ._forks import named as forks_named
from ._isolation import NETNS_ENV
from ._secret import (
    RUN_KEY_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    Refused,
    prove,
    recv_frame,
    run_id,
    run_key,
    send_frame,
    token,
)
from ._settings import loopback, loopback_iface, serving_env, settings


def spawn(argv: list[str], netns=None) -> subprocess.Popen | Forked:
    """Start a serving process on this machine; it exits when its stdin closes. Forked
    from the server ``SOMATIZE_FORKS`` names, where there is one (``fork_workers``), else
    from the one forked from this process (``_fork_here``).
    ``netns``: the run's network namespace (``_isolation.Namespace``), which it enters
    before it makes a socket."""
    env = serving_env(dict(os.environ))
    env.pop(NETNS_ENV, None)
    if netns is not None:
        env[NETNS_ENV] = netns.path  # opened there as this user: no other user may
    if loopback(settings["listen"]) or not env.get("TP_SOCKET_IFNAME"):
        env["TP_SOCKET_IFNAME"] = loopback_iface()  # never wider than the coordinator
    # what imports here imports there: the script's directory and every path of this process
    paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env[RUN_KEY_ENV] = run_key().hex()  # the child's environment: no other user reads it
    server = forks_named(env) or forked_here()
    if server is not None:  # over a socket only this user reaches
        forked = server.popen(["-m", "somatize.remote", *argv], env, os.getcwd(),
                              stdin=subprocess.PIPE)
        if forked is not None:
            return forked
    return subprocess.Popen([sys.executable, "-m", "somatize.remote", *argv],
                            stdin=subprocess.PIPE, env=env)


def ask_daemon(address: str, host: str, request: dict, timeout: float):
    """Ask the standing daemon at ``address`` for a serving process; returns the
    connection (held open for the run) and its reply. Both ends first prove they hold
    the same token (``_secret.prove``); the request says only what the daemon checks and
    builds a command line from, and the run id it derives the run's key from."""
    where, _, port = address.rpartition(":")
    if not loopback(where) and loopback(settings["listen"]):
        raise WorkerError(
            f"worker {host!r} at {address} is on another machine, but this coordinator "
            "listens on loopback only: call somatize.remote.configure(listen='<an address "
            "it can reach>') and set TP_SOCKET_IFNAME to that interface"
        )
    tok = token()
    if tok is None:
        raise WorkerError(
            f"worker {host!r} at {address} is a standing worker, which admits only a "
            f"coordinator holding its token: start this process with {TOKEN_FILE_ENV}=<a "
            "copy of the token file the worker said it keeps> (mode 0600), or with "
            f"{TOKEN_ENV} set (docs/security.md)")
    try:
        conn = socket.create_connection((where, int(port)), timeout=timeout)
    except OSError as e:
        raise WorkerError(
            f"worker {host!r}: no standing worker answered at {address} ({e}). Start one "
            f"there with `python -m somatize.worker --name {host} --listen {address}`"
        ) from None
    try:
        session = prove(conn, tok, "joiner")
        send_frame(conn, session, 0, json.dumps({**request, "run": run_id()}).encode())
        reply = json.loads(recv_frame(conn, session, 1))
    except Refused as e:
        conn.close()
        raise WorkerError(
            f"worker {host!r} at {address} and this coordinator do not hold the same token "
            f"({e}): give this process the worker's token ({TOKEN_FILE_ENV} or {TOKEN_ENV})"
        ) from None
    except (OSError, ValueError) as e:
        conn.close()
        raise WorkerError(
            f"worker {host!r} at {address} refused the run: it closed the connection ({e}). "
            "Its log says why; a standing worker admits only a coordinator holding its token"
        ) from None
    if "error" in reply or "pid" not in reply:
        conn.close()
        raise WorkerError(f"worker {host!r} at {address} refused the run: "
                          f"{reply.get('error', 'no answer')}")
    conn.settimeout(None)
    return conn, reply
