"""Per-item memory on disk: a module's outputs kept row by row, many rows to a pack.

    space = Items("/scratch/soma").space(module_key, {"module": "body", "class": "Enc"})
    locs = space.lookup(keys)                          # [Loc | None], one pass
    rows = space.read(keys, locs)                      # rows.ok[i]: row i read and checked
    space.put(miss_keys, "F32", (512,), data, n)       # one pack, one index segment

On disk, beside the store's blobs and names::

    PATH/items/<module key>/module.json      who writes here (module path, class, code)
    PATH/items/<module key>/packs/<id>.safetensors   the rows of one write
    PATH/items/<module key>/index/<id>.seg   item key -> (pack, row, digest); see _index

A module's items live under its own key (its class, state, salt, autocast): dropping
them is removing that folder (``drop``). A hit reads its row from a pack checked whole
(see _packs) whose rows were then copied into this reader's arena (rows held
in memory, bounded), and only if the pack holds that row for that item's key;
anything that does not check out is a miss, said once. The index also holds a digest
per row, which ``verify`` checks.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._say import say_once
from ._files import move_below, private_dir
from ._index import Index, Loc
from ._lock import Lock
from ._packs import ITEM_SIZE, KEY, BadPack, Pack, row_digest, write_new, write_pack
from ._served import Served

log = logging.getLogger("somatize.store")
_OPEN_PACKS = 256
_HOLD = 256 << 20  # bytes of checked rows held in memory, per module
_HOLD_PACK = 64 << 20  # a bigger pack is checked, then read row by row
_SERVED = 1 << 20  # items remembered as served from the arena (about 130 bytes each)
_SERVED_LOOK = 50_000_000  # ns: how often a batch served from the arena looks at the index


def _row_bytes_of(layout: tuple) -> int:
    n = ITEM_SIZE[layout[0]]
    for s in layout[1]:
        n *= s
    return n


@dataclass
class Rows:
    """Rows found for a batch: their dtype and shape, which slots (keys asked, in order)
    were found and checked, and where their bytes are: ``parts``, each ``(buffer, slots,
    rows)``, slot ``slots[j]`` being row ``rows[j]`` of the buffer (a pack's rows held in
    memory, or rows read for this batch), so a caller gathers a pack's rows at once."""

    dtype: str | None
    row: tuple[int, ...] | None
    ok: list[bool]
    parts: list[tuple[Any, list[int], list[int]]] = field(default_factory=list)
    row_bytes: int = 0
    # or, every slot served from the arena: slot i is row ``codes[i]`` of ``arena``
    codes: Any = None  # an array of int64
    arena: Any = None

    def slot(self, i: int) -> bytes:
        """The bytes found for slot ``i`` (for tests and tools; a copy)."""
        rb = self.row_bytes
        for buf, slots, rows in self.parts:
            if i in slots:
                r = rows[slots.index(i)]
                return bytes(memoryview(buf)[r * rb:(r + 1) * rb])
        raise KeyError(i)


class Items:
    """The per-item part of a store directory: one ``Space`` per module key."""

    def __init__(self, path: str | os.PathLike, fsync: bool = False,
                 lock_timeout: float = 60.0, shared: bool = False):
        self.path = Path(path)
        self.root = self.path / "items"
        self.fsync, self.lock_timeout, self.shared = fsync, lock_timeout, shared
        self._spaces: dict[str, Space] = {}

    def setup(self) -> None:
        """Make the directories a write needs (``tmp/``, ``items/``), with the store's
        modes (what ``Lock`` asks of what it locks)."""
        for d in ("tmp", "items"):
            private_dir(str(self.path), d, self.shared)

    def space(self, key: str, meta: Mapping[str, str] | None = None) -> Space:
        """The items of the module named ``key`` (a hex digest)."""
        space = self._spaces.get(key)
        if space is not None:  # asked at every batch
            return space
        if not (len(key) == 64 and all(c in "0123456789abcdef" for c in key)):
            raise ValueError(f"a module key is 64 hex digits, not {key!r}")
        if key not in self._spaces:
            self._spaces[key] = Space(self, key, dict(meta or {}))
        return self._spaces[key]

    def keys(self) -> list[str]:
        """The module keys that have items here."""
        try:
            return sorted(n for n in os.listdir(self.root) if len(n) == 64)
        except FileNotFoundError:
            return []

    def drop(self, key: str) -> bool:
        """Remove one module's items at once (its folder renamed away, then deleted)."""
        folder = self.root / key
        if not folder.is_dir():
            return False
        gone = f"items/.drop-{uuid.uuid4().hex}"
        # readers now miss all of them, never some; a link is moved, never followed
        move_below(str(self.path), f"items/{key}", gone, self.shared)
        shutil.rmtree(self.path / gone, ignore_errors=True)
        self._spaces.pop(key, None)
        return True


