"""The per-item index: item key -> (pack, row, digest), in immutable segment files.

    index = Index("/scratch/soma", "items/<module key>/index")
    index.add({key: Loc(pack, row, digest), ...})     # one new segment file
    [loc, None] = index.lookup([key, other])           # one pass over a batch's keys

Safe with several writers on several hosts sharing a directory over NFS, with no lock and
no database: every write makes a NEW segment file (written beside, then renamed into
place), and no file is ever changed once named. A reader lists the directory and merges
what it finds. Compaction merges segments into one new segment, renamed into place
before the old ones are removed, so a reader sees every record at every moment (at worst
twice). A segment is checked whole when first read (a BLAKE3 of its bytes at its end): a
cut, flipped or crafted segment is skipped with a warning, and its items are misses.

A segment: ``SOMAIX01``, counts, the pack names it refers to, a fan-out table over the
keys' first bits, the sorted 16-byte keys, then per key (pack number, row, 16-byte row
digest), then the BLAKE3 of all that. Small segments are folded into one dict here;
big ones (compacted) get a dict of their own at their first lookup (about 120 bytes an
item in the reader's memory: a bisect over a million keys costs more in cache misses than
the probe). The sorted keys and their fan-out table let a reader find a key in a few reads
without one (``Segment.search``).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import NamedTuple

from blake3 import blake3

from .._say import say_once
from ._files import remove_below
from ._packs import new_name, write_new

log = logging.getLogger("somatize.store")

MAGIC = b"SOMAIX01"
_HEAD = struct.Struct("<8sIIB3x")  # magic, packs, records, fan-out bits
_VAL = struct.Struct("<II16s")  # pack number, row, digest
KEY = 16
SMALL = 1 << 16  # records: a segment this small is folded into the reader's dict
MERGE_SMALL = 16  # this many small segments are compacted into one
MERGE_BIG = 4
_RACY = 3_000_000_000  # ns: a folder changed this recently is listed at every refresh


class Loc(NamedTuple):
    """Where an item's row lies: its pack, its row there, and the row's digest."""

    pack: str
    row: int
    digest: bytes


class BadSegment(ValueError):
    """A segment file that is not whole or not well formed."""


def encode(records: Mapping[bytes, Loc]) -> list[bytes]:
    """The bytes of a segment holding ``records``."""
    keys = sorted(records)
    packs = sorted({loc.pack for loc in records.values()})
    number = {p: i for i, p in enumerate(packs)}
    bits = max(0, min(16, len(keys).bit_length() - 3))
    counts = [0] * ((1 << bits) + 1)
    for k in keys:
        counts[_bucket(k, bits) + 1] += 1
    for i in range(1, len(counts)):
        counts[i] += counts[i - 1]
    body = [
        _HEAD.pack(MAGIC, len(packs), len(keys), bits),
        "".join(packs).encode("ascii"),
        struct.pack(f"<{len(counts)}I", *counts),
        b"".join(keys),
        b"".join(_VAL.pack(number[records[k].pack], records[k].row, records[k].digest)
                 for k in keys),
    ]
    h = blake3()
    for b in body:
        h.update(b)
    return [*body, h.digest()]


def _bucket(key: bytes, bits: int) -> int:
    return int.from_bytes(key[:2], "big") >> (16 - bits) if bits else 0


class Segment:
    """A segment read and checked: its keys searched through the fan-out table."""

    def __init__(self, raw: bytes, name: str = "?"):
        self.name = name
        self.order = order_of(name)
        if len(raw) < _HEAD.size + 32 or raw[:8] != MAGIC:
            raise BadSegment("not a segment (no SOMAIX01 header)")
        if blake3(memoryview(raw)[:-32]).digest() != raw[-32:]:
            raise BadSegment("its bytes do not match their digest (cut or changed)")
        _, npacks, n, bits = _HEAD.unpack_from(raw)
        if bits > 16:
            raise BadSegment(f"fan-out of {bits} bits")
        at = _HEAD.size
        nfan = (1 << bits) + 1
        if len(raw) != at + 32 * npacks + 4 * nfan + (KEY + _VAL.size) * n + 32:
            raise BadSegment("its size does not match its counts")
        try:
            self.packs = [raw[at + 32 * i: at + 32 * (i + 1)].decode("ascii")
                          for i in range(npacks)]
        except UnicodeDecodeError:
            raise BadSegment("a pack name is not text") from None
        if not all(len(p) == 32 and all(c in "0123456789abcdef" for c in p)
                   for p in self.packs):
            raise BadSegment("a pack name is not 32 hex digits")
        at += 32 * npacks
        self.fan = struct.unpack_from(f"<{nfan}I", raw, at)
        if self.fan[0] != 0 or self.fan[-1] != n or any(
                a > b for a, b in zip(self.fan, self.fan[1:], strict=False)):
            raise BadSegment("its fan-out table is not in order")
        at += 4 * nfan
        self.bits, self.n = bits, n
        self._where: dict[bytes, int] | None = None  # key -> record, once looked up
        self.keys = raw[at: at + KEY * n]
        self.vals = raw[at + KEY * n: at + (KEY + _VAL.size) * n]

    def key(self, i: int) -> bytes:
        return self.keys[i * KEY:(i + 1) * KEY]

    def loc(self, i: int) -> Loc | None:
        p, row, d = _VAL.unpack_from(self.vals, i * _VAL.size)
        return Loc(self.packs[p], row, d) if p < len(self.packs) else None

    def find(self, key: bytes) -> Loc | None:
        if self._where is None:  # built once, at the first lookup: then one probe in C
            ks = self.keys
            self._where = dict(zip((ks[i * KEY:(i + 1) * KEY] for i in range(self.n)),
                                   range(self.n), strict=True))
        i = self._where.get(key)
        return self.loc(i) if i is not None else None

    def search(self, key: bytes) -> Loc | None:
        """``find`` without building the dict: a bisect within the key's fan-out bucket."""
        b = _bucket(key, self.bits)
        lo, hi = self.fan[b], self.fan[b + 1]
        keys = self.keys
        while lo < hi:
            mid = (lo + hi) // 2
            k = keys[mid * KEY:(mid + 1) * KEY]
            if k < key:
                lo = mid + 1
            elif k > key:
                hi = mid
            else:
                return self.loc(mid)
        return None

    def records(self) -> Iterator[tuple[bytes, Loc]]:
        for i in range(self.n):
            loc = self.loc(i)
            if loc is not None:
                yield self.key(i), loc


