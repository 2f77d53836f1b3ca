"""What a cached forward reads is in its key, further cases (tests/test_cache_reads.py has
the first): class attributes, a helper reached through a module, bound methods, a child's
hooks and train flag, a graph node's own tensors. Each compares the cached answer after a
change against the plain forward computed now (``torch.equal``), or expects a refusal
naming the cause, or a warning naming the method that changed."""

import collections

import pytest
import reads_config
import torch
from test_cache_reads import X, cached, check_fresh
from torch import nn

from somatize import Done, Graph, Node, Refused
from somatize.torch import freeze


class Gained(nn.Module):
    GAIN = 1.0  # read as self.GAIN: a class attribute, not the instance's

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x) * self.GAIN


class Shift(nn.Module):
    BY = 0.0

    def forward(self, x):
        return x + self.BY


class HoldsShift(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.shift = Shift()

    def forward(self, x):
        return self.shift(self.lin(x))


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("where", ["its own class", "a child's class"])
def test_a_class_attribute_set_mid_run_is_a_miss(tmp_path, monkeypatch, per_item, where):
    cls, attr = (Gained, "GAIN") if where == "its own class" else (Shift, "BY")
    m, plain = cached(Gained() if cls is Gained else HoldsShift(), tmp_path, per_item)
    check_fresh(m, plain)
    monkeypatch.setattr(cls, attr, 2.0)
    check_fresh(m, plain)


class CallsThroughModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return reads_config.shift(self.lin(x))  # reads reads_config.SHIFT in there


def test_a_global_read_by_a_helper_reached_through_its_module_is_in_the_key(tmp_path,
                                                                            monkeypatch):
    m, plain = cached(CallsThroughModule(), tmp_path)
    check_fresh(m, plain)
    monkeypatch.setattr(reads_config, "SHIFT", 1.5)
    check_fresh(m, plain)


class Scaler:
    def __init__(self):
        self.k = 1.0

    def apply(self, y):
        return y * self.k


class HoldsBound(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.f = f

    def forward(self, x):
        return self.f(self.lin(x))


def test_a_bound_method_of_what_the_key_cannot_name_is_refused_naming_it(tmp_path):
    with pytest.raises(Refused, match=r"'f.__self__' holds a Scaler"):
        cached(HoldsBound(Scaler().apply), tmp_path)
    with pytest.raises(Refused, match=r"'f.__self__' holds a Linear outside the module"):
        cached(HoldsBound(nn.Linear(4, 4).forward), tmp_path)  # its weights: not in the key


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("hook", ["forward", "pre"])
def test_a_hook_on_a_child_added_or_removed_is_a_miss(tmp_path, per_item, hook):
    m, plain = cached(HoldsShift(), tmp_path, per_item)
    check_fresh(m, plain)
    if hook == "forward":
        h = m.lin.register_forward_hook(lambda mod, i, o: o * 2)
    else:
        h = m.lin.register_forward_pre_hook(lambda mod, i: (i[0] + 1,))
    check_fresh(m, plain)
    h.remove()
    check_fresh(m, plain)


def test_a_hook_registered_for_every_module_is_a_miss(tmp_path):
    m, plain = cached(HoldsShift(), tmp_path)
    check_fresh(m, plain)
    h = nn.modules.module.register_module_forward_hook(
        lambda mod, i, o: o * 2 if isinstance(mod, nn.Linear) else o)
    try:
        check_fresh(m, plain)
    finally:
        h.remove()


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4)
        self.bn.running_mean += 1.0

    def forward(self, x):
        return self.bn(self.lin(x))


def test_a_child_put_back_in_train_mode_is_a_miss(tmp_path):
    m, plain = cached(Normed(), tmp_path)
    check_fresh(m, plain)
    m.bn.train()  # normalises by the batch now
    got = m(X)
    assert torch.equal(got, plain(X))  # its running statistics moved twice: one value anyway
    assert m.forward.misses == 2


class Swapped(HoldsShift):
    def post(self, y):
        return y


def test_a_method_replaced_on_its_class_mid_run_is_said_on_a_hit(tmp_path, say_again, said):
    m, _ = cached(Swapped(), tmp_path)
    m(X)
    old = Swapped.forward
    Swapped.forward = lambda self, x: self.shift(self.lin(x)) * 2
    try:
        m(X)
    finally:
        Swapped.forward = old
    assert "Swapped.forward changed since" in said()


# -- the graph route after freeze(g) ------------------------------------------------------

class Enc(Node):
    SHIFT = 0.0

    def __init__(self):
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 6)
        self.extra = torch.zeros(6)  # a tensor the node holds, not its module

    def forward(self, x, ctx):
        return Done(self.lin(x) + self.extra + self.SHIFT)

    def parameters(self):
        return list(self.lin.parameters())


