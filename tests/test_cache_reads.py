"""What a cached forward reads is in its key: each case computes, changes one thing the
forward reads, and calls again; the answer must be what computing again gives (a right
miss: ``torch.equal`` against the plain forward), never the value kept before. Both
routes: a module's cached forward (what ``SomatizeCache`` installs) and a graph's
``.cached()`` / ``.mapped()`` node after ``freeze(g)``."""

import dataclasses
import functools

import pytest
import reads_config
import torch
from torch import nn

from somatize import Done, Graph, Node, Refused
from somatize.torch import freeze
from somatize.torch.cache._cached import CachedForward
from somatize.torch.cache._per_item import PerItemForward

X = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
CFG = {"gain": 1.0}
SCALE = 1.0
CALLS = {"n": 0}
HANDLE = object.__new__(type("Handle", (), {}))  # an object the key cannot name


def cached(module, store, per_item=False, salt=None):
    """``module`` with its forward cached in ``store``, and the plain forward beside."""
    torch.manual_seed(0)
    module.eval().requires_grad_(False)
    kind = PerItemForward if per_item else CachedForward
    module.forward = kind(module, "body", str(store), salt=salt)
    return module, lambda x: type(module).forward(module, x)


def check_fresh(module, plain, x=X):
    """The cached answer is the plain forward's, computed now."""
    got = module(x)
    want = plain(x)
    assert torch.equal(got, want), "a stale value was served"
    return got


class ReadsDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        CALLS["n"] += 1  # written: bookkeeping, never in the key
        return self.lin(x) * CFG["gain"]


class ReadsFloat(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x) * SCALE


class ReadsConfigModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return helper(self.lin(x))


def helper(y):  # a function the forward calls: what it reads is read too
    return y * reads_config.GAIN


@pytest.mark.parametrize("per_item", [False, True])
def test_a_module_level_dict_changed_is_a_miss(tmp_path, per_item):
    m, plain = cached(ReadsDict(), tmp_path, per_item)
    first = check_fresh(m, plain)
    CALLS["n"] = 0
    m(X)
    assert CALLS["n"] == 0  # a hit: the counter the forward writes is not in the key
    CFG["gain"] = 3.0
    try:
        assert not torch.equal(check_fresh(m, plain), first)
    finally:
        CFG["gain"] = 1.0


def test_a_module_level_float_changed_is_a_miss_not_a_warning(tmp_path, said):
    global SCALE
    m, plain = cached(ReadsFloat(), tmp_path)
    check_fresh(m, plain)
    SCALE = 2.0
    try:
        check_fresh(m, plain)
    finally:
        SCALE = 1.0
    assert "changed since" not in said()


def test_an_attribute_of_an_imported_config_module_changed_is_a_miss(tmp_path):
    m, plain = cached(ReadsConfigModule(), tmp_path)
    check_fresh(m, plain)
    reads_config.GAIN = 5.0
    try:
        check_fresh(m, plain)
    finally:
        reads_config.GAIN = 1.0


def make_act(k):
    return lambda y: y * k


class HoldsFunction(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.act = act

    def forward(self, x):
        return self.act(self.lin(x))


@pytest.mark.parametrize("first,then", [
    (make_act(1.0), make_act(2.0)),                        # a closure cell
    (lambda y, k=1.0: y * k, lambda y, k=2.0: y * k),      # a lambda's default
    (lambda y: y * 1.0, lambda y: y * 2.0),                # a function's constant
], ids=["closure", "default", "constant"])
def test_a_function_held_as_an_attribute_changed_is_a_miss(tmp_path, first, then):
    m, plain = cached(HoldsFunction(first), tmp_path)
    check_fresh(m, plain)
    m.act = then
    check_fresh(m, plain)


def test_a_closure_cell_rebound_in_place_is_a_miss(tmp_path):
    k = 1.0

    def act(y):
        return y * k

    m, plain = cached(HoldsFunction(act), tmp_path)
    check_fresh(m, plain)
    k = 4.0  # noqa: F841 - read by act through its cell
    check_fresh(m, plain)


@dataclasses.dataclass
class Cfg:
    gain: float = 1.0


class HoldsDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.cfg = Cfg()

    def forward(self, x):
        return self.lin(x) * self.cfg.gain


@pytest.mark.parametrize("per_item", [False, True])
def test_a_dataclass_field_set_in_place_is_a_miss(tmp_path, per_item):
    m, plain = cached(HoldsDataclass(), tmp_path, per_item)
    check_fresh(m, plain)
    m.cfg.gain = 2.0  # the same object, a field changed
    check_fresh(m, plain)


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3)
        self.lin = nn.Linear(8, 64)

    def forward(self, x):
        return self.conv(self.lin(x).unsqueeze(1)).flatten(1)


def _flush(on):
    was = _TINY[0] * 1.0 == 0.0  # (torch has no read of it)
    torch.set_flush_denormal(on)
    return was


