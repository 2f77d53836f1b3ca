"""Every public name is documented: a docstring, and a mention with an example in README.md."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

PUBLIC = ["somatize", "somatize.torch", "somatize.store", "somatize.remote",
          "somatize.lightning"]
LAZY = {"somatize": ["Worker", "Learning"]}  # loaded on first use, so the core stays torch-free


def public_names():
    for modname in PUBLIC:
        module = importlib.import_module(modname)
        for name in [*module.__all__, *LAZY.get(modname, [])]:
            yield modname, name, getattr(module, name)


@pytest.mark.parametrize("modname,name,obj", list(public_names()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_public_name_has_a_docstring_and_a_place_in_the_readme(modname, name, obj):
    assert (inspect.getdoc(obj) or "").strip(), f"{modname}.{name} has no docstring"
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert re.search(rf"\b{re.escape(name)}\b", readme), f"README.md never mentions {name}"


def test_the_public_modules_say_how_to_call_them():
    for modname in PUBLIC:
        doc = inspect.getdoc(importlib.import_module(modname)) or ""
        assert "    " in doc or ">>>" in doc, f"{modname}'s docstring shows no call"
