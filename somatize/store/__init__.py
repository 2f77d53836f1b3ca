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
    PATH/damaged/                       blobs found damaged, moved aside
    PATH/lock                           writers hold it shared, ``gc`` exclusive (flock:
                                        on NFS, run gc only where every writer runs)

A writer killed anywhere leaves the whole entry or none of it; at worst an unnamed blob
or a temporary file, which ``gc`` removes. Every read checks what it reads: the blob's
bytes against its name, its header and structure (a store may be shared, and a blob
crafted to hash right must not hand out memory it does not hold), the name file too.
What fails is a miss, said on stderr, never a wrong value. What was read and checked
is held in memory (256 MB at most, small blobs only) and served again from there,
since a blob never changes; a bigger blob's file is not hashed again while its stat
identity is the one checked (``_recent``: bit rot under it is ``store verify``'s). Every
tensor read back starts 64-byte aligned (see ``somatize._packing``): a cached value never
changes a number computed from it.

That check on every read is also why no fsync is the default: after a power cut a
blob that did not reach the disk reads as a miss and is recomputed (a killed process
loses nothing: the page cache survives it). ``fsync=True`` buys durability across power
cuts; measured by scripts/bench_cache.py on a 64 MB write it cost 1.1-1.2x here.

A store is private to its owner (directories 0700, files 0600) unless made shared
(``Store(path, shared=True)``: its group may read and write), and never follows a link
below its root (docs/security.md).

The modules: ``_store`` (reading, writing, gc), ``_entry`` (names and name files),
``_blobs`` (a blob's bytes read and hashed), ``_files`` (every file made and reached:
its mode, no link followed), ``_lock``, ``_recent`` (the memory of what was read),
``_guarded`` (the never-raising keeper the engine is handed).
"""

from ._entry import Entry
from ._guarded import Guarded as Guarded  # what open_keeper returns; not in __all__
from ._guarded import open_keeper
from ._store import Store

__all__ = ["Entry", "Store", "open_keeper"]
