"""A blob on disk: a value's bytes in a file named by their BLAKE3, never rewritten.

    buf = read_whole(f)           # writable and 64-aligned: unpack(buf) shares it
    digest(buf) == blob           # the check every read makes

Small blobs are read into 64-aligned memory; large ones are mapped copy-on-write, which
starts page-aligned, so the layout's 64-byte offsets align every tensor either way.
"""

from __future__ import annotations

import mmap
import os

from blake3 import blake3

from .._packing import aligned

MAP_FROM = 1 << 20  # bytes from which a blob is mapped (copy-on-write) rather than read
_HASH_THREADS_FROM = 1 << 20  # BLAKE3 uses every core from here on; below, threads cost more


def read_whole(f, n: int | None = None) -> memoryview | mmap.mmap:
    """The whole of an open blob file (``n`` bytes, its size), in a private buffer the
    caller may write into."""
    if n is None:
        n = os.fstat(f.fileno()).st_size
    if n < MAP_FROM:
        buf = aligned(n)
        got = f.readinto(buf)
        return buf[:got]  # a file shrinking under us reads short; the hash then says so
    # copy-on-write: the caller may modify what it gets; the file never changes
    return mmap.mmap(f.fileno(), n, access=mmap.ACCESS_COPY)


def digest(data) -> str:
    """The hex BLAKE3 of a blob's bytes (its name)."""
    return hasher(len(data), data).hexdigest()


def hasher(size: int, data=b""):
    """A BLAKE3 hasher sized for ``size`` bytes (threads only where they pay)."""
    return blake3(data, max_threads=blake3.AUTO if size >= _HASH_THREADS_FROM else 1)
