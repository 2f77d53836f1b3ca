"""Settings: what a module computes with besides its state — the plain attributes of it and
of every module inside it (``eps``, ``momentum``, a dropout's ``p``, a ``scale``), named so
that changing one changes the key of what it produces.

    pieces, tensors = settings_of(body, "body")   # ["0.eps=f:1e-05", ...], [("0.mask", t)]

A setting is named by value when it is plain data: None, bools, numbers, strings, bytes,
``torch.dtype``/``torch.device``, enums, functions (yours by their code, constants,
defaults and closure cells; a package's by its name and code), dataclass instances of
those, and tuples, lists, sets and dicts (in their order) of them. A tensor that is not a
parameter or buffer is state: its content is digested with the rest. What cannot be named
(an arbitrary object) is refused, naming the attribute and what to do, unless ``salt``
says the caller names it. The autocast state and the math settings of the call
(``math_state``) are registered here as part of every key (``somatize._keys.call_state``),
on both routes. ``Watch`` (``_watch``) tells at each call whether any of it may have
changed.
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from typing import Any

import torch

from ..._bytecode import attrs_set
from ..._classes import class_name
from ..._errors import Refused
from ..._keys import call_state
from ..._reads import (
    Unnamed,
    code_digest,
    code_in,
    enum_text,
    function_text,
    module_is_yours,
    name_value,
    state_reader,
    structure_text,
    value_namer,
    yours,
)
from .._private import (
    FORWARD_HOOKS,
    ROUTED_CALL,
    forward_hooks,
    global_forward_hooks,
)

# the device types whose autocast state is part of every key
_AUTOCAST = ("cpu", "cuda", "xpu", "mps")
# what torch keeps on every module for itself (registries, hooks: named apart, below); the
# train flag is a setting (a child's dropout or BatchNorm put back in train mode)
_BOOKKEEPING = frozenset(vars(torch.nn.Module())) - {"training"}
_MAX_DEPTH = 8


def autocast_state() -> str | None:
    """The autocast state of this call (device types where it is on, with their dtype):
    it changes what a module computes, so it is part of the name."""
    on = [f"{d}:{torch.get_autocast_dtype(d)}" for d in _AUTOCAST if torch.is_autocast_enabled(d)]
    return "autocast " + ",".join(on) if on else None


call_state(autocast_state)

def global_hooks() -> str | None:
    """The hooks registered for every module (``register_module_forward_hook``): they run
    inside a cached forward too, so they are part of every key (None when there are none)."""
    hooks = global_forward_hooks()
    if not hooks:
        return None
    try:
        return "hooks " + _named(hooks, "global hooks", [], 0)
    except Unnamed:
        return "hooks " + ",".join(f"{type(h).__qualname__}@{id(h)}" for h in hooks)


call_state(global_hooks)

# the process-wide settings that change what a kernel computes (or which kernel runs),
# beside autocast in every key: matmul precision, deterministic algorithms, torch.backends'
# flags of the CPU, and those of CUDA (cuBLAS's workspace too) where CUDA is present. The
# thread count is not (a store shared by machines of other sizes would never hit).
_CPU = ("float32_matmul_precision", "deterministic_algorithms", "backends.mkldnn.enabled",
        "backends.mkldnn.deterministic", "backends.mkldnn.matmul.fp32_precision",
        "backends.mkldnn.conv.fp32_precision", "backends.mkldnn.rnn.fp32_precision",
        "backends.opt_einsum.enabled", "backends.opt_einsum.strategy",
        "nnpack", "backends.quantized.engine",
        "mha_fastpath",  # a Transformer layer's fused path in eval
        "flush_denormal")  # read from the CPU's own float math (torch has no read of it)
_readers: list | None = None


def _math_readers() -> list:
    global _readers
    if _readers is None:
        from .._math import _MATH, fast_read  # noqa: PLC0415 - the settings that travel

        known = {name: read for name, read, _ in _MATH}
        cuda = torch.cuda.is_available()
        names = [n for n in known if n != "threads" and (cuda or n in _CPU)]
        names += [n for n in _CPU if n not in known]
        _readers = [(n, known[n] if n in known else fast_read(n)) for n in names]
        # what a tensor made in the forward (torch.ones(4)) is, and so what it promotes to
        _readers.append(("default_dtype", torch.get_default_dtype))
    return _readers


_texts: dict[tuple, str] = {}  # (name, value) of the settings read -> their text
_values: dict[tuple, str] = {}  # every setting's value, in order -> their text


def math_state() -> str:
    """The math settings of this call, as one text (always part of a key): each read in
    one pass, and the text of what they answered found by their values; where a read
    raises (torch refuses a legacy flag after the new API set it), read one by one."""
    readers = _math_readers()
    try:
        now = tuple([read() for _, read in readers])
    except (AttributeError, RuntimeError):
        return _math_state()
    try:
        return _values[now]
    except KeyError:
        text = _math_state()
        if len(_values) < 64:
            _values[now] = text
        return text
    except TypeError:  # a setting that cannot be a dict key
        return _math_state()


def _math_state() -> str:
    got = []
    for name, read in _math_readers():
        try:
            got.append((name, read()))
        except (AttributeError, RuntimeError):
            continue
    now = tuple(got)
    try:
        return _texts[now]
    except KeyError:
        text = "math " + ",".join(f"{name}={v!r}" for name, v in now)
        if len(_texts) < 64:
            _texts[now] = text
        return text
    except TypeError:  # a setting that cannot be a dict key
        return "math " + ",".join(f"{name}={v!r}" for name, v in now)


call_state(math_state)


def _torch_value(v: Any) -> str | None:
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"{type(v).__name__}:{v}"
    if isinstance(v, torch.Size):
        return f"Size:{tuple(v)}"
    return None


value_namer(_torch_value)
# torch's readers of the state of the process: a forward that asks one computes by its
# answer (``if torch.is_grad_enabled(): ...``), so its answer is in that forward's key
for _read in ("is_grad_enabled", "is_inference_mode_enabled", "get_default_device",
              "get_default_dtype", "get_num_threads",
              "are_deterministic_algorithms_enabled", "get_float32_matmul_precision",
              "is_anomaly_enabled"):
    if hasattr(torch, _read):
        state_reader(getattr(torch, _read))


def settings_of(module: torch.nn.Module, where: str, salt: str | None = None,
                hooks: bool = False) -> tuple[list[str], list[tuple[str, torch.Tensor]]]:
    """The named settings of ``module`` and every module inside it, and the tensors held
    as plain attributes (state that no ``state_dict`` shows), by dotted name.

    Raises ``Refused`` for a setting that cannot be named, naming ``where`` and the
    attribute; with a ``salt`` such an attribute is left out (the salt names it).
    ``hooks``: the module's own hooks count too (a graph node's module, called inside the
    node's forward); a child's always do.
    """
    pieces: list[str] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    tree = {id(m) for m in module.modules()}
    for prefix, m in module.named_modules(remove_duplicate=False):
        pieces.append(f"{prefix}:class={class_name(type(m))}")
        written = forward_writes(type(m))  # its forward's bookkeeping (self.calls += 1)
        attrs = [(k, v) for k, v in vars(m).items() if not (
            k in _BOOKKEEPING or k.startswith("_soma") or _ours(k, v) or k in written)]
        if prefix or hooks:  # a child's hooks run inside the cached forward
            attrs += [(k, [_hook(h, tree) for h in d.values()])
                      for k, d in zip(FORWARD_HOOKS, forward_hooks(m), strict=True) if d]
        for k, v in attrs:
            name = f"{prefix}.{k}" if prefix else k
            if k == "forward":  # a forward of yours set on a child: named as its hooks are
                v = _hook(v, tree)
            try:
                pieces.append(f"{name}={_named(v, name, tensors, 0, tree)}")
            except Unnamed as e:
                if salt is not None:
                    continue  # the caller's salt names what this attribute changes
                raise _unnamed(where, *e.args) from None
    return pieces, tensors


def own_settings(node: Any, where: str, salt: str | None, tensors: list) -> list[str]:
    """A graph node's own plain attributes (``self.gain``, ``self.act``), named as a
    module's settings are (its modules and tensors are state: named apart)."""
    tree = {id(m) for v in vars(node).values() if isinstance(v, torch.nn.Module)
            for m in v.modules()}
    pieces = []
    for k, v in own_attributes(node):
        if isinstance(v, (torch.nn.Module, torch.Tensor)):
            continue
        if isinstance(v, types.MethodType) and v.__self__ is node:
            v = v.__func__  # its own method (self.step = self._step): its code
        try:
            pieces.append(f"{k}={_named(v, k, tensors, 0, tree)}")
        except Unnamed as e:
            if salt is None:
                raise _unnamed(f"node {where!r}", *e.args) from None
    return pieces


