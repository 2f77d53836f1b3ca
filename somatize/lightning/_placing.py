"""What ``place=`` may name: submodules of the LightningModule, by the paths
``get_submodule`` takes, none inside another, and no weight tied across the cut.

    modules = placed_modules(model, {"encoder": "worker"})   # {path: module}, or Refused
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

import torch

from .._errors import Refused


def placed_modules(model: torch.nn.Module, place: Mapping[str, str]
                   ) -> dict[str, torch.nn.Module]:
    """The submodules ``place`` names, by path; refused naming the fix when one is not."""
    names = [n for n, _ in model.named_modules() if n]
    out = {}
    for path, host in place.items():
        if not isinstance(host, str) or not host:
            raise Refused(f"place[{path!r}] = {host!r}: name the worker it runs on, e.g. "
                          f"place={{{path!r}: 'worker'}}")
        try:
            m = model.get_submodule(path) if path else model
        except AttributeError:
            near = difflib.get_close_matches(path, names, n=5) or names[:8]
            raise Refused(
                f"place names {path!r}, which is not a submodule of {type(model).__name__}; "
                f"its submodules include {near}. Give paths as get_submodule takes them "
                "('encoder', 'model.transformer')") from None
        if m is model:
            raise Refused("place names the LightningModule itself: place one of its submodules "
                          f"(e.g. {names[:3]}); its training_step and loss stay here")
        out[path] = m
    for a in out:
        for b in out:
            if a != b and b.startswith(a + "."):
                raise Refused(f"place names {a!r} and {b!r}, which is inside it: place one")
    return out


def refuse_tied(model: torch.nn.Module, modules: Mapping[str, torch.nn.Module]) -> None:
    """Refuse a parameter of a placed module that is also used outside it."""
    owner = {id(p): path for path, m in modules.items() for p in m.parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        path = owner.get(id(p))
        if path is not None and not (name == path or name.startswith(path + ".")):
            raise Refused(
                f"parameter {name!r} is the same tensor as one inside {path!r}, which is "
                "placed on a worker: a weight tied across the cut would be trained in two "
                f"places. Untie it, or place a module that holds both ({name!r} and {path!r})")
