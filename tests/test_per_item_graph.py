"""Per-item memory on the graph route: ``Encoder().frozen().cached().mapped()`` in a graph
trained by ``somatize.torch.Trainer`` on shuffled batches; and the refusals of per item
(rows coupled by a layer, outputs that are not rows of the batch), each naming the module."""

import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from somatize import Done, Graph, GraphError, Node, Refused
from somatize.torch import Trainer, freeze, parameters
from somatize.torch.cache._per_item import CONTEXT, PerItem, PerItemForward, item_keys, module_key


class Enc(Node):
    """A frozen encoder that writes ``pid rows`` to a file each time it computes."""

    def __init__(self, log):
        self.lin = nn.Linear(8, 6)
        self.log = log

    def forward(self, x, ctx):
        with open(self.log, "a") as f:
            # distinct rows: per item pads its misses to chunks of 32 with copies of a row
            f.write(f"{os.getpid()} {torch.unique(x, dim=0).shape[0]}\n")
        return Done(self.lin(x).relu())

    def parameters(self):
        return list(self.lin.parameters())


class Head(Node):
    def __init__(self):
        self.lin = nn.Linear(6, 3)

    def forward(self, x, ctx):
        return Done(self.lin(x))

    def parameters(self):
        return list(self.lin.parameters())


X = torch.rand(48, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (48,), generator=torch.Generator().manual_seed(2))


def shuffled(epoch_seed):
    order = torch.randperm(48, generator=torch.Generator().manual_seed(epoch_seed))
    return [(X[order[i:i + 12]], Y[order[i:i + 12]]) for i in range(0, 48, 12)]


def rows_computed(log):
    if not os.path.exists(log):
        return {}
    out = {}
    for line in open(log).read().split("\n"):
        if line:
            pid, n = map(int, line.split())
            out[pid] = out.get(pid, 0) + n
    return out