def own_attributes(node: Any) -> list[tuple[str, Any]]:
    """A graph node's own attributes, by name, less somatize's and those its forward
    writes (``self.runs += 1``: bookkeeping it keeps, not a setting)."""
    written = forward_writes(type(node))
    return sorted((k, v) for k, v in vars(node).items()
                  if not k.startswith("_soma") and k not in written)


@functools.lru_cache(maxsize=1024)
def forward_writes(cls: type) -> frozenset[str]:
    """The attributes a class's ``forward`` sets (``self.calls += 1``): what the forward
    keeps for itself, not what it computes with. Only a forward of yours counts; a setter
    method's writes are settings, in the key."""
    fn = getattr(cls, "forward", None)
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType) or not yours(fn.__code__) or (
            fn.__module__ or "").startswith(("somatize", "torch")):
        return frozenset()
    return frozenset(attrs_set(fn.__code__))


def _unnamed(where: str, what: str, kind: str) -> Refused:
    where = where if where.startswith("node ") else f"module {where!r}"
    return Refused(
        f"{where}: its attribute {what!r} holds a {kind}, which the key of its cached outputs "
        "cannot name (a change to it would serve stale outputs). Make it a buffer "
        "(register_buffer) or a plain value (a number, string, tuple...), or give "
        "SomatizeCache a salt= (.cached(salt=) on a graph) that you change whenever it "
        "changes what the module computes")


