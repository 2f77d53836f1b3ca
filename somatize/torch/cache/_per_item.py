"""Per-item memory for tensors: a batch answered row by row, so shuffled batches hit.

A module (or ``.mapped()`` node) kept per item promises that each output row depends only
on its input row along dim 0. Each row of its input gets its own key; the rows already
kept are read from the store, the others are computed together as one batch and kept (one
pack); the batch comes back in its own order, as a fresh tensor with the dtype and device
of the module's own output.

    item = PerItem("body", "Encoder", "/scratch/soma")
    y = item(x, lambda sub: encoder(sub), state=digest)   # item.hits, item.misses

    key(item) = BLAKE3-keyed(k, the row's bytes)[:16]
    k = BLAKE3-derive-key(CONTEXT, module key | the rows' dtype and shape)
    module key = H("items", class, state digest, salt, call state)  (as whole-batch keys)

Keyed and derive-key modes keep item keys apart from whole-value keys (plain BLAKE3 over
length-prefixed pieces): no row can be named like a whole value.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..._errors import Refused
from ..._keeper import items_of_keeper
from ..._keys import changed, classes_of
from ..._naming import _fingerprint_of, live_state
from ..._node import kind_of
from ..._reads import reads_of
from ..._say import say_once
from ..._values import Opaque, bare
from ...store._items import Items, Space
from .._codec import DTYPES as CODEC_DTYPES
from .._codec import TORCH_DTYPES
from .._private import first_device as _device_of
from .._state import modules_of
from ._cached import CachedForward, _refuse_trained_input
from ._coupled import refuse_coupled, refuse_coupled_node
from ._draws import drawing_refused, held_generators
from ._gather import gather
from ._item_keys import CONTEXT, item_keys, module_key, rows_key  # noqa: F401 - names kept here
from ._served_batch import served_batch

NAMES, DTYPES = CODEC_DTYPES, TORCH_DTYPES  # the codec's one table: torch dtype <-> name
CHUNK = 32  # misses are computed in batches of this many rows (padded): docs/per-item.md


def items_of(store: Any) -> Items | None:
    """The per-item part of a store: a directory's, or what a keeper offers through its
    public ``items()`` (a Store, a wrapper of one, a keeper of the user's own)."""
    if store is None or isinstance(store, Items):
        return store
    if isinstance(store, (str, os.PathLike)):
        return Items(store)
    return items_of_keeper(store)


class PerItem:
    """Answers batches item by item from a store, for one module; counts items.

    Args:
        name: the module's path or node id, for messages and what is kept beside rows.
        kind: its class name (in the key).
        store: a directory path, a Store, or a keeper wrapping one.
        salt: what the key cannot see, as ``.cached(salt=)``.
    """

    def __init__(self, name: str, kind: str, store: Any, salt: str | None = None,
                 exact: bool = False):
        self.name, self.kind, self.salt, self.exact = name, kind, salt, exact
        self.rows_of: dict[tuple, tuple[int, ...]] = {}  # input row layout -> output row
        self.store = store
        self.hits = 0
        self.misses = 0
        self.row: tuple[int, ...] | None = None  # the trailing shape of its output rows
        self.device: torch.device | None = None  # where its output lands
        self._items: Items | None = None
        self._code_seen: set[tuple] = set()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_items": None, "_code_seen": set()}

    def space(self, state: str | None, meta: dict[str, str]) -> Space | None:
        if self._items is None:
            self._items = items_of(self.store)
        if self._items is None:
            return None
        space = self._items.space(module_key(self.kind, state, self.salt), meta)
        seen = (space.key, meta.get("fingerprint"))
        if seen not in self._code_seen:  # once per module key and code in this process
            self._code_seen.add(seen)
            _check_code(self.name, self.kind, space.written_meta().get("fingerprint"),
                        meta.get("fingerprint"))
        return space

    def __call__(self, x: Any, run: Callable[[torch.Tensor], Any], state: str | None,
                 meta: dict[str, str], device: torch.device | None = None) -> tuple[Any, bool]:
        """The output for batch ``x`` and whether ``run`` was called (for the misses)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise Refused(
                f"{self.name!r} is kept per item, but it was called with a "
                f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of no dim'}: "
                "per item needs one tensor whose dim 0 is the batch. Keep it per batch "
                "(leave out per_item=True / .mapped())")
        space = self.space(state, {"module": self.name, "class": self.kind, **meta})
        if space is None:
            say_once(("per item, no directory", self.name),
                     f"{self.name!r} is kept per item, but its store "
                     f"({type(self.store).__name__}) is not a store directory: nothing is kept "
                     "per item. Give a directory path (store='/scratch/soma')")
        if space is None or x.shape[0] == 0:
            return run(x), True
        n = x.shape[0]
        layout = (space.key, x.dtype, tuple(x.shape[1:]))  # what its rows' keys are derived under
        done, keys, asked = served_batch(space, x, self.device or device or x.device)
        if done is not None:  # the epochs after the first: every row served, in one call
            self.hits += n
            self.row = self.rows_of.setdefault(layout, tuple(done.shape[1:]))
            return done, False
        rows = None if asked else space.served(keys)  # (where no native call asked)
        if rows is None:
            locs = space.lookup(keys)
            rows = space.read(keys, locs) if any(loc is not None for loc in locs) else None
        ok = rows.ok if rows is not None else [False] * n
        nhit = sum(ok)
        if nhit == n:  # the epochs after the first: no miss to sort out
            todo: list[int] = []
        else:
            first: dict[bytes, int] = {}
            for i in range(n):
                if not ok[i]:
                    first.setdefault(keys[i], i)
            todo = list(first.values())
        hit = nhit > 0
        self.hits += nhit
        self.misses += n - nhit
        out = None
        if todo:
            sub = x if len(todo) == n else x[torch.tensor(todo, device=x.device)]
            out = self._checked(self._chunked(run, sub, x, todo), len(todo), rows if hit else None,
                                layout)
            kept = out.detach()
            kept = (kept.cpu() if kept.device.type != "cpu" else kept).contiguous()
            space.put([keys[i] for i in todo], NAMES[out.dtype], self.rows_of[layout],
                      kept.reshape(len(todo), -1).view(torch.uint8).numpy())
            dtype, dev = out.dtype, out.device
            self.device = dev
        else:
            dtype = DTYPES[rows.dtype]
            self.rows_of.setdefault(layout, tuple(rows.row))
            dev = self.device or device or x.device
        self.row = self.rows_of[layout]
        result = torch.empty((n, *self.row), dtype=dtype, device=dev)
        if hit and rows.codes is not None:
            gather(result, rows, dtype)
        for buf, slots, at in rows.parts if hit else ():  # a pack's rows at once
            src = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(-1, *rows.row)
            result[torch.tensor(slots, device=dev)] = src[torch.tensor(at)].to(dev)
        if todo:
            where = {k: j for j, k in enumerate(keys[i] for i in todo)}
            miss = [i for i in range(n) if not ok[i]]
            result[torch.tensor(miss, device=dev)] = out.detach()[
                torch.tensor([where[keys[i]] for i in miss], device=out.device)].to(dev)
        return result, bool(todo)

    def _chunked(self, run: Callable[[torch.Tensor], Any], sub: torch.Tensor,
                 x: torch.Tensor, todo: list[int]) -> Any:
        """``run`` over ``sub`` in chunks of ``CHUNK`` rows, the last one padded with copies
        of its last row: every row is computed in a batch of the same size, so its value
        does not depend on the batch it came in (on kernels whose rows depend only on the
        batch's size: docs/per-item.md). With ``exact``, checked against ``x`` computed
        as it came, and refused where they differ."""
        n = sub.shape[0]
        outs = []
        for at in range(0, n, CHUNK):
            part = sub[at:at + CHUNK]
            short = CHUNK - part.shape[0]
            if short:
                part = torch.cat([part, part[-1:].expand(short, *part.shape[1:])])
            y = run(part)
            if not isinstance(y, torch.Tensor) or y.dim() == 0 or y.shape[0] != CHUNK:
                return self._checked(y, CHUNK, None, None, n)  # refused, naming what it gave
            outs.append(y[:CHUNK - short] if short else y)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.exact:
            self._check_exact(run, x, todo, out)
        return out

    def _check_exact(self, run, x: torch.Tensor, todo: list[int], out: torch.Tensor) -> None:
        whole = run(x)  # the batch as it came, as a run without the store computes it
        if isinstance(whole, torch.Tensor) and whole.shape[1:] == out.shape[1:]:
            whole = whole[torch.tensor(todo, device=whole.device)]
            if torch.equal(whole, out):
                return
        differ = (whole != out).reshape(out.shape[0], -1).any(1).nonzero().flatten().tolist() \
            if isinstance(whole, torch.Tensor) and whole.shape == out.shape else []
        raise Refused(
            f"{self.name!r} is kept per item with exact=True, but its rows depend on the batch "
            f"they are computed in: in this batch of {x.shape[0]} rows, rows {differ[:8]} of "
            f"its misses differ from the same rows computed in chunks of {CHUNK} (the last "
            "bits, on these "
            "kernels), so a kept row would not equal what computing this batch again gives. "
            "Per item gives each item's value as first computed, in a chunk of "
            f"{CHUNK}: drop exact=True to accept that, or keep it per batch (leave out "
            "per_item=True / .mapped())")

    def _checked(self, out: Any, n: int, rows: Any, layout: Any,
                 misses: int | None = None) -> torch.Tensor:
        """Refuse an output that is not rows of the batch, or whose rows changed shape
        (``misses``: how many of the ``n`` rows it was given were the batch's)."""
        if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != n \
                or out.dtype not in NAMES:
            got = (f"a {tuple(out.shape)} {out.dtype} tensor" if isinstance(out, torch.Tensor)
                   else f"a {type(out).__name__}")
            raise Refused(
                f"{self.name!r} is kept per item, but for a batch of {misses or n} it returned "
                f"{got}{_given(n) if misses else ''}: "
                f"per item needs a tensor whose dim 0 is the batch ({n} rows). Keep it per "
                "batch (leave out per_item=True / .mapped())")
        row = tuple(out.shape[1:])
        seen = self.rows_of.get(layout, rows.row if rows is not None else None)
        if seen is not None and row != tuple(seen):
            raise Refused(
                f"{self.name!r} is kept per item, but its output rows were {list(seen)} and "
                f"are now {list(row)}: their shape changes from batch to batch (dynamic "
                "padding?), so a kept row would not fit another batch. Pad to a fixed length, "
                "or keep it per batch (leave out per_item=True / .mapped())")
        if rows is not None and DTYPES.get(rows.dtype) != out.dtype:
            raise Refused(
                f"{self.name!r} is kept per item, and its kept rows are {rows.dtype} but it "
                f"now returns {out.dtype} under the same name: give it another salt or store")
        if layout is not None:
            self.rows_of[layout] = row
        return out


def _given(n: int) -> str:
    return f" for the {n} rows it was given (misses are computed in chunks of {n})"


def _check_code(name: str, kind: str, then: str | None, now: str | None) -> None:
    """Say once when the items kept under a module's name were made by other code."""
    if then is None or now is None or then == now:
        return
    try:
        diff = changed(json.loads(then), json.loads(now))
    except ValueError:
        diff = ["(unreadable)"]
    if diff:
        say_once(("per-item code", name, tuple(diff)),
                 f"{name!r} ({kind}): the items kept under its name were produced by different "
                 f"code ({', '.join(diff)} changed since). They are used anyway: the code is "
                 "not part of the name. If the change alters what it produces, give it a salt "
                 "(.cached(salt='v2')) or another store")


class PerItemForward(CachedForward):
    """``CachedForward`` item by item: what ``SomatizeCache(..., per_item=True)`` installs.

    Refused when installed (and at any call that shows it): a layer that couples rows
    (BatchNorm in train mode or without running statistics), a call with anything but one
    tensor, an output that is not rows of the batch or whose rows change shape.
    """

    def __init__(self, module: torch.nn.Module, path: str, store: Any, previous: Any = None,
                 salt: str | None = None, exact: bool = False):
        refuse_coupled(module, path)
        super().__init__(module, path, store, previous, salt)
        if items_of(self.store) is None:
            raise Refused(
                f"module {path!r} is kept per item, which needs a store directory (its packs "
                f"and index are files) or a keeper offering rows through items() as "
                f"Store.items() does; a {type(store).__name__} is neither: give SomatizeCache "
                "store='/scratch/soma' or a somatize.store.Store")
        self.item = PerItem(path, self.kind, self.store, salt, exact)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.run(*args, **kwargs)
        if len(args) != 1 or kwargs:
            raise Refused(
                f"module {self.path!r} is kept per item, but it was called with "
                f"{len(args)} arguments{' and keywords ' + str(sorted(kwargs)) if kwargs else ''}"
                ": per item takes one tensor whose dim 0 is the batch. Keep it per batch "
                "(SomatizeCache without per_item=True)")
        _refuse_trained_input(self.path, args, kwargs)
        if self._watch is None or self.reads is None or self._watch.changed(self.module):
            refuse_coupled(self.module, self.path)  # a layer's train flag is watched too
            self.settle()  # its weights or settings were written: a new name
        out, _ = self.item(args[0], self.compute, self.state(), {"fingerprint": self.code},
                           self._watch.device)  # (where its weights were when it was set)
        self.hits, self.misses = self.item.hits, self.item.misses
        return out


_nodes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def answer_mapped(graph, n: str, node: Any, x: Any, keeper: Any, run) -> tuple[Any, bool]:
    """The engine's ``mapped`` hole: a ``.mapped()`` node's batch, item by item."""
    modules = modules_of(node)
    refuse_coupled_node(n, node)
    mine = _nodes.setdefault(node, {})
    item = mine.get(id(keeper))
    if item is None:
        item = mine[id(keeper)] = PerItem(n, kind_of(node), keeper, graph.memory.cached.get(n))
    item.exact = bool(getattr(node, "_soma_exact", False))  # .mapped(exact=True)
    wrapped = isinstance(x, Opaque)
    opaque = []

    def compute(sub: torch.Tensor) -> torch.Tensor:
        y = computed_node(graph, n, node, lambda: run(Opaque(sub) if wrapped else sub))
        opaque.append(isinstance(y, Opaque))
        return bare(y)

    dev = next((d for _, m in modules if (d := _device_of(m)) is not None), None)
    out, ran = item(bare(x), compute, live_state(n, node, graph.memory.cached.get(n)),
                    {"fingerprint": _fingerprint_of(node)}, dev)
    return (Opaque(out) if (opaque[0] if opaque else wrapped) else out), ran


def computed_node(graph, n: str, node: Any, run: Callable[[], Any]) -> Any:
    """The engine's ``computed`` hole: a cached node's miss, refused if its forward drew
    from torch's random generator (unless its code seeds it)."""
    classes = classes_of(node, getattr(node, "_soma_code", None) or type(node))
    if reads_of(classes, getattr(node, "_soma_held", ())).seeds:
        return run()
    held = held_generators([node, *(m for _, m in modules_of(node))], classes)
    return drawing_refused(f"node {n!r} ({kind_of(node)})", run, f".cached() on {n!r}", held)


def mapped_counts(graph) -> tuple[int, int]:
    """``(hits, misses)`` in items of a graph's ``.mapped()`` nodes run in this process."""
    hits = misses = 0
    for n in graph.memory.mapped:
        for item in _nodes.get(graph.catalog[n], {}).values():
            hits, misses = hits + item.hits, misses + item.misses
    return hits, misses


def say_if_never_hit(graph, epoch: int, before: tuple[int, int]) -> None:
    """After an epoch past the first (counted from 0) in which the graph's ``.mapped()``
    nodes found none of their items: say once that the store only grows (augmentation
    before the cached node, most likely)."""
    hits, misses = mapped_counts(graph)
    hits, misses = hits - before[0], misses - before[1]
    if epoch < 1 or hits or not misses:
        return
    say_once(("per item never hits", id(graph)),
             f"epoch {epoch + 1} found none of its {misses} items in the store, which grew by "
             f"as many rows: the inputs of {sorted(graph.memory.mapped)} are new every epoch "
             "(random augmentation before the cached node, most likely), so nothing kept is "
             "ever read again. Cache the output before the augmentation, or leave it uncached")
