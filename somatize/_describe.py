"""A picture of a graph: text, and Graphviz DOT (rendered to SVG/PNG where ``dot`` exists).
Functions over a graph's facts; ``Graph.describe`` and ``Graph.dot`` call them.

    print(describe(g, trained={"body"}))     # or g.describe(trained={"body"})
    render(dot(g), "graph.svg")
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

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
