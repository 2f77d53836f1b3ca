"""A worker runs one session's calls in the order the coordinator sent them, whatever
order its RPC threads reach the compute thread in (the serving functions themselves,
called from threads as TensorPipe's do)."""

import threading
import time

import pytest

from somatize.remote import _serve


def _arrive(session, tickets, ran):
    answers = {}

    def one(t):
        answers[t] = _serve._in_turn(session, t, lambda: ran.append(t) or t)

    threads = []
    for t in tickets:  # each a little after the other, in the order given
        threads.append(threading.Thread(target=one, args=(t,)))
        threads[-1].start()
        time.sleep(0.05)
    for th in threads:
        th.join(timeout=10)
    return answers


def test_calls_arriving_out_of_order_run_in_the_order_they_were_sent():
    ran = []
    answers = _arrive("order-a", [3, 1, 2, 0], ran)
    assert ran == [0, 1, 2, 3]
    assert answers == {0: 0, 1: 1, 2: 2, 3: 3}
    # the next one, arriving alone, runs at once; another session has its own numbers
    assert _serve._in_turn("order-a", 4, lambda: "four") == "four"
    assert _serve._in_turn("order-b", 0, lambda: "zero") == "zero"
    _serve.close("order-a")
    _serve.close("order-b")


def test_a_call_whose_predecessor_never_comes_fails_naming_both(monkeypatch):
    monkeypatch.setattr(_serve, "_TURN_WAIT_S", 0.3)
    got = _serve._in_turn("order-c", 1, lambda: pytest.fail("ran out of turn"))
    assert isinstance(got, _serve.Failed)
    assert "call 1 of session order-c" in got.message and "call 0 before it" in got.message
    assert "never came" in got.message
    _serve.close("order-c")


def test_closing_the_session_ends_a_waiting_call_without_running_it():
    got = {}
    th = threading.Thread(target=lambda: got.update(
        a=_serve._in_turn("order-d", 2, lambda: pytest.fail("ran out of turn"))))
    th.start()
    time.sleep(0.1)
    _serve.close("order-d")
    th.join(timeout=10)
    assert not th.is_alive()
    assert isinstance(got["a"], _serve.Failed)
