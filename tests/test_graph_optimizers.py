"""The graph route's optimizers over there follow Lightning's (tests/graph_optimizer_runs.py
runs the fits, in a fresh process): a GraphModule's node placed with ``.at("worker")``
and no ``trains=`` entry is trained there by a mirror of the Lightning optimizer that
holds it, rebuilt from each param group's own hyper-parameters, stepping when it steps
(its scheduler's lr followed), its state in the checkpoint's optimizer states under one
piece's indices and handed back on resume: plain Lightning's numbers, bit for bit."""

import pytest
import torch
from oracle import same
from scenario import scenario


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    where = tmp_path_factory.mktemp("graph_optimizers")
    scenario("graph_optimizer_runs.py", "cases", where / "cases.pt", timeout=900)
    return torch.load(where / "cases.pt", weights_only=False)


@pytest.mark.parametrize("case", ["AdamW", "AdamW StepLR", "SGD groups", "SGD warmup"])
def test_a_placed_node_is_trained_by_a_mirror_of_lightnings_optimizer_to_plain_numbers(
        ran, case):
    # AdamW, without and with a StepLR; SGD whose groups have their own lr and momentum,
    # without and with a LambdaLR warmup: the schedulers followed over there, not refused
    got = ran["trained"][case]
    plain, split = got["plain"], got["split"]
    assert split["said"] == plain["said"] == ""
    assert len(plain["losses"]) == 4 and split["losses"] == plain["losses"]
    assert same(split["weights"], plain["weights"])
    # every entry of the optimizer's state, the encoder's (over there) among them, under
    # the indices one piece gives them; and the scheduler's state
    assert sorted(plain["optimizer"][0]["state"]) == list(range(6))
    assert same(split["optimizer"], plain["optimizer"])
    assert same(split["schedulers"], plain["schedulers"])
    # Lightning's optimizer held all six tensors, as in one piece; the encoder ran over there
    assert split["held"] == plain["held"] == 6
    assert split["ran"] and plain["ran"] == []


def test_a_checkpoint_written_during_fit_holds_plain_lightnings_state_and_resumes_exactly(ran):
    got = ran["resumed"]
    assert got["said"] == ""
    plain, split = got["plain"], got["split"]
    assert len(plain["losses"]) == 8 and split["losses"] == plain["losses"]
    assert same(split["weights"], plain["weights"])
    # the checkpoint written at the first epoch's end: plain's optimizer states, entries
    # of the encoder's parameters included, its scheduler's and its weights
    assert sorted(split["ckpt"]["optimizer_states"][0]["state"]) == list(range(6))
    assert same(split["ckpt"], plain["ckpt"])
    # resumed from it under the strategy: the second epoch of the uninterrupted run
    more, weights = split["resumed"]
    assert len(more) == 4 and more == plain["resumed"][0] == plain["losses"][4:]
    assert same(weights, plain["resumed"][1]) and same(weights, plain["weights"])
    # and plainly from the split checkpoint: the same
    more, weights = got["plain from split"]
    assert more == plain["losses"][4:] and same(weights, plain["weights"])


def test_an_optimizer_that_cannot_be_rebuilt_over_there_is_refused_before_the_first_step(ran):
    # the placed route's check, on the graph route: a setting kept beside defaults
    text, step = ran["refused"]
    assert step == 0
    assert text.startswith("Refused: KeepsClip holds parameters of 'encoder'"), text
    assert "'clip' is 0.5 here and 1.0 over there" in text
    assert "trains={'encoder': Split(torch.optim.AdamW, lr=...)}" in text
