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
probes, so a cut-off serving process exits within about 4x that.

Only a coordinator holding this worker's token is served (``SOMATIZE_TOKEN``, or the
file ``SOMATIZE_TOKEN_FILE`` names; started without either, the worker makes one and
keeps it, mode 0600, in ``~/.config/somatize/worker-<name>.token``). Both ends prove
they hold it by challenge and response within 30 s; the coordinator then sends its run
id, and the run's key is derived from the token and that id (docs/security.md). The
serving process's command line is built here from checked fields of the request.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024  # bytes: a request is a few hundred; garbage must not fill memory
REQUEST_SECONDS = 30.0  # a connection that proves nothing and sends no request in time is dropped
PROBES = 3  # unanswered keepalive probes before the run's coordinator is taken for gone


def _serve_run(conn: socket.socket, peer, host: str, store: str | None, children: set,
               keepalive: float, tok: bytes) -> None:
    # one connection is one run: its serving process lives until the run lets go of it
    from .remote._isolation import NETNS_ENV
    from .remote._secret import RUN_KEY_ENV, Refused, derive, prove, recv_frame, send_frame

    with conn:
        try:
            conn.settimeout(REQUEST_SECONDS)
            session = prove(conn, tok, "host")
        except (Refused, OSError) as e:
            log.warning("refused a run from %s: %s", _at(peer), e if isinstance(e, Refused)
                        else f"it did not prove it holds this worker's token ({e})")
            return
        try:
            req = json.loads(recv_frame(conn, session, 0, MAX_REQUEST))
            argv, run, netns = _argv(req), req["run"], _netns(req, host)
            if not isinstance(run, str) or not 8 <= len(run) <= 64:
                raise ValueError("no run id")
        except (OSError, ValueError, KeyError, TypeError, Refused) as e:
            log.warning("dropped a connection from %s: bad request: %s", _at(peer), e)
            try:
                send_frame(conn, session, 1, json.dumps({"error": f"bad request: {e}"}).encode())
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
        if _loopback(host):  # listen where we were told, never wider
            env["TP_SOCKET_IFNAME"] = loopback_iface()
        for k in ("SOMATIZE_TOKEN", "SOMATIZE_TOKEN_FILE"):
            env.pop(k, None)  # the run's key is all the serving process needs
        env[RUN_KEY_ENV] = derive(tok, run).hex()
        env.pop(NETNS_ENV, None)
        if netns is not None:  # the run's own network namespace: its process enters it
            env[NETNS_ENV] = f"{netns['path']}#{netns['inode']}"
        proc = subprocess.Popen([sys.executable, "-m", "somatize.remote", *argv],
                                stdin=subprocess.PIPE, env=env)
        children.add(proc)
        log.info("run joined: serving process pid %d (%s)", proc.pid, " ".join(argv[:2]))
        try:
            send_frame(conn, session, 1, json.dumps({"pid": proc.pid,
                                                     "keeps": store is not None}).encode())
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


_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
_JOIN = re.compile(r"tcp://[A-Za-z0-9.:\[\]-]{1,100}:[0-9]{1,5}")
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:[0-9]{1,3})?")
_OPTIONS = {"transports": list, "channels": (list, type(None)), "rpc_threads": int,
            "timeout": (int, float)}


_NETNS_PATH = re.compile(r"/proc/[0-9]{1,10}/fd/[0-9]{1,10}")
_NETNS_INODE = re.compile(r"net:\[[0-9]{1,20}\]")


def _netns(req: dict, host: str) -> dict | None:
    """The run's network namespace its serving process enters (a coordinator on this
    machine whose run is isolated): a path of that process and the inode it must be,
    honoured only by a daemon on loopback (a path of another machine's is not its)."""
    ns = req.get("netns")
    if ns is None:
        return None
    if not _loopback(host):
        raise ValueError("a network namespace, asked of a daemon that is not on loopback")
    if not (isinstance(ns, dict) and isinstance(ns.get("path"), str)
            and _NETNS_PATH.fullmatch(ns["path"]) and isinstance(ns.get("inode"), str)
            and _NETNS_INODE.fullmatch(ns["inode"])):
        raise ValueError(f"netns {str(ns)[:120]!r}")
    return {"path": ns["path"], "inode": ns["inode"]}


