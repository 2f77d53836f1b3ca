"""Keys: the name of a value, known before anything runs — a Merkle hash over the recipe.

    key(root) = H("input", the input by its content)     # the only place data is hashed
    key(node) = H("node", class name, state digest, salt, keys of its predecessors)

Pieces are length-prefixed, so ``["ab", "c"]`` and ``["a", "bc"]`` are two names.
The hash is BLAKE3 (cryptographic, 2-5 GB/s here; see scripts/bench_cache.py): a
shared store must not serve one value under another's name.

    key_of_input(x) == key_of_input(Opaque(x))
"""

from __future__ import annotations

import dis
import functools
import json
import struct
import types
from collections.abc import Callable, Iterable
from typing import Any

from blake3 import blake3

from ._say import say_once
from ._values import Opaque, codec_for

_LEN = struct.Struct("<Q")


class _Unnamed(Exception):
    """An object in the input has no codec: it, and all below it, stay nameless."""


def digest(pieces: Iterable[bytes | str]) -> str:
    """The hex BLAKE3 of length-prefixed pieces."""
    parts = []
    for p in pieces:
        if isinstance(p, str):
            p = p.encode()
        parts += (_LEN.pack(len(p)), p)
    return blake3(b"".join(parts)).hexdigest()  # one call: pieces are small, calls are not


def key_of_input(value: Any) -> str | None:
    """The key of a root's input, by content; None when part of it has no codec, or a
    codec that cannot turn it into bytes (said once: nothing below it is kept)."""
    h = blake3()
    try:
        _feed(h, value)
    except _Unnamed as e:
        if len(e.args) > 1:  # its codec refused it; no codec at all is said by the caller
            kind, why = e.args
            say_once(("input codec failed", kind, why),
                     f"an input holds a {kind} its codec cannot turn into bytes ({why}): "
                     "nothing computed from it is named, so nothing is kept; the run goes on")
        return None
    return digest(["input", h.hexdigest()])


# what the state of a call adds to a key (the autocast state, registered by somatize.torch)
_call_states: list[Callable[[], str | None]] = []


def call_state(read: Callable[[], str | None]) -> None:
    """Register ``read``: what it answers at naming time (None when nothing is on) is part
    of every node's key, so a value computed under another state is never served."""
    if read not in _call_states:
        _call_states.append(read)


def state_of_call() -> str:
    """What the state of this call adds to a key (every ``call_state`` that is on, joined;
    empty when none is): one way to say it, for whole values and items alike."""
    got = [read() for read in _call_states]
    return ";".join(c for c in got if c) if any(got) else ""


def key_of_node(kind: str, state: str | None, salt: str | None, preds) -> str | None:
    """The key of a node's output; ``preds`` is ``[(pred_id, key)]`` (None if unnamed).

    A node with one predecessor is named by its key alone; a fan-in also by the
    predecessor ids, since those are the keys of the dict the node is handed. The state
    of the call (registered with ``call_state``: autocast, say) is in it when on.
    """
    if any(k is None for _, k in preds):
        return None
    pieces = ["node", kind, state or "", salt or "", str(len(preds))]
    call = state_of_call()
    if call:
        pieces[0] = "node+call"  # never the name of a key without a call
        pieces.append(call)
    if len(preds) == 1:
        pieces.append(preds[0][1])
    else:
        for p, k in preds:
            pieces += [p, k]
    return digest(pieces)


def _feed(h, value: Any) -> None:
    # a tag and a length before every piece: no two values share an encoding
    if isinstance(value, Opaque):
        value = value.value
    if value is None or isinstance(value, (bool, int, float, complex)):
        _piece(h, b"s", repr(value).encode() + type(value).__name__.encode())
    elif isinstance(value, str):
        _piece(h, b"u", value.encode())
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _piece(h, b"b", value)
    elif isinstance(value, (list, tuple)):
        _piece(h, b"l" if isinstance(value, list) else b"t", str(len(value)).encode())
        for v in value:
            _feed(h, v)
    elif isinstance(value, dict):
        _piece(h, b"d", str(len(value)).encode())
        for k in value:  # in its order: a forward that iterates a dict sees that order
            _feed(h, k)
            _feed(h, value[k])
    else:
        c = codec_for(value)
        if c is None:
            raise _Unnamed(type(value).__name__)
        try:
            blob = c.dump(value)
            head = json.dumps([c.kind, blob.dtype, list(blob.shape)]).encode()
            raw = memoryview(blob.data).cast("B")
        except Exception as e:  # a codec refusing a value (complex128, sparse) is no crash
            raise _Unnamed(type(value).__qualname__, f"{type(e).__name__}: {e}") from None
        _piece(h, b"o", head)
        lay = c.layout(value) if c.layout is not None else ""
        if lay:  # a transposed input: the kernels may round it otherwise than its copy
            _piece(h, b"y", lay.encode())
        if type(value).__module__.partition(".")[0] not in _PLAIN_TYPES:
            _piece(h, b"c", _qualified(type(value)).encode())  # a tensor subclass is its own
        _piece(h, b"r", raw)


