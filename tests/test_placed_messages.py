"""What a placed module's call and its answer carry (``somatize/torch/placed/_messages.py``),
in this process: the worker's side of a call (``_there._call``) run against a real
one-node graph, as a worker runs it, and the typed values that say how a structure
travels: distinct tensors and a tensor or tuple of them with no pickle, the rest pickled."""

import dataclasses
import pickle

import pytest
import torch

from somatize import Graph, WorkerError
from somatize._graph import Placement
from somatize.remote._wire import bytes_of
from somatize.torch._pickling import dumps
from somatize.torch._raised import Raised
from somatize.torch._state import on_cpu, restore
from somatize.torch.placed._messages import (
    ONE,
    TUPLE,
    Answer,
    Call,
    Pickled,
    Spread,
    bare,
    pack,
    spread,
)
from somatize.torch.placed._there import Backward, Placed, _backward, _call
from somatize.torch.placed._tree import tree_flatten


class Pair(torch.nn.Module):
    """Answers what ``shape`` asks: one tensor, a tuple of two, or a dict."""

    def __init__(self, shape: str):
        super().__init__()
        self.lin, self.shape = torch.nn.Linear(3, 2), shape

    def forward(self, x, scale=None):
        y = self.lin(x) * (1.0 if scale is None else scale)
        return {"one": y, "tuple": (y, y * 2), "dict": {"y": y, "n": 3}}[self.shape]


def _live(module: torch.nn.Module) -> Graph:
    return Graph({"enc": Placed(module)}, [], Placement({"enc": "w"}))


def _call_of(tensors, structure, needs, number=0) -> Call:
    return Call(number, tensors, structure, needs, True, False, torch.get_rng_state(), [],
                [], torch.get_default_dtype(), "cpu")


def test_distinct_tensor_arguments_travel_as_a_spread_and_the_rest_pickled():
    x, m = torch.randn(2, 3), torch.ones(2)
    assert spread((x,), {"mask": m}) == Spread(1, ("mask",))
    assert spread((x,), {"mask": m}) is spread((x,), {"mask": m})  # made once, not per call
    assert spread((x, x), {}) is None  # a tensor standing twice: its structure is pickled
    assert spread((x,), {"scale": 2.0}) is None
    assert bare(x) is ONE and bare((x, m)) is TUPLE
    assert bare((x, x)) is None and bare([x]) is None and bare({"y": x}) is None


@pytest.mark.parametrize("shape", ["one", "tuple", "dict"])
def test_a_call_over_there_answers_its_outputs_as_the_module_gives_them(shape):
    torch.manual_seed(0)
    module = Pair(shape)
    x = torch.randn(4, 3)
    want = module(x)
    answer = _call(_live(module), "enc", _call_of([x], Spread(1, ()), [False]))
    assert isinstance(answer, Answer), answer
    if shape == "one":
        assert answer.structure == ONE and torch.equal(answer.tensors[0], want)
    elif shape == "tuple":
        assert answer.structure == TUPLE
        assert all(torch.equal(a, b) for a, b in zip(answer.tensors, want, strict=True))
    else:  # pickled: the output, what the forward left on the modules, what it changed
        assert isinstance(answer.structure, Pickled)
        spec, plain = pickle.loads(answer.structure.blob)
        assert 3 in plain and torch.equal(answer.tensors[0], want["y"])
    # the weights ask for a gradient: the call waits for its backward, every output alive
    assert answer.kept and all(answer.alive)
    assert all(not t.requires_grad and t.device.type == "cpu" for t in answer.tensors)


def test_a_pickled_call_is_rebuilt_over_there_and_its_backward_answers_the_arguments():
    torch.manual_seed(0)
    module = Pair("one")
    live = _live(module)
    x = torch.randn(4, 3)
    flat, spec = tree_flatten(((x,), {"scale": 2.0}))
    tensors, plain = pack(flat)
    answer = _call(live, "enc", _call_of(tensors, Pickled(dumps((spec, plain))), [True], 7))
    assert torch.equal(answer.tensors[0], module(x, scale=2.0).detach())
    grads = _backward(live, "enc", 7, [torch.ones(4, 2)], [])
    xx = x.clone().requires_grad_()
    (module(xx, scale=2.0) * torch.ones(4, 2)).sum().backward()
    assert torch.equal(grads[0], xx.grad)


def test_an_exception_over_there_answers_as_a_raised_and_messages_are_frozen():
    answer = _call(_live(Pair("one")), "enc", _call_of([torch.randn(4, 5)], Spread(1, ()),
                                                       [False]))
    assert isinstance(answer, Raised) and answer.name == "RuntimeError"
    call = _call_of([torch.randn(2, 3)], Spread(1, ()), [False])
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.number = 1


