"""What the engine is handed for ``store=``: a keeper that never raises. A keeper that
fails never kills the run: its failure is said once, a lookup reads as a miss and a
value not kept is recomputed next time.

    keeper = open_keeper("/scratch/soma")        # or a Store, or any Keeper, or None
    [hit, None] = keeper.get_many(["value/" + k, "value/" + other])
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .._errors import StoreError
from .._keeper import Kept, items_of_keeper
from .._say import say_once
from ._store import Store


class Guarded:
    """A keeper that never raises: a failure is said once and read as a miss / not kept."""

    def __init__(self, keeper: Any):
        self.keeper = keeper

    def __repr__(self) -> str:
        return f"Guarded({self.keeper!r})"

    def get_many(self, names: Sequence[str]) -> list[Kept | None]:
        names = list(names)
        try:
            got = list(self.keeper.get_many(names))
            if len(got) != len(names):
                raise StoreError(f"answered {len(got)} results for {len(names)} names")
        except Exception as e:
            self._said("get_many", e)
            return [None] * len(names)
        return [k if isinstance(k, Kept) or k is None else self._odd(k) for k in got]

    def put(self, name: str, value: Any, meta: Mapping[str, str] | None = None) -> bool:
        try:
            return bool(self.keeper.put(name, value, meta))
        except Exception as e:
            self._said("put", e)
            return False

    def names(self, prefix: str = "") -> Iterator[str]:
        try:
            return iter(list(self.keeper.names(prefix)))
        except Exception as e:
            self._said("names", e)
            return iter(())

    def items(self) -> Any:
        """The wrapped keeper's per-item part, where it offers one (else None)."""
        return items_of_keeper(self.keeper)

    def _odd(self, k: Any) -> Kept | None:
        if isinstance(k, tuple) and len(k) == 2 and isinstance(k[1], Mapping):
            return Kept(*k)
        self._said("get_many", StoreError(f"answered a {type(k).__name__}, not a Kept"))
        return None

    def _said(self, op: str, e: Exception) -> None:
        say_once(("keeper failed", type(self.keeper).__qualname__, op, type(e).__name__),
                 f"keeper {self.keeper!r}.{op} failed ({type(e).__name__}: {e}); the run "
                 "goes on as if nothing were kept (values are recomputed)")


def open_keeper(store: Any) -> Guarded | None:
    """What ``store=`` names: None, a directory path, or an object that fills ``Keeper``."""
    if store is None:
        return None
    if isinstance(store, Guarded):
        return store
    if isinstance(store, (str, os.PathLike)):
        return Guarded(Store(store))
    if callable(getattr(store, "get_many", None)) and callable(getattr(store, "put", None)):
        return Guarded(store)
    raise StoreError(
        f"store= takes a directory path or a Keeper (an object with get_many(names) and "
        f"put(name, value, meta)), not a {type(store).__name__}: "
        "pass store='/path/to/dir' or store=somatize.store.Store(path)"
    )
