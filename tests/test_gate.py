"""The run's rendezvous in one process (its gate and a joiner's store on loopback, no
worker): a joiner proving the key reads and writes the store, one without it is refused,
and a proven connection sends each write at once (TCP_NODELAY on both ends: each end
writes its proof and then its first frame before it reads, which Nagle's algorithm held
for the peer's delayed ACK, 40 ms a join)."""

import os
import socket
import threading

import pytest

from somatize.remote._gate import Gate, GatedStore
from somatize.remote._secret import Refused, prove


def nodelay(sock):
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_both_ends_of_a_proven_connection_send_at_once():
    key = os.urandom(32)
    srv = socket.create_server(("127.0.0.1", 0))
    got = {}

    def host():
        conn, _ = srv.accept()
        got["conn"], got["session"] = conn, prove(conn, key, "host")

    t = threading.Thread(target=host)
    t.start()
    joiner = socket.create_connection(srv.getsockname(), timeout=10)
    assert not nodelay(joiner)  # a fresh socket: Nagle on
    session = prove(joiner, key, "joiner")
    t.join(10)
    assert session == got["session"]  # the same session key on both ends
    assert nodelay(joiner) and nodelay(got["conn"])
    for s in (joiner, got["conn"], srv):
        s.close()


def test_a_joiner_with_the_key_uses_the_store_and_one_without_is_refused():
    key = os.urandom(32)
    gate = Gate("127.0.0.1", key, timeout=10)
    try:
        store = GatedStore("127.0.0.1", gate.port, key, 10, "worker")
        store.set("a", b"1")
        assert gate.store.get("a") == b"1" and store.get("a") == b"1"
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5
        assert "worker" in gate.seen
        with pytest.raises(Refused, match="refused this worker"):
            GatedStore("127.0.0.1", gate.port, os.urandom(32), 10, "stranger")
        assert "stranger" not in gate.seen and store.get("a") == b"1"  # the run goes on
    finally:
        gate.close()
