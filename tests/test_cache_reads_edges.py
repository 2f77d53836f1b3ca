"""What a cached forward reads is in its key, at the edges of what the code reaches
(tests/test_cache_reads.py and tests/test_cache_reads_more.py have the rest): a class of
yours used as a namespace, a decorated helper, a function held in a dict or passed in, a
builtin rebound, ``globals()[...]`` and ``getattr(config, ...)``, an enum's value, a
tensor rebound inside a dataclass or a closure, torch's state read by the forward, a
tensor subclass as input, a graph node's own settings, and a forward that draws random
numbers. Each compares the cached answer after a change against the plain forward
computed now (``torch.equal``), or expects a refusal naming the cause."""

import dataclasses
import enum
import functools
import os

import pytest
import reads_config
import torch
from test_cache_reads import X, cached, check_fresh
from torch import nn
from torch.nn import functional as F

from somatize import Done, Graph, Node, Refused
from somatize.torch import freeze

SCALE = 1.0
ACT = torch.relu
ACT_F = F.relu


class Namespace:  # a class of yours used as a bag of settings, not in the module's tree
    gain = 1.0


class Helper:
    @staticmethod
    def scale(y):
        return y * SCALE


def scaled(y):
    return y * SCALE


def passthrough(fn):
    @functools.wraps(fn)
    def wrapper(*a):
        return fn(*a)
    return wrapper


@passthrough
def decorated(y):  # what runs is the wrapper; SCALE is read by what it wraps
    return y * SCALE


ACTS = {"scaled": scaled}


class Body(nn.Module):
    """``how(self, y)`` after a linear layer: each test gives what the forward reads."""

    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.how = how

    def forward(self, x):
        return self.how(self, self.lin(x))


# each reads SCALE, Namespace.gain, reads_config.GAIN... by a road the key did not follow
ROADS = {
    "a namespace class": (lambda m, y: y * Namespace.gain, (Namespace, "gain")),
    "a static method of another class": (lambda m, y: Helper.scale(y), "SCALE"),
    "globals()[name]": (lambda m, y: y * globals()["SCALE"], "SCALE"),
    "globals().get(name)": (lambda m, y: y * globals().get("SCALE", 1.0), "SCALE"),
    "getattr(module, name)": (lambda m, y: y * getattr(reads_config, "GAIN"),  # noqa: B009
                              (reads_config, "GAIN")),
    "a decorated helper": (lambda m, y: decorated(y), "SCALE"),
    "a function in a global dict": (lambda m, y: ACTS["scaled"](y), "SCALE"),
}


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("road", list(ROADS))
def test_a_global_reached_by_another_road_is_in_the_key(tmp_path, monkeypatch, per_item, road):
    how, what = ROADS[road]
    m, plain = cached(Body(how), tmp_path, per_item)
    check_fresh(m, plain)
    owner, name = what if isinstance(what, tuple) else (globals(), what)
    if isinstance(owner, dict):
        monkeypatch.setitem(owner, name, 2.0)
    else:
        monkeypatch.setattr(owner, name, 2.0)
    check_fresh(m, plain)


