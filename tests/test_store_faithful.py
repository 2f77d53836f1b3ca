"""A store never changes a number and never kills a run: what is read back gives the head
bit for bit what the fresh value gives (tensors come back 64-byte aligned), and an input
its codec cannot encode runs as if no store were given."""

import pytest
import torch
from torch import nn

import somatize.torch  # noqa: F401  (registers the tensor's codec)
from somatize import Done, Graph, Node, Opaque
from somatize.torch import Trainer, freeze

pytestmark = pytest.mark.usefixtures("say_again")


class Encoder(Node):
    """A frozen float32 encoder whose output size is no multiple of 64 bytes."""

    def __init__(self, d_in: int, d_out: int):
        torch.manual_seed(0)
        self.lin = nn.Linear(d_in, d_out)
        self.runs = 0

    def forward(self, x, ctx):
        self.runs += 1
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


class Head(Node):
    def __init__(self, d_in: int):
        torch.manual_seed(1)
        self.lin = nn.Linear(d_in, 10)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x)))

    def parameters(self):
        return list(self.lin.parameters())


@pytest.mark.parametrize("width", [37, 100, 255])
@pytest.mark.parametrize("batch", [1, 3, 5, 7, 64, 100])
def test_the_head_gives_the_same_numbers_over_a_value_read_back_as_over_a_fresh_one(
        store, batch, width):
    enc, head = Encoder(29, width), Head(width)
    g = freeze(Graph.somatize(enc.frozen().cached() >> head))
    x = torch.randn(batch, 29)
    fresh = g.forward(x, store=store)  # a miss: computed, then kept
    again = g.forward(x, store=store)  # a hit: the head is fed what the store gives back
    assert enc.runs == 1
    assert torch.equal(again, fresh)
    (name,) = store.names()
    kept = store.get(name).value
    assert kept.data_ptr() % 64 == 0
    assert torch.equal(head.lin(kept), head.lin(enc.lin(x)))


@pytest.mark.parametrize("batch", [1, 3, 7, 64])
def test_training_over_a_store_is_bit_identical_to_training_without_one(tmp_path, batch):
    def train(store):
        torch.manual_seed(2)
        data = [(torch.randn(batch, 29), torch.randint(0, 10, (batch,))) for _ in range(3)]
        enc, head = Encoder(29, 37), Head(37)
        g = Graph.somatize(enc.frozen().cached() >> head)
        losses = Trainer(g, objective=nn.functional.cross_entropy,
                         optimizer=torch.optim.Adam(head.parameters(), lr=1e-2),
                         store=store).fit(data, epochs=3)
        return losses, head.lin.weight.detach(), head.lin.bias.detach(), enc.runs

    plain, kept = train(None), train(tmp_path)
    assert kept[3] == 3  # epochs 2 and 3 read every batch back from the store
    assert kept[0] == plain[0]
    assert torch.equal(kept[1], plain[1]) and torch.equal(kept[2], plain[2])


# -- an input the codec cannot encode runs as without a store --

class Magnitude(Node):
    """A settled node that takes what its codec may refuse (complex, sparse, conj views)."""

    runs = 0

    def forward(self, x, ctx):
        Magnitude.runs += 1
        dense = x.to_dense() if x.layout != torch.strided else x
        return Done(Opaque(dense.abs().float()))


class Double(Node):
    def forward(self, x, ctx):
        return Done(Opaque(x * 2))


def complex128():
    return torch.randn(4, 3, dtype=torch.complex128)


def sparse():
    return torch.randn(4, 3).relu().to_sparse()


def conj_view():
    return torch.randn(4, 3, dtype=torch.complex64).conj()


@pytest.mark.parametrize("make, why", [(complex128, "complex128"), (sparse, "sparse")])
def test_an_input_its_codec_cannot_encode_runs_keeps_nothing_and_says_why_once(
        store, said, make, why):
    g = Graph.somatize(Magnitude().frozen().cached() >> Double())
    Magnitude.runs = 0
    x = make()
    want = g.forward(x)
    for _ in range(2):
        assert torch.equal(g.forward(x, store=store), want)
    assert Magnitude.runs == 3
    assert list(store.names()) == []
    assert said().count("cannot turn into bytes") == 1 and why in said()


def test_a_conjugate_view_as_input_is_resolved_named_and_kept(store):
    g = Graph.somatize(Magnitude().frozen().cached() >> Double())
    Magnitude.runs = 0
    x = conj_view()
    want = g.forward(x)
    assert torch.equal(g.forward(x, store=store), want)
    assert torch.equal(g.forward(x, store=store), want)
    assert Magnitude.runs == 2  # the second run with the store read it back
    assert len(list(store.names())) == 1


def test_an_output_its_codec_cannot_encode_is_not_kept_and_the_run_goes_on(store, said):
    class ToSparse(Node):
        def forward(self, x, ctx):
            return Done(Opaque(x.to_sparse()))

    g = Graph.somatize(ToSparse().frozen().cached())
    x = torch.eye(3)
    assert torch.equal(g.forward(x, store=store).to_dense(), x)
    assert list(store.names()) == []
    assert "sparse_coo tensor cannot be kept" in said()
