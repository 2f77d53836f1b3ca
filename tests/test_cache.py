"""What is remembered, and what is not computed twice: the CU13 questionnaire through
``g.forward(x, store=...)`` on a real directory store."""

import json

import pytest
import torch
from models import RUNS, Encoder, FromHandle, Handle, Probe, Stem, ToHandle, Tokenize
from scenario import scenario

from somatize import Graph, Opaque, Refused, cacheable, codec
from somatize._engine import walk
from somatize._keys import fingerprint, key_of_input, key_of_node
from somatize._values import Blob, _codecs
from somatize.store import Store
from somatize.torch import Trainer, freeze, state_digest


@pytest.fixture(autouse=True)
def _fresh(say_again):
    RUNS.clear()


def settled(*nodes):
    return freeze(Graph.somatize(nodes[0] if len(nodes) == 1 else _seq(nodes)))


def _seq(nodes):
    expr = nodes[0]
    for n in nodes[1:]:
        expr = expr >> n
    return expr


x = torch.arange(8.0).reshape(2, 4)


# -- the core section of the questionnaire --

def test_what_is_kept_is_not_computed_again_and_is_what_was_produced(store):
    enc = Encoder()
    g = settled(enc.frozen().cached(), Probe())
    y1 = g.forward(x, store=store)
    y2 = g.forward(Opaque(x), store=store.path)  # a path or the store: the same directory
    assert RUNS == {"encoder": 1, "probe": 2}
    assert torch.equal(y1, y2)
    (name,) = store.names()
    assert torch.equal(store.get(name).value, enc.lin(x).detach())


def test_a_different_input_is_a_different_name_and_the_node_runs(store):
    g = settled(Encoder().frozen().cached(), Probe())
    g.forward(x, store=store)
    g.forward(x + 1, store=store)
    g.forward(x.clone(), store=store)  # the same content is the same name
    assert RUNS["encoder"] == 2
    assert len(list(store.names())) == 2


def test_what_is_above_names_what_is_below(store):
    # Stem keeps nothing; another state up there is another name for the encoder below
    g1 = settled(Stem(seed=1).frozen(), Encoder().frozen().cached(), Probe())
    g2 = settled(Stem(seed=5).frozen(), Encoder().frozen().cached(), Probe())
    g1.forward(x, store=store)
    g2.forward(x, store=store)
    assert RUNS["encoder"] == 2
    g1.forward(x, store=store)
    assert RUNS["encoder"] == 2
    assert len(list(store.names())) == 2


def test_changing_the_head_does_not_touch_the_name_of_what_is_underneath(store):
    enc = Encoder().frozen().cached()
    settled(enc, Probe(seed=2)).forward(x, store=store)
    settled(enc, Probe(seed=3)).forward(x, store=store)
    assert RUNS == {"encoder": 1, "probe": 2}


def test_the_code_fingerprint_is_not_in_the_name_and_what_is_beside_is_what_produced_it(
        store, said):
    settled(Encoder().frozen().cached()).forward(x, store=store)
    (entry,) = store.entries()
    assert entry.meta["node"] == "encoder" and entry.meta["class"] == "Encoder"
    assert json.loads(entry.meta["fingerprint"]) == fingerprint(Encoder)

    class Encoder2(Encoder):  # the same name, another body
        def forward(self, x, ctx):
            RUNS["changed"] += 1
            return super().forward(x, ctx)

    Encoder2.__name__ = "Encoder"
    y = settled(Encoder2().frozen().cached()).forward(x, store=store)
    assert RUNS == {"encoder": 1}  # a hit: the code is not part of the name
    assert torch.equal(y, store.get(entry.name).value)
    text = said()
    assert "'encoder'" in text and "Encoder2.forward" in text and "different code" in text


def test_a_node_that_keeps_nothing_still_passes_its_name_on():
    g = settled(Stem().frozen(), Tokenize().frozen(), Encoder().frozen().cached())
    out = walk(g, g.plan.order, inputs={"stem": x}, naming=True)
    assert set(out.keys) == {"stem", "tokenize", "encoder"}
    assert all(out.keys.values())
    assert out.keys["encoder"] == key_of_node("Encoder", state_digest(g["encoder"]), None,
                                              [("tokenize", out.keys["tokenize"])])


