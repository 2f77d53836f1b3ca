"""Looking after per-item memory: what ``somatize store ls/du/verify/gc`` say of packs.

    for s in spaces(Items(path)): s.module, s.items, s.packs, s.bytes, s.disk
    problems = verify(Items(path))           # [] when every row checks out
    removed, freed = gc(Items(path), grace=3600)

``gc`` keeps a pack while any index segment names one of its rows, and leaves alone what
is younger than ``grace`` seconds (a writer names its pack in a segment just after
writing it; writers also hold the store's lock shared, gc holds it exclusive).
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from ._files import remove_below
from ._index import Segment
from ._items import Items
from ._lock import Lock
from ._packs import BadPack, Pack, row_digest


@dataclass(frozen=True)
class SpaceUse:
    """One module's items: who wrote them, how many, and the space they take."""

    key: str
    module: str
    kind: str
    items: int
    packs: int
    bytes: int  # the bytes of its packs and segments
    disk: int  # what they take on disk (blocks allocated)


def _files(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if p.is_file()]
    except FileNotFoundError:
        return []


def _meta(folder: Path) -> dict:
    try:
        return json.loads((folder / "module.json").read_text())
    except (OSError, ValueError):
        return {}


def spaces(items: Items) -> list[SpaceUse]:
    """What each module keeps per item."""
    out = []
    for key in items.keys():
        sp = items.space(key)
        files = _files(sp.folder / "packs") + _files(sp.folder / "index")
        stats = [p.stat() for p in files]
        meta = _meta(sp.folder)
        out.append(SpaceUse(key, meta.get("module", "-"), meta.get("class", "-"),
                            len(sp.index.records()), len(sp.pack_names()),
                            sum(s.st_size for s in stats),
                            sum(getattr(s, "st_blocks", 0) * 512 for s in stats)))
    return out


def verify(items: Items) -> list[str]:
    """Every problem found, each naming its file and what to do (empty: all checks out)."""
    problems = []
    for key in items.keys():
        sp = items.space(key)
        for p in sorted(_files(sp.folder / "index")):
            if p.name.endswith(".seg"):
                try:
                    Segment(p.read_bytes(), p.name)
                except ValueError as e:
                    problems.append(f"damaged: index segment {p}: {e}. Delete it (its items "
                                    "are recomputed and kept again)")
        packs: dict[str, Pack | None] = {}
        for k, loc in sorted(sp.index.records().items(), key=lambda kv: kv[1]):
            if loc.pack not in packs:
                path = sp.folder / "packs" / f"{loc.pack}.safetensors"
                try:
                    packs[loc.pack] = Pack.open(str(path))
                    if not packs[loc.pack].check(hold=False):
                        problems.append(f"damaged: pack {path}: its bytes do not match its "
                                        "digest. Delete it (its items are recomputed)")
                except (BadPack, OSError) as e:
                    packs[loc.pack] = None
                    problems.append(f"damaged: pack {path}: {e}. Delete it (its items are "
                                    "recomputed)")
            pack = packs[loc.pack]
            if pack is None:
                continue
            if row_digest(k, pack.dtype, pack.row, pack.raw_row(loc.row)) != loc.digest:
                problems.append(f"damaged: pack {pack.path} row {loc.row} does not match its "
                                "digest in the index. Delete the pack (its items are "
                                "recomputed)")
        for name in sorted(sp.index.packs_named() - set(packs)):  # older copies' packs
            path = sp.folder / "packs" / f"{name}.safetensors"
            try:
                with Pack.open(str(path)) as pack:
                    if not pack.check(hold=False):
                        problems.append(f"damaged: pack {path} (an older copy no lookup "
                                        "reads): its bytes do not match its digest. Delete it")
            except (BadPack, OSError) as e:
                problems.append(f"damaged: pack {path} (an older copy no lookup reads): "
                                f"{e}. Delete it")
        for p in packs.values():
            if p is not None:
                p.close()
    return problems


def gc(items: Items, grace: float = 3600.0, dry_run: bool = False) -> tuple[int, int]:
    """Remove packs no segment names and writers' leftovers older than ``grace``
    seconds; returns (files removed, bytes freed)."""
    removed = freed = 0
    if not items.root.is_dir():
        return 0, 0
    cutoff = time.time() - grace
    with Lock(items, items.lock_timeout, exclusive=True) if not dry_run else nullcontext():
        for key in items.keys():
            sp = items.space(key)
            named = sp.index.packs_named()  # every copy named: damage never costs the live one
            doomed = [sp.folder / "packs" / f"{p}.safetensors" for p in sp.pack_names()
                      if p not in named]
            doomed += list(sp.leftovers())
            for p in doomed:
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                if st.st_mtime > cutoff:
                    continue
                if not dry_run and not remove_below(str(items.path),
                                                    str(p.relative_to(items.path))):
                    continue
                removed += 1
                freed += st.st_size
        for p in items.root.glob(".drop-*"):  # a drop that was killed half way
            if not dry_run:
                shutil.rmtree(p, ignore_errors=True)
            removed += 1
    return removed, freed



def size_text(n: float) -> str:
    """``n`` bytes as the store's commands say them (``512 B``, ``1.5 MB``)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def ls_lines(path) -> list[str]:
    """``somatize store ls``: a line per module kept per item."""
    return [f"items/{u.key}\t{u.items} items in {u.packs} packs\t{size_text(u.bytes)}\t"
            f"module={u.module}\tclass={u.kind}" for u in spaces(Items(path))]


def du_line(path) -> str | None:
    """``somatize store du``: what per-item memory holds, beside the disk it takes."""
    uses = spaces(Items(path))
    if not uses:
        return None
    return (f"{path}: per item: {len(uses)} modules, {sum(u.items for u in uses)} items in "
            f"{sum(u.packs for u in uses)} packs, {size_text(sum(u.bytes for u in uses))} kept, "
            f"{size_text(sum(u.disk for u in uses))} on disk")


def drop(path, which: str) -> list[str]:
    """Drop the items of the modules whose key starts with ``which`` or whose path is
    ``which``; the keys dropped."""
    items = Items(path)
    hit = [u.key for u in spaces(items) if u.key.startswith(which) or u.module == which]
    for key in hit:
        items.drop(key)
    return hit
