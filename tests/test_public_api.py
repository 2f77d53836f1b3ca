"""Every public name is documented: a docstring, and a mention with an example in README.md
or a page under docs/ that README.md links."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PUBLIC = ["somatize", "somatize.torch", "somatize.store", "somatize.remote",
          "somatize.lightning", "somatize.fed"]
LAZY = {"somatize": ["Worker", "Learning"]}  # loaded on first use, so the core stays torch-free


def public_names():
    for modname in PUBLIC:
        module = importlib.import_module(modname)
        for name in [*module.__all__, *LAZY.get(modname, [])]:
            yield modname, name, getattr(module, name)


@pytest.mark.parametrize("modname,name,obj", list(public_names()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_public_name_has_a_docstring_and_a_place_in_the_readme_or_its_docs(modname, name, obj):
    assert (inspect.getdoc(obj) or "").strip(), f"{modname}.{name} has no docstring"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert any(re.search(rf"\b{re.escape(name)}\b", p.read_text()) for p in pages), (
        f"neither README.md nor docs/*.md mentions {name}: document it with an example")


def test_the_readme_links_every_page_under_docs():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
                if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"README.md links none of {unlinked}: add a line to its map"


def test_the_public_modules_say_how_to_call_them():
    for modname in PUBLIC:
        doc = inspect.getdoc(importlib.import_module(modname)) or ""
        assert "    " in doc or ">>>" in doc, f"{modname}'s docstring shows no call"
