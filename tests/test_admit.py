"""The socket filter a run on a network puts on its listeners (somatize/remote/_admit.py):
only the listed addresses get a connection; one accepted before from elsewhere is cut.
On loopback, in this process: 127.0.0.2 stands for the run's host, 127.0.0.1 for a
stranger (both are this machine's, so no test host is needed)."""

import socket

import pytest

from somatize.remote import _admit


@pytest.fixture
def fresh():
    hosts, guarded = set(_admit._hosts), dict(_admit._guarded)
    _admit._hosts.clear()
    _admit._guarded.clear()
    yield
    _admit._hosts.clear()
    _admit._hosts.update(hosts)
    _admit._guarded.clear()
    _admit._guarded.update(guarded)


def _connects(srv, source: str) -> bool:
    with socket.socket(srv.family) as s:
        s.settimeout(0.5)  # a dropped SYN is never answered; a kept one is, at once
        s.bind((source, 0))
        try:
            s.connect(srv.getsockname()[:2])
        except TimeoutError:
            return False
        return True


def _listener(host="127.0.0.1", family=socket.AF_INET):
    srv = socket.create_server((host, 0), family=family, backlog=16)
    return srv, {k: fd for k, fd in _admit.listening().items() if fd == srv.fileno()}


def test_a_guarded_listener_accepts_only_the_runs_hosts_and_those_allowed_later(fresh):
    srv, mine = _listener()
    with srv:
        assert len(mine) == 1
        assert _connects(srv, "127.0.0.1") and _connects(srv, "127.0.0.3")
        _admit.guard(mine, ["127.0.0.2"])
        assert _admit.hosts() == ["127.0.0.1", "127.0.0.2"]  # its own address, and the run's
        srv.close()
    srv, mine = _listener("127.0.0.2")  # bound to the run's address: a stranger's is not
    with srv:
        _admit._hosts.clear()
        _admit.guard(mine, ["127.0.0.4"])
        assert _connects(srv, "127.0.0.4") and _connects(srv, "127.0.0.2")
        assert not _connects(srv, "127.0.0.3")
        assert _admit.allow(["127.0.0.3"]) and not _admit.allow(["127.0.0.3"])
        assert _connects(srv, "127.0.0.3")  # said by the gate: admitted from now on


def test_an_ipv6_listener_is_guarded_by_its_ipv6_hosts(fresh):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        srv, mine = _listener("::1", socket.AF_INET6)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    with srv:
        _admit.guard(mine, ["198.18.0.9"])  # its own ::1 is admitted, as a host of the run
        assert _connects(srv, "::1")
        _admit._hosts.discard("::1")
        _admit.allow(["2001:db8::1"])  # a filter with no ::1 in it
        assert not _connects(srv, "::1")


def test_a_connection_accepted_before_the_filter_from_outside_the_run_is_cut(fresh, caplog):
    srv, mine = _listener("127.0.0.2")
    with srv:
        early = socket.create_connection(srv.getsockname(), source_address=("127.0.0.3", 0))
        run = socket.create_connection(srv.getsockname(), source_address=("127.0.0.4", 0))
        accepted = [srv.accept()[0], srv.accept()[0]]
        _admit.guard(mine, ["127.0.0.4"])
        with early, run:
            early.settimeout(5)
            assert early.recv(1) == b""  # its end was shut down
            accepted[1].sendall(b"k")
            assert run.recv(1) == b"k"  # the run's own connection goes on
        for c in accepted:
            c.close()
    assert "cut a connection from 127.0.0.3" in caplog.text


def test_a_filter_with_too_many_hosts_is_refused_naming_the_setting():
    from somatize import WorkerError

    with pytest.raises(WorkerError, match="isolate='off'"):
        _admit.program([f"10.0.{i // 250}.{i % 250 + 1}" for i in range(130)])
