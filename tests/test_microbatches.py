"""Micro-batches with the far half in this process, the schedule they follow, and what
is refused; the same over worker processes is in test_microbatches_remote.py."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from micro_runs import SGD, one_piece, split, tensor_bytes
from models import Body, Drop, Head, Pre, batches, twins
from oracle import same, weights

from somatize import Ctx, Refused
from somatize.torch import Split, Trainer, parameters
from somatize.torch.graph._pipeline import Action, in_order, one_f_one_b


def trained(build, data, k, trains_for=("body",), seed=1):
    """(one piece's losses and weights, the Trainer's) on ``data`` cut in ``k``."""
    whole, cut = twins(build)
    torch.manual_seed(seed)
    want = one_piece(whole, data, k)
    trains = {n: split() for n in trains_for}
    here = parameters(cut, without=trains)
    t = Trainer(cut, F.cross_entropy, SGD(here) if here else None, trains=trains,
                micro_batches=k)
    torch.manual_seed(seed)
    got = [t.step(d) for d in data]
    return (want, weights(whole)), (got, weights(cut)), t


@pytest.mark.parametrize("rows,k", [(16, 1), (16, 2), (16, 4), (10, 4)])
@pytest.mark.parametrize("build", [lambda: Body(seed=None) >> Head(seed=None),
                                   lambda: Pre() >> Body(seed=None) >> Head(seed=None)],
                         ids=["body-head", "pre-body-head"])
def test_micro_batches_train_to_the_numbers_of_one_piece_on_the_same_cut(build, rows, k):
    (want, w_want), (got, w_got), t = trained(build, batches(6, size=rows), k)
    assert got == want
    assert same(w_got, w_want)
    # the trainer stepped its optimizer once per batch: momentum over 6 steps, as one piece
    assert t.state_dict()["trainers"]["body"]["optimizer"]["state"]


def test_with_every_stage_here_both_sides_may_draw_random_numbers():
    # nothing on a worker: the pieces run one after another, in one piece's order of draws
    (want, w_want), (got, w_got), _ = trained(
        lambda: Drop() >> Body(seed=None) >> Drop() >> Head(seed=None), batches(5, size=10), 4)
    assert got == want and same(w_got, w_want)


def test_a_chain_of_trainers_and_nothing_here_accumulates_piece_by_piece():
    build = lambda: Pre() >> Body(seed=None) >> Head(seed=None)  # noqa: E731
    (want, w_want), (got, w_got), _ = trained(build, batches(5, size=12), 3,
                                              trains_for=("pre", "body", "head"))
    assert got == want and same(w_got, w_want)


def test_nothing_trained_where_it_runs_still_cuts_and_accumulates():
    whole, cut = twins(lambda: Pre() >> Body(seed=None) >> Head(seed=None))
    data = batches(4, size=10)
    want = one_piece(whole, data, 4)
    t = Trainer(cut, F.cross_entropy, SGD(parameters(cut)), micro_batches=4)
    assert [t.step(d) for d in data] == want
    assert same(weights(cut), weights(whole))


def test_the_loss_of_a_batch_is_the_sum_of_its_pieces_losses_each_divided_by_k():
    g = twins(lambda: Body(seed=None) >> Head(seed=None))[0]
    x, y = batches(1, size=10)[0]
    head_first = [F.cross_entropy(g.forward(xi.clone()), yi) / 4
                  for xi, yi in zip(x.tensor_split(4), y.tensor_split(4), strict=True)]
    trains = {"body": split()}
    t = Trainer(g, F.cross_entropy, SGD(parameters(g, without=trains)), trains=trains,
                micro_batches=4)
    total = head_first[0]
    for part in head_first[1:]:
        total = total + part
    assert t.step((x, y)) == total.item()


def test_the_schedule_sends_the_next_pieces_body_before_this_pieces_head():
    # body on a worker (stage 0, a lane), head here (stage 1), k = 4: 1F1B
    got = one_f_one_b(2, 4, lanes={0})
    F_, L_, B_ = (lambda s, i: Action("F", s, i)), (lambda i: Action("L", 1, i)), \
        (lambda s, i: Action("B", s, i))
    assert got == [F_(0, 0), F_(0, 1), F_(1, 0), L_(0), B_(1, 0), B_(0, 0), F_(0, 2),
                   F_(1, 1), L_(1), B_(1, 1), B_(0, 1), F_(0, 3),
                   F_(1, 2), L_(2), B_(1, 2), B_(0, 2), F_(1, 3), L_(3), B_(1, 3), B_(0, 3)]
    for i in range(3):  # the worker has piece i+1 before the coordinator runs piece i
        assert got.index(F_(0, i + 1)) < got.index(F_(1, i))
    # and with no lane, one piece after another: one piece's own order
    assert in_order(2, 2) == [F_(0, 0), F_(1, 0), L_(0), B_(1, 0), B_(0, 0),
                              F_(0, 1), F_(1, 1), L_(1), B_(1, 1), B_(0, 1)]


@pytest.mark.parametrize("stages,k,lanes", [(1, 3, {0}), (2, 1, {0}), (3, 4, {1}),
                                            (3, 5, {0, 1}), (4, 2, {0, 2}), (2, 4, set())])
def test_every_schedule_runs_each_action_once_after_what_it_reads(stages, k, lanes):
    got = one_f_one_b(stages, k, lanes)
    assert sorted(got, key=repr) == sorted(in_order(stages, k), key=repr)
    at = {a: i for i, a in enumerate(got)}
    for a in got:
        needs = {"F": [Action("F", a.stage - 1, a.piece)] if a.stage else [],
                 "L": [Action("F", a.stage, a.piece)],
                 "B": [Action("L", a.stage, a.piece) if a.stage == stages - 1
                       else Action("B", a.stage + 1, a.piece)]}[a.kind]
        assert all(at[n] < at[a] for n in needs), a
    for s in range(stages):  # each stage takes its pieces in order, forward and back
        for kind in "FB":
            mine = [a.piece for a in got if a.stage == s and a.kind == kind]
            assert mine == sorted(mine)


@pytest.mark.parametrize("k", [0, -1, 2.0, True, "4"])
def test_micro_batches_that_are_not_a_whole_number_from_one_are_refused(k):
    g = twins(lambda: Body(seed=None) >> Head(seed=None))[0]
    with pytest.raises(Refused, match=r"micro_batches=.*\['body'\] -> \['head'\].*e\.g\. "
                                      r"micro_batches=4"):
        Trainer(g, F.cross_entropy, SGD(parameters(g)), micro_batches=k)


def test_a_batch_smaller_than_k_or_unlike_its_target_is_refused_naming_both():
    g = twins(lambda: Body(seed=None) >> Head(seed=None))[0]
    trains = {"body": split()}
    t = Trainer(g, F.cross_entropy, SGD(parameters(g, without=trains)), trains=trains,
                micro_batches=4)
    x, y = batches(1, size=3)[0]
    before = weights(g)
    with pytest.raises(Refused, match=r"a batch of 3 rows \(target: 3\) cannot be cut into 4 "
                                      r"micro-batches .*\['body'\].*at least 4 rows"):
        t.step((x, y))
    x, y = batches(1, size=8)[0]
    with pytest.raises(Refused, match=r"8 rows \(target: 7\)"):
        t.step((x, y[:7]))
    with pytest.raises(Refused, match=r"cuts each batch's target .* a list"):
        t.step((x, y.tolist()))
    assert same(weights(g), before)  # nothing ran
    x, y = batches(1, size=8)[0]
    assert t.step((x, y)) > 0  # and the trainer is fine


def test_a_batch_that_fails_midway_leaves_nothing_accumulated_or_kept():
    data = batches(4, size=16)
    whole, cut = twins(lambda: Pre() >> Body(seed=None) >> Head(seed=None))
    want = one_piece(whole, data[:1] + data[2:], 4)
    seen = []

    def fails_once(out, target):
        seen.append(1)
        if len(seen) == 7:  # the second batch's third piece
            raise RuntimeError("the objective failed")
        return F.cross_entropy(out, target)

    trains = {"body": split()}
    t = Trainer(cut, fails_once, SGD(parameters(cut, without=trains)), trains=trains,
                micro_batches=4)
    got = [t.step(data[0])]
    with pytest.raises(RuntimeError, match="the objective failed"):
        t.step(data[1])
    # no activation awaits a gradient: a learn now finds nothing to learn from
    assert trains["body"].learn(torch.ones(4, 6), Ctx("body", None, True)) is None
    got += [t.step(d) for d in data[2:]]
    assert got == want and same(weights(cut), weights(whole))


def test_a_trainer_keeps_one_activation_per_piece_in_flight_and_answers_oldest_first():
    s = Split(torch.optim.SGD, lr=0.1)
    s.node, s.in_flight, s.accumulates = Body(seed=None), 3, True  # as micro_batches=3 sets them
    ctx = Ctx("body", None, True)
    xs = [torch.randn(2, 8) for _ in range(3)]
    for x in xs:
        s.leave(s.node.lin(s.enter(x, ctx)), ctx)
    # what is kept does not travel: a copy has nothing to learn from
    assert pickle.loads(pickle.dumps(s)).learn(torch.ones(2, 6), ctx) is None
    grads = [s.learn(torch.ones(2, 6) * (i + 1), ctx) for i in range(3)]
    w = s.node.lin.weight.detach()
    assert all(torch.equal(g, torch.ones(2, 6) * (i + 1) @ w) for i, g in enumerate(grads))
    assert s.learn(torch.ones(2, 6), ctx) is None  # nobody left awaiting
    s.in_flight = 1  # one in flight: a forward whose learn never came is replaced
    s.leave(s.node.lin(s.enter(xs[0], ctx)), ctx)
    s.leave(s.node.lin(s.enter(xs[1], ctx)), ctx)
    # one kept, the second forward's: its input is in the weights' gradient
    s.node.lin.weight.grad = None
    assert s.learn(torch.ones(2, 6), ctx) is not None
    assert torch.equal(s.node.lin.weight.grad, torch.ones(2, 6).T @ xs[1])
    assert s.learn(torch.ones(2, 6), ctx) is None


# -- the wire -------------------------------------------------------------------------

def test_a_wire_dtype_halves_what_crosses_and_is_cast_back_where_it_is_read():
    s = Split(torch.optim.SGD, lr=0.1, wire=torch.bfloat16)
    s.node = Body(seed=None)
    ctx = Ctx("body", "gpu", True)
    x = torch.randn(4, 8)
    y = s.leave(s.node.forward(s.enter(x, ctx), ctx).value.value, ctx)
    plain = s.node.lin(x).relu().detach()  # the activation, as it left the node
    assert tensor_bytes(y) * 2 == tensor_bytes(plain)  # what pickles: bf16
    back = pickle.loads(pickle.dumps(y))
    assert back.value.dtype == torch.float32  # cast back on arrival
    assert torch.equal(back.value, plain.to(torch.bfloat16).float())
    grad = s.learn(torch.ones(4, 6), ctx)
    assert tensor_bytes(grad) * 2 == tensor_bytes(grad.value)  # dL/dx crosses narrow too
    assert grad.value.dtype == torch.float32


def test_with_a_wire_dtype_training_is_close_but_not_bit_identical():
    data = batches(6, size=16)
    a, b = twins(lambda: Pre() >> Body(seed=None) >> Head(seed=None))
    runs = []
    for g, kw in ((a, {}), (b, {"wire": torch.bfloat16})):
        trains = {"body": Split(torch.optim.SGD, lr=0.1, momentum=0.9, **kw)}
        t = Trainer(g, F.cross_entropy, SGD(parameters(g, without=trains)), trains=trains)
        runs.append([t.step(d) for d in data])
    assert runs[0] != runs[1]
    assert max(abs(p - q) for p, q in zip(*runs, strict=True)) < 0.05


def test_a_wire_that_is_not_a_floating_dtype_is_refused():
    for wire in (torch.int8, "bf16"):
        with pytest.raises(Refused, match=r"Split\(wire=.*e\.g\. wire=torch\.bfloat16"):
            Split(torch.optim.SGD, lr=0.1, wire=wire)