def test_an_opaque_root_with_no_codec_leaves_everything_below_nameless_not_an_error(store):
    g = settled(FromHandle().frozen(), Encoder().frozen().cached())
    out = walk(g, g.plan.order, inputs={"fromhandle": Opaque(Handle(x))}, naming=True)
    assert out.keys == {"fromhandle": None, "encoder": None}
    y1 = g.forward(Opaque(Handle(x)), store=store)
    y2 = g.forward(Opaque(Handle(x)), store=store)
    assert torch.equal(y1, y2) and RUNS["encoder"] == 3
    assert list(store.names()) == []


def test_a_tensor_root_without_somatize_torch_keeps_nothing_and_says_why_once(tmp_path):
    # the tensor's codec comes with importing somatize.torch, which somatize never does
    code = f"""
import logging, sys, torch
from somatize import Graph, Node, Done, Opaque
from somatize.store import Store

class Tok(Node):
    def forward(self, x, ctx):
        print("ran", flush=True)
        return Done(Opaque(x * 2))

g = Graph.somatize(Tok().frozen().cached())
for _ in range(2):
    assert torch.equal(g.forward(torch.ones(2), store={str(tmp_path)!r}), torch.full((2,), 2.0))
assert "somatize.torch" not in sys.modules
assert list(Store({str(tmp_path)!r}).names()) == []
"""
    r = scenario("-c", code, timeout=120)
    assert r.stdout.split() == ["ran", "ran"]
    assert r.stderr.count("'tok' is fed a Tensor that has no codec") == 1, r.stderr
    assert "import somatize.torch" in r.stderr


class Counted:
    """An input whose codec counts how often it is turned into bytes (hashed)."""

    dumps = 0

    def __init__(self, t):
        self.t = t


def _dump(c):
    Counted.dumps += 1
    return Blob("F32", tuple(c.t.shape), memoryview(c.t.numpy()).cast("B"))


class Unwrap(Tokenize):
    def forward(self, x, ctx):
        return super().forward(x.t, ctx)


def test_nothing_is_named_without_a_keeper(store):
    codec("counted", Counted, dump=_dump, load=lambda b: None)
    try:
        g = settled(Unwrap().frozen(), Encoder().frozen().cached())
        Counted.dumps = 0
        g.forward(Counted(x))
        assert Counted.dumps == 0  # no keeper: the input is not even hashed
        assert walk(g, g.plan.order, inputs={"unwrap": Counted(x)}).keys == {}
        g.forward(Counted(x), store=store)
        assert Counted.dumps == 1
    finally:
        _codecs.pop("counted")


def test_with_nothing_cached_a_store_costs_no_hashing(store):
    codec("counted", Counted, dump=_dump, load=lambda b: None)
    try:
        g = settled(Unwrap().frozen(), Encoder().frozen(), Probe())  # frozen, not cached
        Counted.dumps = 0
        g.forward(Counted(x), store=store)
        trainer = Trainer(g, objective=lambda y, t: (y - t).pow(2).mean(), store=store,
                          optimizer=torch.optim.SGD(g["probe"].parameters(), lr=0.1))
        trainer.step((Counted(x), torch.zeros(2, 2)))
        assert Counted.dumps == 0  # nothing can be kept: nothing is named
        assert list(store.names()) == []
    finally:
        _codecs.pop("counted")


def test_cacheable_names_the_cached_node_and_the_ancestor_that_can_still_change(store):
    g = Graph.somatize(Stem() >> Encoder().frozen().cached() >> Probe())
    with pytest.raises(Refused, match="'encoder'.*'stem'"):
        cacheable(g)
    # asked wherever a cache is declared: with no store at all too (the review's third bug)
    with pytest.raises(Refused, match="'encoder'.*'stem'"):
        g.forward(x)
    assert RUNS == {}  # before anything ran
    g2 = Graph.somatize(Encoder().cached() >> Probe())
    with pytest.raises(Refused, match="'encoder' is .cached.* itself"):
        g2.forward(x, store=store)


def test_at_inference_the_whole_settled_prefix_is_cacheable(store):
    g = settled(Stem().frozen().cached(), Tokenize().frozen().cached(),
                Encoder().frozen().cached())
    cacheable(g)
    g.forward(x, store=store)
    g.forward(x, store=store)
    assert RUNS == {"stem": 1, "tokenize": 1, "encoder": 1}
    assert len(list(store.names())) == 3


