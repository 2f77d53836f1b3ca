"""A name in the store and the small JSON file under ``PATH/names/`` it is kept in: the
blob it points at, that blob's size, and the meta written beside it.

    check_name("value/" + key)                      # StoreError for anything else
    entry = parse_entry("value/" + key, raw)         # an Entry, or ValueError saying why

A name file is trusted no more than a blob (a store may be shared): anything but a
BLAKE3 hex hash, a byte count and a str -> str meta makes that name a miss, and
nothing else is touched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .._errors import StoreError

_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]*")  # fullmatch: "$" lets a "\n" by
BLOB = re.compile(r"[0-9a-f]{64}")  # fullmatch only
MAX_NAME_FILE = 16 << 20  # a name file is a few KB; anything near this is not one


@dataclass(frozen=True)
class Entry:
    """A name in the store: the blob it points at, its size, and the meta kept beside it."""

    name: str
    blob: str
    size: int
    meta: Mapping[str, str]


def check_name(name: str) -> None:
    """Refuse a name that is not ``value/<key>`` or ``artifact/<kind>/<id>``."""
    parts = name.split("/") if isinstance(name, str) else []
    ok = (len(parts) == 2 and parts[0] == "value") or (len(parts) == 3 and parts[0] == "artifact")
    if not ok or not all(_PART.fullmatch(p) for p in parts[1:]):
        raise StoreError(
            f"{name!r} is not a store name: use 'value/<key>' or 'artifact/<kind>/<id>', "
            "each part letters, digits, '_', '.', '=', '+' or '-'"
        )


def check_meta(name: str, meta: Mapping[str, str] | None) -> dict[str, str]:
    """``meta`` as a plain dict; StoreError unless it maps str to str."""
    meta = dict(meta or {})
    for k, v in meta.items():
        if type(k) is not str or type(v) is not str:
            raise StoreError(f"the meta of {name} must map str to str, not {k!r}: "
                             f"{type(v).__name__}; pass str(...) of it")
    return meta


def parse_entry(name: str, raw: bytes) -> Entry:
    """The entry a name file's bytes say; ValueError saying what is wrong with them."""
    if len(raw) > MAX_NAME_FILE:
        raise ValueError(f"{len(raw)} bytes, too big for a name file")
    try:
        d = json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    blob, size, meta = d.get("blob"), d.get("size"), d.get("meta", {})
    if type(blob) is not str or not BLOB.fullmatch(blob):
        raise ValueError(f"'blob' is {str(blob)[:70]!r}, not a BLAKE3 hex hash")
    if type(size) is not int or size < 0:
        raise ValueError(f"'size' is {str(size)[:30]!r}, not a byte count")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(
            type(k) is str and type(v) is str for k, v in meta.items()):
        raise ValueError("'meta' does not map strings to strings")
    return Entry(name, blob, size, meta)