def _argv(req: dict) -> list[str]:
    """The serving process's command line, built here from checked fields: never taken
    from the request as it came."""
    name, rank, join = req["name"], req["rank"], req["join"]
    threads, device, opts = req.get("threads"), req.get("device"), req.get("options", {})
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ValueError(f"name {str(name)[:70]!r}")
    if type(rank) is not int or not 0 < rank < 1 << 20:
        raise ValueError(f"rank {str(rank)[:20]!r}")
    if not (isinstance(join, str) and _JOIN.fullmatch(join)):
        raise ValueError(f"join {str(join)[:110]!r}")
    if threads is not None and (type(threads) is not int or not 0 < threads < 4096):
        raise ValueError(f"threads {str(threads)[:20]!r}")
    if device is not None and not (isinstance(device, str) and _DEVICE.fullmatch(device)):
        raise ValueError(f"device {str(device)[:20]!r}")
    if not isinstance(opts, dict) or set(opts) - set(_OPTIONS) or not all(
            isinstance(v, _OPTIONS[k]) for k, v in opts.items()) or not all(
            isinstance(t, str) and _NAME.fullmatch(t)
            for k in ("transports", "channels") for t in (opts.get(k) or [])):
        raise ValueError(f"options {str(opts)[:200]!r}")
    argv = ["--name", name, "--rank", str(rank), "--join", join,
            "--options", json.dumps(opts)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if device is not None:
        argv += ["--device", device]
    return argv


def _keep_alive(conn: socket.socket, every: float) -> None:
    # the run's connection is silent while the run lasts: probes are what tell a
    # coordinator that answers from one whose machine or link is gone
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    seconds = max(1, round(every))
    for opt, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", seconds),
                       ("TCP_KEEPCNT", PROBES)):
        if hasattr(socket, opt):  # Linux has all three; others keep their defaults
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _token(name: str) -> bytes:
    """This worker's token: SOMATIZE_TOKEN, the file SOMATIZE_TOKEN_FILE names, else one
    made and kept (mode 0600) in ~/.config/somatize/worker-<name>.token."""
    from .remote._secret import TOKEN_FILE_ENV, make_token_file, token

    tok = token()
    if tok is not None:
        return tok
    home = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    d = os.path.join(home, "somatize")
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(d, f"worker-{name}.token")
    tok = make_token_file(path)
    log.info("no token given: this worker's token is kept in %s (mode 0600); a coordinator "
             "needs a copy of it (mode 0600): start it with %s=<that copy>", path,
             TOKEN_FILE_ENV)
    return tok


def _at(peer) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def main(argv: list[str] | None = None) -> int:
    """Serve runs on ``--listen HOST:PORT`` until SIGTERM or SIGINT."""
    ap = argparse.ArgumentParser(prog="python -m somatize.worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="the host name runs place nodes on")
    ap.add_argument("--listen", required=True, help="HOST:PORT (loopback, or an address on "
                    "a private network: docs/security.md)")
    ap.add_argument("--store", default=None, help="a directory to keep what runs here")
    ap.add_argument("--keepalive", type=float, default=10.0, help="seconds between probes of "
                    f"a run's silent connection; {PROBES} unanswered end the run (default 10)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"somatize worker {args.name}: %(message)s")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"--listen {args.listen!r}: give HOST:PORT, e.g. 127.0.0.1:7000", file=sys.stderr)
        return 2
    try:
        tok = _token(args.name)
    except Exception as e:  # a token file others may read, or none to be made
        print(f"somatize worker {args.name}: {e}", file=sys.stderr)
        return 2
    try:
        srv = socket.create_server((host, int(port)))
    except OSError as e:  # a port in use, an address not of this machine
        fix = ("another process listens there: stop it, or give another port"
               if e.errno == errno.EADDRINUSE else
               "give an address of this machine (ip addr), or 127.0.0.1")
        print(f"somatize worker {args.name}: cannot listen on {args.listen} ({e.strerror}): "
              f"{fix}", file=sys.stderr)
        return 2
    children: set[subprocess.Popen] = set()
    done = threading.Event()

    def finish(*_):
        done.set()
        srv.close()

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    log.info("listening on %s:%d", host, srv.getsockname()[1])
    if not _loopback(host):
        log.warning("%s is not loopback: only coordinators holding this worker's token "
                    "are served, and the TensorPipe listeners of its runs admit only the "
                    "run's hosts, but whoever shares or forges one of their addresses (another "
                    "user of one of those machines) reaches them (torch's built-in operators "
                    "run unauthenticated there). Listen only on a private network "
                    "(WireGuard, ssh -w): docs/security.md", host)
        if "TP_SOCKET_IFNAME" not in os.environ:
            log.warning("TP_SOCKET_IFNAME is not set: set it to the interface of %s, so that "
                        "runs' serving processes listen there too", host)
    while not done.is_set():
        try:
            conn, peer = srv.accept()
        except OSError:
            break
        threading.Thread(target=_serve_run,
                         args=(conn, peer, host, args.store, children, args.keepalive, tok),
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
