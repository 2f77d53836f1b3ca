"""``somatize show``: print and draw the graph a script or module builds.

    somatize show my_model.py --svg graph.svg
    somatize show examples/digits_graph.py     # digits_graph() -> Graph, with its defaults
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import runpy
import sys
from pathlib import Path

from ._describe import describe, dot, render
from ._errors import SomatizeError
from ._graph import Graph


def _find_graph(namespace: dict, where: str):
    """The first Graph at module level; else what the first function of that module
    annotated ``-> Graph`` builds, called with its defaults."""
    graphs = [(k, v) for k, v in namespace.items() if isinstance(v, Graph)]
    if graphs:
        return graphs[0][1]
    for v in namespace.values():
        if (inspect.isfunction(v) and v.__module__ == namespace.get("__name__")
                and inspect.signature(v).return_annotation in (Graph, "Graph")
                and all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                        for p in inspect.signature(v).parameters.values())):
            return v()
    raise SomatizeError(
        f"{where} defines no somatize.Graph at module level, nor a function annotated "
        "`-> Graph` that needs no arguments: build one there, e.g. "
        "`g = Graph.somatize(Body() >> Head())`"
    )


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