def test_the_names_a_slice_brings_are_not_the_names_it_gives():
    g = settled(Encoder().frozen(), Probe())
    brought = key_of_node("Encoder", "some digest", None, [("", key_of_input(x))])
    out = walk(g, ["probe"], given={"encoder": Opaque(torch.ones(2, 3))},
               given_keys={"encoder": brought}, naming=True)
    assert out.keys["encoder"] == brought
    assert out.keys["probe"] == key_of_node("Probe", None, None, [("encoder", brought)])
    assert out.keys["probe"] != brought


# -- what the store's users see through a run --

def test_cached_with_no_store_still_runs_and_says_nothing_is_kept(said):
    g = settled(Encoder().frozen().cached(), Probe())
    g.forward(x)
    g.forward(x)
    assert RUNS == {"encoder": 2, "probe": 2}
    assert said().count("nothing is kept") == 1


def test_a_keeper_that_fails_never_kills_the_run(said):
    class Broken:
        def get_many(self, names):
            raise OSError(28, "No space left on device")

        def put(self, name, value, meta=None):
            raise PermissionError(13, "Permission denied")

    g = settled(Encoder().frozen().cached(), Probe())
    y = g.forward(x, store=Broken())
    assert torch.equal(g.forward(x, store=Broken()), y)
    assert RUNS["encoder"] == 2
    assert torch.equal(y, settled(Encoder().frozen(), Probe()).forward(x))
    text = said()
    assert text.count("get_many failed") == 1 and text.count("put failed") == 1


def test_a_store_on_a_bad_path_never_kills_the_run(tmp_path, said):
    (tmp_path / "file").write_text("")
    y = settled(Encoder().frozen().cached(), Probe()).forward(x, store=tmp_path / "file")
    assert y.shape == (2, 2) and "cannot keep" in said()


def test_a_corrupted_value_is_recomputed_in_a_run(store, said):
    g = settled(Encoder().frozen().cached(), Probe())
    y = g.forward(x, store=store)
    (blob, _), = store.blobs()
    path = store.blob_path(blob)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert torch.equal(g.forward(x, store=store), y)
    assert RUNS["encoder"] == 2 and "damaged" in said()
    assert torch.equal(g.forward(x, store=store), y)  # kept again, whole
    assert RUNS["encoder"] == 2


def test_an_output_with_no_codec_is_not_kept_and_stderr_says_why_once(store, said):
    g = Graph.somatize(ToHandle().frozen().cached() >> FromHandle())
    g.forward(x, store=store)
    g.forward(x, store=store)
    assert RUNS["tohandle"] == 2 and list(store.names()) == []
    assert said().count("Handle has no codec") == 1


def test_training_above_a_kept_value_trains_the_head_only(store):
    # what comes back from the store is a leaf: the backward pass stops at it
    head = Probe()
    g = settled(Encoder().frozen().cached(), head)
    for _ in range(2):
        head.lin.weight.grad = None
        y = g.forward(x, store=store, training=True)
        y.sum().backward()
        assert head.lin.weight.grad is not None
    assert RUNS["encoder"] == 1
    assert g["encoder"].lin.weight.grad is None
    kept = store.get(next(store.names())).value
    assert kept.is_leaf and not kept.requires_grad


def test_the_trainer_settles_what_is_frozen_and_keeps_what_is_cached(tmp_path):
    # the seed's case: a head trained over a frozen, cached encoder; epoch 2 reads it back
    from somatize.torch import Trainer

    head = Probe()
    g = Graph.somatize(Encoder().frozen().cached() >> head)
    data = [(torch.randn(4, 4), torch.tensor([0, 1, 0, 1])) for _ in range(3)]
    before = head.lin.weight.detach().clone()
    trainer = Trainer(g, objective=torch.nn.functional.cross_entropy,
                      optimizer=torch.optim.SGD(head.parameters(), lr=0.1), store=tmp_path)
    trainer.fit(data, epochs=2)
    assert RUNS == {"encoder": 3, "probe": 6}
    assert not torch.equal(head.lin.weight, before)
    assert not any(p.requires_grad for p in g["encoder"].parameters())
    assert len(list(Store(tmp_path).names())) == 3
