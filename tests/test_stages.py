"""Stages, as the seeds define them — and this file imports no torch (a test checks it)."""

import os
import subprocess
import sys
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from somatize import Done, Graph, GraphError, Node, Placement, cut, stages
from somatize._stages import levels


class N(Node):
    def forward(self, x, ctx):
        return Done(x)


class Body(N):
    pass


class Head(N):
    pass


def graph_of(n, edges, hosts):
    return Graph({f"n{i}": N() for i in range(n)}, [(f"n{p}", f"n{c}") for p, c in edges],
                 Placement({f"n{i}": h for i, h in hosts.items() if h}))


@st.composite
def dags(draw):
    n = draw(st.integers(1, 9))
    pairs = list(combinations(range(n), 2))
    edges = [e for e in pairs if draw(st.booleans())] if pairs else []
    hosts = {i: draw(st.sampled_from([None, None, "a", "b"])) for i in range(n)}
    trained = {f"n{i}" for i in range(n) if draw(st.integers(0, 3)) == 0}
    return graph_of(n, edges, hosts), trained


def most_cuts_to(g, trained, n):
    """Brute force: the most cut edges on any path ending at n."""
    best = 0
    for p in g.preds[n]:
        best = max(best, most_cuts_to(g, trained, p) + cut(g, trained, p, n))
    return best


@settings(max_examples=300, deadline=None)
@given(dags())
def test_every_cut_crosses_a_boundary_none_stays_inside_and_none_goes_backwards(case):
    g, trained = case
    level = levels(g, trained)
    for p, c in g.edges:
        if cut(g, trained, p, c):
            assert level[c] > level[p]  # crosses a boundary, so it is inside no stage
        assert level[c] >= level[p]  # nothing goes backwards


@settings(max_examples=300, deadline=None)
@given(dags())
def test_the_stages_are_the_right_ones_not_just_valid_ones(case):
    g, trained = case
    out = stages(g, trained)
    assert set().union(*out) == set(g.ids)
    assert sum(len(s) for s in out) == len(g.ids)
    assert all(out), "no stage is empty"
    for k, stage in enumerate(out):
        for n in stage:
            assert most_cuts_to(g, trained, n) == k
    most = max(most_cuts_to(g, trained, n) for n in g.ids)
    assert len(out) == most + 1


@settings(max_examples=100, deadline=None)
@given(dags())
def test_a_graph_with_no_cut_is_one_stage(case):
    g, _ = case
    flat = Graph(dict(g.catalog), g.edges)  # nothing placed, nothing trained
    assert stages(flat, []) == [set(flat.ids)]


def test_the_seeds_body_and_head():
    g = Graph.somatize(Body().at("gpu") >> Head())
    assert stages(g, []) == [{"body"}, {"head"}]  # the cable cuts
    assert stages(g, ["body"]) == [{"body"}, {"head"}]
    here = Graph.somatize(Body() >> Head())
    assert stages(here, []) == [{"body", "head"}]
    assert stages(here, ["body"]) == [{"body"}, {"head"}]  # a trainer cuts too
    assert stages(here, ["body", "head"]) == [{"body", "head"}]


def test_a_lone_trained_node_is_one_stage():
    g = Graph.somatize(Body())
    assert stages(g, ["body"]) == [{"body"}]


def test_side_by_side_on_two_hosts_is_one_stage():
    g = Graph.somatize(Body().at("a") | Head().at("b"))
    assert stages(g, []) == [{"body", "head"}]


def test_trained_naming_a_node_not_in_the_graph_is_refused():
    g = Graph.somatize(Body() >> Head())
    with pytest.raises(GraphError, match="'tail'.*not in the graph"):
        stages(g, ["tail"])


def test_stage_tests_import_no_torch():
    if os.environ.get("SOMATIZE_NO_TORCH_CHECK"):
        assert "torch" not in sys.modules, "the stage tests imported torch"
        return
    here = os.path.dirname(__file__)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
         "-o", "addopts=", os.path.join(here, "test_stages.py")],
        env={**os.environ, "SOMATIZE_NO_TORCH_CHECK": "1"}, capture_output=True, text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
