"""Nothing wrong, nothing leaked: a lost worker is named on every later call, a node that
never leaves here need not pickle, and Ctrl-C stops a run at once, leaving no process.
The coordinators are functions of tests/remote_failure_runs.py, each run in a process of its
own."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from models import Body, Head, Holding
from remote_run import no_worker_left, said, start

from somatize import Graph, Refused
from somatize.remote import runtime_for
from somatize.remote._group import group
from somatize.torch import Split, Trainer, parameters


def test_every_call_to_a_lost_worker_raises_worker_error_naming_it(tmp_path):
    got = said("lost_worker", cwd=tmp_path)
    assert got["during"]["error"] == "WorkerError", got
    assert "was lost while running" in got["during"]["message"], got
    for call in ("forward", "call", "provision"):  # not RuntimeError: unknown destination
        e = got[call]
        assert e["error"] == "WorkerError", (call, e)
        assert "worker 'gpu'" in e["message"] and "state over there is gone" in e["message"], e
        assert "close" in e["message"], e
    assert got["again"] is True
    assert no_worker_left([got["pid"]])


def test_a_worker_lost_between_two_runs_is_named_on_every_later_one(tmp_path):
    got = said("lost_while_idle", cwd=tmp_path)
    for e in (got["first"], got["second"]):
        assert e["error"] == "WorkerError" and "worker 'gpu'" in e["message"], e
        assert "state over there is gone" in e["message"], e
    assert no_worker_left([got["pid"]])


def test_a_node_that_does_not_pickle_runs_here_beside_a_placed_one(tmp_path):
    got = said("unpicklable_here", cwd=tmp_path)
    assert got["forward"] is True and got["losses"] is True and got["weights"] is True, got
    # the trainer travelled with its node, one object in both its positions; the rest
    # of the catalog stands there by id and kind alone
    assert got["there"] == {"one_trainer": True, "trains_its_node": True,
                            "elsewhere": ["head", "holding"]}, got


def test_a_placed_node_that_does_not_pickle_is_refused_naming_it_before_anything_starts():
    # refused before RPC starts: nothing here needs a process of its own
    g = Graph.somatize(Body().at("gpu") >> Holding().at("gpu") >> Head())
    with pytest.raises(Refused) as e:
        g.forward(torch.zeros(2, 8))
    msg = str(e.value)
    assert "node 'holding' (Holding)" in msg and "worker 'gpu'" in msg, msg
    assert "does not pickle" in msg and "_thread.lock" in msg, msg
    assert runtime_for(g).peers == {} and not group().started
    g.close()


def test_a_trainer_that_does_not_pickle_is_refused_naming_its_node():
    g = Graph.somatize(Body().at("gpu") >> Head())
    trainer = Split(torch.optim.SGD, lr=0.1)
    trainer.lock = Holding().lock  # what it keeps does not pickle
    trains = {"body": trainer}
    with pytest.raises(Refused) as e:
        Trainer(g, torch.nn.functional.cross_entropy,
                torch.optim.SGD(parameters(g, without=trains), lr=0.1), trains=trains)
    msg = str(e.value)
    assert "the trainer of node 'body' (Split)" in msg and "worker 'gpu'" in msg, msg
    assert not group().started


def _interrupt(tmp_path, where: str) -> tuple[float, str, int]:
    """Start ``interrupted(where)``, SIGINT it once its remote node sleeps; answer the
    seconds it took to exit, its stderr and the worker's pid."""
    pid_file = tmp_path / "pid.txt"
    proc = start("interrupted", where, pid_file, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while not pid_file.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the remote node never ran"
            time.sleep(0.05)
        time.sleep(0.5)  # the coordinator is waiting (or napping, "here") by now
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return took, err, int(pid_file.read_text())


@pytest.mark.parametrize("where", ["forward", "fit", "here"])
def test_ctrl_c_stops_a_run_at_once_and_leaves_no_worker(tmp_path, where):
    took, err, worker = _interrupt(tmp_path, where)
    assert "KeyboardInterrupt" in err, err[-3000:]
    assert took < 5, f"{took:.1f} s to stop\n{err[-3000:]}"
    assert no_worker_left([worker]), err[-3000:]
    # nothing failed on the way out: no second error, no hang at exit
    assert "During handling" not in err and "WorkerError" not in err, err[-3000:]
    assert "Traceback" not in err.split("KeyboardInterrupt")[-1], err[-3000:]