def _hook(h: Any, tree: set) -> Any:
    # torch's own hook objects (weight_norm's) compute from the module's state: their class
    # names them; a function (yours) is named by its code, closure and all, and one bound
    # to (or closing over) what the key cannot name (a callback counting calls) by its
    # code alone: its presence is in the key, that object's state is not
    if not isinstance(h, (types.FunctionType, types.MethodType)) and \
            type(h).__module__.startswith("torch."):
        return f"hook:{type(h).__module__}.{type(h).__qualname__}"
    try:
        _named(h, "hook", [], 1, tree)
        return h
    except Unnamed:
        fn = getattr(h, "__func__", h)
        code = getattr(fn, "__code__", None)
        return (f"hook:{type(h).__qualname__}:{getattr(fn, '__qualname__', '')}:"
                f"{code_digest(code) if code is not None else ''}")


def _ours(k: str, v: Any) -> bool:
    # somatize's forward installed on the instance (the cache's), or where its calls are
    # routed (a placed module's, or compile()'s): not a setting. A forward of yours set on
    # an instance (``m.a.forward = lambda x: ...``) runs in place of its class's: it is one
    return k == ROUTED_CALL and callable(v) or k == "forward" and getattr(
        v, "stands_in", False) is True


def instance_forward(previous: Any, module: torch.nn.Module, tensors: list) -> str:
    """A forward set on the cached module itself before the cache was (it runs in place
    of its class's), named as a child's is: a setting of the module (``tensors``: those
    it holds, state)."""
    tree = {id(m) for m in module.modules()}
    return "forward=" + _named(_hook(previous, tree), "forward", tensors, 0, tree)


def _named(v: Any, name: str, tensors: list, depth: int, tree: set | None = None) -> str:
    """A setting as text that differs whenever the value does (``tree``: the ids of the
    modules whose state is in the key; a module outside it cannot be named)."""
    if depth > _MAX_DEPTH:
        raise Unnamed(name, "structure nested too deep")
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (torch.dtype, torch.device, torch.Size)):
        return f"{type(v).__name__}:{v}"
    if isinstance(v, enum.Enum):
        return enum_text(v, lambda x, w, d: _named(x, w, tensors, d, tree), depth)
    if isinstance(v, torch.Tensor):
        tensors.append((name, v))  # by content, with the state (deduplicated there)
        return f"tensor:{name}"
    if isinstance(v, weakref.ref):
        return _named(v(), name, tensors, depth + 1, tree)  # an RNN's _flat_weight_refs
    if isinstance(v, torch.nn.Module):
        if tree is not None and id(v) not in tree:  # in a list, bound: its state is not ours
            raise Unnamed(name, f"{type(v).__name__} outside the module (its weights are "
                          "not in the key)")
        return "module"  # walked as a module of its own
    if isinstance(v, types.ModuleType) and module_is_yours(v):  # self.cfg = config
        return "module:" + ",".join(  # its data, by value (read again at every call)
            f"{k}={_named(x, f'{name}.{k}', tensors, depth + 1, tree)}"
            for k, x in sorted(vars(v).items()) if not k.startswith("_") and not isinstance(
                x, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)))
    if isinstance(v, types.MethodType):  # bound: what it is bound to is read too
        return (f"method:{_named(v.__self__, f'{name}.__self__', tensors, depth + 1, tree)}"
                f":{_named(v.__func__, name, tensors, depth + 1, tree)}")
    if isinstance(v, types.FunctionType):  # an activation held as a function, a lambda:
        # its code, constants, defaults and closure cells (by value, tensors as state)
        if not yours(v.__code__):  # an installed package's (F.relu): its version names it
            return f"code:{v.__module__}.{v.__qualname__}:{code_digest(v.__code__)}"
        return function_text(v, name, depth, lambda x, w, d: _named(x, w, tensors, d, tree))
    again = lambda x, w, d: _named(x, w, tensors, d, tree)  # noqa: E731
    text = structure_text(v, name, depth, again)
    return text if text is not None else name_value(v, name, depth, again)


def held_code(holders: list) -> tuple:
    """The functions and classes of yours the modules in ``holders`` (and their children)
    hold as attributes or as a child's hooks: what they read is in the key too
    (``_reads.code_in``). A holder that is not a module (a graph node) counts its own."""
    out: list = []
    for holder in holders:
        mods = list(holder.modules()) if isinstance(holder, torch.nn.Module) else [holder]
        for m in mods:
            out += [c for k, v in vars(m).items() if not (
                k in _BOOKKEEPING or k.startswith("_soma") or _ours(k, v)) for c in code_in(v)]
            if m is not holder:  # a child's hooks run inside its forward
                out += [c for d in forward_hooks(m) for h in d.values() for c in code_in(h)]
    return tuple(dict.fromkeys(out))
