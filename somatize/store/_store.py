"""The directory store: content-addressed safetensors blobs, and names that point at them.

    store = Store("/scratch/soma")
    store.put("value/" + key, {"emb": t}, meta={"node": "encoder"})
    [kept, None] = store.get_many(["value/" + key, "value/" + other])

A write is: the blob to ``tmp/`` then renamed (skipped when those bytes are already
kept), then the name to ``tmp/`` then renamed, under the lock held shared. A read checks
everything it is handed, since a store may be shared: a name file that does not parse,
or whose size is not its blob's, is a miss (said once, nothing else touched); a blob
whose bytes do not hash to its name or do not parse as a packed value is a miss, said,
and moved to ``PATH/damaged/``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from .._keeper import Kept
from .._packing import Damaged, Unpackable, check, pack, unpack
from .._say import say_once
from ._blobs import digest, hasher, read_whole
from ._entry import Entry, check_meta, check_name, parse_entry
from ._files import (
    BelowLink,
    files_below,
    move_below,
    open_below,
    private_dir,
    remove_below,
    write_file_atomic,
)
from ._lock import Lock
from ._recent import checked, recent
from ._rounds import doomed_names

log = logging.getLogger("somatize.store")


class Store:
    """A directory of content-addressed safetensors blobs and the names that point at them.

    Args:
        path: the directory (created on the first write).
        fsync: flush each blob and name to disk before it is named (durability across a
            power cut; not needed for consistency, which every read checks).
        lock_timeout: seconds a writer waits for a running ``gc`` before not keeping.
        shared: give the directory's group access (directories 2770, files 0660) so
            several users in one group keep and read values; by default a store is
            private to its owner (directories 0700, files 0600). docs/security.md.
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False,
                 lock_timeout: float = 60.0, shared: bool = False):
        self.path = Path(path)
        self._root = str(self.path)
        self.fsync = fsync
        self.lock_timeout = lock_timeout
        self.shared = shared
        self._made = False  # its directories made (with their modes) by this object


    def items(self) -> Any:
        """This store's per-item part (``Items``): rows kept under their own keys, in
        packs and an index beside the named values (docs/per-item.md).

            rows = Store(".soma").items().space(key).lookup([row_key])"""
        from ._items import Items

        return Items(self.path, fsync=self.fsync, shared=self.shared)
    def setup(self) -> None:
        """Make the store's directories (with their modes); OSError when it cannot be
        written (another user's store, a read-only disk)."""
        if not self._made:
            for d in ("tmp", "blobs", "names"):
                private_dir(self._root, d, self.shared)
            self._made = True

    def writable(self) -> str | None:
        """Why this process cannot write the store (None when it can): said once by a
        worker at its start, rather than once per value not kept."""
        try:
            self.setup()
            write_file_atomic(self._root, "tmp/.probe", [b""], self.shared)
            remove_below(self._root, "tmp/.probe")
        except OSError as e:
            return f"{e.strerror or e} (this process runs as uid {os.geteuid()})"
        return None

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r})"

    # -- reading ----------------------------------------------------------------
    def get_many(self, names: Sequence[str]) -> list[Kept | None]:
        """Look up several names; answers in the order asked, ``None`` for a miss."""
        return [self.get(n) for n in names]

    def get(self, name: str) -> Kept | None:
        """The value kept under ``name`` and its meta, or None (a miss is not a failure)."""
        check_name(name)
        entry = self.entry(name)
        if entry is None:
            return None
        buf = self._read_blob(entry)
        if buf is None:
            return None
        try:
            value = unpack(buf)
        except Unpackable as e:
            say_once(("store no codec", e.kind),
                     f"store {self.path}: {name} holds a {e.kind!r} but " + (
                         f"it cannot be rebuilt here ({e.why}), so it is a miss" if e.why else
                         "no codec for it is registered in this process, so it is a miss "
                         "(import somatize.torch for tensors, or register one with "
                         "somatize.codec)"))
            return None
        except Damaged as e:
            self._damaged(entry.blob, f"not a packed value ({e})", name)
            return None
        return Kept(value, dict(entry.meta))

    def entry(self, name: str) -> Entry | None:
        """The entry under ``name`` (without reading its value), or None."""
        entry, why = self._parse(name)
        if why is not None:
            self._bad_name(name, why)
        return entry

    def check_entry(self, name: str) -> str | None:
        """What is wrong with the name file of ``name`` (None when it parses)."""
        return self._parse(name)[1]

    def _parse(self, name: str) -> tuple[Entry | None, str | None]:
        path = self._name_file(name)
        try:
            with open_below(self._root, "names/" + name) as f:
                raw = f.read()
        except FileNotFoundError:
            return None, None
        except OSError as e:
            self._unreadable(path, e)
            return None, None
        try:
            return parse_entry(name, raw), None
        except ValueError as e:
            return None, str(e)

    def names(self, prefix: str = "") -> Iterator[str]:
        """Every name kept, under ``prefix`` (``"value/"``, ``"artifact/emb/"``...)."""
        for name, _ in files_below(self._root, "names", self._link):
            if name.startswith(prefix):
                yield name

    def entries(self, prefix: str = "") -> Iterator[Entry]:
        """Every entry kept under ``prefix``, with its blob, size and meta (a damaged name
        file is left out, said once)."""
        for n in self.names(prefix):
            e = self.entry(n)
            if e is not None:
                yield e

    def blobs(self) -> Iterator[tuple[str, int]]:
        """Every blob on disk: (its hash, its size)."""
        for rel, st in files_below(self._root, "blobs", self._link):
            sub, _, f = rel.partition("/")
            blob = f.removesuffix(".safetensors")
            if f.endswith(".safetensors") and sub == blob[:2] and "/" not in f:
                yield blob, st.st_size

    def _link(self, rel: str) -> None:
        say_once(("store link", self._root, rel),
                 f"store {self.path}: {rel} below it is a link, which a store never "
                 "follows: it is left alone (remove it)")

    def blob_path(self, blob: str) -> Path:
        """Where the blob named ``blob`` lives (it may not exist)."""
        return Path(self._blob_file(blob))

    def name_path(self, name: str) -> Path:
        """Where the name file of ``name`` lives (it may not exist)."""
        return Path(self._name_file(name))

    def _blob_file(self, blob: str) -> str:
        return os.path.join(self._root, _blob_rel(blob))

    def _name_file(self, name: str) -> str:
        return os.path.join(self._root, "names", name)

    def check_blob(self, blob: str) -> str | None:
        """What is wrong with a blob (None when its bytes match its name and parse);
        ``"missing"`` when there is no such file."""
        try:
            with open_below(self._root, _blob_rel(blob)) as f:
                buf = read_whole(f)
        except FileNotFoundError:
            return "missing"
        except BelowLink:
            return "a link, which the store never follows: remove it"
        except OSError as e:
            return f"unreadable ({e.strerror})"
        if digest(buf) != blob:
            return "its bytes do not match its name (corrupted or truncated)"
        try:
            check(buf)
        except Damaged as e:
            return f"not a packed value ({e})"
        return None

    def _read_blob(self, entry: Entry):
        key = (self._root, entry.blob)
        held = recent.copy(key)
        if held is not None:
            return held if self._sized(entry, len(held)) else None
        path = self._blob_file(entry.blob)
        try:
            with open_below(self._root, _blob_rel(entry.blob)) as f:
                st = os.fstat(f.fileno())  # of the file read, not of whatever the path names later
                buf = read_whole(f, st.st_size)
        except FileNotFoundError:
            say_once(("store missing blob", entry.blob),
                     f"store {self.path}: {entry.name} points at blob {entry.blob[:16]} "
                     "which is gone; treated as a miss, the value is recomputed and kept "
                     "again")
            return None
        except OSError as e:
            self._unreadable(path, e)
            return None
        # a file checked whole before, its stat unchanged, is not hashed again (see _recent)
        if not checked.same(key, st):
            if digest(buf) != entry.blob:
                why = "its bytes do not match its name (corrupted)" if len(buf) == entry.size \
                    else f"{len(buf)} bytes instead of {entry.size} (truncated?)"
                self._damaged(entry.blob, why, entry.name)
                return None
            checked.note(key, st)
        if not self._sized(entry, len(buf)):
            return None
        if isinstance(buf, memoryview):  # read whole, not mapped: small enough to hold
            recent.hold(key, bytes(buf))
        return buf

    def _sized(self, entry: Entry, n: int) -> bool:
        # the blob hashes to its name, so it is whole: a size that differs is the name's fault
        if n == entry.size:
            return True
        self._bad_name(entry.name, f"it says {entry.size} bytes, blob {entry.blob[:16]} "
                                   f"has {n}")
        return False

    def _bad_name(self, name: str, why: str) -> None:
        say_once(("store bad name", self._root, name),
                 f"store {self.path}: the name file {self._name_file(name)} is damaged "
                 f"({why}); {name} is a miss, nothing else is touched. The value is "
                 "recomputed and its name written again (or delete that file)")

    def _unreadable(self, path: str, e: OSError) -> None:
        # said once per store and errno: a permissions problem hits every read alike
        say_once(("store read", self._root, e.errno),
                 f"store {self.path}: cannot read {path} ({e.strerror}); treated as a "
                 "miss, the value is recomputed. Check the directory's permissions")

    def _damaged(self, blob: str, why: str, name: str) -> None:
        # moved aside (a rename: whoever maps it keeps reading), so the next put rewrites it
        recent.drop((self._root, blob))
        checked.drop((self._root, blob))
        aside = self.path / "damaged"
        try:
            move_below(self._root, _blob_rel(blob), f"damaged/{blob}.safetensors", self.shared)
            where = f"moved to {aside}"
        except OSError as e:
            where = f"could not be moved to {aside} ({e.strerror}): delete {self._blob_file(blob)}"
        say_once(("store damaged", blob),
                 f"store {self.path}: blob {blob[:16]} (under {name}) is damaged: {why}. "
                 f"Treated as a miss, {where}; the value is recomputed and kept again")

    # -- writing ----------------------------------------------------------------
    def put(self, name: str, value: Any, meta: Mapping[str, str] | None = None) -> bool:
        """Keep ``value`` under ``name``; False when it cannot be kept (said on stderr)."""
        check_name(name)
        check_meta(name, meta)  # refused before anything is packed
        packed = self._pack(name, value)
        return packed is not None and self._keep(name, meta, *packed)

    def put_addressed(self, kind: str, value: Any, meta: Mapping[str, str] | None = None
                      ) -> str | None:
        """Keep ``value`` under its content's address, ``artifact/<kind>/<its blob's
        BLAKE3>`` (the name checks what it points at); that name, or None when it cannot
        be kept (said on stderr)."""
        check_name(f"artifact/{kind}/x")
        check_meta(f"artifact/{kind}", meta)
        packed = self._pack(f"artifact/{kind}/...", value)
        if packed is None:
            return None
        name = f"artifact/{kind}/{packed[2]}"
        return name if self._keep(name, meta, *packed) else None

    def _pack(self, name: str, value: Any) -> tuple[bytes, list, str, int] | None:
        try:
            header, buffers = pack(value)
        except Unpackable as e:
            say_once(("store no codec", e.kind),
                     f"{name}: a {e.kind} has no codec, so this value is not kept (import "
                     "somatize.torch for tensors, or register one with somatize.codec)")
            return None
        except (TypeError, ValueError) as e:
            say_once(("store cannot pack", type(value).__qualname__, str(e)),
                     f"{name}: this {type(value).__qualname__} cannot be kept ({e})")
            return None
        size = len(header) + sum(b.nbytes for b in buffers)
        h = hasher(size, header)
        for b in buffers:
            h.update(b)
        return header, buffers, h.hexdigest(), size

    def _keep(self, name: str, meta: Mapping[str, str] | None, header: bytes,
              buffers: list, blob: str, size: int) -> bool:
        meta = check_meta(name, meta)
        record = json.dumps({"blob": blob, "size": size, "meta": meta,
                             "time": time.time()}, sort_keys=True).encode()
        try:
            with Lock(self, self.lock_timeout, exclusive=False):
                if not self._has(blob):  # the same bytes are kept once
                    self._write(_blob_rel(blob), [header, *buffers], "blob")
                self._write("names/" + name, [record], "name")
        except OSError as e:
            why = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
                   errno.EROFS: "read-only file system"}.get(e.errno, e.strerror or str(e))
            say_once(("store write", self._root, e.errno),
                     f"store {self.path}: cannot keep {name} ({why}). The run goes on "
                     "without keeping it; free space or fix the directory to keep values")
            return False
        return True

    def _step(self, what: str) -> None:
        """Called at each step of a write (``blob:open`` ... ``name:renamed``); nothing
        here. tests/store_writer.py overrides it to kill or pause a writer there."""

    def _write(self, rel: str, pieces: list, what: str) -> None:
        write_file_atomic(self._root, rel, pieces, self.shared, self.fsync,
                          step=lambda at: self._step(f"{what}:{at}"))

    def _has(self, blob: str) -> bool:
        try:
            os.stat(self._blob_file(blob), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True  # a link there is refused when it is read, never written through

    # -- looking after it ---------------------------------------------------------
    def gc(self, dry_run: bool = False) -> tuple[int, int]:
        """Remove blobs no name points at, and leftovers of killed writers; first, the
        names of a study's rounds that are no longer live (``_rounds``: a study keeps its
        latest ``--keep-rounds`` rounds).

        Safe while others read (a removed blob is only unlinked, never truncated) and
        write (writers hold the lock shared from writing a blob to naming it; gc takes
        it exclusive). Returns (files removed, bytes freed); raises ``OSError`` when the
        store cannot be written (read-only, permissions).
        """
        removed = freed = 0
        if not self.path.is_dir():
            return 0, 0
        # a dry run removes nothing, so it neither needs the lock nor a writable store
        with nullcontext() if dry_run else Lock(self, self.lock_timeout, exclusive=True):
            # the rounds of studies no longer live (``_rounds``): their names go first
            names = doomed_names(self)
            for name in names:
                try:
                    size = os.stat(self._name_file(name), follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                if not dry_run:
                    remove_below(self._root, "names/" + name)
                removed += 1
                freed += size
            gone = set(names)
            used = {e.blob for e in self.entries() if e.name not in gone}
            doomed = [(_blob_rel(b), s) for b, s in self.blobs() if b not in used]
            doomed += [("tmp/" + rel, st.st_size) for rel, st in files_below(self._root, "tmp")]
            for rel, s in doomed:  # never through a link: files_below enters none
                if not dry_run:
                    remove_below(self._root, rel)
                removed += 1
                freed += s
        log.info("store %s: gc removed %d files, %d bytes", self.path, removed, freed)
        return removed, freed


def _blob_rel(blob: str) -> str:
    return f"blobs/{blob[:2]}/{blob}.safetensors"
