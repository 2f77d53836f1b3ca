"""What per item gives, exactly (docs/per-item.md): each item's value as computed in a chunk
of 32 rows (padded), whatever batch it came in; ``exact=True`` refuses, naming the cause,
where that differs from computing the batch as it came; rows of two input lengths kept
under one module are each served right."""

import pytest
import torch
from torch import nn

from somatize import Done, GraphError, Node, Refused
from somatize.torch.cache._per_item import CHUNK, PerItemForward, _nodes, mapped_counts

torch.manual_seed(0)
MLP = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 6)).eval().requires_grad_(False)
X = torch.randn(40, 8, generator=torch.Generator().manual_seed(3))


def per_item(module, store, exact=False):
    module.forward = PerItemForward(module, "body", str(store), exact=exact)
    return module


def plain(module, x):
    return type(module).forward(module, x)


def in_a_chunk(module, rows):
    """Each row as computed in a chunk of 32, beside other rows (here: other items)."""
    filler = torch.randn(CHUNK - 1, rows.shape[1], generator=torch.Generator().manual_seed(9))
    return torch.cat([plain(module, torch.cat([r[None], filler]))[:1] for r in rows])


def test_an_items_value_does_not_depend_on_the_batch_it_came_in(tmp_path):
    import copy

    a = per_item(copy.deepcopy(MLP), tmp_path / "a")
    b = per_item(copy.deepcopy(MLP), tmp_path / "b")
    # the same items, in batches of 7 and of 8 with other companions, a last smaller one
    got_a = torch.cat([a(X[i:i + 7]) for i in range(0, 40, 7)])
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    got_b = torch.empty_like(got_a)
    for i in range(0, 40, 8):
        got_b[order[i:i + 8]] = b(X[order[i:i + 8]])
    assert torch.equal(got_a, got_b)
    assert torch.equal(got_a, in_a_chunk(MLP, X))  # what the docs say it is
    # and a hit is exactly what was kept
    assert torch.equal(a(X[order[:13]]), got_a[order[:13]]) and a.forward.item.hits == 13


torch.manual_seed(0)  # wider: on oneDNN/MKL here, rows in a batch of 7 and of 8 differ
WIDE = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval().requires_grad_(False)
XW = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))


def test_rows_whose_value_depends_on_the_batch_size_are_served_alike_from_any_batch(tmp_path):
    import copy

    a = per_item(copy.deepcopy(WIDE), tmp_path / "a")
    b = per_item(copy.deepcopy(WIDE), tmp_path / "b")
    got_a = torch.cat([a(XW[i:i + 7]) for i in range(0, 40, 7)])  # a last smaller batch of 5
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    got_b = torch.empty_like(got_a)
    for i in range(0, 40, 8):
        got_b[order[i:i + 8]] = b(XW[order[i:i + 8]])
    assert torch.equal(got_a, got_b) and torch.equal(got_a, in_a_chunk(WIDE, XW))
    twice = XW[[3, 3, 17, 3]]  # oversampled: one item twice in a batch, and kept already
    assert torch.equal(b(twice), got_a[[3, 3, 17, 3]])
    fresh = per_item(copy.deepcopy(WIDE), tmp_path / "c")
    assert torch.equal(fresh(twice), got_a[[3, 3, 17, 3]])  # computed anew: the same rows