def plain_enc(enc, x):
    return enc.lin(x) + enc.extra + Enc.SHIFT


@pytest.mark.parametrize("mapped", [False, True], ids=["cached", "mapped"])
@pytest.mark.parametrize("change", ["own tensor", "hook on its module", "class attribute"])
def test_a_node_changed_after_freeze_is_computed_anew(tmp_path, mapped, change):
    enc = Enc()
    node = enc.frozen().cached()
    g = freeze(Graph.somatize(node.mapped() if mapped else node))
    assert torch.equal(g.forward(X, store=str(tmp_path)), plain_enc(enc, X))
    if change == "own tensor":
        enc.extra.add_(1.0)
    elif change == "hook on its module":
        enc.lin.register_forward_hook(lambda mod, i, o: o * 3)
    else:
        Enc.SHIFT = 1.0
    try:
        got = g.forward(X, store=str(tmp_path))  # no freeze(g) again
        want = plain_enc(enc, X)
        assert torch.equal(got, want)
    finally:
        Enc.SHIFT = 0.0


class MakesOnes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x) + torch.ones(4)  # of the default dtype: what the sum promotes to


def test_the_default_dtype_changed_is_a_miss(tmp_path):
    m, plain = cached(MakesOnes(), tmp_path)
    check_fresh(m, plain)
    torch.set_default_dtype(torch.float64)
    try:
        got, want = m(X), plain(X)
        assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)
    finally:
        torch.set_default_dtype(torch.float32)


class Holds(nn.Module):
    """Holds ``value`` as ``self.v``; ``read(self.v)`` is what it multiplies by."""

    def __init__(self, value, read):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.v, self.read = value, read

    def forward(self, x):
        return self.lin(x) * self.read(self.v)


def _set_gain(d):
    d["g"] = 3.0


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("value, read, change", [
    (collections.OrderedDict(g=1.0), lambda v: v["g"], _set_gain),
    (collections.defaultdict(float, g=1.0), lambda v: v["g"], _set_gain),
    ({1, 2}, lambda v: float(len(v)), lambda v: v.add(3)),
    ((1.0, [2.0]), lambda v: v[1][0], lambda v: v[1].append(0) or v[1].reverse()),
    (reads_config, lambda v: v.GAIN, lambda v: setattr(v, "GAIN", 4.0)),
], ids=["OrderedDict", "defaultdict", "set", "list in a tuple", "a config module"])
def test_a_container_or_module_attribute_changed_in_place_is_a_miss(tmp_path, per_item, value,
                                                                   read, change):
    m, plain = cached(Holds(value, read), tmp_path, per_item)
    check_fresh(m, plain)
    change(value)
    try:
        check_fresh(m, plain)
    finally:
        reads_config.GAIN = 1.0


def test_a_weight_whose_data_is_swapped_is_a_miss(tmp_path):
    m, plain = cached(HoldsShift(), tmp_path)
    check_fresh(m, plain)
    m.lin.weight.data = m.lin.weight.data * 2  # the same Parameter, the same version
    check_fresh(m, plain)