# where the types a codec dumps as they are come from: any other is named by its class
_PLAIN_TYPES = frozenset({"torch", "numpy"})


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _piece(h, tag: bytes, data) -> None:
    mv = memoryview(data).cast("B")  # hashes in place: never a copy of the bytes
    h.update(tag)
    h.update(_LEN.pack(mv.nbytes))
    h.update(mv)


# -- the code's fingerprint: written beside a value, compared on a hit, never in the key --

def fingerprint(cls: type, *more: type) -> dict[str, str]:
    """``{"Class.method": hash}`` for the code classes run (their own and their bases'):
    ``cls`` and ``more`` (the classes of a module's children, say).

    Only what the code refers to is read: globals it really loads (LOAD_GLOBAL),
    never attribute names (``self.model`` does not pull a global ``model`` in).
    """
    return {who: _code_hash(fn.__code__, fn.__globals__)
            for who, fn in functions_of((cls, *more), ("somatize", "torch."))}


def wrapped(fn: Any) -> types.FunctionType | None:
    """What a functools wrapper object (``lru_cache``, ``cache``) runs, else None."""
    if type(fn).__module__ == "functools" and not isinstance(fn, types.FunctionType):
        inner = getattr(fn, "__dict__", {}).get("__wrapped__")
        return inner if isinstance(inner, types.FunctionType) else None
    return None


def functions_of(classes: Iterable[type], skip: tuple[str, ...]) -> list:
    """``[("Class.method", function), ...]``: the functions (methods, class and static
    methods, property getters) of ``classes`` and their bases, each class once; classes of
    modules starting with ``skip``, and ``object``, left out."""
    out: list = []
    seen: set[type] = set()
    for klass in (k for c in classes for k in c.__mro__):
        if klass in seen or klass is object or klass.__module__.startswith(skip):
            continue
        seen.add(klass)
        for name, attr in vars(klass).items():
            fn = getattr(attr, "__func__", attr)
            if isinstance(fn, property):
                fn = fn.fget
            elif isinstance(fn, functools.cached_property):
                fn = fn.func
            fn = wrapped(fn) or fn  # functools.lru_cache's wrapper: what it runs
            if isinstance(fn, types.FunctionType):
                out.append((f"{klass.__qualname__}.{name}", fn))
    return out


def _code_hash(code: types.CodeType, globals_: dict, depth: int = 0) -> str:
    pieces: list[bytes | str] = [code.co_code, repr(code.co_varnames)]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            pieces.append(_code_hash(c, globals_, depth))
        else:
            pieces.append(repr(c))
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            pieces.append("global:" + str(ins.argval))
            pieces.append(_global_piece(globals_.get(ins.argval), depth))
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR"):
            pieces.append("attr:" + str(ins.argval))
    return digest(pieces)


def _global_piece(value: Any, depth: int) -> str:
    """What a loaded global contributes: its code for a function, its value for a constant."""
    if isinstance(value, (bool, int, float, str, bytes, type(None))):
        return repr(value)
    if isinstance(value, types.FunctionType) and depth < 3:
        return _code_hash(value.__code__, value.__globals__, depth + 1)
    if isinstance(value, (type, types.ModuleType)):
        return getattr(value, "__qualname__", None) or value.__name__
    return type(value).__qualname__


# what a node's code is made of besides its own class (the classes of a module's children,
# registered by somatize.torch)
_trees: list[Callable[[Any], Iterable[type]]] = []


def code_tree(read: Callable[[Any], Iterable[type]]) -> None:
    """Register ``read``: the classes whose code a node runs besides its own class."""
    if read not in _trees:
        _trees.append(read)


def classes_of(node: Any, cls: type) -> tuple[type, ...]:
    """``cls`` and the classes registered readers find in ``node``, each once, in order."""
    more = {c for read in _trees for c in read(node)} - {cls}
    return (cls, *sorted(more, key=lambda c: (c.__module__, c.__qualname__)))


def changed(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """The methods whose code differs between two fingerprints."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
