"""The library's exceptions: one base class, each message naming the node, worker
or file at fault and saying what to do.

    try:
        g.forward(x)
    except somatize.SomatizeError as e:
        print(e)
"""

from __future__ import annotations


class SomatizeError(Exception):
    """Base class of every error somatize raises."""


class GraphError(SomatizeError):
    """A graph cannot be built as written (a cycle, a duplicate id, not a node)."""


class ContractError(SomatizeError):
    """A node broke its contract (its forward did not return ``Done``)."""


class MissingInput(SomatizeError):
    """A root of the graph (or of a stretch) was given no input."""


class Refused(SomatizeError):
    """A run was refused before anything ran (a cache after a cut, settled-and-trained...)."""


class NotSettled(Refused):
    """A node declared ``.frozen()`` has state and no digest: call ``somatize.torch.freeze(g)``."""


class Lost(SomatizeError):
    """A value stayed behind in another process and was read from here."""


class WorkerError(SomatizeError):
    """A worker died, timed out, or raised inside a node over there."""


def check_workers(workers: object) -> None:
    """Refuse ``workers=`` that is not a ``{host: Worker}`` mapping (None is fine): the one
    check behind ``Graph.forward``, ``Step``, ``Session`` and the runtime."""
    from collections.abc import Mapping

    if workers is not None and not isinstance(workers, Mapping):
        raise WorkerError(f"workers= takes a dict {{host: Worker}}, not a "
                          f"{type(workers).__name__}: e.g. workers={{'gpu': "
                          "Worker.at('127.0.0.1:7000')}}")


class NoGradient(SomatizeError):
    """Local parameters got no gradient in a backward pass."""


class StoreError(SomatizeError):
    """A store could not be opened or used as asked."""


# a traceback names them as the user imports them: somatize.Refused, not somatize._errors.Refused
for _cls in (SomatizeError, GraphError, ContractError, MissingInput, Refused, NotSettled, Lost,
             WorkerError, NoGradient, StoreError):
    _cls.__module__ = "somatize"
del _cls
