"""Packs: the rows kept together by one write, in one safetensors file.

    name = write_pack(root, "items/<key>/packs", keys, "F32", (512,), rows, {"module": "b"})
    pack = Pack.open(f"{root}/items/<key>/packs/{name}.safetensors")  # header checked
    pack.check()                                      # once per file identity
    pack.holds(7, key) and pack.rows                  # row 7 is key's; the held rows

A pack is a plain safetensors file holding ``keys`` (``[n, 16]`` U8: each row's item key)
and ``rows`` (``[n, *row]``), and in its metadata the BLAKE3 of both. Opening one checks
the header against the file's size (a crafted or cut pack never makes a read leave it).
A pack is checked whole the first time a process reads from it (and again when its file
identity changes): a flipped bit makes all its rows misses. After that a row is served
only to the key the pack itself holds for it, so an index record that points an item at
another item's row is a miss. Checked packs are held in memory (bounded); bit rot under
an unchanged file is ``somatize store verify``'s to find (it checks each row's digest).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from blake3 import blake3

from .._packing import SIZES, Damaged, header, header_length, parse_header
from ._files import write_file_atomic

ITEM_SIZE = SIZES  # safetensors dtype names and their item sizes: the package's one table
_HEADER_MAX = 1 << 20
KEY = 16  # bytes of an item key


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


def write_new(root: str, relpath: str, chunks: Sequence[Any], fsync: bool,
              shared: bool = False) -> None:
    """Create ``root/relpath`` whole or not at all, through the store's one file helper
    (``_files.write_file_atomic``): written in ``root/tmp/`` (mode 0600, 0660 in a shared
    store; no link below the root followed), flushed when ``fsync``, then renamed into
    place. A killed writer leaves at most a file in ``tmp/`` (the store's gc removes it)."""
    write_file_atomic(root, relpath, chunks, shared=shared, fsync=fsync)


def write_pack(root: str, reldir: str, keys: Sequence[bytes], dtype: str, row: Sequence[int],
               data, meta: Mapping[str, str], fsync: bool = False, shared: bool = False) -> str:
    """Write the rows of ``keys`` (``data``: their bytes, row after row) as one new pack
    in ``root/reldir`` (``root``: the store's); returns its name."""
    n = len(keys)
    data = memoryview(data).cast("B")
    nbytes = data.nbytes
    if nbytes != n * _row_bytes(dtype, row):
        raise ValueError(f"{nbytes} bytes are not {n} rows of {dtype}{list(row)}")
    kb = b"".join(keys)
    if len(kb) != KEY * n:
        raise ValueError(f"item keys are {KEY} bytes each")
    h = blake3(kb)
    h.update(data)
    head, buffers = header({**{k: str(v) for k, v in meta.items()}, "digest": h.hexdigest()},
                           [("keys", "U8", (n, KEY), kb), ("rows", dtype, (n, *row), data)])
    name = new_name()
    write_new(root, f"{reldir}/{name}.safetensors", [head, *buffers], fsync, shared)
    return name


class Pack:
    """An open pack: its rows' dtype and shape, where its bytes lie, and once checked,
    its keys (and its rows, when held in memory)."""

    def __init__(self, path: str, fd: int, dtype: str, row: tuple[int, ...], n: int,
                 start: int, meta: Mapping[str, str], identity: tuple):
        self.path, self.fd, self.dtype, self.row, self.n = path, fd, dtype, row, n
        self.start, self.meta, self.identity = start, meta, identity  # start: of the keys
        self.row_bytes = _row_bytes(dtype, row)
        self.keys: bytes | None = None  # set by check()
        self.rows: memoryview | None = None  # held rows, when small enough
        self.checked: bool | None = None

    @classmethod
    def open(cls, path: str) -> Pack:
        """Open and check a pack's header; raises ``BadPack`` (or OSError) otherwise."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            st = os.fstat(fd)
            size = st.st_size
            try:
                hlen = header_length(os.pread(fd, 8, 0), size)
                if hlen > _HEADER_MAX:
                    raise Damaged(f"a header of {hlen} bytes")
                entries, meta = parse_header(os.pread(fd, hlen, 8), size - 8 - hlen)
            except Damaged as e:
                raise BadPack(str(e)) from None
            keys, rows = entries.get("keys"), entries.get("rows")
            if set(entries) != {"keys", "rows"} or "digest" not in meta or not rows[1]:
                raise BadPack(f"not a pack: tensors {sorted(entries)[:4]}, metadata "
                              f"{sorted(meta)[:4]}")
            dtype, shape = rows[0], rows[1]
            n, row = shape[0], tuple(shape[1:])
            if keys[:3] != ("U8", (n, KEY), 0) or rows[2] != KEY * n:
                raise BadPack(f"keys {keys[:2]} and rows {rows[:2]} do not lie as a pack's")
            return cls(path, fd, dtype, row, n, 8 + hlen, meta,
                       (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        except BaseException:
            os.close(fd)
            raise

    def check(self, hold: bool) -> bool:
        """Read the whole pack and check it against its digest (once); keep its keys, and
        its rows too when ``hold``. False when it does not check out."""
        if self.checked is None:
            total = KEY * self.n + self.n * self.row_bytes
            buf = bytearray(total)
            got = os.preadv(self.fd, [buf], self.start)
            self.checked = got == total and blake3(buf).hexdigest() == self.meta["digest"]
            if self.checked:
                view = memoryview(buf)
                self.keys = bytes(view[:KEY * self.n])
                self.rows = view[KEY * self.n:] if hold else None
        return self.checked

    def held(self) -> int:
        """The bytes this pack holds in memory."""
        return self.rows.nbytes if self.rows is not None else 0

    def holds(self, r: int, key: bytes) -> bool:
        """Whether this checked pack holds ``key``'s row at row ``r``."""
        return bool(self.checked) and 0 <= r < self.n and \
            self.keys[r * KEY:(r + 1) * KEY] == key

    def read_rows(self, rows: Sequence[int]) -> bytearray | None:
        """Rows ``rows`` read from the file, one after another (a pack not held);
        None when the file is shorter than its header said."""
        rb = self.row_bytes
        out = bytearray(rb * len(rows))
        view = memoryview(out)
        at = self.start + KEY * self.n
        for j, r in enumerate(rows):
            if os.preadv(self.fd, [view[j * rb:(j + 1) * rb]], at + r * rb) != rb:
                return None
        return out

    def raw_row(self, r: int) -> bytes:
        """Row ``r``'s bytes as they are on disk now, unchecked (for ``verify``)."""
        rb = self.row_bytes
        return os.pread(self.fd, rb, self.start + KEY * self.n + r * rb) if 0 <= r < self.n \
            else b""

    def close(self) -> None:
        self.rows = None
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