class BatchSized(nn.Module):
    """Rows that depend on the batch: nothing a coupling check sees."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.ones(8))

    def forward(self, x):
        return x * self.w * x.shape[0]


def test_exact_refuses_rows_that_depend_on_the_batch_naming_the_cause(tmp_path):
    m = per_item(BatchSized(), tmp_path, exact=True)
    with pytest.raises(Refused, match=r"'body' is kept per item with exact=True, but its rows "
                                      r"depend on the batch they are computed in: in this "
                                      r"batch of 7 rows, rows \[0, 1"):
        m(X[:7])


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.tensor(1.5))

    def forward(self, x):
        return x * self.w


def test_exact_serves_rows_that_do_not_depend_on_the_batch(tmp_path):
    m = per_item(Scaled(), tmp_path, exact=True)
    for i in range(0, 40, 7):
        assert torch.equal(m(X[i:i + 7]), plain(m, X[i:i + 7]))
    assert torch.equal(m(X[5:17]), plain(m, X[5:17])) and m.forward.item.hits == 12


def test_two_input_lengths_kept_under_one_module_are_each_served_right(tmp_path):
    m = per_item(Scaled(), tmp_path)
    short, long = torch.randn(12, 12), torch.randn(16, 16)  # train padded to 12, val to 16
    m(short), m(long)  # both kept
    again = per_item(Scaled(), tmp_path)  # a new process's view: both lengths already kept
    assert torch.equal(again(long), plain(again, long))
    assert torch.equal(again(short), plain(again, short))
    assert torch.equal(again(long[3:9]), plain(again, long[3:9]))
    assert again.forward.item.misses == 0


def test_a_per_item_cache_that_never_hits_across_epochs_says_so_once(tmp_path, said, say_again):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from somatize.lightning import SomatizeCache

    class Augmented(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 6)
            self.head = nn.Linear(6, 2)

        def training_step(self, batch, _):
            x, y = batch
            x = x + 0.1 * torch.randn_like(x)  # random augmentation before the cached module
            return nn.functional.cross_entropy(self.head(self.body(x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.head.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(X[:32], torch.arange(32) % 2), batch_size=8, shuffle=True)
    cache = SomatizeCache(tmp_path / "store", modules=["body"], per_item=True)
    pl.Trainer(max_epochs=4, callbacks=[cache], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(Augmented(), data)
    assert (cache.hits, cache.misses) == (0, 128)
    text = said()
    assert text.count("found none of its 32 items in the store, which grew by as many") == 1
    assert "random augmentation before the cached module" in text and "['body']" in text


def test_on_the_graph_route_a_mapped_node_that_never_hits_says_so_once(tmp_path, said, say_again):
    from somatize import Done, Graph, Node
    from somatize.torch import Trainer, freeze, parameters

    class Enc(Node):
        def __init__(self):
            self.lin = nn.Linear(8, 6)

        def forward(self, x, ctx):
            return Done(self.lin(x))

        def parameters(self):
            return list(self.lin.parameters())

    class Head(Node):
        def __init__(self):
            self.lin = nn.Linear(6, 2)

        def forward(self, x, ctx):
            return Done(self.lin(x))

        def parameters(self):
            return list(self.lin.parameters())

    g = freeze(Graph.somatize(Enc().frozen().cached().mapped() >> Head()))
    gen = torch.Generator().manual_seed(5)

    def augmented():  # new rows every epoch: augmentation before the cached node
        return [(X[i:i + 8] + 0.1 * torch.randn(8, 8, generator=gen), torch.arange(8) % 2)
                for i in range(0, 32, 8)]

    class Epochs:
        def __len__(self):
            return 4

        def __iter__(self):
            return iter(augmented())

    trainer = Trainer(g, objective=nn.functional.cross_entropy,
                      optimizer=torch.optim.SGD(parameters(g, without={"enc": None}), lr=0.1),
                      store=str(tmp_path))
    trainer.fit(Epochs(), epochs=3, progress=False)
    text = said()
    assert text.count("found none of its 32 items in the store, which grew by as many") == 1
    assert "['enc']" in text and "random augmentation before the cached node" in text


class OwnKeeper:
    """A keeper of the user's own: named values in a dict, rows through a Store's items()
    (or none, with ``rows=False``)."""

    def __init__(self, path, rows=True):
        from somatize.store import Store

        self.values, self.store, self.rows = {}, Store(path), rows

    def get_many(self, names):
        return [self.values.get(n) for n in names]

    def put(self, name, value, meta=None):
        from somatize._keeper import Kept

        self.values[name] = Kept(value, dict(meta or {}))
        return True

    def names(self, prefix=""):
        return (n for n in self.values if n.startswith(prefix))

    def items(self):
        if not self.rows:
            raise AssertionError("not offered")
        return self.store.items()


def test_a_keeper_of_ones_own_holds_items_through_its_items_method(tmp_path):
    import copy

    module = copy.deepcopy(MLP)
    module.forward = PerItemForward(module, "body", OwnKeeper(tmp_path / "own"))
    first = module(X[:16])
    again = module(X[torch.randperm(16, generator=torch.Generator().manual_seed(2))][:8])
    assert module.forward.item.hits == 8 and first.shape == (16, 6)
    assert torch.equal(again, in_a_chunk(MLP, X[:16])[
        torch.randperm(16, generator=torch.Generator().manual_seed(2))][:8])
    assert list((tmp_path / "own").rglob("*"))  # the rows are in the Store it offered

    class NoRows(OwnKeeper):
        items = None  # a keeper of values alone

    with pytest.raises(Refused, match=r"'body' is kept per item.*offering rows through "
                                      r"items\(\).*a NoRows is neither"):
        PerItemForward(copy.deepcopy(MLP), "body", NoRows(tmp_path / "none"))


class Rows(Node):
    """A graph node around a module (rows that depend on the batch, or not)."""

    def __init__(self, module):
        self.module = module

    def forward(self, x, ctx):
        return Done(self.module(x))


def test_on_the_graph_route_mapped_exact_refuses_rows_that_depend_on_the_batch(tmp_path):
    from somatize import Graph
    from somatize.torch import freeze

    sized = freeze(Graph.somatize(Rows(BatchSized()).frozen().cached().mapped(exact=True)))
    with pytest.raises(Refused, match=r"'rows' is kept per item with exact=True, but its rows "
                                      r"depend on the batch they are computed in: in this "
                                      r"batch of 7 rows, rows \[0, 1"):
        sized.forward(X[:7], store=str(tmp_path / "a"))
    loose = freeze(Graph.somatize(Rows(BatchSized()).frozen().cached().mapped()))
    got = loose.forward(X[:7], store=str(tmp_path / "b"))  # without exact: as in a chunk
    assert torch.equal(got, X[:7] * CHUNK) and not torch.equal(got, X[:7] * 7)
    with pytest.raises(GraphError, match=r"Rows.mapped\(exact='yes'\): exact is True or False"):
        Rows(Scaled()).mapped(exact="yes")


def test_on_the_graph_route_mapped_exact_serves_what_a_run_without_the_store_gives(tmp_path):
    from somatize import Graph
    from somatize.torch import freeze

    g = freeze(Graph.somatize(Rows(Scaled()).frozen().cached().mapped(exact=True)))
    for i in range(0, 40, 7):
        assert torch.equal(g.forward(X[i:i + 7], store=str(tmp_path)), X[i:i + 7] * 1.5)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(4))[:13]
    assert torch.equal(g.forward(X[order], store=str(tmp_path)), X[order] * 1.5)
    items = _nodes[g.catalog["rows"]].values()
    assert all(i.exact for i in items) and mapped_counts(g) == (13, 40)
