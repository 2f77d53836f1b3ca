"""The Keeper hole: what keeps values by name. ``somatize.store.Store`` fills it.

A name is ``value/<key>`` for a node's output or ``artifact/<kind>/<id>`` for
anything else. A miss is ``None``, never an error.

    keeper.put("value/" + k, value, meta={"node": "encoder"})
    [hit, None] = keeper.get_many(["value/" + k, "value/" + other])
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable


class Kept(NamedTuple):
    """A value found under a name, with what was written beside it."""

    value: Any
    meta: Mapping[str, str]


@runtime_checkable
class Keeper(Protocol):
    """What keeps values by name (a directory store, or your own)."""

    def get_many(self, names: Sequence[str]) -> list[Kept | None]:
        """Look up several names; answers in the order asked, ``None`` for a miss."""

    def put(self, name: str, value: Any, meta: Mapping[str, str] | None = None) -> bool:
        """Keep ``value`` under ``name``; False when it cannot be kept (said on stderr)."""

    def names(self, prefix: str = "") -> Iterator[str]:
        """Every name kept, under ``prefix``."""


def items_of_keeper(keeper: Any) -> Any:
    """What ``keeper`` offers for rows kept one by one (per item, docs/per-item.md): its
    ``items()``, a ``somatize.store.Items``; None for a keeper without that method. A
    keeper of your own holds items by answering ``items()`` as ``Store`` does."""
    if not callable(getattr(keeper, "get_many", None)):
        return None  # not a keeper (a dict's items() is something else)
    offer = getattr(keeper, "items", None)
    got = offer() if callable(offer) else None
    return got if callable(getattr(got, "space", None)) else None