class Passed(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.act = act

    def forward(self, x):
        return self.act(self.lin(x))


@dataclasses.dataclass
class Scaler:
    g: float = 1.0

    def apply(self, y):
        return y * self.g * SCALE


def scale_hook(mod, inputs, out):
    return out * SCALE


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("held", ["a function passed in", "a dataclass's method",
                                  "a hook put on a child"])
def test_what_a_function_held_from_outside_reads_is_in_the_key(tmp_path, monkeypatch, per_item,
                                                               held):
    if held == "a hook put on a child":
        body = Passed(torch.nn.Identity())
        body.lin.register_forward_hook(scale_hook)
    else:
        body = Passed(scaled if held == "a function passed in" else Scaler().apply)
    m, plain = cached(body, tmp_path, per_item)
    check_fresh(m, plain)
    monkeypatch.setitem(globals(), "SCALE", 2.0)
    check_fresh(m, plain)


class Acts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return ACT(self.lin(x)) + ACT_F(self.lin(x))


@pytest.mark.parametrize("name, then", [("ACT", torch.tanh), ("ACT_F", F.gelu)],
                         ids=["a builtin", "a library function"])
def test_a_global_rebound_to_another_function_is_a_miss(tmp_path, monkeypatch, name, then):
    m, plain = cached(Acts(), tmp_path)
    check_fresh(m, plain)
    monkeypatch.setitem(globals(), name, then)
    check_fresh(m, plain)


def test_a_global_read_by_a_computed_name_is_refused_naming_it(tmp_path):
    name = "SCALE"
    with pytest.raises(Refused, match=r"reads globals\(\)\[\.\.\.\] by a name it computes"):
        cached(Body(lambda m, y: y * globals()[name]), tmp_path)


class ReadsEnv(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.how = how

    def forward(self, x):
        gain = os.getenv("GAIN", "1") if self.how == "getenv" else os.environ.get("GAIN", "1")
        return self.lin(x) * float(gain)


@pytest.mark.parametrize("how", ["getenv", "environ"])
def test_a_forward_that_reads_the_environment_is_refused_saying_so(tmp_path, how):
    # a variable changed would serve stale outputs: read it once, or give a salt
    with pytest.raises(Refused, match=r"reads the environment \(os\.environ\), which the "
                                      r"key of its cached outputs cannot follow"):
        cached(ReadsEnv(how), tmp_path)


def mode(value):
    class Mode(enum.Enum):  # one name, two values: the source of two runs
        FAST = value
    return Mode.FAST


class Moded(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.mode = mode

    def forward(self, x):
        return self.lin(x) * self.mode.value


@pytest.mark.parametrize("per_item", [False, True])
def test_an_enum_member_of_another_value_is_another_name(tmp_path, per_item):
    first, _ = cached(Moded(mode(1.0)), tmp_path, per_item)
    first(X)
    m, plain = cached(Moded(mode(2.0)), tmp_path, per_item)
    check_fresh(m, plain)


@dataclasses.dataclass
class Masked:
    mask: torch.Tensor


class HoldsMasked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.cfg = Masked(torch.ones(4))

    def forward(self, x):
        return self.lin(x) * self.cfg.mask


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("where", ["a dataclass field", "a closure cell"])
def test_a_tensor_rebound_inside_an_attribute_is_a_miss(tmp_path, per_item, where):
    t = torch.ones(4)
    body = HoldsMasked() if where == "a dataclass field" else Passed(lambda y: y * t)
    m, plain = cached(body, tmp_path, per_item)
    check_fresh(m, plain)
    if where == "a dataclass field":
        m.cfg.mask = torch.full((4,), 2.0)  # the same dataclass, another tensor
    else:
        t = torch.full((4,), 2.0)  # noqa: F841 - read by the lambda through its cell
    check_fresh(m, plain)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)

    def forward(self, x):
        return self.layer(x.view(-1, 3, 8))


def test_the_transformer_fast_path_switched_off_is_a_miss(tmp_path):
    m, plain = cached(Layer(), tmp_path)
    check_fresh(m, plain)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        check_fresh(m, plain)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


@pytest.mark.parametrize("per_item", [False, True])
def test_torch_state_the_forward_asks_for_is_in_its_key(tmp_path, per_item):
    m, plain = cached(Body(lambda m, y: y * (2.0 if torch.is_grad_enabled() else 1.0)),
                      tmp_path, per_item)
    with torch.no_grad():
        check_fresh(m, plain)
    check_fresh(m, plain)  # grad mode on: the forward's answer differs


class Tagged(torch.Tensor):
    """A tensor subclass: a forward may compute by its class."""


def test_a_tensor_subclass_input_is_not_named_as_a_plain_tensor(tmp_path):
    m, plain = cached(Body(lambda m, y: y * (2.0 if isinstance(y, Tagged) else 1.0)), tmp_path)
    check_fresh(m, plain)
    tagged = X.as_subclass(Tagged)
    got, want = m(tagged), plain(tagged)
    assert torch.equal(got.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))


class Draws(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.5)
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        return self.drop(y) if self.how == "dropout" else y + torch.randn(y.shape)


@pytest.mark.parametrize("per_item", [False, True])
@pytest.mark.parametrize("how", ["dropout", "randn"])
def test_a_forward_that_draws_random_numbers_is_refused_naming_the_module(tmp_path, per_item,
                                                                         how):
    m, _ = cached(Draws(how), tmp_path, per_item)
    m.drop.train()  # put back in train mode by hand: its masks are drawn at each call
    with pytest.raises(Refused, match=r"module 'body' \(Draws\) draws from torch's random"):
        m(X)


# -- the graph route ------------------------------------------------------------------------

class Enc(Node):
    def __init__(self, act):
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 6)
        self.gain = 1.0
        self.act = act

    def forward(self, x, ctx):
        return Done(self.act(self.lin(x)) * self.gain * Namespace.gain)

    def parameters(self):
        return list(self.lin.parameters())


