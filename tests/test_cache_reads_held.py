"""What a cached forward reads is in its key, in cases a probe held out of the others
(tests/test_cache_reads*.py): the input's layout, a forward set on an instance, what a
``functools.cached_property`` or an ``lru_cache``'d helper reads, namespaces and slices as
plain data, and a ``torch.Generator`` the module holds. Each compares the cached answer
after a change against the plain forward computed now (``torch.equal``), or expects a
refusal naming the cause."""

import argparse
import functools
import types

import pytest
import torch
from test_cache_reads import X, cached, check_fresh
from torch import nn
from torch.nn import functional as F

from somatize import Done, Graph, Node, Refused
from somatize.torch import freeze
from somatize.torch.cache._cached import CachedForward
from somatize.torch.cache._per_item import PerItemForward

SCALE = 1.0
ARGS = argparse.Namespace(gain=1.0)  # args = parser.parse_args() at module level


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x)


class AsksLayout(Lin):
    def forward(self, x):
        return self.lin(x) * (1.0 if x.is_contiguous() else 2.0)


@pytest.mark.parametrize("body", [AsksLayout, Lin], ids=["a forward that asks", "a kernel"])
def test_a_transposed_input_is_not_named_as_its_contiguous_copy(tmp_path, body):
    # a Linear on x.t() and on x.t().contiguous() differ in the last bit on the CPU kernels
    m, plain = cached(body(), tmp_path)
    xt = torch.randn(8, 12, generator=torch.Generator().manual_seed(1))
    check_fresh(m, plain, xt.t())
    check_fresh(m, plain, xt.t().contiguous())
    assert m.forward.misses == 2


class Enc(Node):
    """A graph node around a module (``body()``, made from torch's seed 0)."""

    def __init__(self, body):
        torch.manual_seed(0)
        self.body = body()

    def forward(self, x, ctx):
        return Done(self.body(x))

    def parameters(self):
        return list(self.body.parameters())


def test_a_transposed_input_to_a_cached_node_is_its_own_name(tmp_path):
    enc = Enc(AsksLayout)
    g = freeze(Graph.somatize(enc.frozen().cached()))
    xt = torch.randn(8, 12)
    for x in (xt.t(), xt.t().contiguous()):
        assert torch.equal(g.forward(x, store=str(tmp_path)), enc.body(x))


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x))


def times(k, y):
    return y * k


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("how", ["a lambda", "a partial"])
def test_a_forward_set_on_a_child_is_in_the_key(tmp_path, per_item, how):
    m, plain = cached(Two(), tmp_path, per_item)
    check_fresh(m, plain)
    if how == "a lambda":  # what runs in place of Linear.forward
        m.a.forward = lambda y: F.linear(y, m.a.weight) * 2
        check_fresh(m, plain)
    else:
        m.a.forward = functools.partial(times, 2.0)
        check_fresh(m, plain)
        m.a.forward = functools.partial(times, 3.0)  # the same function, another argument
        check_fresh(m, plain)


@pytest.mark.parametrize("mapped", [False, True], ids=["cached", "mapped"])
def test_a_forward_set_on_a_node_module_after_freeze_is_computed_anew(tmp_path, mapped):
    enc = Enc(Two)
    node = enc.frozen().cached()
    g = freeze(Graph.somatize(node.mapped() if mapped else node))
    assert torch.equal(g.forward(X, store=str(tmp_path)), enc.body(X))
    enc.body.a.forward = functools.partial(times, 3.0)
    assert torch.equal(g.forward(X, store=str(tmp_path)), enc.body(X))


def lin_times(m, k, y):
    return m.lin(y) * k


@pytest.mark.parametrize("per_item", [False, True])
def test_a_forward_set_on_the_module_before_it_is_cached_is_in_the_key(tmp_path, per_item):
    kind = PerItemForward if per_item else CachedForward
    got = []
    for k in (2.0, 3.0):  # two runs over one store: their own forwards differ
        torch.manual_seed(0)
        m = Lin().eval().requires_grad_(False)
        own = functools.partial(lin_times, m, k)
        m.forward = kind(m, "body", str(tmp_path), previous=own)
        got.append(m(X))
        assert torch.equal(got[-1], own(X))
    assert not torch.equal(got[0], got[1])


class CachedProp(Lin):
    @functools.cached_property
    def factor(self):
        return SCALE * 2

    def forward(self, x):
        return self.lin(x) * self.factor


@functools.lru_cache(maxsize=64)
def factor_of(n):
    return SCALE * n


class LruReads(Lin):
    def forward(self, x):
        return self.lin(x) * factor_of(2)


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("body", [CachedProp, LruReads],
                         ids=["a cached_property", "an lru_cache'd helper"])
def test_what_a_memoized_function_reads_is_in_the_key(tmp_path, monkeypatch, per_item, body):
    m, plain = cached(body(), tmp_path, per_item)
    check_fresh(m, plain)
    monkeypatch.setitem(globals(), "SCALE", 2.0)
    m.__dict__.pop("factor", None)  # the memo dropped: computed again from SCALE
    factor_of.cache_clear()
    check_fresh(m, plain)
    factor_of.cache_clear()


class ReadsArgs(Lin):
    def forward(self, x):
        return self.lin(x) * ARGS.gain


