"""The standing worker: a daemon that, for each run that asks, starts a fresh serving
process which joins that run's RPC group; the run ends it, or it ends with the run.

    python -m somatize.worker --name gpu --listen 127.0.0.1:7000 [--store /scratch/soma]
    somatize worker --name gpu --listen 127.0.0.1:7000

    g.forward(x, workers={"gpu": Worker.at("127.0.0.1:7000")})

A fresh process per run, because torch.distributed.rpc cannot be initialised twice
in one process (pytorch#46491) and a run that breaks must not take the daemon with it.
The worker runs the code it is sent (classes from the coordinator's ``__main__``
travel by value; others must be importable here): listen only where you trust
whoever can connect. The daemon imports no torch; its serving processes do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

log = logging.getLogger(__name__)


def _serve_run(conn: socket.socket, host: str, store: str | None, children: set) -> None:
    # one connection is one run: its serving process lives until the run lets go of it
    with conn:
        try:
            req = json.loads(conn.makefile("rb").readline() or b"{}")
            argv = [str(a) for a in req["serve"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            conn.sendall(json.dumps({"error": f"bad request: {e}"}).encode() + b"\n")
            return
        if store is not None:
            argv += ["--store", store]
        from .remote._settings import loopback_iface
        from .remote._spawn import serving_env

        env = serving_env(dict(os.environ))  # only a process we start can have them
        if _loopback(host) and "TP_SOCKET_IFNAME" not in env:  # listen where we were told
            env["TP_SOCKET_IFNAME"] = loopback_iface()
        proc = subprocess.Popen([sys.executable, "-m", "somatize.remote", *argv],
                                stdin=subprocess.PIPE, env=env)
        children.add(proc)
        log.info("run joined: serving process pid %d (%s)", proc.pid, " ".join(argv[:2]))
        try:
            conn.sendall(json.dumps({"pid": proc.pid, "keeps": store is not None}).encode()
                         + b"\n")
            while conn.recv(1 << 12):  # the run holds the connection open while it lasts
                pass
        except OSError:
            pass
        proc.stdin.close()  # the serving process exits when its stdin closes
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        children.discard(proc)
        log.info("run ended: pid %d exited with %s", proc.pid, proc.returncode)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def main(argv: list[str] | None = None) -> int:
    """Serve runs on ``--listen HOST:PORT`` until SIGTERM or SIGINT."""
    ap = argparse.ArgumentParser(prog="python -m somatize.worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="the host name runs place nodes on")
    ap.add_argument("--listen", required=True, help="HOST:PORT (loopback unless you trust "
                    "the network: whoever connects runs code here)")
    ap.add_argument("--store", default=None, help="a directory to keep what runs here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"somatize worker {args.name}: %(message)s")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"--listen {args.listen!r}: give HOST:PORT, e.g. 127.0.0.1:7000", file=sys.stderr)
        return 2
    srv = socket.create_server((host, int(port)))
    children: set[subprocess.Popen] = set()
    done = threading.Event()

    def finish(*_):
        done.set()
        srv.close()

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    log.info("listening on %s:%d", host, srv.getsockname()[1])
    while not done.is_set():
        try:
            conn, peer = srv.accept()
        except OSError:
            break
        threading.Thread(target=_serve_run, args=(conn, host, args.store, children),
                         daemon=True, name=f"run-{peer}").start()
    for proc in list(children):
        proc.terminate()
    for proc in list(children):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
