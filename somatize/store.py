"""The directory store that fills the Keeper hole: content-addressed safetensors blobs,
and names that point at them.

    store = Store("/scratch/soma")
    store.put("value/" + key, {"emb": t}, meta={"node": "encoder"})
    [kept, None] = store.get_many(["value/" + key, "value/" + other])
    kept.value["emb"], kept.meta["node"]

    g.forward(x, store="/scratch/soma")          # what the engine does with it

On disk::

    PATH/blobs/ab/abcd....safetensors   a value's bytes, named by their BLAKE3; never
                                        rewritten (a reader may hold it mmapped)
    PATH/names/value/<key>              JSON: the blob, its size, the meta written beside
    PATH/names/artifact/<kind>/<id>
    PATH/tmp/                           files being written; renamed into place when whole
    PATH/lock                           writers hold it shared, ``gc`` exclusive (flock:
                                        on NFS, run gc only where every writer runs)

A write is: the blob to ``tmp/`` then renamed (skipped when those bytes are already
kept), then the name to ``tmp/`` then renamed. A writer killed anywhere leaves the whole
entry or none of it; at worst an unnamed blob or a temporary file, which ``gc`` removes.
Every read checks the blob's bytes against its name, so a damaged or torn blob is a
miss (said on stderr, moved to ``PATH/damaged/``), never a wrong value. What was read
and checked is held in memory (256 MB at most, small blobs only) and served again
from there, since a blob never changes.

That check on every read is also why no fsync is the default: after a power cut a
blob that did not reach the disk
reads as a miss and is recomputed (a killed process loses nothing: the page cache
survives it). ``fsync=True`` buys durability across power cuts; measured by
scripts/bench_cache.py on a 64 MB write it cost 1.1-1.2x here (ext4, warm cache).
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blake3 import blake3

from ._errors import StoreError
from ._keeper import Kept
from ._packing import Damaged, Unpackable, pack, unpack
from ._say import say_once

try:
    import fcntl
except ImportError:  # pragma: no cover - no flock on this platform: gc is not guarded
    fcntl = None

log = logging.getLogger(__name__)

__all__ = ["Entry", "Store", "open_keeper"]

_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]*$")
_BLOB = re.compile(r"^[0-9a-f]{64}$")
_MAP_FROM = 1 << 20  # bytes from which a blob is mapped (copy-on-write) rather than read
_HASH_THREADS_FROM = 1 << 20  # BLAKE3 uses every core from here on; below, threads cost more

# A test hook: called with the name of each step of a write (see tests/test_store_processes.py)
_at_step = None


def _step(what: str) -> None:
    if _at_step is not None:
        _at_step(what)


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
    if not ok or not all(_PART.match(p) for p in parts[1:]):
        raise StoreError(
            f"{name!r} is not a store name: use 'value/<key>' or 'artifact/<kind>/<id>', "
            "each part letters, digits, '_', '.', '=', '+' or '-'"
        )


class Store:
    """A directory of content-addressed safetensors blobs and the names that point at them.

    Args:
        path: the directory (created on the first write).
        fsync: flush each blob and name to disk before it is named (durability across a
            power cut; not needed for consistency, which every read checks).
        lock_timeout: seconds a writer waits for a running ``gc`` before not keeping.
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False,
                 lock_timeout: float = 60.0):
        self.path = Path(path)
        self._root = str(self.path)
        self.fsync = fsync
        self.lock_timeout = lock_timeout

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
        buf = self._read_blob(entry.blob, entry.size, name)
        if buf is None:
            return None
        try:
            value = unpack(memoryview(buf))
        except Unpackable as e:
            say_once(("store no codec", e.kind),
                     f"store {self.path}: {name} holds a {e.kind!r} but no codec for it is "
                     f"registered in this process, so it is a miss (import somatize.torch "
                     "for tensors, or register one with somatize.codec)")
            return None
        except Damaged as e:
            self._damaged(entry.blob, f"not a packed value ({e})", name)
            return None
        return Kept(value, dict(entry.meta))

    def entry(self, name: str) -> Entry | None:
        """The entry under ``name`` (without reading its value), or None."""
        path = os.path.join(self._root, "names", name)  # str paths: pathlib costs on a hit
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._unreadable(path, e)
        try:
            d = json.loads(raw)
            blob, size, meta = d["blob"], int(d["size"]), d.get("meta") or {}
            if not _BLOB.match(blob):
                raise ValueError(blob)
        except (ValueError, KeyError, TypeError):
            say_once(("store bad name", str(path)),
                     f"store {self.path}: the name file {path} is damaged; treated as a "
                     "miss. Delete it (the value is recomputed and kept again)")
            return None
        return Entry(name, blob, size, meta)

    def names(self, prefix: str = "") -> Iterator[str]:
        """Every name kept, under ``prefix`` (``"value/"``, ``"artifact/emb/"``...)."""
        root = self.path / "names"
        for dirpath, _, files in os.walk(root):
            rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
            for f in sorted(files):
                name = f if rel == "." else f"{rel}/{f}"
                if name.startswith(prefix):
                    yield name

    def entries(self, prefix: str = "") -> Iterator[Entry]:
        """Every entry kept under ``prefix``, with its blob, size and meta."""
        for n in self.names(prefix):
            e = self.entry(n)
            if e is not None:
                yield e

    def blobs(self) -> Iterator[tuple[str, int]]:
        """Every blob on disk: (its hash, its size)."""
        for sub in sorted((self.path / "blobs").glob("??")):
            for p in sorted(sub.glob("*.safetensors")):
                try:
                    yield p.name.split(".")[0], p.stat().st_size
                except FileNotFoundError:
                    continue  # removed by a gc meanwhile

    def blob_path(self, blob: str) -> Path:
        return Path(self._blob_file(blob))

    def _blob_file(self, blob: str) -> str:
        return os.path.join(self._root, "blobs", blob[:2], blob + ".safetensors")

    def check_blob(self, blob: str) -> str | None:
        """What is wrong with a blob (None when its bytes match its name)."""
        try:
            with open(self.blob_path(blob), "rb") as f:
                buf = self._map(f)
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            return f"unreadable ({e.strerror})"
        if _hash(buf) != blob:
            return "its bytes do not match its name (corrupted or truncated)"
        try:
            unpack(memoryview(buf))
        except Damaged as e:
            return f"not a packed value ({e})"
        except Unpackable:
            pass  # a codec this process lacks is not damage
        return None

    def _read_blob(self, blob: str, size: int, name: str):
        held = _recent.get((self._root, blob))
        if held is not None:
            return bytearray(held)  # a private copy: the caller may write into what it gets
        path = self._blob_file(blob)
        try:
            with open(path, "rb") as f:
                n = os.fstat(f.fileno()).st_size
                if n != size:
                    self._damaged(blob, f"{n} bytes instead of {size} (truncated?)", name)
                    return None
                buf = self._map(f)
        except FileNotFoundError:
            say_once(("store missing blob", blob),
                     f"store {self.path}: {name} points at blob {blob[:16]} which is gone; "
                     "treated as a miss, the value is recomputed and kept again")
            return None
        except OSError as e:
            return self._unreadable(path, e)
        if _hash(buf) != blob:
            self._damaged(blob, "its bytes do not match its name (corrupted)", name)
            return None
        if isinstance(buf, bytearray):
            _recent.hold((self._root, blob), bytes(buf))
        return buf

    @staticmethod
    def _map(f):
        n = os.fstat(f.fileno()).st_size
        if n < _MAP_FROM:
            buf = bytearray(n)
            f.readinto(buf)
            return buf
        # copy-on-write: the caller may modify what it gets; the file never changes
        return mmap.mmap(f.fileno(), n, access=mmap.ACCESS_COPY)

    def _unreadable(self, path: str, e: OSError) -> None:
        # said once per store and errno: a permissions problem hits every read alike
        say_once(("store read", str(self.path), e.errno),
                 f"store {self.path}: cannot read {path} ({e.strerror}); treated as a "
                 "miss, the value is recomputed. Check the directory's permissions")

    def _damaged(self, blob: str, why: str, name: str) -> None:
        # moved aside (a rename: whoever maps it keeps reading), so the next put rewrites it
        _recent.drop((self._root, blob))
        try:
            (self.path / "damaged").mkdir(exist_ok=True)
            os.replace(self.blob_path(blob), self.path / "damaged" / f"{blob}.safetensors")
        except OSError:
            pass
        say_once(("store damaged", blob),
                 f"store {self.path}: blob {blob[:16]} (under {name}) is damaged: {why}. "
                 f"Treated as a miss, moved to {self.path / 'damaged'}; the value is "
                 "recomputed and kept again")

    # -- writing ----------------------------------------------------------------
    def put(self, name: str, value: Any, meta: Mapping[str, str] | None = None) -> bool:
        """Keep ``value`` under ``name``; False when it cannot be kept (said on stderr)."""
        check_name(name)
        try:
            header, buffers = pack(value)
        except Unpackable as e:
            say_once(("store no codec", e.kind),
                     f"{name}: a {e.kind} has no codec, so this value is not kept (import "
                     "somatize.torch for tensors, or register one with somatize.codec)")
            return False
        except (TypeError, ValueError) as e:
            say_once(("store cannot pack", type(value).__qualname__, str(e)),
                     f"{name}: this {type(value).__qualname__} cannot be kept ({e})")
            return False
        size = len(header) + sum(b.nbytes for b in buffers)
        h = blake3(max_threads=blake3.AUTO if size >= _HASH_THREADS_FROM else 1)
        h.update(header)
        for b in buffers:
            h.update(b)
        blob = h.hexdigest()
        record = json.dumps({"blob": blob, "size": size, "meta": dict(meta or {}),
                             "time": time.time()}, sort_keys=True).encode()
        try:
            with self._lock(exclusive=False):
                if not self.blob_path(blob).exists():  # the same bytes are kept once
                    self._write(self.blob_path(blob), [header, *buffers], "blob")
                self._write(self.path / "names" / name, [record], "name")
        except OSError as e:
            why = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
                   errno.EROFS: "read-only file system"}.get(e.errno, e.strerror or str(e))
            say_once(("store write", str(self.path), e.errno),
                     f"store {self.path}: cannot keep {name} ({why}). The run goes on "
                     "without keeping it; free space or fix the directory to keep values")
            return False
        return True

    def _write(self, final: Path, pieces: list, what: str) -> None:
        tmp = self.path / "tmp" / f"{os.getpid()}-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                _step(f"{what}:open")
                for i, p in enumerate(pieces):
                    f.write(p)
                    if i == 0:
                        f.flush()
                        _step(f"{what}:partial")
                f.flush()
                _step(f"{what}:written")
                if self.fsync:
                    os.fsync(f.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            _step(f"{what}:closed")
            os.replace(tmp, final)  # atomic: readers see the old file, or the whole new one
            _step(f"{what}:renamed")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            _sync_dir(final.parent)

    def _lock(self, exclusive: bool):
        return _Lock(self, exclusive)

    # -- looking after it ---------------------------------------------------------
    def gc(self, dry_run: bool = False) -> tuple[int, int]:
        """Remove blobs no name points at, and leftovers of killed writers.

        Safe while others read (a removed blob is only unlinked, never truncated) and
        write (writers hold the lock shared from writing a blob to naming it; gc takes
        it exclusive). Returns (files removed, bytes freed).
        """
        removed = freed = 0
        if not self.path.is_dir():
            return 0, 0
        with self._lock(exclusive=True):
            used = {e.blob for e in self.entries()}
            doomed = [(self.blob_path(b), s) for b, s in self.blobs() if b not in used]
            doomed += [(p, p.stat().st_size) for p in _files(self.path / "tmp")]
            for p, s in doomed:
                if not dry_run:
                    p.unlink(missing_ok=True)
                removed += 1
                freed += s
        log.info("store %s: gc removed %d files, %d bytes", self.path, removed, freed)
        return removed, freed


class _Lock:
    """``flock`` on PATH/lock: shared for writers, exclusive for gc; waits up to a timeout."""

    def __init__(self, store: Store, exclusive: bool):
        self.store, self.exclusive, self.fd = store, exclusive, None

    def __enter__(self):
        for d in ("tmp", "blobs", "names"):
            (self.store.path / d).mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            return self
        self.fd = os.open(self.store.path / "lock", os.O_RDWR | os.O_CREAT, 0o666)
        mode = fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + self.store.lock_timeout
        while True:
            try:
                fcntl.flock(self.fd, mode | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise OSError(errno.EAGAIN, "the store stayed locked (a gc running?) "
                                  f"for {self.store.lock_timeout:.0f} s") from None
                time.sleep(0.02)

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock


class _Recent:
    """The last blobs read, checked, in memory (bounded): a blob never changes once
    written, so what was read whole is served again without opening the file or
    hashing it (an epoch over a cached encoder reads the same values every epoch)."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.items: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> bytes | None:
        with self.lock:
            data = self.items.get(key)
            if data is not None:
                self.items.move_to_end(key)
            return data

    def hold(self, key: tuple[str, str], data: bytes) -> None:
        if len(data) > self.budget // 8:
            return
        with self.lock:
            if key in self.items:
                return
            self.items[key] = data
            self.used += len(data)
            while self.used > self.budget:
                _, old = self.items.popitem(last=False)
                self.used -= len(old)

    def drop(self, key: tuple[str, str]) -> None:
        with self.lock:
            data = self.items.pop(key, None)
            if data is not None:
                self.used -= len(data)


_recent = _Recent(256 << 20)


def _hash(buf) -> str:
    n = len(buf)
    return blake3(buf, max_threads=blake3.AUTO if n >= _HASH_THREADS_FROM else 1).hexdigest()


def _files(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if p.is_file()]
    except FileNotFoundError:
        return []


def _sync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- what the engine is handed ------------------------------------------------------

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