class HoldsPlain(Lin):
    def __init__(self):
        super().__init__()
        self.cfg = types.SimpleNamespace(gain=1.0)
        self.keep = slice(0, 3)

    def forward(self, x):
        return self.lin(x)[:, self.keep] * self.cfg.gain


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("change", ["an argparse namespace global", "a namespace attribute",
                                    "a slice attribute"])
def test_namespaces_and_slices_are_named_by_value(tmp_path, monkeypatch, per_item, change):
    m, plain = cached(ReadsArgs() if change.endswith("global") else HoldsPlain(), tmp_path,
                      per_item)
    check_fresh(m, plain)
    if change == "an argparse namespace global":
        monkeypatch.setattr(ARGS, "gain", 2.0)  # written in place: the same object
    elif change == "a namespace attribute":
        m.cfg.gain = 2.0
    else:
        m.keep = slice(1, 4)
    check_fresh(m, plain)


class HoldsGenerator(Lin):
    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(0)

    def forward(self, x):
        return self.lin(x) + torch.randn(x.shape[0], 4, generator=self.g)


class SeedsItsGenerator(HoldsGenerator):
    def forward(self, x):
        self.g.manual_seed(0)  # its draws are its own: the same at every call
        return super().forward(x)


@pytest.mark.parametrize("per_item", [False, True])
def test_a_forward_drawing_from_a_generator_it_holds_is_refused_salt_or_not(tmp_path,
                                                                           per_item):
    with pytest.raises(Refused, match=r"module 'body'.*holds a Generator"):
        cached(HoldsGenerator(), tmp_path, per_item)
    m, _ = cached(HoldsGenerator(), tmp_path, per_item, salt="v1")
    with pytest.raises(Refused, match=r"module 'body' \(HoldsGenerator\) draws from .*"
                                      r"a torch.Generator it holds"):
        m(X)


def test_a_forward_that_seeds_the_generator_it_holds_is_cached(tmp_path):
    m, plain = cached(SeedsItsGenerator(), tmp_path, salt="v1")
    check_fresh(m, plain)
    check_fresh(m, plain)
    assert (m.forward.hits, m.forward.misses) == (1, 1)


def test_a_node_drawing_from_a_generator_it_holds_is_refused(tmp_path):
    class Noisy(Node):
        def __init__(self):
            torch.manual_seed(0)
            self.lin = nn.Linear(8, 4)
            self.g = torch.Generator().manual_seed(0)

        def forward(self, x, ctx):
            return Done(self.lin(x) + torch.randn(x.shape[0], 4, generator=self.g))

        def parameters(self):
            return list(self.lin.parameters())

    g = freeze(Graph.somatize(Noisy().frozen().cached(salt="v1")))
    with pytest.raises(Refused, match=r"node 'noisy' \(Noisy\) draws from"):
        g.forward(X, store=str(tmp_path))


class Doubled(Two):
    def forward(self, x):
        return self.b(self.a(x)) * 2


@pytest.mark.parametrize("per_item", [False, True])
def test_a_class_swapped_on_the_instance_is_a_miss(tmp_path, per_item):
    m, plain = cached(Two(), tmp_path, per_item)
    check_fresh(m, plain)
    m.__class__ = Doubled  # what torch's parametrize does, by hand: other code runs
    check_fresh(m, plain)


@pytest.mark.parametrize("per_item", [False, True])
def test_a_hook_whose_closure_is_written_in_place_is_a_miss(tmp_path, per_item):
    m, plain = cached(Two(), tmp_path, per_item)
    cfg = {"k": 1.0}
    m.a.register_forward_hook(lambda mod, i, out: out * cfg["k"])
    check_fresh(m, plain)
    cfg["k"] = 2.0  # the same hook, the same dict: its content changed
    check_fresh(m, plain)


LEAKY = functools.partial(F.leaky_relu, negative_slope=0.1)


class ReadsPartial(Lin):
    def forward(self, x):
        return LEAKY(self.lin(x) - 0.3)


@pytest.mark.parametrize("per_item", [False, True])
def test_a_global_partial_is_named_by_what_it_was_given(tmp_path, monkeypatch, per_item):
    m, plain = cached(ReadsPartial(), tmp_path, per_item)
    check_fresh(m, plain)
    monkeypatch.setitem(globals(), "LEAKY", functools.partial(F.leaky_relu, negative_slope=0.5))
    check_fresh(m, plain)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(16, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 8, 1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


class AsksWeightLayout(Lin):
    def forward(self, x):
        return self.lin(x) * (1.0 if self.lin.weight.is_contiguous() else 2.0)


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("how", ["a forward that asks", "a kernel"])
def test_weights_in_another_memory_layout_are_another_name(tmp_path, per_item, how):
    # the same weights, channels-last: the CPU convolution rounds otherwise in the last bit
    if how == "a kernel":
        m, plain = cached(ConvNet(), tmp_path, per_item)
        x = torch.randn(32, 16, 12, 12, generator=torch.Generator().manual_seed(2))
        check_fresh(m, plain, x)
        m.to(memory_format=torch.channels_last)
    else:
        m, plain = cached(AsksWeightLayout(), tmp_path, per_item)
        x = X
        check_fresh(m, plain, x)
        w = m.lin.weight.detach()
        m.lin.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)  # same bytes
    check_fresh(m, plain, x)