def test_what_a_call_and_its_answer_carry_is_counted_as_their_tensors_and_rng_state():
    x = torch.randn(16, 64)
    call = _call_of([x], Spread(1, ()), [False])
    rng = call.rng.nelement() * call.rng.element_size()
    assert bytes_of(("session", b"code", ("enc", call), {})) == x.nelement() * 4 + rng
    answer = Answer([x[:, :8]], ONE, [True], call.rng, 1, True)
    assert bytes_of(answer) == 16 * 8 * 4 + rng


def test_a_state_comes_to_the_cpu_detached_and_copied_lists_and_tuples_walked():
    w = torch.ones(2, requires_grad=True)
    state = {"state": {0: {"m": w}}, "param_groups": [{"lr": torch.tensor(0.1), "params": [0]}],
             "pair": (w, 3)}
    got = on_cpu(state)
    assert not got["state"][0]["m"].requires_grad and got["state"][0]["m"] is not w
    assert torch.equal(got["param_groups"][0]["lr"], torch.tensor(0.1))
    assert got["param_groups"][0]["lr"] is not state["param_groups"][0]["lr"]
    assert type(got["pair"]) is tuple and got["pair"][1] == 3


def test_weights_are_copied_into_a_module_in_place_by_state_dict_key():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    weight = module[0].weight
    restore(module, {"0.weight": torch.zeros(2, 3), "1.running_mean": torch.ones(2)})
    assert module[0].weight is weight and torch.equal(weight, torch.zeros(2, 3))
    assert torch.equal(module[1].running_mean, torch.ones(2))


def test_a_worker_is_told_what_its_placed_randomness_draws_from_or_refused_naming_both():
    from somatize.remote import Worker

    assert Worker().rng == "sent" and Worker.at("h:1", rng="derived").rng == "derived"
    assert Worker.embedded(rng="derived", rng_key="k").rng_key == "k"
    with pytest.raises(WorkerError, match="say 'sent' .* or 'derived'"):
        Worker(rng="derive")


def test_a_call_with_a_seed_draws_from_it_over_there_and_sends_no_rng_state_back():
    # Worker(rng="derived"): the Call carries an int seed, not this process's state; the
    # worker's dropout draws from it, its own RNG is put back, and the Answer holds none
    from somatize.torch._seeds import seeded

    drop = torch.nn.Dropout(0.5)
    x = torch.ones(4, 8)
    with seeded(12345):
        want = drop(x)
    call = dataclasses.replace(_call_of([x], Spread(1, ()), [False]), rng=12345)
    before = torch.get_rng_state()
    answer = _call(_live(drop), "enc", call)
    assert isinstance(answer, Answer) and answer.rng is None
    assert torch.equal(answer.tensors[0], want) and torch.equal(torch.get_rng_state(), before)
    assert bytes_of(call) == x.nbytes  # the seed is no tensor: only the activation counts


def test_a_backward_sent_with_the_next_call_runs_first_as_its_own_message_would_have():
    torch.manual_seed(0)
    x, g = torch.randn(4, 3), torch.randn(4, 2)
    alone, queued = Pair("one"), Pair("one")
    queued.load_state_dict(alone.state_dict())
    got = {}
    for module in (alone, queued):
        live = _live(module)
        _call(live, "enc", _call_of([x], Spread(1, ()), [False], 0))
        then = _call_of([x * 2], Spread(1, ()), [False], 1)
        if module is alone:  # the backward's own message, then the next call
            assert _backward(live, "enc", 0, [g], []) == [None]
        else:  # the backward queued: it travels among the next call's ops
            before = bytes_of(then)
            then = dataclasses.replace(then, ops=[Backward("enc", 0, [g], True)])
            assert bytes_of(then) == before + g.nbytes
        got[module] = (_call(live, "enc", then).tensors[0], module.lin.weight.grad.clone())
    assert torch.equal(got[alone][0], got[queued][0])
    assert torch.equal(got[alone][1], got[queued][1])
    # one whose graph is gone raises in the call it travels with, as itself
    freed = _call_of([x], Spread(1, ()), [False], 2)
    answer = _call(_live(Pair("one")), "enc",
                   dataclasses.replace(freed, ops=[Backward("enc", 5, [g], True)]))
    assert isinstance(answer, Raised) and answer.name == "RuntimeError"
    assert "graph was freed" in answer.message
