"""What a node's code reads besides its input and its own attributes, named by value: the
globals its methods (and the user's functions they call) load, read again at every call,
so a changed module-level setting is a new key, never a stale hit.

    reads = reads_of((Encoder,))          # built once per tree of classes: the references
    reads.now("node 'enc'", salt=None)   # "CFG=dict[...];config.GAIN=float:2.0;..."

A reference is a global name and the attributes read off it while it is a module
(``config.GAIN``, ``np.pi``). Its value is named by ``name_value``: plain data (None, bools,
numbers, strings, bytes, enums, tuples, lists, sets, dicts, dataclasses, namespaces, slices
and ranges of them) by value, an object with a codec (a tensor) by its content, a class,
module or built-in by its qualified name, a function by its qualified name, defaults and
closure cells (its code is in the fingerprint). Anything else is refused naming the
global, unless a salt names it. Only code outside the installed packages and the standard
library is walked (yours).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import logging
import os
import sys
import sysconfig
import types
from collections.abc import Callable
from typing import Any

from blake3 import blake3

from ._bytecode import DYNAMIC, attrs_set, globals_written, loaded_globals
from ._errors import Refused
from ._keys import functions_of, wrapped
from ._values import codec_for

_MAX_DEPTH = 8
# where installed and standard code lives: its functions are not walked (not yours)
_LIBRARY = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib",
                                                     "platlib")} if p)
_LIBRARY_MODULES = ("somatize", "torch", "lightning", "numpy", "builtins")

# namers for types the core does not know (torch.dtype, torch.device), registered by
# somatize.torch: each answers a text for a value it names, None otherwise
_namers: list[Callable[[Any], str | None]] = []


def value_namer(read: Callable[[Any], str | None]) -> None:
    """Register ``read``: a text naming a value of a type the core does not know."""
    if read not in _namers:
        _namers.append(read)


# torch's readers of process state (torch.is_grad_enabled, torch.get_default_device),
# registered by somatize.torch: code of yours that calls one is keyed by its answer
_state_readers: set = set()
_SEEDING = frozenset({"manual_seed", "seed", "set_rng_state", "fork_rng"})
_READER_TYPES = (types.BuiltinFunctionType, types.FunctionType)


def state_reader(read: Callable[[], Any]) -> None:
    """Register ``read``: a function of no arguments whose answer, when the user's code
    refers to it, is part of the key (read again at every call)."""
    _state_readers.add(read)


class Unnamed(Exception):
    """A value that cannot be named by value (``.args``: its path and its type)."""


def yours(code: types.CodeType) -> bool:
    """Whether ``code`` is the user's (not an installed package's, nor the stdlib's)."""
    f = code.co_filename
    if f.startswith("<"):
        return True  # exec'd or interactive: the user's
    return not os.path.realpath(f).startswith(_LIBRARY)


@functools.lru_cache(maxsize=4096)  # asked at every call: a path resolved once per module
def module_is_yours(mod: types.ModuleType) -> bool:
    """Whether a module object is the user's (a config module), not a package's."""
    f = getattr(mod, "__file__", None)
    return bool(f) and not mod.__name__.startswith(_LIBRARY_MODULES) and not (
        os.path.realpath(f).startswith(_LIBRARY))


def code_digest(code: types.CodeType) -> str:
    """A digest of a code object: bytecode, constants (nested code too), names."""
    h = blake3(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        h.update((code_digest(c) if isinstance(c, types.CodeType) else repr(c)).encode())
    return h.hexdigest()[:32]


def name_value(v: Any, where: str, depth: int = 0,
               inner: Callable[[Any, str, int], str] | None = None) -> str:
    """A value as text that differs whenever it does; raises ``Unnamed`` otherwise.
    ``inner`` names the values inside containers (default: this function)."""
    again = inner or name_value
    if depth > _MAX_DEPTH:
        raise Unnamed(where, "structure nested too deep")
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, enum.Enum):
        return enum_text(v, again, depth)
    for read in _namers:
        got = read(v)
        if got is not None:
            return got
    if isinstance(v, (type, types.ModuleType, types.BuiltinFunctionType)):
        return f"name:{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', v.__name__)}"
    if isinstance(v, types.FunctionType):
        if not yours(v.__code__) or v.__module__.startswith(_LIBRARY_MODULES):
            return f"name:{v.__module__}.{v.__qualname__}"  # a library's: its version names it
        return function_text(v, where, depth, again)
    if type(v) is object or isinstance(v, (logging.Logger, logging.LoggerAdapter)):
        return f"name:{type(v).__qualname__}"  # a sentinel, a logger: nothing computed
    if isinstance(v, types.MethodType):
        return f"method:{type(v.__self__).__qualname__}.{again(v.__func__, where, depth + 1)}"
    if isinstance(v, functools.partial):  # its function and what it was given, by value
        return (f"partial:{again(v.func, f'{where}.func', depth + 1)}:"
                f"{again(v.args, f'{where}.args', depth + 1)}:"
                f"{again(v.keywords, f'{where}.keywords', depth + 1)}")
    inner = wrapped(v)
    if inner is not None:  # an lru_cache'd function of yours: by what it wraps
        return f"{type(v).__qualname__}:{again(inner, where, depth + 1)}"
    text = structure_text(v, where, depth, again)
    if text is not None:
        return text
    c = codec_for(v)
    if c is not None:
        try:
            blob = c.dump(v)
            h = blake3(f"{c.kind}{blob.dtype}{list(blob.shape)}".encode())
            h.update(memoryview(blob.data).cast("B"))
            return f"{c.kind}:{h.hexdigest()[:32]}"
        except Exception:  # noqa: BLE001 - a codec refusing it: unnamed, said below
            pass
    raise Unnamed(where, type(v).__qualname__)


