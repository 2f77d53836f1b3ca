"""Both routes in one LightningModule: a submodule placed by name and a GraphModule with
a node placed by ``.at(...)``, trained together under SomatizeStrategy to plain
Lightning's numbers, bit for bit, as parts of one session (tests/mixed_runs.py, in a
fresh process)."""

import contextlib
import json
import os
import signal
import time

import pytest
import torch
from scenario import scenario, start


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """One mixed fit, plain and under the strategy, and what it saw (run once)."""
    out = tmp_path_factory.mktemp("mixed") / "mixed.pt"
    scenario("mixed_runs.py", "mixed", out, timeout=600)
    return torch.load(out, weights_only=False)


def test_a_placed_submodule_and_a_graph_node_placed_in_one_model_both_train_exactly(mixed):
    got = mixed
    plain_losses, plain = got["plain"]
    split_losses, split = got["split"]
    assert len(plain_losses) == 12 and split_losses == plain_losses
    assert plain.keys() == split.keys()
    for k in plain:
        assert torch.equal(split[k], plain[k]), k
        assert not torch.equal(plain[k], got["fresh"][k]), k  # every weight trained
    # each route's work ran in a worker process, every step: the same one (one host)
    where = got["where"]
    assert got["pid"] not in where["encoder"] and sum(where["encoder"].values()) >= 12
    assert got["pid"] not in where["net.body"] and sum(where["net.body"].values()) >= 12
    assert where["encoder"].keys() == where["net.body"].keys()


def test_the_two_routes_of_a_fit_are_parts_of_one_session_that_closes_them_both(mixed):
    seen, after = mixed["seen"], mixed["after"]
    # during fit: part(name) answers the part that runs name, both of one session
    assert seen["parts"] == ["", "net"] and seen["one"] is True
    assert (seen["placed"], seen["graph"], seen["none"]) == ("", "net", True)
    assert seen["open"] == [True, True]
    assert "strategy.part('encoder')" in seen["refused"]  # a part is part(name), not session
    total, placed, graph = seen["traffic"]
    assert placed[1] > 0 and graph[1] > 0  # both sent something
    assert total[1:] == (placed[1] + graph[1], placed[2] + graph[2])
    # after fit the placed part is closed (its modules have their own forward back), the
    # graph's stays for a validate or test; its traffic still counts; close() ends all
    assert after["parts"] == {"": True, "net": False}
    assert after["traffic"][1] >= total[1] and after["closed"] is True


def test_a_refusal_of_one_route_at_setup_undoes_what_the_other_route_opened(tmp_path):
    out = tmp_path / "refused.json"
    scenario("mixed_runs.py", "refused", out)
    got = json.loads(out.read_text())
    assert got["said"].startswith("gradient_clip_val with a GraphModule's nodes trained")
    # the placed encoder has its own forward back and computes here; nothing stays open
    assert got["own_forward"] is True and got["same"] is True
    assert got["closed"] is True and got["routes"] == 0


def _alive(pids):
    left = set()
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                left.add(p)
    return left


def test_ctrl_c_in_a_mixed_fit_stops_both_routes_workers_and_says_what_each_loses(tmp_path):
    marker = tmp_path / "pids.json"
    proc = start("mixed_runs.py", "interrupted", marker)
    workers = set()
    try:
        _, err = proc.communicate(timeout=300)
        workers = set(json.loads(marker.read_text()))
        assert workers and proc.pid not in workers
        deadline = time.monotonic() + 10
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(workers)  # stopped, not left to the exit of this test's process
    finally:
        proc.kill()
        for p in _alive(workers):
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]  # Lightning's exit after a Ctrl-C
    # each route says what is not brought here; teardown asked nothing of the dead workers
    assert "what ['encoder'] trained on the workers" in err, err[-3000:]
    assert "what the placed nodes of ['net'] trained on the workers" in err, err[-3000:]
    assert "Traceback" not in err and "WorkerError" not in err, err[-3000:]
    # the trace asked for is written all the same, with what ran here
    trace = json.loads((tmp_path / "pids.json.trace.json").read_text())
    assert any(e.get("pid") == proc.pid for e in trace["traceEvents"])


def test_a_graph_module_refused_after_another_opened_leaves_that_one_running_here(tmp_path):
    out = tmp_path / "refused.json"
    scenario("mixed_runs.py", "refused_later", out)
    got = json.loads(out.read_text())
    assert "does not pickle" in got["said"] and "'odd'" in got["said"], got["said"]
    assert got["shape"] == [4, 10] and got["closed"] is True


def test_two_parts_on_one_worker_process_each_run_under_the_settings_they_sent(tmp_path):
    out = tmp_path / "math.json"
    scenario("mixed_runs.py", "math", out)
    got = json.loads(out.read_text())
    assert got["where"] == {"a": {}, "b": {}}  # answered before anything ran
    (b_det, b_pid), (a_det, a_pid) = got["b"], got["a"]
    assert a_pid == b_pid  # one process serves both parts
    # b set deterministic algorithms over there; a, whose own settings had not changed
    # since it last sent them, still runs its call with its own (off)
    assert b_det is True and a_det is False
    # and b, back to the settings it sent last, sends them again: a changed the process's
    assert got["b_again"][0] is True and got["closed"] is True