def plain_enc(enc, x):
    return enc.act(enc.lin(x)) * enc.gain * Namespace.gain


@pytest.mark.parametrize("mapped", [False, True], ids=["cached", "mapped"])
@pytest.mark.parametrize("change", ["its own setting", "its own function", "what it holds reads",
                                    "a namespace class"])
def test_a_node_changed_after_freeze_is_computed_anew(tmp_path, monkeypatch, mapped, change):
    enc = Enc(scaled)
    node = enc.frozen().cached()
    g = freeze(Graph.somatize(node.mapped() if mapped else node))
    assert torch.equal(g.forward(X, store=str(tmp_path)), plain_enc(enc, X))
    if change == "its own setting":
        enc.gain = 2.0
    elif change == "its own function":
        enc.act = lambda y: y * 3.0
    elif change == "what it holds reads":
        monkeypatch.setitem(globals(), "SCALE", 2.0)
    else:
        monkeypatch.setattr(Namespace, "gain", 2.0)
    got = g.forward(X, store=str(tmp_path))  # no freeze(g) again
    assert torch.equal(got, plain_enc(enc, X))


class Noisy(Node):
    def __init__(self):
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 6)

    def forward(self, x, ctx):
        return Done(self.lin(x) + torch.randn(x.shape[0], 6))

    def parameters(self):
        return list(self.lin.parameters())


@pytest.mark.parametrize("mapped", [False, True], ids=["cached", "mapped"])
def test_a_node_that_draws_random_numbers_is_refused_naming_it(tmp_path, mapped):
    node = Noisy().frozen().cached()
    g = freeze(Graph.somatize(node.mapped() if mapped else node))
    with pytest.raises(Refused, match=r"node 'noisy' \(Noisy\) draws from torch's random"):
        g.forward(X, store=str(tmp_path))


class Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.calls = 0
        self.gain = 1.0

    def set_gain(self, g):  # a setter: what it writes is a setting, in the key
        self.gain = g

    def forward(self, x):
        self.calls += 1  # what the forward writes is its bookkeeping, not a setting
        return self.lin(x) * self.gain


@pytest.mark.parametrize("per_item", [False, True])
def test_what_the_forward_writes_is_bookkeeping_and_what_a_setter_writes_is_a_setting(
        tmp_path, per_item):
    m, plain = cached(Counts(), tmp_path, per_item)
    check_fresh(m, plain)
    m(X)
    assert m.forward.hits == X.shape[0] if per_item else m.forward.hits == 1
    m.set_gain(2.0)
    check_fresh(m, plain)


class Settable(Enc):
    def set_gain(self, g):
        self.gain = g


def test_a_node_setting_written_by_its_setter_after_freeze_is_computed_anew(tmp_path):
    enc = Settable(scaled)
    g = freeze(Graph.somatize(enc.frozen().cached()))
    assert torch.equal(g.forward(X, store=str(tmp_path)), plain_enc(enc, X))
    enc.set_gain(2.0)
    assert torch.equal(g.forward(X, store=str(tmp_path)), plain_enc(enc, X))
