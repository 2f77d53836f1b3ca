"""The standing worker: a daemon that, for each run that asks, starts a fresh serving
process which joins that run's RPC group; the run ends it, or it ends with the run.

    python -m somatize.worker --name gpu --listen 127.0.0.1:7000 [--store /scratch/soma]
    somatize worker --name gpu --listen 127.0.0.1:7000

    g.forward(x, workers={"gpu": Worker.at("127.0.0.1:7000")})

A fresh process per run, because torch.distributed.rpc cannot be initialised twice
in one process (pytorch#46491) and a run that breaks must not take the daemon with it.
The worker runs the code it is sent (classes from the coordinator's ``__main__``
travel by value; others must be importable here): listen only where you trust
whoever can connect. Listening anywhere but loopback says so on start. The daemon
imports no torch; its serving processes do.

A run holds its connection to the daemon open while it lasts; the daemon ends the run's
serving process when that connection ends. A coordinator that vanishes without closing
it (its machine down, the link cut) is found by TCP keepalive: the daemon probes an idle
connection every ``--keepalive`` seconds (10) and gives the run up after 3 unanswered
probes, so a cut-off serving process exits within about 4x that. A request is one JSON
line of at most 64 KB, read within 30 s; anything else is answered with an error line
and the connection dropped.
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

MAX_REQUEST = 64 * 1024  # bytes: a request is a few hundred; garbage must not fill memory
REQUEST_SECONDS = 30.0  # a connection that sends no request line in time is dropped
PROBES = 3  # unanswered keepalive probes before the run's coordinator is taken for gone


def _serve_run(conn: socket.socket, peer, host: str, store: str | None, children: set,
               keepalive: float) -> None:
    # one connection is one run: its serving process lives until the run lets go of it
    with conn:
        try:
            conn.settimeout(REQUEST_SECONDS)
            line = conn.makefile("rb").readline(MAX_REQUEST + 1)
            if len(line) > MAX_REQUEST:
                raise ValueError(f"more than {MAX_REQUEST} bytes without a newline: a "
                                 "somatize coordinator sends one short JSON line")
            req = json.loads(line or b"{}")
            argv = [str(a) for a in req["serve"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("dropped a connection from %s: bad request: %s", _at(peer), e)
            try:
                conn.sendall(json.dumps({"error": f"bad request: {e}"}).encode() + b"\n")
            except OSError:
                pass
            return
        conn.settimeout(None)
        _keep_alive(conn, keepalive)
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
        except OSError as e:  # a keepalive that went unanswered, or a reset
            log.warning("the coordinator at %s stopped answering (%s): ending its run",
                        _at(peer), e)
        proc.stdin.close()  # the serving process exits when its stdin closes
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        children.discard(proc)
        log.info("run ended: pid %d exited with %s", proc.pid, proc.returncode)


def _keep_alive(conn: socket.socket, every: float) -> None:
    # the run's connection is silent while the run lasts: probes are what tell a
    # coordinator that answers from one whose machine or link is gone
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    seconds = max(1, round(every))
    for opt, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", seconds),
                       ("TCP_KEEPCNT", PROBES)):
        if hasattr(socket, opt):  # Linux has all three; others keep their defaults
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _at(peer) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


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
    ap.add_argument("--keepalive", type=float, default=10.0, help="seconds between probes of "
                    f"a run's silent connection; {PROBES} unanswered end the run (default 10)")
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
    if not _loopback(host):
        log.warning("%s is not loopback: a worker runs the code it is sent, so whoever can "
                    "connect to port %d runs code on this machine as this user. Listen only "
                    "on a network where you trust everyone (or on 127.0.0.1 behind an SSH "
                    "tunnel)", host, srv.getsockname()[1])
        if "TP_SOCKET_IFNAME" not in os.environ:
            log.warning("TP_SOCKET_IFNAME is not set: set it to the interface of %s, so that "
                        "runs' serving processes listen there too", host)
    while not done.is_set():
        try:
            conn, peer = srv.accept()
        except OSError:
            break
        threading.Thread(target=_serve_run,
                         args=(conn, peer, host, args.store, children, args.keepalive),
                         daemon=True, name=f"run-{_at(peer)}").start()
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
