"""A cached forward that draws random numbers is refused: the value kept would be served
where computing again gives another. What is watched: torch's generator (CUDA's offsets
where CUDA is in use) and the ``torch.Generator``s the module holds, before and after a
miss computes.

    out = drawing_refused("module 'body' (Body)", lambda: body(x), "SomatizeCache(...)")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._errors import Refused
from ..._keys import functions_of


def rng_state(generators: tuple = ()) -> tuple:
    """What torch's random generators are at now (the CPU's state; CUDA's offsets, where
    CUDA is in use; and the state of each of ``generators``): a forward that draws moves
    them."""
    cpu = (torch.default_generator.get_state(), *(g.get_state() for g in generators))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return (*cpu, *(g.get_offset() for g in torch.cuda.default_generators))
    return cpu


def same_rng(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b, strict=True))


def held_generators(holders: list, classes: tuple) -> tuple:
    """The ``torch.Generator``s the modules in ``holders`` (and their children) or a graph
    node hold as attributes, that the code of ``classes`` does not seed itself outside
    ``__init__`` (``self.g.manual_seed(0)``): a forward that draws from one is no function
    of its input, whatever a salt names."""
    if any(_SEEDING & set(fn.__code__.co_names) for who, fn in functions_of(
            classes, ("torch.", "somatize.")) if not who.endswith(".__init__")):
        return ()
    mods = [m for h in holders for m in (h.modules() if isinstance(h, torch.nn.Module)
                                         else [h])]
    return tuple({id(v): v for m in mods for v in vars(m).values()
                  if isinstance(v, torch.Generator)}.values())


_SEEDING = frozenset({"manual_seed", "seed", "set_state", "graphsafe_set_state"})


def drawing_refused(who: str, run: Callable[[], Any], where: str,
                    generators: tuple = ()) -> Any:
    """``run()``, refused if it drew from torch's random generator (or from one of
    ``generators``, those the module holds): its output is then no function of what its
    key names, and a kept one would be served where computing again gives another."""
    before = rng_state(generators)
    out = run()
    if not same_rng(before, rng_state(generators)):
        raise Refused(
            f"{who} draws from torch's random generator in its forward (a dropout in train "
            "mode, torch.rand..., or a torch.Generator it holds, salt or not): its output "
            "is not a function of its input, and a kept one would be served where computing "
            "again gives another. Put it in eval mode (.eval()), seed the generator in its "
            f"forward, or leave it out of {where}")
    return out
