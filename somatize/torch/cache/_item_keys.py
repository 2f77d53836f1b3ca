"""The names of per-item memory: a module's items' common part, and one key per row.

    mkey = module_key("Encoder", digest, salt)   # H("items", class, state, salt, call state)
    keys = item_keys(mkey, x)                    # BLAKE3-keyed(rows_key(...), row i)[:16]

Keyed and derive-key modes keep item keys apart from whole-value keys (plain BLAKE3 over
length-prefixed pieces): no row can be named like a whole value.
"""

from __future__ import annotations

import functools

import torch
from blake3 import blake3

from ..._keys import digest, state_of_call
from ...store._rows import native, row_keys

CONTEXT = "somatize 2026-12 per-item key v1"
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass of its own names its rows apart


def module_key(kind: str, state: str | None, salt: str | None) -> str:
    """The name under which a module's items are kept (its items' common part): the pieces
    of a whole-batch key (class, state and settings digest, salt, the call's state as
    ``_keys.state_of_call`` says it: autocast) under a domain of its own."""
    return _module_key(kind, state or "", salt or "", state_of_call())


@functools.lru_cache(maxsize=256)
def _module_key(*pieces: str) -> str:
    return digest(["items", *pieces])  # asked at every batch, with the same pieces


def item_keys(mkey: str, x: torch.Tensor) -> list[bytes]:
    """One 16-byte key per row of ``x`` (hashed in place on a contiguous CPU copy, in one
    native call: ``_rows``)."""
    x, sub = prepared(x)
    n = x.shape[0]
    if n == 0:
        return []
    key = rows_key(mkey, x.dtype, tuple(x.shape[1:]), sub)
    size = x.numel() * x.element_size()
    if size and native() is not None:  # the hasher reads the tensor's bytes where they are
        return row_keys(key, size, n, x.data_ptr())
    raw = memoryview(x.reshape(n, -1).view(torch.uint8).numpy()).cast("B") if size \
        else memoryview(b"")
    return row_keys(key, raw, n)


@functools.lru_cache(maxsize=256)
def rows_key(mkey: str, dtype: torch.dtype, row: tuple[int, ...], sub: str = "") -> bytes:
    """A key of its own per module and row layout, derived under our context: each row is
    then keyed BLAKE3 (a mode no whole-value key uses), many rows at a time (_rows)."""
    return blake3(bytes.fromhex(mkey) + f"{dtype}{list(row)}{sub}".encode(),
                  derive_key_context=CONTEXT).digest()


def prepared(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    """``x`` as its rows are hashed (detached, on the CPU, contiguous), and the name of its
    tensor subclass ("" for a plain tensor)."""
    sub = "" if type(x) in _PLAIN else f"{type(x).__module__}.{type(x).__qualname__}"
    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    return x.contiguous(), sub
