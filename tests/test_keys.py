"""Keys: the name of a value, a Merkle hash over the recipe (no torch needed but for tensors)."""

import torch

import somatize.torch  # noqa: F401  (registers the tensor's codec)
from somatize import Opaque
from somatize._keys import changed, digest, fingerprint, key_of_input, key_of_node


def test_the_pieces_of_a_recipe_cannot_run_into_each_other():
    assert digest(["ab", "c"]) != digest(["a", "bc"])
    assert digest(["ab", ""]) != digest(["a", "b"])
    assert key_of_node("ab", "c", None, [("p", "k")]) != key_of_node("a", "bc", None, [("p", "k")])
    p = [("p", "k")]
    assert key_of_node("Enc", None, "ab", p) != key_of_node("Enc", "a", "b", p)


def test_a_name_is_blake3_over_length_prefixed_pieces_so_stores_written_before_still_match():
    import struct

    from blake3 import blake3

    stream = b"".join(struct.pack("<Q", len(p)) + p for p in [b"node", b"Enc", b"", b"k0"])
    assert digest(["node", "Enc", "", b"k0"]) == blake3(stream).hexdigest()


def test_the_same_recipe_is_the_same_name_every_time():
    k = key_of_node("Enc", "digest", "salt", [("root", "k0")])
    assert all(key_of_node("Enc", "digest", "salt", [("root", "k0")]) == k for _ in range(3))
    assert key_of_node("Enc", "other", "salt", [("root", "k0")]) != k
    assert key_of_node("Enc", "digest", None, [("root", "k0")]) != k
    assert key_of_node("Enc", "digest", "salt", [("root", "k1")]) != k


def test_only_a_root_is_named_by_its_content():
    x = torch.arange(12.0).reshape(3, 4)
    assert key_of_input(x) == key_of_input(x.clone()) == key_of_input(Opaque(x))
    assert key_of_input(x) != key_of_input(x + 1)
    assert key_of_input(x) != key_of_input(x.reshape(4, 3))  # same bytes, another shape
    assert key_of_input(x) != key_of_input(x.double())  # another dtype
    # nested values are named by content too, and their pieces do not run into each other
    assert key_of_input({"a": [1, 2]}) == key_of_input({"a": [1, 2]})
    assert key_of_input(["ab", "c"]) != key_of_input(["a", "bc"])
    assert key_of_input([1, 2]) != key_of_input((1, 2))
    assert key_of_input(1) != key_of_input(1.0) != key_of_input(True)


def test_a_node_key_is_not_a_hash_of_the_data():
    # the name below a root is known before anything runs: hashes of hashes
    big = torch.randn(1000, 100)
    k_root = key_of_input(big)
    assert key_of_node("Enc", None, None, [("x", k_root)]) == key_of_node(
        "Enc", None, None, [("x", key_of_input(big.clone()))])


def test_an_input_with_no_codec_has_no_name():
    class Handle:
        pass

    assert key_of_input(Handle()) is None
    assert key_of_input(Opaque(Handle())) is None
    assert key_of_input({"h": Handle()}) is None
    assert key_of_node("Enc", None, None, [("x", None)]) is None


def test_a_fan_in_is_named_by_its_predecessors_ids_too():
    a = key_of_node("Join", None, None, [("left", "k1"), ("right", "k2")])
    b = key_of_node("Join", None, None, [("right", "k1"), ("left", "k2")])
    assert a != b


model = 1  # a global of the same name as an attribute below (the co_names bug)


class UsesAttr:
    def __init__(self):
        self.model = None

    def forward(self, x, ctx):
        return self.model(x)


class UsesGlobal:
    def forward(self, x, ctx):
        return model + x


def test_an_attribute_does_not_pull_a_global_of_its_name_into_the_fingerprint():
    global model
    before_attr, before_global = fingerprint(UsesAttr), fingerprint(UsesGlobal)
    model = 2
    try:
        assert fingerprint(UsesAttr) == before_attr
        # a global the code really loads is read, and its change is seen
        assert changed(before_global, fingerprint(UsesGlobal)) == ["UsesGlobal.forward"]
    finally:
        model = 1


def test_the_fingerprint_says_which_method_changed():
    class A:
        def forward(self, x, ctx):
            return x + 1

        def other(self):
            return 0

    old = fingerprint(A)

    class A:  # noqa: F811  (the same class name, another body)
        def forward(self, x, ctx):
            return x + 2

        def other(self):
            return 0

    assert [c.split(".")[-2:] for c in changed(old, fingerprint(A))] == [["A", "forward"]]


def test_the_autocast_state_is_in_every_key_and_off_changes_nothing():
    p = [("", "k")]
    plain = key_of_node("Enc", "s", None, p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = key_of_node("Enc", "s", None, p)
    with torch.autocast("cpu", dtype=torch.float16):
        half = key_of_node("Enc", "s", None, p)
    assert len({plain, low, half}) == 3
    assert key_of_node("Enc", "s", None, p) == plain


class Leaf(torch.nn.Module):
    def forward(self, x):
        return x


def test_the_fingerprint_of_a_tree_covers_each_class_once():
    both = fingerprint(torch.nn.Sequential, Leaf, Leaf)
    assert [k for k in both if k.startswith("Leaf.")] == ["Leaf.forward"]
    assert fingerprint(Leaf) == both  # torch's own classes are torch's version, not code