def enum_text(v: enum.Enum, again: Callable, depth: int) -> str:
    """An enum member by its class, name and value (``Mode.FAST = 2.0`` in the source of
    another run is another name)."""
    try:
        value = again(v.value, "value", depth + 1)
    except Unnamed:
        value = "?"
    return f"enum:{type(v).__module__}.{type(v).__qualname__}.{v.name}={value}"


def structure_text(v: Any, where: str, depth: int, again: Callable) -> str | None:
    """A tuple, list, set, dict (in its order: code that iterates it sees that order) or
    dataclass named by its items, each by ``again(item, where, depth)``; None for any
    other value."""
    if isinstance(v, (tuple, list, set, frozenset)):
        items = [again(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            items.sort()
        return f"{type(v).__name__}[{','.join(items)}]"
    if isinstance(v, dict):
        return "dict[" + ",".join(f"{again(k, where, depth + 1)}:"
                                  f"{again(x, f'{where}[{k!r}]', depth + 1)}"
                                  for k, x in v.items()) + "]"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        items = [f"{f.name}={again(getattr(v, f.name), f'{where}.{f.name}', depth + 1)}"
                 for f in dataclasses.fields(v)]
        return f"{type(v).__module__}.{type(v).__qualname__}({','.join(items)})"
    if isinstance(v, NAMESPACES):  # args = parser.parse_args(): its fields, in their order
        items = [f"{k}={again(x, f'{where}.{k}', depth + 1)}" for k, x in vars(v).items()]
        return f"{type(v).__module__}.{type(v).__qualname__}({','.join(items)})"
    if isinstance(v, (slice, range)):  # self.keep = slice(0, 4)
        return f"{type(v).__name__}:{again((v.start, v.stop, v.step), where, depth + 1)}"
    return None


NAMESPACES = (types.SimpleNamespace, argparse.Namespace)  # the stdlib's bags of attributes


def function_text(fn: types.FunctionType, where: str, depth: int,
                  inner: Callable[[Any, str, int], str]) -> str:
    """A function by its name, code, defaults and closure cells (by value)."""
    parts = [f"fn:{fn.__module__}.{fn.__qualname__}:{code_digest(fn.__code__)}"]
    for i, d in enumerate(fn.__defaults__ or ()):
        parts.append(inner(d, f"{where}.__defaults__[{i}]", depth + 1))
    for k, d in sorted((fn.__kwdefaults__ or {}).items()):
        parts.append(f"{k}={inner(d, f'{where}.__kwdefaults__[{k!r}]', depth + 1)}")
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            content = cell.cell_contents
        except ValueError:  # a cell not yet filled
            content = None
        parts.append(f"{var}={inner(content, f'{where} (closure {var!r})', depth + 1)}")
    return "(" + ";".join(parts) + ")"


class Reads:
    """The globals a tree of classes' code reads (and the user's functions it calls)."""

    def __init__(self, refs: list[tuple[str, dict, str, tuple[str, ...]]]):
        self.refs = refs  # (who reads it, its globals, the name, attributes read off it)
        # whether code other than a constructor seeds torch's generator (its draws are its
        # own, from a state it set)
        self.seeds = any((chain[-1] if chain else name) in _SEEDING and not who.partition(
            " ")[0].endswith(".__init__") for who, _, name, chain in refs)

    def now(self, who_runs: str, salt: str | None) -> str:
        """What they hold now, as one text; refused for one that cannot be named (left
        out when ``salt`` names what the key cannot see)."""
        out = []
        for who, g, name, chain in self.refs:
            if name == DYNAMIC:
                if salt is None:
                    raise Refused(_computed(who_runs, who, f"{chain[0]}[...]"))
                continue
            if name not in g:
                continue  # a builtin (or not yet defined): not the user's data
            v, path = g[name], f"{who[6:]}.{name}" if who.startswith("class ") else name
            owner = None  # what the value was read off, if anything
            for attr in chain:
                if attr == DYNAMIC and (module_is_yours(v) if isinstance(
                        v, types.ModuleType) else _walked(v)):
                    if salt is None:
                        raise Refused(_computed(who_runs, who, f"getattr({path}, ...)"))
                    break
                if not _walked(v) or not hasattr(v, attr):
                    break
                owner, v, path = v, getattr(v, attr), f"{path}.{attr}"
            if isinstance(v, (type, types.ModuleType)):
                continue  # code, not data: the fingerprint beside the value names it
            if type(v) in _READER_TYPES:
                if v in _state_readers:
                    v, path = v(), f"{path}()"  # torch.is_grad_enabled(): its answer
                elif owner is not None and _libraries(owner):
                    continue  # read off a package (torch.relu): its version names it
            try:
                # a package's function bound by your code (ACT = torch.relu) is named too,
                # so rebinding it is a new name
                out.append(f"{path}={name_value(v, path)}")
            except Unnamed as e:
                if salt is not None:
                    continue
                what, kind = e.args
                if v is os.environ:  # os.getenv, os.environ[...]: the environment
                    raise Refused(
                        f"{who_runs}: {who} reads the environment (os.environ), which the "
                        "key of its cached outputs cannot follow (a variable changed would "
                        "serve stale outputs). Read it once into an attribute (self.gain = "
                        "float(os.getenv('GAIN', '1')) in __init__), or give it a salt= "
                        "(.cached(salt=...), SomatizeCache(salt=...)) that names the "
                        "variables it reads") from None
                where = "class attribute" if who.startswith("class ") else "global"
                raise Refused(
                    f"{who_runs}: {who} reads the {where} {what!r}, a {kind}, which the key "
                    "of its cached outputs cannot name (a change to it would serve stale "
                    "outputs). Make it plain data (a number, string, tuple, dict, dataclass), "
                    "pass it as an attribute or buffer, or give it a salt= "
                    "(.cached(salt=...), SomatizeCache(salt=...)) that you change whenever "
                    "it changes what the node computes") from None
        return ";".join(sorted(set(out)))


def _computed(who_runs: str, who: str, what: str) -> str:
    return (f"{who_runs}: {who} reads {what} by a name it computes, which the key of its "
            "cached outputs cannot know (a change to what it reads would serve stale "
            "outputs). Read the global by its name (CFG, config.GAIN), pass it as an "
            "attribute, or give a salt= (.cached(salt=...), SomatizeCache(salt=...)) that you "
            "change whenever it changes what the node computes")


def _libraries(owner: Any) -> bool:
    # a module or class a name was read off that is a package's, not yours
    return owner is not None and not (module_is_yours(owner) if isinstance(
        owner, types.ModuleType) else class_is_yours(owner))


def _walked(v: Any) -> bool:
    # what a chain of attributes is followed through: a module, or a class of yours
    return isinstance(v, types.ModuleType) or (isinstance(v, type) and class_is_yours(v))


@functools.lru_cache(maxsize=4096)
def class_is_yours(klass: type) -> bool:
    """Whether a class is the user's (not the standard library's, nor a package's)."""
    mod = sys.modules.get(klass.__module__ or "")
    return not (klass.__module__ or "").startswith(_LIBRARY_MODULES) and (
        mod is None or not getattr(mod, "__file__", None) or module_is_yours(mod))


_built: dict[tuple, Reads] = {}


def reads_of(classes: tuple[type, ...], held: tuple = ()) -> Reads:
    """The globals read by the code of ``classes`` and of ``held`` (functions and classes
    a module holds as attributes: ``code_in``), built once per tuple of them."""
    got = _built.get((classes, held))
    if got is None:
        got = _built[(classes, held)] = Reads(_references(classes, held))
    return got


def code_in(v: Any, depth: int = 0) -> list:
    """The functions and classes of yours that ``v`` holds (a function, a bound method, a
    dataclass, a partial, a container of them; a function's closure cells, defaults and
    what it wraps): their code runs when ``v`` is called, so what it reads is read."""
    if depth > 4 or v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return []
    if isinstance(v, types.FunctionType):
        inner = [*(v.__defaults__ or ()), *(v.__kwdefaults__ or {}).values()]
        for cell in v.__closure__ or ():
            try:
                inner.append(cell.cell_contents)
            except ValueError:
                pass
        if "__wrapped__" in vars(v):
            inner.append(vars(v)["__wrapped__"])
        return [v, *(c for x in inner if x is not v for c in code_in(x, depth + 1))]
    if isinstance(v, types.MethodType):
        return [*code_in(v.__func__, depth + 1), *code_in(type(v.__self__), depth + 1)]
    if isinstance(v, functools.partial):
        return [c for x in (v.func, *v.args, *v.keywords.values()) for c in code_in(x, depth + 1)]
    if isinstance(v, type):
        return [v] if _walked(v) else []
    if isinstance(v, dict):
        return [c for x in v.values() for c in code_in(x, depth + 1)]
    if isinstance(v, (list, tuple, set, frozenset)):
        return [c for x in v for c in code_in(x, depth + 1)]
    if dataclasses.is_dataclass(v) or isinstance(v, enum.Enum):
        return code_in(type(v), depth + 1)
    inner = wrapped(v)  # an lru_cache'd function: what it wraps runs
    return code_in(inner, depth + 1) if inner is not None else []


def _references(classes: tuple[type, ...], held: tuple = ()) -> list:
    refs: list = []
    seen_code: set[int] = set()
    classes = (*classes, *(c for c in held if isinstance(c, type)))
    todo: list[tuple[str, types.FunctionType]] = functions_of(classes, _LIBRARY_MODULES)
    todo += [(f"{f.__qualname__} (held as an attribute)", f) for f in held
             if isinstance(f, types.FunctionType)]
    reached: list[type] = []  # classes of yours the code reaches: their code and data too
    written: set[tuple[int, str]] = set()  # (id of its globals, name)
    set_attrs: set[str] = set()  # attributes the code sets (Encoder.runs += 1: a counter)
    while todo:
        who, fn = todo.pop()
        if id(fn.__code__) in seen_code or not yours(fn.__code__) or (
                fn.__module__ or "").startswith(_LIBRARY_MODULES):
            continue
        seen_code.add(id(fn.__code__))
        written |= {(id(fn.__globals__), n) for n in globals_written(fn.__code__)}
        set_attrs |= attrs_set(fn.__code__)
        # a decorated helper's wrapped function, a function in a closure cell or default
        todo += [(f"{c.__qualname__} (called by {who})", c) for c in code_in(fn)[1:]
                 if isinstance(c, types.FunctionType)]
        for name, chain in loaded_globals(fn.__code__):
            refs.append((who, fn.__globals__, name, chain))
            v = fn.__globals__.get(name)
            for attr in chain:  # helpers.scale, Helper.scale: reached through a module
                if not _walked(v):
                    break
                v = getattr(v, attr, None)
            for c in code_in(v):  # a function, one in a dict (ACTS["relu"]), a class
                if isinstance(c, types.FunctionType):
                    todo.append((f"{c.__qualname__} (called by {who})", c))
                elif c not in classes and c not in reached:
                    reached.append(c)
                    todo += [f for f in functions_of((c,), _LIBRARY_MODULES)
                             if yours(f[1].__code__)]
    # a global the code writes into is its bookkeeping (a counter, a log), not an input
    return [r for r in refs if (id(r[1]), r[2]) not in written] + _class_data(
        (*classes, *reached), set_attrs)


def _class_data(classes: tuple[type, ...], set_attrs: set[str]) -> list:
    """The data attributes of the user's classes in the tree (``GAIN = 1.0`` read as
    ``self.GAIN``), as references read again at every call, as globals are: a class
    attribute set mid-run is a new key. One the code itself sets (``set_attrs``: a
    counter, ``Encoder.runs += 1``) is its bookkeeping, left out."""
    refs, seen = [], set()
    for klass in (k for c in classes for k in c.__mro__):
        if klass in seen or klass is object or not class_is_yours(klass):
            continue
        seen.add(klass)
        for name, v in vars(klass).items():
            if name.startswith("__") or isinstance(v, _CODE) or name in set_attrs or hasattr(
                    type(v), "__get__"):  # a descriptor (a namedtuple's field): code
                continue
            refs.append((f"class {klass.__qualname__}", vars(klass), name, ()))
    return refs


# what a class holds that is code or a descriptor, not data: named by the fingerprint
_CODE = (types.FunctionType, staticmethod, classmethod, property, type, types.ModuleType,
         types.BuiltinFunctionType, types.MemberDescriptorType, types.GetSetDescriptorType,
         functools.cached_property)
