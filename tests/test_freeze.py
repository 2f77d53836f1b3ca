"""Settling: ``freeze(g)`` makes ``.frozen()`` true and pays once for the digest that
names what a settled node produces; a declared-but-never-obeyed ``.frozen()`` refuses."""

import pytest
import torch
from models import RUNS, Encoder, Probe, Tokenize

from somatize import Graph, NotSettled
from somatize._say import forget
from somatize.store import Store
from somatize.torch import freeze, parameters, state_digest

x = torch.arange(8.0).reshape(2, 4)


@pytest.fixture(autouse=True)
def _fresh():
    RUNS.clear()
    forget()
    yield


def test_freeze_stops_gradients_sets_eval_and_pays_for_the_digest_once():
    enc, head = Encoder(), Probe()
    enc.lin.train()
    g = Graph.somatize(enc.frozen() >> head)
    assert freeze(g) is g
    assert not any(p.requires_grad for p in enc.parameters())
    assert all(p.requires_grad for p in head.parameters())
    assert not enc.lin.training
    with pytest.raises(NotSettled, match="'encoder'"):  # before freeze it was refused
        Graph.somatize(Encoder().frozen() >> Probe()).forward(x)
    assert torch.equal(g.forward(x), head.lin(enc.lin(x)))  # settled: it runs as its layers do
    assert RUNS == {"encoder": 1, "probe": 1}
    assert parameters(g) == head.parameters()


def test_a_frozen_node_with_state_and_no_digest_refuses_and_says_to_call_freeze(tmp_path):
    g = Graph.somatize(Encoder().frozen() >> Probe())
    with pytest.raises(NotSettled, match=r"'encoder'.*somatize\.torch\.freeze\(g\)"):
        g.forward(x)
    g2 = Graph.somatize(Encoder().frozen().cached() >> Probe())
    with pytest.raises(NotSettled, match="'encoder'"):
        g2.forward(x, store=tmp_path)
    assert RUNS == {}


def test_a_frozen_node_with_no_state_is_fine_without_freeze(tmp_path):
    g = Graph.somatize(Tokenize().frozen().cached() >> Probe(d_in=4))
    g.forward(x, store=tmp_path)
    g.forward(x, store=tmp_path)
    assert RUNS == {"tokenize": 1, "probe": 2}


def test_two_checkpoints_of_one_class_are_two_names(tmp_path):
    # the review's first bug: same class, same input, another checkpoint must not hit
    store = Store(tmp_path)
    a, b = Encoder(seed=0), Encoder(seed=1)
    ya = freeze(Graph.somatize(a.frozen().cached())).forward(x, store=store)
    yb = freeze(Graph.somatize(b.frozen().cached())).forward(x, store=store)
    assert RUNS["encoder"] == 2
    assert torch.equal(yb, b.lin(x)) and not torch.equal(ya, yb)
    assert len(list(store.names())) == 2


def test_the_first_review_bug_reproduced_declared_frozen_never_obeyed_is_refused(tmp_path):
    # before decision 8 the second checkpoint got the first one's tensor back; now the
    # undigested node refuses to run at all, so it cannot be served a wrong value
    freeze(Graph.somatize(Encoder(seed=0).frozen().cached())).forward(x, store=tmp_path)
    never_frozen = Graph.somatize(Encoder(seed=1).frozen().cached())
    with pytest.raises(NotSettled):
        never_frozen.forward(x, store=tmp_path)


def test_two_nodes_settled_at_the_same_digest_are_one_name(tmp_path):
    store = Store(tmp_path)
    a, b = Encoder(seed=3), Encoder(seed=3)  # two objects, the same weights
    freeze(Graph.somatize(a.frozen().cached() >> Probe())).forward(x, store=store)
    freeze(Graph.somatize(b.frozen().cached() >> Probe())).forward(x, store=store)
    assert state_digest(a) == state_digest(b)
    assert RUNS["encoder"] == 1 and len(list(store.names())) == 1


def test_the_digest_sees_every_weight_and_its_name():
    a, b = Encoder(seed=0), Encoder(seed=0)
    assert state_digest(a) == state_digest(b)
    with torch.no_grad():
        b.lin.bias[0] += 1e-6
    assert state_digest(a) != state_digest(b)
    assert state_digest(Tokenize()) is None


def test_a_module_node_settles_like_any_other(tmp_path):
    torch.manual_seed(0)
    enc = torch.nn.Linear(4, 3)
    g = freeze(Graph.somatize(Tokenize().frozen() >> somatize_node(enc).frozen().cached()))
    y1 = g.forward(x, store=tmp_path)
    y2 = g.forward(x, store=tmp_path)
    assert torch.equal(y1, y2) and not enc.weight.requires_grad
    (entry,) = Store(tmp_path).entries()
    assert entry.meta["class"] == "Linear"


def somatize_node(m):
    from somatize.torch import node

    return node(m)
