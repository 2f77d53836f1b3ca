"""Packs: the rows kept together by one write, in one safetensors file, read row by row.

    name = write_pack(folder, "F32", (512,), rows_bytes, n=256, meta={"module": "body"})
    pack = Pack.open(folder / f"{name}.safetensors")    # the header read and checked
    pack.read_row(7, into=memoryview(buf))              # that row's bytes, and no others

A pack is a plain safetensors file holding one tensor ``rows`` of shape ``[n, *row]``; its
header is padded so the data starts 64-byte aligned. Opening one checks the header
against the file's size (a crafted or cut pack never makes a read leave it); a row is
read by its byte range alone, and checked by its caller against the digest the index
holds for it (``row_digest``).
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from blake3 import blake3

# safetensors dtype names and their item sizes
ITEM_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1}
_HEADER_MAX = 1 << 20
_U64 = struct.Struct("<Q")


class BadPack(ValueError):
    """A pack whose header does not describe the file it is in."""


def row_digest(key: bytes, dtype: str, shape: Sequence[int], row) -> bytes:
    """16 bytes that bind a row's bytes to its item key, dtype and shape: an index record
    pointing at another item's row, or a row changed on disk, does not match."""
    h = blake3(key)
    h.update(f"{dtype}{list(shape)}".encode())
    h.update(row)
    return h.digest(16)


def new_name() -> str:
    """A fresh pack or segment name: 32 hex digits, unique across writers and hosts."""
    return uuid.uuid4().hex


# -- writing files (ONE place: the lead switches this to somatize/store/_files.py) --------

def write_new(folder: str, name: str, chunks: Sequence[Any], fsync: bool) -> None:
    """Create ``folder/name`` whole or not at all: written to a temporary file in the same
    directory (created O_EXCL, never following a link), flushed when ``fsync``, then
    renamed into place. A killed writer leaves at most a ``.tmp-*`` file (gc removes it)."""
    tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.rename(tmp, os.path.join(folder, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_pack(folder: str, dtype: str, row: Sequence[int], data, n: int,
               meta: Mapping[str, str], fsync: bool = False) -> str:
    """Write ``n`` rows (``data``: their bytes, row after row) as one new pack; its name."""
    nbytes = memoryview(data).nbytes
    if nbytes != n * _row_bytes(dtype, row):
        raise ValueError(f"{nbytes} bytes are not {n} rows of {dtype}{list(row)}")
    head = {"__metadata__": {k: str(v) for k, v in meta.items()},
            "rows": {"dtype": dtype, "shape": [n, *row], "data_offsets": [0, nbytes]}}
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 64)  # the data starts 64-byte aligned
    name = new_name()
    write_new(folder, f"{name}.safetensors", [_U64.pack(len(raw)), raw, data], fsync)
    return name


class Pack:
    """An open pack: its rows' dtype and shape, and where each row's bytes lie."""

    def __init__(self, path: str, fd: int, dtype: str, row: tuple[int, ...], n: int,
                 start: int, meta: Mapping[str, str]):
        self.path, self.fd, self.dtype, self.row, self.n = path, fd, dtype, row, n
        self.start, self.meta = start, meta
        self.row_bytes = _row_bytes(dtype, row)

    @classmethod
    def open(cls, path: str) -> Pack:
        """Open and check a pack's header; raises ``BadPack`` (or OSError) otherwise."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            size = os.fstat(fd).st_size
            first = os.pread(fd, 8, 0)
            if len(first) != 8:
                raise BadPack("shorter than a safetensors header")
            hlen = _U64.unpack(first)[0]
            if hlen > _HEADER_MAX or 8 + hlen > size:
                raise BadPack(f"header of {hlen} bytes in a file of {size}")
            try:
                head = json.loads(os.pread(fd, hlen, 8))
                rows = head["rows"]
                dtype, shape = rows["dtype"], [int(s) for s in rows["shape"]]
                begin, end = (int(o) for o in rows["data_offsets"])
                meta = {str(k): str(v) for k, v in head.get("__metadata__", {}).items()}
            except (ValueError, KeyError, TypeError) as e:
                raise BadPack(f"header does not parse: {e}") from None
            if dtype not in ITEM_SIZE or not shape or min(shape) < 0:
                raise BadPack(f"rows of dtype {dtype!r}, shape {shape}")
            n, row = shape[0], tuple(shape[1:])
            if not 0 <= begin <= end or end - begin != n * _row_bytes(dtype, row) \
                    or 8 + hlen + end > size:
                raise BadPack(f"data offsets {begin}..{end} do not hold {shape} {dtype} "
                              f"in a file of {size} bytes")
            return cls(path, fd, dtype, row, n, 8 + hlen + begin, meta)
        except BaseException:
            os.close(fd)
            raise

    def read_rows(self, rows: Sequence[int], into: memoryview) -> bool:
        """Read ``rows`` into ``into`` one after another; False when one is out of range
        or the file is shorter than its header said (it changed under us)."""
        rb = self.row_bytes
        for i, r in enumerate(rows):
            if not 0 <= r < self.n:
                return False
            if os.preadv(self.fd, [into[i * rb:(i + 1) * rb]], self.start + r * rb) != rb:
                return False
        return True

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> Pack:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _row_bytes(dtype: str, row: Sequence[int]) -> int:
    n = ITEM_SIZE[dtype]
    for s in row:
        n *= s
    return n
