"""Naming: every value's key, known before anything runs, and the store asked for the
cached ones; what is kept carries its code's fingerprint, compared on a hit.

    named = look_up(g, g.plan.order, inputs={"enc": x}, keeper=keeper)
    named.keys["head"], named.hits.get("enc")
    if naming(g, keeper, runtime): ...    # keys are computed only where they can be used
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ._holes import Runtime
from ._keys import changed, classes_of, fingerprint, key_of_input, key_of_node
from ._memory import state_digest
from ._node import kind_of
from ._reads import reads_of
from ._say import say_once
from ._values import Opaque, bare, codec_for


def naming(graph, keeper: Any, runtime: Runtime | None) -> bool:
    """Whether a run names its values: something is cached and can be kept, here (a
    keeper) or on a worker that keeps (said once when something cached cannot be)."""
    if not graph.memory.cached:
        return False
    if keeper is not None or (runtime is not None and runtime.keeps()):
        return True
    say_once(("nothing kept", id(graph)),
             f"nodes {sorted(graph.memory.cached)} are .cached() but no store was given "
             "(here or on a worker): nothing is kept. Pass store='/path/to/dir'")
    return False


@dataclass(frozen=True)
class Named:
    """What is known of a walk before anything runs: every key, and the cached values
    the keeper already holds (by node, their code fingerprints checked)."""

    keys: Mapping[str, str | None]
    hits: Mapping[str, Any]


def look_up(
    graph,
    order: Iterable[str],
    *,
    inputs: Mapping[str, Any],
    given_keys: Mapping[str, str | None] | None = None,
    here: str | None = None,
    keeper: Any = None,
) -> Named:
    """Name the nodes of ``order`` over ``inputs`` and ask ``keeper`` for the cached ones
    run on ``here``'s side: the part of a walk that runs no node."""
    keys = _name(graph, order, inputs, given_keys or {})
    hits: dict[str, Any] = {}
    if keeper is not None:
        cached = cached_here(graph, here) - graph.memory.mapped  # those are asked per item
        ask = [n for n in order if n in cached and keys.get(n)]
        if ask:
            found = keeper.get_many([f"value/{keys[n]}" for n in ask])
            for n, kept in zip(ask, found, strict=True):
                if kept is not None:
                    _check_fingerprint(graph, n, kept.meta)
                    hits[n] = kept.value
    return Named(keys, hits)


def cached_here(graph, here: str | None) -> frozenset[str]:
    """The cached nodes that run on ``here``'s side."""
    return frozenset(n for n in graph.memory.cached if graph.placement.get(n) == here)


def _name(graph, order, inputs, given_keys) -> dict[str, str | None]:
    keys: dict[str, str | None] = dict(given_keys)
    by_input: dict[int, str | None] = {}  # roots fed the same object are hashed once
    for n in order:
        ps = graph.preds[n]
        if ps:
            fed = [(p, keys.get(p)) for p in ps]
        else:
            # a root node is named like any other, over the key of what it is fed: two
            # encoders (or two checkpoints) fed one input must not share a name
            x = inputs.get(n)
            if id(x) not in by_input:
                by_input[id(x)] = key_of_input(x) if n in inputs else None
                # a value whose codec refused it was said by key_of_input, with the reason
                if n in inputs and by_input[id(x)] is None and codec_for(bare(x)) is None:
                    what = type(bare(x)).__qualname__
                    say_once(("nameless input", n, what),
                             f"root {n!r} is fed a {what} that has no codec: nothing below it "
                             "is named, so nothing below it is kept (import somatize.torch "
                             "for tensors, or register a codec with somatize.codec)")
            fed = [("", by_input[id(x)])]
        node = graph.catalog[n]
        salt = graph.memory.cached.get(n)
        keys[n] = key_of_node(kind_of(node), live_state(n, node, salt), salt, fed)
    return keys


def live_state(n: str, node: Any, salt: str | None) -> str | None:
    """What a node computes with, as it is now: its settled digest (taken again if its
    weights or settings changed since ``freeze``) and the globals its code reads."""
    state = state_digest(node)
    reads = reads_of(classes_of(node, _code_of(node)), getattr(node, "_soma_held", ())).now(
        f"node {n!r}", salt)
    return f"{state or ''}|{reads}" if reads else state


def _code_of(node: Any) -> type:
    return getattr(node, "_soma_code", None) or type(node)


# the fingerprint of a tree of classes, read once per process: disassembling it costs
# milliseconds, more than a hit saves on a small node
_fingerprints: dict[tuple[type, ...], str] = {}


def _fingerprint_of(node: Any) -> str:
    classes = classes_of(node, _code_of(node))  # the node's module's children too
    if classes not in _fingerprints:
        _fingerprints[classes] = json.dumps(fingerprint(*classes), sort_keys=True)
    return _fingerprints[classes]


def keep(graph, keeper, n: str, key: str, value: Any) -> None:
    """Keep node ``n``'s value under its key, with its class and code fingerprint."""
    node = graph.catalog[n]
    meta = {"node": n, "class": kind_of(node), "fingerprint": _fingerprint_of(node)}
    keeper.put(f"value/{key}", value.value if isinstance(value, Opaque) else value, meta)


def _check_fingerprint(graph, n: str, meta: Mapping[str, str]) -> None:
    node = graph.catalog[n]
    now = _fingerprint_of(node)
    if meta.get("fingerprint") == now:
        return
    try:
        old = json.loads(meta.get("fingerprint", "{}"))
    except ValueError:
        old = {}
    diff = changed(old, json.loads(now))
    if diff:
        say_once(
            ("fingerprint", n, tuple(diff)),
            f"node {n!r} ({kind_of(node)}): the value kept under its name was produced by "
            f"different code ({', '.join(diff)} changed since). It is used anyway: the code "
            f"is not part of the name. If the change alters what {n!r} produces, say so in "
            f"its key with .cached(salt='v2')",
        )


