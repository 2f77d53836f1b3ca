"""A picture of a graph: text, and Graphviz DOT (rendered to SVG/PNG where ``dot`` exists).

    print(g.describe(trained={"body"}))
    somatize show my_model.py --svg graph.svg
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from ._errors import SomatizeError
from ._node import kind_of
from ._stages import cut, levels


def _marks(g, n: str, trained: set[str]) -> str:
    marks = []
    if n in g.memory.frozen:
        marks.append("frozen")
    if n in g.memory.cached:
        salt = g.memory.cached[n]
        marks.append(f"cached(salt={salt!r})" if salt else "cached")
    if n in trained:
        marks.append("trained")
    return " ".join(marks)


def describe(g, trained: Iterable[str] = ()) -> str:
    """One line per node: stage, id, class, host, marks; then the cut edges."""
    trained = set(trained)
    level = levels(g, trained)
    rows = [("stage", "node", "class", "runs on", "marks")]
    for n in g.plan.order:
        rows.append((str(level[n]), n, kind_of(g.catalog[n]), g.placement.get(n) or "here",
                     _marks(g, n, trained)))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(width[i]) for i in range(4)) + "  " + r[4] for r in rows]
    cuts = [f"{p} -> {c}" for p, c in g.edges if cut(g, trained, p, c)]
    edges = [f"{p} -> {c}" for p, c in g.edges]
    lines.append(f"edges: {', '.join(edges) or 'none'}")
    lines.append(f"cuts:  {', '.join(cuts) or 'none'}")
    return "\n".join(line.rstrip() for line in lines)


def _q(s: str) -> str:
    return '"' + s.replace('"', '\\"') + '"'


def dot(g, trained: Iterable[str] = ()) -> str:
    """The graph as DOT: one cluster per stage, nodes coloured by host, cut edges dashed."""
    trained = set(trained)
    level = levels(g, trained)
    palette = ["#dbeafe", "#fde68a", "#bbf7d0", "#fbcfe8", "#ddd6fe", "#fed7aa"]
    hosts = [None, *g.placement.workers()]
    out = ["digraph somatize {", "  rankdir=LR;", '  node [shape=box, style="rounded,filled"];']
    for k in range(max(level.values(), default=-1) + 1):
        out.append(f"  subgraph cluster_stage{k} {{")
        out.append(f'    label="stage {k}"; style=dashed;')
        for n in g.plan.order:
            if level[n] != k:
                continue
            host = g.placement.get(n)
            label = f"{n}\\n{kind_of(g.catalog[n])} @ {host or 'here'}"
            marks = _marks(g, n, trained)
            if marks:
                label += f"\\n[{marks}]"
            color = palette[hosts.index(host) % len(palette)]
            out.append(f"    {_q(n)} [label={_q(label)}, fillcolor={_q(color)}];")
        out.append("  }")
    for p, c in g.edges:
        style = ' [style=dashed, color="#dc2626", label="cut"]' if cut(g, trained, p, c) else ""
        out.append(f"  {_q(p)} -> {_q(c)}{style};")
    out.append("}")
    return "\n".join(out) + "\n"


def render(dot_text: str, path: str | Path) -> bool:
    """Render DOT to ``path`` (format from its suffix) with Graphviz; False when absent."""
    exe = shutil.which("dot")
    if exe is None:
        return False
    fmt = Path(path).suffix.lstrip(".") or "svg"
    subprocess.run([exe, f"-T{fmt}", "-o", str(path)], input=dot_text.encode(), check=True,
                   timeout=60)
    return True


def _find_graph(namespace: dict, where: str):
    from ._graph import Graph

    graphs = [(k, v) for k, v in namespace.items() if isinstance(v, Graph)]
    if not graphs:
        raise SomatizeError(
            f"{where} defines no somatize.Graph at module level: build one there, e.g. "
            "`g = Graph.somatize(Body() >> Head())`"
        )
    return graphs[0][1]


def show_main(argv: list[str]) -> int:
    """``somatize show PATH|MODULE``: print the graph a script or module builds, and draw it."""
    ap = argparse.ArgumentParser(prog="somatize show", description=show_main.__doc__)
    ap.add_argument("target", help="a .py file or an importable module that builds a Graph")
    ap.add_argument("--trained", default="", help="comma-separated ids trained where they run")
    ap.add_argument("--dot", help="write the DOT text here")
    ap.add_argument("--svg", help="render an SVG here (needs Graphviz)")
    ap.add_argument("--png", help="render a PNG here (needs Graphviz)")
    args = ap.parse_args(argv)
    try:
        if args.target.endswith(".py") or Path(args.target).is_file():
            ns = runpy.run_path(args.target, run_name="__somatize_show__")
        else:
            ns = vars(importlib.import_module(args.target))
        g = _find_graph(ns, args.target)
    except SomatizeError as e:
        print(f"somatize show: {e}", file=sys.stderr)
        return 1
    trained = [t for t in args.trained.split(",") if t]
    print(describe(g, trained))
    text = dot(g, trained)
    if args.dot:
        Path(args.dot).write_text(text)
    for path in (args.svg, args.png):
        if path and not render(text, path):
            print("somatize show: Graphviz `dot` is not installed; wrote no picture "
                  "(apt-get install graphviz)", file=sys.stderr)
            return 1
    return 0
