"""A picture of the graph: text, DOT, a rendered SVG/PNG, and `somatize show`."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from somatize import Done, Graph, Node


class Body(Node):
    def forward(self, x, ctx):
        return Done(x)


class Head(Node):
    def forward(self, x, ctx):
        return Done(x)


def seeds_graph():
    return Graph.somatize(Body().at("gpu").frozen().cached(salt="a100") >> Head())


def test_describe_lists_each_node_with_its_stage_host_and_marks_and_the_cuts():
    text = seeds_graph().describe(trained=["head"])
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "node", "class", "runs", "on", "marks"]
    assert lines[1].split() == ["0", "body", "Body", "gpu", "frozen", "cached(salt='a100')"]
    assert lines[2].split() == ["1", "head", "Head", "here", "trained"]
    assert lines[-1] == "cuts:  body -> head"


def test_dot_puts_each_stage_in_a_cluster_and_dashes_the_cut():
    text = seeds_graph().dot()
    assert "subgraph cluster_stage0" in text and "subgraph cluster_stage1" in text
    assert '"body" -> "head" [style=dashed' in text
    assert "body\\nBody @ gpu" in text


needs_dot = pytest.mark.skipif(shutil.which("dot") is None and not os.environ.get("CI"),
                               reason="Graphviz is not installed (.ci/run installs it)")


@needs_dot
def test_show_renders_svg_and_png_from_a_script(tmp_path):
    script = tmp_path / "model.py"
    script.write_text(textwrap.dedent("""
        from somatize import Done, Graph, Node

        class Encoder(Node):
            def forward(self, x, ctx):
                return Done(x)

        class Head(Node):
            def forward(self, x, ctx):
                return Done(x)

        g = Graph.somatize(Encoder().at("gpu") >> Head())
    """))
    svg, png, dot = tmp_path / "g.svg", tmp_path / "g.png", tmp_path / "g.dot"
    r = subprocess.run(
        [sys.executable, "-m", "somatize", "show", str(script), "--svg", str(svg),
         "--png", str(png), "--dot", str(dot)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "encoder  Encoder  gpu" in r.stdout
    assert "<svg" in svg.read_text() and ">encoder<" in svg.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "cluster_stage1" in dot.read_text()


def test_show_without_a_graph_says_what_to_build(tmp_path):
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    r = subprocess.run([sys.executable, "-m", "somatize", "show", str(script)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "defines no somatize.Graph" in r.stderr and "Graph.somatize" in r.stderr


def test_the_console_script_and_module_share_one_entry():
    exe = shutil.which("somatize")
    assert exe is not None, "the somatize console script is installed with the package"
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "show" in r.stdout and "store" in r.stdout
