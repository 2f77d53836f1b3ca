"""The graph and the local engine: composition, ids, values, plan, errors."""

import pytest

from somatize import (
    ContractError,
    Done,
    Graph,
    GraphError,
    MissingInput,
    Node,
    Opaque,
)


class Add(Node):
    def __init__(self, k=1):
        self.k = k

    def forward(self, x, ctx):
        return Done(x + self.k)


class Double(Node):
    def forward(self, x, ctx):
        return Done(x * 2)


class Sum(Node):
    def forward(self, x, ctx):
        return Done(sorted(x.items()))


class Seen(Node):
    """Records what it was handed and where it stood."""

    def __init__(self):
        self.seen = []

    def forward(self, x, ctx):
        self.seen.append((x, ctx))
        return Done(Opaque(x))


def test_ids_are_lower_cased_class_names_numbered_in_composition_order():
    g = Graph.somatize(Add() >> Add() >> Double() >> Add())
    assert g.ids == ("add", "add_2", "double", "add_3")
    assert g.edges == (("add", "add_2"), ("add_2", "double"), ("double", "add_3"))


def test_named_sets_the_id_and_numbering_steps_around_it():
    g = Graph.somatize(Add().named("add") >> Add() >> Add().named("enc"))
    assert g.ids == ("add", "add_2", "enc")


def test_a_duplicate_explicit_id_names_both_and_says_what_to_do():
    with pytest.raises(GraphError, match=r"two nodes are named 'x' \(Add and Double\).*rename"):
        Graph.somatize(Add().named("x") >> Double().named("x"))


def test_a_lone_node_is_a_graph():
    g = Graph.somatize(Double())
    assert g.ids == ("double",) and g.edges == ()
    assert g.forward(4) == 8


def test_sequence_and_side_by_side_make_a_fan_in_keyed_by_predecessor():
    g = Graph.somatize((Add(1) | Double()) >> Sum())
    assert g.preds["sum"] == ("add", "double")
    assert g.forward(5) == [("add", 6), ("double", 10)]


def test_a_diamond_feeds_both_branches_what_feeds_the_group():
    g = Graph.somatize(Add(1) >> (Add(10) | Double()) >> Sum())
    assert g.plan.waves == (("add",), ("add_2", "double"), ("sum",))
    assert g.forward(1) == [("add_2", 12), ("double", 4)]


def test_several_sinks_answer_a_dict_by_sink():
    g = Graph.somatize(Add(1) >> (Add(10) | Double()))
    assert g.forward(1) == {"add_2": 12, "double": 4}


def test_side_by_side_roots_are_all_fed_the_input():
    g = Graph.somatize(Add(1) | Double())
    assert g.roots == ("add", "double")
    assert g.forward(3) == {"add": 4, "double": 6}


def test_feeds_give_each_root_its_own_input_and_a_missing_one_is_named():
    g = Graph.somatize((Add(1) | Double()) >> Sum())
    assert g.forward(feeds={"add": 1, "double": 10}) == [("add", 2), ("double", 20)]
    with pytest.raises(MissingInput, match="'double'.*feeds"):
        g.forward(feeds={"add": 1})


def test_a_node_is_handed_bare_values_even_inside_a_fan_in():
    a, b, s = Seen(), Seen(), Seen()
    g = Graph.somatize((a | b.named("b")) >> s.named("s"))
    payload = object()
    out = g.forward(Opaque(payload))
    assert a.seen[0][0] is payload
    fan_in = s.seen[0][0]
    assert fan_in == {"seen": payload, "b": payload}
    assert not any(isinstance(v, Opaque) for v in fan_in.values())
    assert out is fan_in  # the sink's bare value comes back


def test_ctx_says_node_host_and_training():
    s = Seen()
    g = Graph.somatize(s)
    g.forward(1, training=True)
    ctx = s.seen[0][1]
    assert (ctx.node, ctx.host, ctx.training) == ("seen", None, True)
    g.forward(1)
    assert s.seen[1][1].training is False


def test_declarations_chain_and_land_in_placement_and_memory():
    body = Add().at("gpu").frozen().cached(salt="fp16")
    g = Graph.somatize(body >> Double())
    assert g.placement.get("add") == "gpu" and g.placement.get("double") is None
    assert g.placement.workers() == ("gpu",)
    assert g.memory.frozen == {"add"}
    assert g.memory.cached == {"add": "fp16"}


def test_a_node_that_never_calls_super_init_still_works():
    class Bare(Node):
        def __init__(self):
            self.k = 3  # no super().__init__()

        def forward(self, x, ctx):
            return Done(x * self.k)

    assert Graph.somatize(Bare().at(None) >> Bare()).forward(1) == 9


def test_composing_something_that_is_not_a_node_says_what_to_do():
    with pytest.raises(GraphError, match="'int'.*not a Node.*forward"):
        Add() >> 3
    with pytest.raises(GraphError, match="'str'"):
        Graph.somatize("hello")


def test_a_forward_that_does_not_return_done_names_the_node():
    class Sloppy(Node):
        def forward(self, x, ctx):
            return x

    with pytest.raises(ContractError, match=r"'sloppy' \(Sloppy\).*return Done\(value\)"):
        Graph.somatize(Add() >> Sloppy()).forward(1)


def test_a_cycle_is_refused_and_named():
    a, b = Add(), Double()
    with pytest.raises(GraphError, match="cycle through add, double"):
        Graph.somatize(a >> b >> a)


def test_the_same_node_object_twice_is_one_node():
    shared = Add()
    g = Graph.somatize(Double() >> (shared | Add(5)) >> Sum())
    assert g.ids == ("double", "add", "add_2", "sum")
    assert g.forward(1) == [("add", 3), ("add_2", 7)]


def test_waves_hold_nodes_that_depend_on_none_of_each_other():
    g = Graph.somatize(Add() >> (Double() | Add() >> Add()) >> Sum())
    for wave in g.plan.waves:
        for n in wave:
            assert not (g.ancestors(n) & set(wave))
    assert g.plan.order.index("sum") == len(g.ids) - 1


def test_an_unknown_node_id_lists_the_real_ones():
    g = Graph.somatize(Add() >> Double())
    with pytest.raises(GraphError, match=r"no node 'head'.*\['add', 'double'\]"):
        g["head"]
