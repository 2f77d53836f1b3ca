"""Training the half that is not here, in a worker process: the same numbers as the
whole net in one process, bit for bit. Each test runs its coordinator, a function of
tests/remote_trainer_runs.py, in a process of its own (torch.distributed.rpc is initialised once
per process) with an embedded worker."""

from __future__ import annotations

import json

from remote_run import coordinate


def test_a_graph_trained_across_a_worker_gives_the_same_numbers_as_the_whole_one(tmp_path):
    out = coordinate("trained_across", cwd=tmp_path, timeout=120)
    assert out.split() == ["ok", "3", "ok", "2"]


def test_the_math_settings_here_reach_the_worker_before_the_step_under_them(tmp_path):
    out = coordinate("math_follows", cwd=tmp_path, timeout=120)
    assert out.splitlines()[-3:] == ["1 high True", "2 medium False", "1 highest False"]


def test_the_hand_written_loop_and_trainer_step_over_a_worker_give_the_same_losses(tmp_path):
    coordinate("by_hand_and_step", cwd=tmp_path, timeout=120)


def test_stop_and_resume_over_a_worker_and_nothing_trained_here(tmp_path):
    coordinate("stop_and_resume", cwd=tmp_path, timeout=120)


def test_a_far_half_nobody_trains_is_a_plain_step_and_gives_the_same_numbers(tmp_path):
    # CU14 decision 4: a slice on another host with nobody training it needs no stages
    coordinate("nobody_trains_there", cwd=tmp_path, timeout=120)


def test_where_the_far_sides_step_waits_for_the_next_input_the_weights_here_do_not(tmp_path):
    out = coordinate("head_up_to_date", cwd=tmp_path, timeout=120)
    assert "WAITED" in out


def test_a_placed_node_nothing_in_trains_trains_is_trained_by_a_mirror_of_the_optimizer(
        tmp_path):
    # its weights in the optimizer here, nothing in trains=: trained over there as in one
    # piece (losses ==, weights and optimizer state entries torch.equal), resumed exactly
    out = coordinate("mirrored_body", cwd=tmp_path, timeout=180)
    assert out.splitlines()[-2:] == ["ok mirrored SGD", "ok mirrored AdamW"]


def test_a_nodes_value_error_on_the_worker_is_a_value_error_here_with_its_traceback(tmp_path):
    # in g.forward, in Trainer.step (the run goes on after it) and a trainer's own
    # exception in its learn: the type raised over there, the worker's traceback its cause
    got = json.loads(coordinate("raised_there", cwd=tmp_path, timeout=120).splitlines()[-1])
    assert got.keys() == {"forward", "step", "then", "learn", "drawn"}
    # a node whose forward draws from Python's random over there: refused, named
    assert got["drawn"]["type"] == "Refused"
    assert got["drawn"]["message"].startswith(
        "node 'dicey' drew from Python's random (its global generator) on the worker")
    for what in ("forward", "step"):
        assert got[what]["type"] == "ValueError"
        assert got[what]["message"].startswith(
            "a NaN in the input (raised in node 'picky' on worker 'gpu' (pid ")
        assert 'raise ValueError("a NaN in the input")' in got[what]["cause"]
        assert "remote_trainer_runs.py" in got[what]["cause"]  # the user's file and line
    assert isinstance(got["then"], float)
    assert got["learn"]["type"] == "Strange"
    assert got["learn"]["message"].startswith("picky will not learn (raised in node 'picky'")


def test_the_globals_a_placed_nodes_code_reads_follow_it_to_the_worker(tmp_path):
    # GAIN = 3.0 and CFG["gain"] = 0.5 here, mid-run: the node over there reads them too
    # (trained by a Split, mirrored, frozen); one rebound to a function is refused
    out = coordinate("globals_follow", cwd=tmp_path, timeout=180)
    assert out.splitlines()[-3:] == ["ok split", "ok mirrored", "ok frozen"]
