"""``somatize store {ls,du,verify,gc,drop} PATH``: look inside a store, check it, clean it.

    somatize store ls /scratch/soma [PREFIX]   # names, node, class, fingerprint, size;
                                               # studies' rounds: study, round, size
    somatize store du /scratch/soma            # blobs, names, bytes, on disk, what gc frees
    somatize store verify /scratch/soma        # exit 1 when a blob or a name is damaged
    somatize store gc /scratch/soma [--dry-run] [--grace SECONDS]
    somatize store drop /scratch/soma MODULE   # one module's per-item entries, alone

Per-item memory (``items/``: packs and their index) is listed, measured, checked and
cleaned beside the names and blobs; so are the rounds a study's hub keeps
(``store._rounds``: ``gc`` keeps each study's latest ``--keep-rounds``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from blake3 import blake3

from .store import Store
from .store import _items_care as items
from .store import _rounds as rounds


def _ls(store: Store, prefix: str) -> int:
    for e in store.entries(prefix):
        fp = e.meta.get("fingerprint")
        fp = blake3(fp.encode()).hexdigest()[:12] if fp else "-"
        print(f"{e.name}\t{items.size_text(e.size)}\tnode={e.meta.get('node', '-')}\t"
              f"class={e.meta.get('class', '-')}\tcode={fp}\tblob={e.blob[:12]}")
    for line in items.ls_lines(store.path):
        print(line)
    if rounds.RECORD.startswith(prefix) or prefix.startswith(rounds.RECORD):
        for line in rounds.ls_lines(store):
            print(line)
    return 0


def _du(store: Store) -> int:
    blobs = dict(store.blobs())
    entries = list(store.entries())
    used = {e.blob for e in entries}
    free = sum(s for b, s in blobs.items() if b not in used)
    tmp = [p.stat().st_size for p in (store.path / "tmp").glob("*")] if (
        store.path / "tmp").is_dir() else []
    files, on_disk = disk_used(store.path)
    print(f"{store.path}: {len(blobs)} blobs, {items.size_text(sum(blobs.values()))}; "
          f"{len(entries)} names; unreferenced {len(blobs) - len(used & set(blobs))} blobs, "
          f"{items.size_text(free)}; leftovers {len(tmp)} files, "
          f"{items.size_text(sum(tmp))} (gc frees both); "
          f"on disk {items.size_text(on_disk)} in {files} files (whole blocks, names and all)")
    per_item = items.du_line(store.path)
    if per_item:
        print(per_item)
    return 0


def disk_used(root: Path) -> tuple[int, int]:
    """``(files, bytes)`` the store takes on disk: allocated blocks (``st_blocks`` x 512),
    every file under it counted once, links not followed."""
    st = os.lstat(root)
    files, used = 0, st.st_blocks * 512
    seen: set[tuple[int, int]] = {(st.st_dev, st.st_ino)}
    for top, dirs, names in os.walk(root):
        for name in [*names, *dirs]:
            try:
                st = os.lstat(os.path.join(top, name))
            except FileNotFoundError:  # removed meanwhile (a gc, a writer's temporary)
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            files += name in names
            used += st.st_blocks * 512
    return files, used


def _verify(store: Store) -> int:
    bad = 0
    by_blob: dict[str, list] = {}
    for name in store.names():
        why = store.check_entry(name)
        if why is not None:
            bad += 1
            print(f"damaged: name file {store.name_path(name)}: {why}. Delete it (its value "
                  "is recomputed and named again)", file=sys.stderr)
            continue
        e = store.entry(name)
        if e is not None:
            by_blob.setdefault(e.blob, []).append(e)
    on_disk = dict(store.blobs())
    problems: dict[str, str] = {}  # blob: what is wrong with it
    for blob in sorted(set(on_disk) | set(by_blob)):
        named = by_blob.get(blob, [])
        why = store.check_blob(blob)
        if why == "missing":
            bad += len(named)
            for e in named:
                print(f"missing: {e.name} points at blob {blob[:16]}, which is gone. Delete "
                      f"the name file {store.name_path(e.name)} (its value is recomputed and "
                      "kept again)", file=sys.stderr)
        elif why is not None:
            bad += 1
            problems[blob] = why
            names = ", ".join(e.name for e in named) or "no name"
            print(f"damaged: blob {blob[:16]} ({names}): {why}. Delete "
                  f"{store.blob_path(blob)} (its values are recomputed and kept again)",
                  file=sys.stderr)
        else:
            for e in named:
                if e.size != on_disk[blob]:
                    bad += 1
                    print(f"damaged: name file {store.name_path(e.name)}: it says {e.size} "
                          f"bytes, blob {blob[:16]} has {on_disk[blob]}. Delete it (its value "
                          "is recomputed and named again)", file=sys.stderr)
    for problem in [*rounds.verify(store, problems), *items.verify(items.Items(store.path))]:
        bad += 1
        print(problem, file=sys.stderr)
    print(f"{store.path}: {len(on_disk)} blobs, {sum(map(len, by_blob.values()))} names, "
          f"{bad} damaged")
    return 1 if bad else 0


def _gc(store: Store, dry_run: bool, grace: float = 3600.0) -> int:
    removed, freed = store.gc(dry_run=dry_run)
    r, f = items.gc(items.Items(store.path), grace=grace, dry_run=dry_run)
    removed, freed = removed + r, freed + f
    print(f"{store.path}: {'would remove' if dry_run else 'removed'} {removed} files, "
          f"{items.size_text(freed)}")
    return 0


def _drop(store: Store, module: str) -> int:
    gone = items.drop(store.path, module)
    if not gone:
        print(f"somatize store drop: {store.path} keeps nothing per item for {module!r}; "
              "`somatize store ls` lists what it keeps", file=sys.stderr)
        return 1
    print(f"{store.path}: dropped the per-item entries of {len(gone)} module keys "
          f"({', '.join(k[:12] for k in gone)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``somatize store ...``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="somatize store", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list names, with node, class, code fingerprint and size")
    ls.add_argument("path")
    ls.add_argument("prefix", nargs="?", default="", help="e.g. value/ or artifact/")
    sub.add_parser("du", help="how much is kept, and what gc would free").add_argument("path")
    sub.add_parser("verify", help="check every blob; exit 1 if one is damaged").add_argument(
        "path")
    gc = sub.add_parser("gc", help="remove blobs no name points at (safe while in use)")
    gc.add_argument("path")
    gc.add_argument("--dry-run", action="store_true")
    gc.add_argument("--grace", type=float, default=3600.0,
                    help="leave packs younger than this many seconds (a writer may be "
                         "naming them); default 3600")
    drop = sub.add_parser("drop", help="remove one module's per-item entries")
    drop.add_argument("path")
    drop.add_argument("module", help="its path (as `ls` shows it) or the start of its key")
    args = parser.parse_args(argv)
    path = Path(args.path)
    if not any((path / d).is_dir() for d in ("names", "blobs", "items")):
        print(f"somatize store: no store at {path} (no names/ nor blobs/ in it); "
              "a store is created by the first g.forward(x, store=PATH) that keeps a value",
              file=sys.stderr)
        return 2
    store = Store(path)
    try:
        if args.cmd == "ls":
            return _ls(store, args.prefix)
        if args.cmd == "du":
            return _du(store)
        if args.cmd == "verify":
            return _verify(store)
        if args.cmd == "drop":
            return _drop(store, args.module)
        return _gc(store, args.dry_run, args.grace)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        fix = ("; run it where the store is writable (or try --dry-run)" if args.cmd == "gc"
               else "; check the store's permissions")
        print(f"somatize store {args.cmd}: the store at {path} cannot be "
              f"{'cleaned' if args.cmd == 'gc' else 'read'}: {e.strerror or e}{where}{fix}",
              file=sys.stderr)
        return 1