_VANISHED = object()  # a segment listed, then gone before it was read
_STAMP = 16  # hex digits of a segment name's time stamp, before its 32 random ones


def segment_name(after: Iterable[str] = ()) -> str:
    """A new segment's file name (no ``.seg``): its writing time (ns, 16 hex digits), then
    32 random ones, so names sort in the order segments were written. A compaction's
    segment (``after``: the names it merges) takes the stamp of the newest it merges: a
    segment written meanwhile stays newer than it."""
    stamps = [n[:_STAMP] for n in after if len(n.removesuffix(".seg")) == _STAMP + 32]
    if after:
        stamp = max(stamps) if stamps else "0" * _STAMP
    else:
        stamp = f"{time.time_ns():0{_STAMP}x}"
    return stamp + new_name()


def order_of(name: str) -> tuple[int, str]:
    """Where a segment stands among the others: older first. Names written before stamps
    (32 random hex digits) count as older than every stamped one, in name order."""
    return (len(name.removesuffix(".seg")) == _STAMP + 32, name)


class Index:
    """The segments of one directory, read as one mapping from item key to ``Loc``."""

    def __init__(self, root: str, rel: str, fsync: bool = False, shared: bool = False):
        self.root, self.rel, self.fsync, self.shared = root, rel, fsync, shared
        self.folder = os.path.join(root, rel)
        self.segments: dict[str, Segment | None] = {}  # by file name; None: unreadable
        self.small: dict[bytes, tuple[Segment, int]] = {}  # key -> its segment, record
        self.big: list[Segment] = []
        self.generation = 0  # counts the refreshes that found segments new or gone
        self._listed: tuple | None = None  # the folder's stat when last listed
        self._names: list[str] | None = None  # what that listing found, all of it read
        self._looked = -(1 << 62)  # time.monotonic_ns() of the last refresh

    def _list(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.folder) if n.endswith(".seg"))
        except FileNotFoundError:
            return []
        except OSError as e:
            say_once(("index unreadable", self.folder, e.errno),
                     f"store index {self.folder} cannot be listed ({e.strerror or e}): every "
                     "item reads as a miss and is recomputed; fix the directory to keep them")
            return []

    def refresh(self, within_ns: int = 0) -> None:
        """See the segments now in the directory (new ones read, gone ones forgotten);
        ``within_ns``: not looked at again within that long of the last look (a reader
        serving from its arena asks at every batch: one stat in a few milliseconds).

        A segment listed but gone before it is read was compacted away meanwhile: the
        merged one was named before it went, so the directory is listed again, and the
        records are found there (a view that lacks both is never used). Not listed again
        while the folder's stat is what it was at the last listing, and that is older than
        ``_RACY`` (a name added within a coarse mtime's tick is listed)."""
        t = time.monotonic_ns()
        if t - self._looked < within_ns:
            return
        self._looked = t
        try:
            st = os.stat(self.folder)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_nlink)
        except OSError:
            stamp = None
        if stamp is not None and stamp == self._listed \
                and time.time_ns() - stamp[1] > _RACY:
            return  # asked at every batch: one stat, no listing
        self._listed = stamp
        now = self._list()
        if now == self._names:  # listed again (a recent change) and found as it was
            return
        gone: set[str] = set()
        new: list[str] = []
        for _ in range(100):  # each pass that finds one vanished follows a compaction
            if now is None:
                now = self._list()
            gone |= set(self.segments) - set(now)
            for n in set(self.segments) - set(now):
                del self.segments[n]
            fresh = [n for n in now if n not in self.segments]
            vanished = False
            for n in fresh:
                seg = self._read(n)
                if seg is _VANISHED:
                    vanished = True
                    continue
                self.segments[n] = seg
                new.append(n)
            if not vanished:
                self._names = now
                break
            now = self._names = None
        new = [n for n in new if n in self.segments]
        newest = max((s.order for n, s in self.segments.items() if s is not None
                      and n not in new), default=None)
        if newest is not None and any(self.segments[n] is not None and
                                      self.segments[n].order < newest for n in new):
            gone = gone or {""}  # one older than those read (another host's clock): redo
        self.segments = dict(sorted(self.segments.items(), key=lambda e: order_of(e[0])))
        if gone:
            self.small = {}
            todo = [s for s in self.segments.values() if s is not None and s.n <= SMALL]
        else:
            todo = [self.segments[n] for n in new]
            todo = [s for s in todo if s is not None and s.n <= SMALL]
        todo.sort(key=lambda s: s.order)  # the newest record of a key counts: it goes last
        for s in todo:  # built in C: a refresh after a compaction re-reads thousands
            ks = s.keys
            self.small.update(zip((ks[i * KEY:(i + 1) * KEY] for i in range(s.n)),
                                  zip(repeat(s), range(s.n)), strict=True))
        if gone or new:  # newest first: the first that holds a key answers for it
            self.generation += 1
            self.big = sorted((s for s in self.segments.values() if s is not None
                               and s.n > SMALL), key=lambda s: s.order, reverse=True)

    def _read(self, name: str) -> Segment | None:
        try:
            with open(os.path.join(self.folder, name), "rb") as f:
                return Segment(f.read(), name)
        except FileNotFoundError:
            return _VANISHED  # compacted away since listed: its records are in the new one
        except (BadSegment, OSError) as e:
            say_once(("bad segment", self.folder, name),
                     f"store index {self.folder}: segment {name} cannot be used ({e}); its "
                     "items read as misses and are recomputed. `somatize store verify` "
                     "names it; delete it to stop this warning")
            return None

    def lookup(self, keys: Sequence[bytes], refresh: bool = True) -> list[Loc | None]:
        """Each key's ``Loc`` or None, in order: one pass over the batch (``refresh``:
        the directory listed first; False where the caller just did)."""
        if refresh:
            self.refresh()
        small, big = self.small, self.big
        out = []
        for k in keys:
            at = small.get(k)
            loc = at[0].loc(at[1]) if at is not None else None
            for s in big:  # one newer than the small segment that holds it answers
                if loc is not None and s.order < at[0].order:
                    break
                found = s.find(k)
                if found is not None:
                    loc = found
                    break
            out.append(loc)
        return out

    def records(self) -> dict[bytes, Loc]:
        """Every item's record that counts: where a key is in several segments, the
        newest one's (the one ``lookup`` answers; ``verify`` checks it)."""
        self.refresh()
        out: dict[bytes, Loc] = {}
        for s in self.segments.values():  # oldest first: a newer record overwrites
            if s is not None:
                out.update(s.records())
        return out

    def packs_named(self) -> set[str]:
        """Every pack any record of any segment names (what ``gc`` keeps: a damaged or
        older copy's pack is removed only once no record names it)."""
        self.refresh()
        return {p for s in self.segments.values() if s is not None for p in s.packs}

    def add(self, records: Mapping[bytes, Loc]) -> None:
        """Write ``records`` as a new segment; then compact, when segments have piled up."""
        if not records:
            return
        write_new(self.root, f"{self.rel}/{segment_name()}.seg", encode(records), self.fsync,
                  self.shared)
        self.refresh()
        small = [n for n, s in self.segments.items() if s is not None and s.n <= SMALL]
        big = [n for n, s in self.segments.items() if s is not None and s.n > SMALL]
        if len(small) >= MERGE_SMALL:
            self.compact(small)
        elif len(big) >= MERGE_BIG:
            self.compact(big + small)

    def compact(self, names: Iterable[str]) -> None:
        """Merge the segments ``names`` into one new segment, then remove them. Safe
        beside writers and other compactions: the merged one is named before any goes."""
        names = sorted((n for n in names if self.segments.get(n) is not None), key=order_of)
        merged: dict[bytes, Loc] = {}
        for n in names:  # oldest first: the newest record of a key is the one kept
            merged.update(self.segments[n].records())
        if len(names) < 2:
            return
        write_new(self.root, f"{self.rel}/{segment_name(names)}.seg", encode(merged),
                  self.fsync, self.shared)
        for n in names:  # one gone already: another compaction took it, records and all
            remove_below(self.root, f"{self.rel}/{n}")
        log.debug("index %s: %d segments compacted into one of %d records", self.folder,
                  len(names), len(merged))
        self.refresh()

