"""SomatizeStrategy with a real lightning.Trainer and a real worker process: each run
is a subprocess (tests/lightning_runs.py), since RPC starts once per process."""

import signal
import subprocess
import time

import pytest
import torch
from scenario import scenario, start
from test_remote_standing import _free_port, _listening

from somatize.store import open_keeper


def run(*args, timeout=240):
    return scenario("lightning_runs.py", *args, timeout=timeout)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_split_training_through_lightning_equals_one_piece_bit_for_bit(tmp_path, accumulate):
    out = tmp_path / "oracle.pt"
    run("oracle", out, accumulate)
    got = torch.load(out)
    plain_losses, plain = got["plain"]
    split_losses, split = got["split"]
    assert len(plain_losses) >= 10  # ten optimizer steps
    assert split_losses == plain_losses
    assert plain.keys() == split.keys()
    for k in plain:
        assert torch.equal(split[k], plain[k]), k
    # and the body really trained over there: its weights here never moved during a
    # training step (they are read back at epoch ends), another process ran it, Lightning's
    # optimizer held all four tensors, as in one piece, and the strategy said the body is
    # trained by mirrors of it
    where = got["where"]
    assert where["plain"]["moved_here"] and where["plain"]["held"] == 4
    assert not where["split"]["moved_here"] and where["split"]["held"] == 4
    assert where["split"]["body_pids"] and where["split"]["pid"] not in where["split"]["body_pids"]
    assert any("node 'body' of 'net' is trained on worker 'worker' by mirrors of Lightning's "
               "optimizers" in m for m in got["said"]), got["said"]


@pytest.mark.parametrize("stop", ["epoch", "mid"])
def test_a_run_resumed_from_its_checkpoint_matches_the_uninterrupted_one(tmp_path, stop):
    # mid-epoch: the training loader's place is in the checkpoint (ResumableLoader)
    for part in ("whole", "first", "rest"):
        run("resume", tmp_path / f"{part}.pt", part, stop)
    whole_losses, whole = torch.load(tmp_path / "whole.pt")
    first_losses, _ = torch.load(tmp_path / "first.pt")
    rest_losses, rest = torch.load(tmp_path / "rest.pt")
    assert len(first_losses) == (5 if stop == "epoch" else 7)
    assert first_losses + rest_losses == whole_losses
    for k in whole:
        assert torch.equal(rest[k], whole[k]), k


def test_a_model_whose_weights_are_all_remote_trains_and_evaluating_does_not(tmp_path):
    out = tmp_path / "remote.pt"
    run("all_remote", out)
    got = torch.load(out)
    assert got["losses"][-1] < got["losses"][0]
    assert not torch.equal(got["trained"]["net.nodes.body.lin.weight"],
                           got["fresh"]["net.nodes.body.lin.weight"])
    for k, v in got["trained"].items():  # validate, test and predict trained nothing
        assert torch.equal(got["after"][k], v), k
    assert got["predicted"] == 360


def test_killing_the_worker_mid_fit_ends_the_run_with_an_error_naming_it(tmp_path):
    out = tmp_path / "error.txt"
    run("kill", out, timeout=120)
    message = out.read_text()
    assert message.startswith("WorkerError")
    assert "worker 'worker'" in message


def test_a_nodes_value_error_on_the_worker_mid_fit_is_a_value_error_with_its_traceback(
        tmp_path):
    out = tmp_path / "raised.pt"
    run("raises", out)
    got = torch.load(out)
    assert got["type"] == "ValueError"
    assert got["message"].startswith(
        "the third batch (raised in node 'body' on worker 'worker' (pid ")
    kind, trace = got["cause"]
    assert kind == "WorkerTraceback" and 'raise ValueError("the third batch")' in trace
    assert "lightning_runs.py" in trace  # the user's file and line, over there


def test_no_checkpoint_is_written_once_the_worker_holding_trained_weights_is_lost(tmp_path):
    out = tmp_path / "lost.pt"
    run("lost_checkpoint", out, timeout=120)
    got = torch.load(out)
    assert got["written"] == []  # neither OnExceptionCheckpoint's nor the later one
    assert len(got["said"]) == 2
    assert all(s.startswith("WorkerError") and "worker 'worker'" in s for s in got["said"])
    assert "no checkpoint is written" in got["said"][1]


def test_a_standing_worker_trains_the_body_and_one_process_also_uses_somatize_remote(tmp_path):
    port = _free_port()
    daemon = start("-m", "somatize.worker", "--name", "worker", "--listen",
                   f"127.0.0.1:{port}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _listening(port, time.monotonic() + 30), "the daemon never listened"
        out = tmp_path / "standing.pt"
        run("standing", out, f"127.0.0.1:{port}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)
    got = torch.load(out)
    plain_losses, plain = got["plain"]
    split_losses, split = got["split"]
    assert split_losses == plain_losses
    for k in plain:
        assert torch.equal(split[k], plain[k]), k


@pytest.mark.parametrize("how", ["workers", "strategy"])
def test_a_cached_body_on_a_worker_with_a_store_is_looked_up_there(tmp_path, how):
    # Worker.embedded(store=...) in workers=, or SomatizeStrategy(store=...) for every
    # embedded worker the fit places work on
    store = tmp_path / "worker-store"
    out = tmp_path / "counts.pt"
    run("worker_keeps", out, store, how)
    counts = torch.load(out)["counts"]
    assert counts[0] > 0 and counts[1] == counts[0]  # epoch 2 found every batch over there
    assert list(open_keeper(str(store)).names("value/"))  # kept over there


def test_a_store_the_workers_cannot_open_is_refused_when_the_strategy_is_built(store):
    from somatize import Refused
    from somatize.lightning import SomatizeStrategy

    with pytest.raises(Refused, match="give a path"):
        SomatizeStrategy(store=store)  # a Store object: another process cannot open it



def test_the_strategy_hashes_nothing_when_nothing_is_cached(tmp_path):
    # a store is attached (SomatizeCache), no worker keeps: naming every input would be
    # wasted work; the control caches the frozen body and does hash
    out = tmp_path / "hashes.pt"
    run("hashes", out, tmp_path / "stores")
    nothing_cached, body_cached = torch.load(out)
    assert nothing_cached == 0
    assert body_cached > 0