def oracle(epochs):
    """By hand: the encoder's output for each item the first time it is seen (unseen rows of
    a batch computed together), reused ever after; the head trained on that."""
    torch.manual_seed(0)
    enc, head = nn.Linear(8, 6), nn.Linear(6, 3)
    opt = torch.optim.SGD(head.parameters(), lr=0.3)
    kept, losses = {}, []
    for seed in epochs:
        for x, y in shuffled(seed):
            keys = [r.numpy().tobytes() for r in x]
            new = list(dict.fromkeys(k for k in keys if k not in kept))
            if new:
                at = [keys.index(k) for k in new]
                with torch.no_grad():
                    out = enc(x if len(at) == len(x) else x[at]).relu()
                kept.update((k, r.clone()) for k, r in zip(new, out, strict=True))
            loss = F.cross_entropy(head(torch.stack([kept[k] for k in keys])), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, head


def train(tmp_path, log, epochs):
    torch.manual_seed(0)
    g = Graph.somatize(Enc(str(log)).frozen().cached().mapped() >> Head())
    freeze(g)
    t = Trainer(g, F.cross_entropy, torch.optim.SGD(parameters(g), lr=0.3),
                store=str(tmp_path / "store"))
    losses = []
    for seed in epochs:
        losses += t.fit(shuffled(seed), epochs=1)
    return losses, g.catalog["head"].lin


def test_a_mapped_node_computes_each_item_once_and_trains_as_the_oracle(tmp_path):
    losses, head = train(tmp_path, tmp_path / "a.log", [0, 1, 2])
    want, want_head = oracle([0, 1, 2])
    assert losses == want
    assert torch.equal(head.weight, want_head.weight) and torch.equal(head.bias, want_head.bias)
    assert rows_computed(tmp_path / "a.log") == {os.getpid(): 48}
    # another run on the same store, in other orders, computes nothing (its log path is
    # one of its settings, in its key: the same path, emptied)
    (tmp_path / "a.log").unlink()
    losses, head = train(tmp_path, tmp_path / "a.log", [5, 6])
    assert rows_computed(tmp_path / "a.log") == {}
    assert losses == oracle([5, 6])[0]


def test_mapped_without_cached_is_refused_naming_the_node():
    with pytest.raises(GraphError, match=r"node 'enc' is .mapped\(\) but not .cached\(\)"):
        Graph.somatize(Enc("x").frozen().mapped() >> Head())


class Normed(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.norm = nn.BatchNorm1d(6, **kw)

    def forward(self, x):
        return self.norm(self.lin(x))


def test_a_layer_that_couples_rows_is_refused_at_setup_naming_it(tmp_path):
    with pytest.raises(Refused, match=r"'body' is kept per item, but its layer 'body.norm' "
                                      r"\(BatchNorm1d\) has track_running_stats=False"):
        PerItemForward(Normed(track_running_stats=False).eval(), "body", str(tmp_path))
    with pytest.raises(Refused, match=r"layer 'body.norm' \(BatchNorm1d\) is in train mode"):
        PerItemForward(Normed().train(), "body", str(tmp_path))
    from somatize.torch import node

    g = Graph.somatize(node(Normed(track_running_stats=False)).frozen().cached().mapped())
    with pytest.raises(Refused, match=r"'normed' is kept per item, but its layer 'normed.norm'"):
        freeze(g)
    PerItemForward(Normed().eval(), "body", str(tmp_path))  # running statistics: row by row
    with pytest.raises(Refused, match="module 'body' is kept per item, which needs a store "
                                      "directory .*a dict is neither"):
        PerItemForward(Normed().eval(), "body", {})


def test_outputs_that_are_not_rows_of_the_batch_are_refused_at_the_batch_that_shows_it(tmp_path):
    item = PerItem("body", "Pooled", str(tmp_path))
    with pytest.raises(Refused, match=r"'body' is kept per item, but for a batch of 4 it "
                                      r"returned a \(1, 3\)"):
        item(torch.rand(4, 3), lambda x: x.mean(0, keepdim=True), None, {})
    assert not list((tmp_path / "items").rglob("*.seg"))  # nothing kept
    padded = PerItem("body", "Padded", str(tmp_path))
    padded(torch.rand(4, 3), lambda x: x * 2, None, {})
    longer = torch.rand(4, 5)  # inputs of another length: their own rows, served right
    assert torch.equal(padded(longer, lambda x: x * 2, None, {})[0], longer * 2)
    with pytest.raises(Refused, match=r"its output rows were \[3\] and are now \[6\]: their "
                                      r"shape changes from batch to batch"):
        padded(torch.rand(4, 3), lambda x: x.repeat(1, 2), None, {})  # the same inputs' length


def test_a_batch_comes_back_in_order_fresh_with_the_modules_dtype(tmp_path):
    item = PerItem("body", "Double", str(tmp_path))
    calls = []

    def double(x):
        calls.append(len(x))
        return (x * 2).double()

    x = torch.rand(6, 3)
    first, ran = item(x, double, None, {})
    assert ran and calls == [32]  # misses are computed in chunks of 32 rows, padded
    mixed, ran = item(torch.cat([x[[4, 1]], torch.ones(1, 3), x[[1]]]), double, None, {})
    assert calls == [32, 32] and (item.hits, item.misses) == (3, 7)
    assert mixed.dtype == torch.float64
    assert torch.equal(mixed, torch.cat([first[[4, 1]], torch.full((1, 3), 2.0,
                                         dtype=torch.float64), first[[1]]]))
    again, ran = item(x.flip(0), double, None, {})
    assert not ran and torch.equal(again, first.flip(0)) and again.dtype == torch.float64
    assert again.data_ptr() % 64 == 0 and again.data_ptr() != first.data_ptr()


def test_item_keys_are_kept_apart_from_whole_value_keys_and_name_the_module():
    from blake3 import blake3

    x = torch.rand(3, 4)
    k = item_keys("0" * 64, x)
    assert k == item_keys("0" * 64, x[[0, 1, 2]]) and len(set(k)) == 3
    assert item_keys("0" * 64, x[[2]]) == [k[2]]  # a row's key does not depend on its batch
    assert item_keys("1" * 64, x) != k  # the module's key is in each item's
    whole = blake3(b"").digest(16)
    assert CONTEXT and whole not in k
    outside = module_key("Enc", "s", None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module_key("Enc", "s", None) != outside  # the autocast state is in the name


def test_items_made_by_other_code_are_used_and_said_once(tmp_path, caplog):
    import json

    from somatize._say import forget

    forget()
    x = torch.rand(4, 3)
    old = json.dumps({"Enc.forward": "a"})
    PerItem("body", "Enc", str(tmp_path))(x, lambda v: v * 2, None, {"fingerprint": old})
    item = PerItem("body", "Enc", str(tmp_path))
    got, ran = item(x, lambda v: v * 3, None, {"fingerprint": json.dumps({"Enc.forward": "b"})})
    assert not ran and torch.equal(got, x * 2)  # the name holds no code: kept rows are used
    assert "'body' (Enc): the items kept under its name were produced by different code " \
           "(Enc.forward changed since)" in caplog.text
