"""The layers, read off every module's imports (inside functions too): the core imports
no layer above it, and no layer imports one above itself.

    core (somatize/_*.py) < store < torch < remote < fed < lightning

``somatize/__init__.py`` wires the defaults into the core's holes and the command-line
entries sit on top; they are not layers.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "somatize"
LAYERS = ["core", "store", "torch", "remote", "fed", "lightning"]
ON_TOP = {"somatize", "somatize.__main__", "somatize._cli", "somatize._store_cli",
          "somatize.worker"}  # the wiring and the command-line entries
NO_TORCH = {"core", "store"}  # what `import somatize` and a store reader load


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    if module in ON_TOP:
        return None
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("store", "torch", "remote", "fed", "lightning"):
        return parts[1]
    return "core"


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, absolute, with its line (relative ones resolved)."""
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_of(source: str, me: str, is_package: bool) -> list[tuple[int, str]]:
    package = me if is_package else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module
            out.append((node.lineno, target))
            # `from . import _holes` imports a module too
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names
                    if (PACKAGE.parent / f"{target}.{a.name}".replace(".", "/")).with_suffix(
                        ".py").exists()]
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_module_imports_a_layer_above_its_own(path):
    me = module_name(path)
    mine = layer_of(me)
    if mine is None:
        return
    wrong = []
    for line, target in imports(path):
        top = target.split(".")[0]
        if top == "somatize":
            theirs = layer_of(target)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"line {line}: {target} ({theirs})")
            if theirs is None and target != "somatize":
                wrong.append(f"line {line}: {target} (an entry point)")
        elif mine in NO_TORCH and top in ("torch", "lightning", "hydra", "numpy"):
            wrong.append(f"line {line}: {target}")
    assert not wrong, (f"{me} is in the {mine} layer and imports from above it: "
                       f"{'; '.join(wrong)}. Plug it in through a hole (somatize/_holes.py)")


def test_the_check_sees_an_upward_import_inside_a_function():
    # the control: the reading above catches what the old engine and node did
    source = ("from . import _holes\n"
              "def run():\n    from .store import open_keeper\n"
              "def wrap():\n    from .torch import node\n    import torch\n")
    found = imports_of(source, "somatize._engine", False)
    assert {(1, "somatize._holes"), (3, "somatize.store"), (5, "somatize.torch"),
            (6, "torch")} <= set(found)
    assert layer_of("somatize.store") == "store" and layer_of("somatize._engine") == "core"


# -- no circle inside the core ---------------------------------------------------------
def _under_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def run_time_imports(source: str, me: str, is_package: bool) -> list[tuple[int, str]]:
    """``imports_of``, less what sits under ``if TYPE_CHECKING:`` (never imported at run
    time); imports inside functions count, since calling the function imports them."""
    tree = ast.parse(source)
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _under_type_checking(node):
            skipped |= {n.lineno for part in node.body for n in ast.walk(part)
                        if isinstance(n, (ast.Import, ast.ImportFrom))}
    return [(line, t) for line, t in imports_of(source, me, is_package) if line not in skipped]


def circle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of ``edges`` (module -> the modules it imports) as a path that returns
    to its start, or None when there is none."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, todo = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(sorted(edges.get(nxt, ()))))
    return None


def core_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Who imports whom among the core's modules (``somatize._*``), by module name."""
    return {me: {t for _, t in run_time_imports(src, me, False) if t in sources and t != me}
            for me, src in sources.items()}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def package_imports(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Who imports whom in the package, by module name (``sources``: module -> (source,
    is a package)). ``from . import _holes`` imports the module ``_holes``, not the
    package; ``from .. import Split`` imports the package."""
    edges = {}
    for me, (src, is_package) in sources.items():
        package = me if is_package else me.rpartition(".")[0]
        tree = ast.parse(src)
        skipped = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _under_type_checking(node):
                skipped |= {id(n) for part in node.body for n in ast.walk(part)}
        out = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module
                subs = {f"{target}.{a.name}" for a in node.names
                        if f"{target}.{a.name}" in sources or _is_module(f"{target}.{a.name}")}
                out |= subs
                if len(subs) < len(node.names):
                    out.add(target)
        edges[me] = {t for t in out if t in sources and t != me}
    return edges


def test_no_module_of_the_package_imports_in_a_circle():
    sources = {module_name(p): (p.read_text(), p.name == "__init__.py") for p in MODULES}
    assert len(sources) > 100
    found = circle(package_imports(sources))
    assert found is None, (f"somatize imports in a circle: {' -> '.join(found)}. Move what "
                           "both sides need below both, or pass it in")


def test_the_package_circle_check_counts_functions_and_packages_but_not_type_checking():
    # the control: the circle the placed route had (_placed <-> _call, one side inside a
    # function), and a module importing its own package's name
    crafted = {
        "somatize.torch._placed": ("from ._call import dumps\n", False),
        "somatize.torch._call": ("def run():\n    from ._placed import _apply\n", False),
    }
    assert circle(package_imports(crafted)) == [
        "somatize.torch._call", "somatize.torch._placed", "somatize.torch._call"]
    crafted["somatize.torch._call"] = ("from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from ._placed import X\n", False)
    assert circle(package_imports(crafted)) is None
    package = {
        "somatize.torch": ("from ._mirror import Mirror\n", True),
        "somatize.torch._mirror": ("def f():\n    from . import Split\n", False),
        "somatize.torch._holes": ("", False),
        "somatize.torch._user": ("from . import _holes\n", False),
    }
    assert circle(package_imports(package)) == [
        "somatize.torch", "somatize.torch._mirror", "somatize.torch"]
    # a submodule taken by name from a package is the submodule's import alone
    assert package_imports(package)["somatize.torch._user"] == {"somatize.torch._holes"}


def test_the_core_has_no_import_circle():
    sources = {module_name(p): p.read_text() for p in sorted(PACKAGE.glob("_*.py"))
               if p.name != "__init__.py"}
    assert len(sources) > 10
    found = circle(core_imports(sources))
    assert found is None, (f"the core imports in a circle: {' -> '.join(found)}. Move what "
                           "both sides need below both, or pass it in")


def test_the_circle_check_sees_a_circle_through_a_function_but_not_type_checking():
    # the control: the circle the old graph had (_graph -> _engine -> _learning -> _graph),
    # two of its imports hidden inside functions
    crafted = {
        "somatize._graph": "from ._plan import plan\n"
                           "class Graph:\n    def forward(self):\n"
                           "        from ._engine import run_graph\n",
        "somatize._engine": "from ._learning import Learning\n",
        "somatize._learning": "def around(g):\n    from ._graph import Graph\n",
        "somatize._plan": "from ._errors import GraphError\n",
        "somatize._errors": "",
    }
    assert circle(core_imports(crafted)) == [
        "somatize._engine", "somatize._learning", "somatize._graph", "somatize._engine"]
    # the same import, made for the type checker only, closes no circle
    crafted["somatize._learning"] = ("from typing import TYPE_CHECKING\n"
                                     "if TYPE_CHECKING:\n    from ._graph import Graph\n")
    assert circle(core_imports(crafted)) is None
    crafted["somatize._learning"] = ("import typing\n"
                                     "if typing.TYPE_CHECKING:\n    from . import _graph\n")
    assert circle(core_imports(crafted)) is None
    # a module importing itself through the package, and a two-step circle
    assert circle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_file_of_the_package_is_over_400_lines():
    # a file that long holds two jobs: cut it along them (issue 25)
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}, long