class Space:
    """One module's items: its index and its packs. Used from one thread (a native call
    reads its served table and arena without the GIL)."""

    def __init__(self, items: Items, key: str, meta: dict[str, str]):
        self.items, self.key, self.meta = items, key, meta
        self.folder = items.root / key
        self.rel = f"items/{key}"  # below the store's root
        self.index = Index(str(items.path), f"{self.rel}/index", items.fsync, items.shared)
        self._packs: OrderedDict[str, Pack] = OrderedDict()
        self._pack_dir = str(self.folder / "packs")
        # the arena: rows of checked packs, by pack name -> (chunk, first row, rows, keys,
        # layout); what it holds was checked whole when copied, so it is served as is
        self._held: dict[str, tuple[int, int, int, bytes, tuple]] = {}
        self._arena: list[memoryview] = []  # one: anonymous memory, taken as it is filled
        self._layout: tuple | None = None
        self._cap = self._fill = self._arena_bytes = 0
        self._arena_at: ctypes.c_char | None = None
        # item key -> its row in the arena, for items the index sent there while
        # it stood as it does now (forgotten whenever a segment comes or goes)
        self._served = Served()
        self._generation = -1

    # -- reading ------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[Loc | None]:
        """Each item's ``Loc``, or None for one not kept."""
        return self.index.lookup(keys)

    def served(self, keys: Sequence[bytes]) -> Rows | None:
        """The rows of ``keys`` when every one was read from the arena before, under the
        index as it stands now (listed again first): what ``lookup`` and ``read`` would
        find, with no Python step per item; None otherwise (then ask those). The index
        is looked at again at most every ``_SERVED_LOOK`` ns: another process's new
        segment may be seen that much later (these rows are the items' values all the same:
        their keys name what they hold)."""
        self.index.refresh(_SERVED_LOOK)
        if self.index.generation != self._generation:
            self._served.clear()
            self._generation = self.index.generation
            return None
        codes = self._served.codes(keys) if self._layout is not None else None
        if codes is None:
            return None
        dtype, row = self._layout
        return Rows(dtype, row, [True] * len(keys), row_bytes=_row_bytes_of(self._layout),
                    codes=codes, arena=self._arena[0])

    def serving(self) -> tuple[tuple, int, int, int, int] | None:
        """What a native call needs to serve a batch from the arena (``_rows.serve``):
        ``(layout, table, mask, arena, rows in it)`` of the items served before, under the
        index as ``served`` sees it (table 0: none yet); None when nothing is held."""
        self.index.refresh(_SERVED_LOOK)
        if self.index.generation != self._generation:
            self._served.clear()
            self._generation = self.index.generation
        if self._layout is None or not self._arena:
            return None
        if self._arena_at is None:
            self._arena_at = ctypes.c_char.from_buffer(self._arena[0].obj)  # where its bytes are
        table, mask = self._served.table()
        return self._layout, table, mask, ctypes.addressof(self._arena_at), self._fill

    def read(self, keys: Sequence[bytes], locs: Sequence[Loc | None]) -> Rows:
        """Find the rows of ``locs`` (None: skipped). A row whose pack is gone, damaged or
        holds another key at that row is not ok (a miss, said once)."""
        rows = Rows(None, None, [False] * len(locs))
        by_pack: dict[str, list[int]] = {}
        for i, loc in enumerate(locs):
            if loc is not None:
                by_pack.setdefault(loc.pack, []).append(i)
        chunks: dict[int, tuple[list[int], list[int]]] = {}
        for name, slots in by_pack.items():
            if name in self._held or self._hold(name):
                at_chunk, first, n, kp, layout = self._held[name]
                if rows.dtype is None:
                    rows.dtype, rows.row = layout
                    rows.row_bytes = _row_bytes_of(layout)
                elif layout != (rows.dtype, rows.row):
                    continue
                got = chunks.setdefault(at_chunk, ([], []))
                mine = len(got[0])
                for i in slots:
                    r = locs[i].row
                    if 0 <= r < n and kp[r * KEY:(r + 1) * KEY] == keys[i]:
                        got[0].append(i)
                        got[1].append(first + r)
                        rows.ok[i] = True
                if len(self._served) < _SERVED:
                    self._served.add([keys[i] for i in got[0][mine:]], got[1][mine:])
                continue
            pack = self._pack(name)
            if pack is None:
                continue
            if rows.dtype is None:
                rows.dtype, rows.row, rows.row_bytes = pack.dtype, pack.row, pack.row_bytes
            elif (pack.dtype, pack.row) != (rows.dtype, rows.row):
                continue  # another shape under the same module: the caller sees a miss
            try:
                whole = pack.check(hold=pack.n * pack.row_bytes <= _HOLD_PACK)
            except OSError:
                whole = False
            if not whole:
                say_once(("bad pack", pack.path, pack.identity),
                         f"store {self.items.path}: pack {pack.path} does not match its digest "
                         "(cut, changed or crafted); its rows are misses and are recomputed. "
                         "`somatize store verify` names what is damaged")
                continue
            kp, n = pack.keys, pack.n  # the pack's own key for each row (checked above)
            good = [(i, r) for i in slots
                    if 0 <= (r := locs[i].row) < n and kp[r * KEY:(r + 1) * KEY] == keys[i]]
            if len(good) < len(slots):
                say_once(("bad row", pack.path),
                         f"store {self.items.path}: the index sends an item to a row of pack "
                         f"{pack.path} that is not that item's (a crafted or damaged index); "
                         "it is a miss and is recomputed")
            if not good:
                continue
            if pack.rows is not None:
                buf, at = pack.rows, [r for _, r in good]
            else:
                try:
                    buf, at = pack.read_rows([r for _, r in good]), list(range(len(good)))
                except OSError:
                    continue
                if buf is None:
                    continue
            rows.parts.append((buf, [i for i, _ in good], at))
            for i, _ in good:
                rows.ok[i] = True
        for c, (slots, at) in chunks.items():  # one part per chunk of held rows
            if slots:
                rows.parts.append((self._arena[c], slots, at))
        if sum(rows.ok) < sum(loc is not None for loc in locs):
            say_once(("bad row", str(self.folder)),
                     f"store {self.items.path}: the index sends an item of "
                     f"{self.meta.get('module', self.key[:12])!r} to a row that is not that "
                     "item's (a crafted or damaged index, or a pack gone); it is a miss and is "
                     "recomputed")
        self._trim()
        return rows

    def _hold(self, name: str) -> bool:
        """Open, check and copy a pack's rows into the arena (one buffer of rows held in
        memory, so a batch gathers its hits at once); False when it cannot be held (not
        checked out, too big, another layout, over the budget)."""
        pack = self._pack(name)
        if pack is None or pack.n * pack.row_bytes > _HOLD_PACK:
            return False
        try:
            if not pack.check(hold=True):
                return False  # said by read, on its own path
        except OSError:
            return False
        layout, rb = (pack.dtype, pack.row), pack.row_bytes
        if self._layout is None:
            self._layout = layout
        if layout != self._layout or rb == 0:
            return False
        if not self._arena:  # its pages are taken as rows are copied in, up to _HOLD
            self._cap, self._fill, self._arena_bytes = _HOLD // rb, 0, _HOLD
            self._arena.append(memoryview(mmap.mmap(-1, _HOLD))[:self._cap * rb])  # whole rows
        if self._fill + pack.n > self._cap:
            return False
        c, first = len(self._arena) - 1, self._fill
        memoryview(self._arena[c])[first * rb:(first + pack.n) * rb] = pack.rows
        self._fill += pack.n
        self._held[name] = (c, first, pack.n, pack.keys, layout)
        self._packs.pop(name).close()  # what it holds is checked and copied: no file needed
        return True

    def _pack(self, name: str) -> Pack | None:
        path = f"{self._pack_dir}{os.sep}{name}.safetensors"  # str: pathlib costs per batch
        pack = self._packs.get(name)
        if pack is not None:
            try:
                st = os.stat(path)
                same = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == pack.identity
            except OSError:
                same = False
            if same:
                self._packs.move_to_end(name)
                return pack
            self._packs.pop(name).close()  # changed or gone: opened and checked again
        try:
            pack = Pack.open(path)
        except FileNotFoundError:
            return None  # removed by gc after a compaction dropped its rows: a miss
        except (BadPack, OSError) as e:
            say_once(("bad pack", path), f"store {self.items.path}: pack {path} cannot be "
                     f"read ({e}); its rows are misses and are recomputed")
            return None
        self._packs[name] = pack
        return pack

    def _trim(self) -> None:
        # after a read: the packs it used stay open until it is done
        held = sum(p.held() for p in self._packs.values())
        while self._packs and (len(self._packs) > _OPEN_PACKS or held > _HOLD):
            _, old = self._packs.popitem(last=False)
            held -= old.held()
            old.close()

    def written_meta(self) -> dict[str, str]:
        """What the first writer of these items wrote beside them (``module.json``)."""
        try:
            with open(self.folder / "module.json", "rb") as f:
                got = json.loads(f.read())
            return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}
        except (OSError, ValueError):
            return {}

    # -- writing ------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], dtype: str, row: Sequence[int], data: Any) -> bool:
        """Keep ``len(keys)`` rows (``data``: their bytes in order) as one pack, and index
        them; False when they cannot be kept (said once; the run goes on)."""
        n = len(keys)
        if n == 0:
            return True
        view = memoryview(data).cast("B")
        rb = view.nbytes // n
        try:
            with Lock(self.items, self.items.lock_timeout, exclusive=False):
                root, shared = str(self.items.path), self.items.shared
                if not (self.folder / "packs").is_dir():
                    private_dir(root, f"{self.rel}/packs", shared)
                    write_new(root, f"{self.rel}/module.json",
                              [json.dumps(self.meta, sort_keys=True).encode()], False, shared)
                name = write_pack(root, f"{self.rel}/packs", keys, dtype, row, view,
                                  {**self.meta, "time": f"{time.time():.3f}"}, self.items.fsync,
                                  shared)
                self.index.add({k: Loc(name, i, row_digest(k, dtype, row,
                                                           view[i * rb:(i + 1) * rb]))
                                for i, k in enumerate(keys)})
        except OSError as e:
            say_once(("items write", str(self.folder), e.errno),
                     f"store {self.items.path}: cannot keep {n} items of module "
                     f"{self.meta.get('module', self.key[:12])!r} ({e.strerror or e}). The run "
                     "goes on without keeping them; free space or fix the directory")
            return False
        return True

    # -- looking after it ---------------------------------------------------------------
    def pack_names(self) -> list[str]:
        try:
            return sorted(n[:-len(".safetensors")] for n in os.listdir(self.folder / "packs")
                          if n.endswith(".safetensors") and not n.startswith("."))
        except FileNotFoundError:
            return []

    def leftovers(self) -> Iterator[Path]:
        """Temporary files of writers that were killed (or are writing now)."""
        for sub in ("packs", "index", ""):
            d = self.folder / sub
            if d.is_dir():
                yield from (p for p in d.iterdir() if p.name.startswith(".tmp-"))

    def close(self) -> None:
        for p in self._packs.values():
            p.close()
        self._packs.clear()
        self._held.clear()
        self._arena.clear()
        self._arena_at = None
        self._served.clear()
        self._layout, self._cap, self._fill, self._arena_bytes = None, 0, 0, 0