_TINY = [1e-310]
_SETTINGS = {  # each: set it to another value, answer how to set it back
    "mkldnn": lambda: functools.partial(setattr, torch.backends.mkldnn, "enabled",
                                        _swap(torch.backends.mkldnn, "enabled", False)),
    "mkldnn_deterministic": lambda: functools.partial(
        setattr, torch.backends.mkldnn, "deterministic",
        _swap(torch.backends.mkldnn, "deterministic", True)),
    "matmul_precision": lambda: functools.partial(
        torch.set_float32_matmul_precision,
        (torch.get_float32_matmul_precision(), torch.set_float32_matmul_precision("medium"))[0]),
    "flush_denormal": lambda: functools.partial(torch.set_flush_denormal, _flush(True)),
    "nnpack": lambda: functools.partial(  # (under oneDNN off: the test below)
        torch._C._set_nnpack_enabled,
        (torch._C._get_nnpack_enabled(), torch._C._set_nnpack_enabled(False))[0]),
    "quantized_engine": lambda: functools.partial(
        setattr, torch.backends.quantized, "engine",
        _swap(torch.backends.quantized, "engine", "qnnpack")),
}


def _swap(owner, name, value):
    was = getattr(owner, name)
    setattr(owner, name, value)
    return was


@pytest.mark.parametrize("setting", sorted(_SETTINGS))
def test_a_math_setting_changed_is_a_miss(tmp_path, setting):
    m, plain = cached(Conv(), tmp_path)
    first = m(X)
    back = _SETTINGS[setting]()
    try:
        n = len(list((tmp_path / "names" / "value").iterdir()))
        check_fresh(m, plain)
        assert len(list((tmp_path / "names" / "value").iterdir())) == n + 1  # a new name
    finally:
        back()
    assert torch.equal(m(X), first)  # and back: the first name again


def test_nnpack_turned_off_under_onednn_off_is_a_miss(tmp_path):
    # with oneDNN's convolutions off, NNPACK's or torch's own run (other last bits):
    # torch.backends.nnpack has no attribute to read, torch._C's reader is in the key
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        test_a_math_setting_changed_is_a_miss(tmp_path, "nnpack")
    finally:
        torch.backends.mkldnn.enabled = was


class Joins(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, d):
        return self.lin(torch.cat(list(d.values()), 1))


def test_a_dict_input_in_another_order_is_a_miss(tmp_path):
    m, plain = cached(Joins(), tmp_path)
    a, b = X[:, :4], X[:, 4:]
    check_fresh(m, plain, {"a": a, "b": b})
    check_fresh(m, plain, {"b": b, "a": a})


class ReadsHandle(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        assert HANDLE is not None
        return self.lin(x)


def test_a_global_the_key_cannot_name_is_refused_naming_it_unless_salted(tmp_path):
    with pytest.raises(Refused, match=r"ReadsHandle.forward reads the global 'HANDLE', a Handle"):
        cached(ReadsHandle(), tmp_path)
    m, plain = cached(ReadsHandle(), tmp_path, salt="v1")
    check_fresh(m, plain)


# -- the graph route after freeze(g) ------------------------------------------------------

class Enc(Node):
    def __init__(self):
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6)
        self.bn.running_mean += 0.5
        self.computed = 0

    def forward(self, x, ctx):
        self.computed += torch.unique(x, dim=0).shape[0]  # misses are padded to 32 rows
        return Done(self.bn(self.lin(x)) * CFG["gain"])

    def parameters(self):
        return [*self.lin.parameters(), *self.bn.parameters()]


def plain_enc(enc, x):
    return enc.bn(enc.lin(x)) * CFG["gain"]


def graph(mapped):
    enc = Enc()
    node = enc.frozen().cached()
    g = freeze(Graph.somatize(node.mapped() if mapped else node))
    return g, enc


@pytest.mark.parametrize("mapped", [False, True], ids=["cached", "mapped"])
@pytest.mark.parametrize("change", ["load_state_dict", "bn.eps", "global"])
def test_a_node_changed_after_freeze_is_computed_anew(tmp_path, mapped, change):
    g, enc = graph(mapped)
    first = g.forward(X, store=str(tmp_path))
    assert torch.equal(first, plain_enc(enc, X))
    assert torch.equal(g.forward(X, store=str(tmp_path)), first)  # a hit
    computed = enc.computed
    if change == "load_state_dict":
        state = {k: v + 0.25 for k, v in enc.lin.state_dict().items()}
        enc.lin.load_state_dict(state)
    elif change == "bn.eps":
        enc.bn.eps = 0.5
    else:
        CFG["gain"] = 2.0
    try:
        got = g.forward(X, store=str(tmp_path))  # no freeze(g) again
        assert torch.equal(got, plain_enc(enc, X))
        assert enc.computed == computed + X.shape[0]
    finally:
        CFG["gain"] = 1.0


SCRIPT = '''
import sys
import torch
from torch import nn
from somatize.torch.cache._cached import CachedForward


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


def run(store):
    m = Lin().eval().requires_grad_(False)
    m.forward = CachedForward(m, "lin", store)
    m(torch.ones(3, 4))
    return m.forward.hits, m.forward.misses


if __name__ == "__main__":
    COUNTS = run(STORE)
'''


def test_a_class_run_as_the_script_and_imported_is_named_the_same(tmp_path, monkeypatch):
    import runpy
    import sys

    (tmp_path / "lin_script.py").write_text(SCRIPT)
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python lin_script.py` has it
    store = str(tmp_path / "soma")
    ran = runpy.run_path(str(tmp_path / "lin_script.py"), {"STORE": store}, run_name="__main__")
    assert ran["COUNTS"] == (0, 1) and ran["Lin"].__module__ == "__main__"
    import lin_script

    try:
        assert lin_script.run(store) == (1, 0)  # imported: the same name, a hit
    finally:
        sys.modules.pop("lin_script", None)
