"""Micro-batches and the wire over an embedded worker: each coordinator is a process of
its own (tests/micro_runs.py), since RPC starts once per process."""

from __future__ import annotations

import json

from micro_runs import EXACT
from scenario import HERE, scenario


def run(what: str, timeout: float = 240) -> str:
    return scenario("micro_runs.py", what, timeout=timeout, cwd=HERE).stdout


def test_micro_batches_over_workers_train_to_the_numbers_of_one_piece_on_the_same_cut():
    # k = 1, 2, 4 and 10 rows cut in 4; the body (and a layer above it) on workers, the
    # head here drawing dropout masks: losses ==, weights torch.equal, read over there
    out = run("exact")
    assert out.splitlines() == [f"ok {name}" for name, *_ in EXACT]


def test_a_batch_that_fails_midway_leaves_nothing_on_the_worker():
    assert run("failed_batch").split() == ["ok", "failed", "batch"]


def test_the_digits_over_a_bfloat16_wire_keep_their_accuracy_and_send_half_the_bytes():
    got = json.loads(run("wire").splitlines()[-1])
    plain, narrow = got["plain"], got["bf16"]
    assert plain["accuracy"] > 0.9
    assert abs(plain["accuracy"] - narrow["accuracy"]) <= 0.01
    assert plain["loss"] != narrow["loss"]  # not bit-identical, and not said to be
    # activations and gradients, as the transport carries them: half
    assert abs(narrow["bytes"] / plain["bytes"] - 0.5) < 0.01, got


def test_a_first_trainer_on_a_worker_sends_no_gradient_of_its_input_back():
    # told before it is sent: the first node's copy over there asks no dL/dx of its input
    assert json.loads(run("feeds_back").splitlines()[-1]) == {"pre": False, "body": True}
