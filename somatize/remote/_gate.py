"""The run's rendezvous, behind a gate: only a peer that proves it holds the run's key
reaches the store the RPC group meets in.

    gate = Gate("127.0.0.1", key, timeout=60)      # the coordinator: gate.store, gate.port
    store = GatedStore("127.0.0.1", gate.port, key, timeout=60)   # a joining worker

torch's own ``tcp://`` rendezvous is a TCPStore that answers anyone who connects (a
stranger joins the group and calls anything). Here the coordinator keeps the store in
its own memory (a ``HashStore``) and serves it over a socket bound to one address; each
connection first proves both ends hold the key (``_secret.prove``), then every request
and answer carries a MAC. A connection that fails is refused and said in the run's log
("refused a join from ..."); the run goes on.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from datetime import timedelta

import torch.distributed as dist

from . import _exposure
from ._secret import Refused, prove, recv_frame, send_frame

log = logging.getLogger(__name__)
_ADDRS = "rpc_prefix_0/addrs/"  # where each member's TensorPipe address is written


def _pack(*fields: bytes) -> bytes:
    return b"".join(struct.pack("!I", len(f)) + f for f in fields)


def _unpack(body: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(body):
        (n,) = struct.unpack_from("!I", body, i)
        out.append(body[i + 4:i + 4 + n])
        i += 4 + n
    return out


class Gate:
    """The coordinator's rendezvous: a store in this process, served to proven peers."""

    def __init__(self, host: str, key: bytes, timeout: float):
        self.key, self.store = key, dist.HashStore()
        self.seen: set[str] = set()  # the names of the joiners that proved the key
        self.admit = None  # told each proven joiner's address (_admit.Admitted), if any
        self.store.set_timeout(timedelta(seconds=timeout))
        self.sock = socket.create_server((host, 0), backlog=128)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="somatize-gate").start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name="somatize-gate-peer").start()

    def _serve(self, conn: socket.socket, peer) -> None:
        with conn:
            try:
                conn.settimeout(10.0)  # the proof comes at once, or not at all
                session = prove(conn, self.key, "host")
                conn.settimeout(None)
            except (Refused, OSError) as e:
                why = str(e) if isinstance(e, Refused) else \
                    f"it did not prove it holds the run's secret ({e.strerror or e})"
                if _exposure.refused("a join", peer[0]):  # one line per stranger
                    log.warning("refused a join from %s:%s: %s (later attempts from %s are "
                                "refused without a word)", peer[0], peer[1], why, peer[0])
                return
            if self.admit is not None:  # before it may connect to any member
                self.admit(peer[0])
            seq = 0
            while True:
                try:
                    body = recv_frame(conn, session, seq)
                except Refused as e:
                    log.warning("dropped the rendezvous connection of %s:%s: %s",
                                peer[0], peer[1], e)
                    return
                except (OSError, struct.error):
                    return  # the peer left
                try:
                    answer = b"k" + self._do(_unpack(body))
                except Exception as e:  # a store error (a wait that timed out) goes back
                    answer = b"e" + str(e).encode()
                try:
                    send_frame(conn, session, seq + 1, answer)
                except OSError:
                    return
                seq += 2

    def _do(self, f: list[bytes]) -> bytes:
        op, s = f[0], self.store
        key = f[1].decode() if len(f) > 1 else ""
        if op == b"set":
            if self.admit is not None and key.startswith(_ADDRS):  # its TensorPipe address
                self.admit(f[2].decode().split("://")[-1].rpartition(":")[0])
            s.set(key, f[2])
            return b""
        if op == b"get":
            return s.get(key)
        if op == b"add":
            return str(s.add(key, int(f[2]))).encode()
        if op == b"cas":
            return s.compare_set(key, f[2], f[3])
        if op == b"wait":
            keys = [k.decode() for k in f[2:]]
            s.wait(keys, timedelta(milliseconds=int(f[1])))
            return b""
        if op == b"check":
            return b"1" if s.check([k.decode() for k in f[1:]]) else b"0"
        if op == b"del":
            return b"1" if s.delete_key(key) else b"0"
        if op == b"num":
            return str(s.num_keys()).encode()
        if op == b"hi":  # a joiner says who it is (to tell "late" from "cannot reach")
            self.seen.add(key)
            return b""
        raise ValueError(f"no such store operation {op[:20]!r}")


class GatedStore(dist.Store):
    """A joiner's view of the coordinator's store, through its gate (one proven
    connection per thread: a blocking ``get`` on one thread never holds up another)."""

    def __init__(self, host: str, port: int, key: bytes, timeout: float, who: str = ""):
        super().__init__()
        self.where, self.key, self.limit, self.who = (host, port), key, timeout, who
        self.local = threading.local()
        if who:
            self._ask(b"hi", who.encode())

    def _conn(self):
        c = getattr(self.local, "conn", None)
        if c is None:
            sock = socket.create_connection(self.where, timeout=self.limit)
            try:
                session = prove(sock, self.key, "joiner")
            except Refused as e:
                sock.close()
                raise Refused(f"the rendezvous at {self.where[0]}:{self.where[1]} refused "
                              f"this worker, or was not the run's: {e}. Both ends must hold "
                              "the same run key (SOMATIZE_TOKEN)") from None
            sock.settimeout(None)
            c = self.local.conn = [sock, session, 0]
        return c

    def _ask(self, *fields: bytes) -> bytes:
        c = self._conn()
        send_frame(c[0], c[1], c[2], _pack(*fields))
        answer = recv_frame(c[0], c[1], c[2] + 1)
        c[2] += 2
        if answer[:1] == b"e":
            raise RuntimeError(answer[1:].decode(errors="replace"))
        return answer[1:]

    def set(self, key, value):
        self._ask(b"set", key.encode(), _bytes(value))

    def get(self, key):
        return self._ask(b"get", key.encode())

    def add(self, key, amount):
        return int(self._ask(b"add", key.encode(), str(int(amount)).encode()))

    def compare_set(self, key, expected, desired):
        return self._ask(b"cas", key.encode(), _bytes(expected), _bytes(desired))

    def wait(self, keys, timeout=None):
        ms = int((timeout or timedelta(seconds=self.limit)).total_seconds() * 1000)
        self._ask(b"wait", str(ms).encode(), *(k.encode() for k in keys))

    def check(self, keys):
        return self._ask(b"check", *(k.encode() for k in keys)) == b"1"

    def delete_key(self, key):
        return self._ask(b"del", key.encode()) == b"1"

    def num_keys(self):
        return int(self._ask(b"num"))

    def set_timeout(self, timeout):
        self.limit = timeout.total_seconds()


def _bytes(v) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def main() -> None:
    """A gate in a process of its own (``python -m somatize.remote._gate HOST TIMEOUT``,
    the key in ``SOMATIZE_RUN_KEY``): for torchrun's rank 0, whose agent waits for the
    other ranks inside C++ holding the GIL, so that a gate in its own process would
    never answer them. Prints its port; exits when its stdin closes."""
    import os
    import sys

    from ._secret import RUN_KEY_ENV

    logging.basicConfig(level=logging.WARNING, format="somatize rendezvous: %(message)s")
    gate = Gate(sys.argv[1], bytes.fromhex(os.environ.pop(RUN_KEY_ENV)), float(sys.argv[2]))
    print(gate.port, flush=True)
    while os.read(0, 1 << 12):  # rank 0 holds our stdin while it lives
        pass


if __name__ == "__main__":
    main()
