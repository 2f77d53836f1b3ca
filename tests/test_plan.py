"""Units: consecutive nodes on one worker run in one call; stretches of a wave together."""

from somatize import Done, Graph, Node
from somatize._plan import Unit, units


class N(Node):
    def forward(self, x, ctx):
        return Done(x)


def units_of(g, here=None):
    return units(g.preds, g.plan.order, g.placement.hosts, here)


def test_consecutive_nodes_on_one_host_are_one_stretch():
    g = Graph.somatize(N().at("w") >> N().at("w") >> N().at("w") >> N())
    assert units_of(g) == [[Unit("w", ("n", "n_2", "n_3"))], [Unit(None, ("n_4",))]]


def test_side_by_side_on_two_hosts_is_one_wave_of_two_stretches():
    g = Graph.somatize(N() >> (N().at("a") | N().at("b")) >> N())
    assert units_of(g)[1] == [Unit("a", ("n_2",)), Unit("b", ("n_3",))]


def test_a_stretch_never_swallows_a_node_that_waits_on_something_in_between():
    # x@w -> (y@w | z here) -> v@w : v cannot join x's stretch, z sits between them
    g = Graph.somatize(N().at("w").named("x") >> (N().at("w").named("y") | N().named("z"))
                       >> N().at("w").named("v"))
    got = units_of(g)
    assert got == [[Unit("w", ("x", "y"))], [Unit(None, ("z",))], [Unit("w", ("v",))]]


def test_on_the_worker_itself_every_node_of_its_host_runs_here():
    g = Graph.somatize(N().at("w") >> N().at("w"))
    assert units_of(g, here="w") == [[Unit(None, ("n",))], [Unit(None, ("n_2",))]]


def test_back_and_forth_across_the_cable_is_three_calls():
    g = Graph.somatize(N().at("w") >> N() >> N().at("w"))
    assert [u.host for wave in units_of(g) for u in wave] == ["w", None, "w"]
