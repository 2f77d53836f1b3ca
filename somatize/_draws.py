"""Draws that code run on a worker (a placed module's forward, a graph's nodes) makes from
Python's or numpy's global generator there.

torch's random state travels with each call (or each call gets a seed of its own); these
two do not: a forward that draws from them over there draws other numbers than one piece
does here (HF's older layerdrop, ``random.random() < p``), so the run is refused, naming
the module. Their states are read on a module's first calls and then one call in
``EVERY`` (reading them costs 20 and 90 us): a forward that draws on some calls only may
be seen late.

    before = seen(placed.__dict__)   # None on a call that is not looked at
    out = forward(...)
    refuse_drawn("the forward of 'encoder'", "'encoder'", before)
"""

from __future__ import annotations

import random
import sys

from ._errors import Refused

FIRST, EVERY = 8, 32  # calls looked at: a module's first ones, then one in EVERY


def seen(counts: dict) -> tuple | None:
    """The two generators' states now, on a call looked at (``counts`` keeps how many
    were made); None on the others."""
    n = counts.get("drawn_calls", 0)
    counts["drawn_calls"] = n + 1
    if n >= FIRST and n % EVERY:
        return None
    return _states()


def _states() -> tuple:
    np = sys.modules.get("numpy")  # (imported only if some code here uses it)
    state = None
    if np is not None:
        state = np.random.mtrand._rand.get_state(legacy=False)
        state = (state["state"]["pos"], state["state"]["key"].tobytes(), state["has_gauss"],
                 state["gauss"])
    return random.getstate(), state


def refuse_drawn(who: str, name: str, before: tuple | None) -> None:
    """Refuse code that drew from Python's or numpy's global generator: ``who`` ran it
    (``"the forward of 'encoder'"``), ``name`` is what to leave unplaced."""
    if before is None:
        return
    after = _states()
    # (numpy imported by the forward itself, for the first time: nothing drawn before it)
    which = [what for what, then, now in zip(("Python's random", "numpy.random"), before,
                                             after, strict=True)
             if then is not None and then != now]
    if which:
        raise Refused(
            f"{who} drew from {' and '.join(which)} (its global generator) "
            f"on the worker that runs it: that generator's state here does not travel there "
            f"(torch's does), so it drew other numbers than one piece would. Draw with torch "
            f"(torch.rand(()) < p instead of random.random() < p), or leave {name} "
            "unplaced")

