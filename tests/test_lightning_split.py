"""SomatizeStrategy with a real lightning.Trainer and a real worker process: each run
is a subprocess (tests/lightning_runs.py), since RPC starts once per process."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "tests", "lightning_runs.py")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def run(*args, timeout=240):
    done = subprocess.run([sys.executable, RUNS, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


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


def test_a_run_resumed_from_its_checkpoint_matches_the_uninterrupted_one(tmp_path):
    for part in ("whole", "first", "rest"):
        run("resume", tmp_path / f"{part}.pt", part)
    whole_losses, whole = torch.load(tmp_path / "whole.pt")
    first_losses, _ = torch.load(tmp_path / "first.pt")
    rest_losses, rest = torch.load(tmp_path / "rest.pt")
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
