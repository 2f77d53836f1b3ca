"""Classes kept as data, and named (``class_name``: the same whether its file runs as the
script or is imported): a namedtuple, a dataclass or a mapping of its own class (such as
transformers' ``ModelOutput``) is written as its class's path, its kind and its fields by
name, and rebuilt from a class already imported in this process: never imported, never
unpickled, and only when it still is that kind with those fields.

    path, kind, items = class_of(Point(1, 2))   # "geo:Point", "namedtuple", [("x", 1), ...]
    rebuild(path, kind, items)                  # Point(x=1, y=2)
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any


def class_of(value: Any) -> tuple[str, str, list[tuple[Any, Any]]] | None:
    """``(class path, kind, [(field, value)])`` for a value kept with its class, or None
    for one that is not (a plain tuple, list or dict, a number...).

    Raises ``ValueError`` for one that could not be rebuilt as it is (a class defined
    inside a function, attributes beyond its fields).
    """
    cls = type(value)
    if isinstance(value, tuple) and hasattr(cls, "_fields"):
        kind, items = "namedtuple", list(zip(cls._fields, value, strict=True))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = "dataclass"
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, Mapping) and cls is not dict:
        kind, items = "mapping", list(value.items())
    else:
        return None
    path = f"{cls.__module__}:{cls.__qualname__}"
    if "<locals>" in cls.__qualname__:
        raise ValueError(f"its class {path} is defined inside a function, so it cannot be "
                         "found again by name: define it at module level")
    extra = sorted(set(getattr(value, "__dict__", {})) - {f for f, _ in items
                                                           if kind != "mapping"})
    if extra:
        raise ValueError(f"a {path} holds attributes beyond its {kind} fields ({extra[:5]}), "
                         "which would not come back")
    return path, kind, items


def find(path: str) -> type:
    """The class at ``module:qualname`` among the modules already imported (LookupError
    otherwise: nothing is imported to find it)."""
    module_name, _, qualname = path.partition(":")
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        raise LookupError(f"module {module_name!r} is not imported in this process (nothing "
                          "is imported to read a value): import it before the run")
    for part in qualname.split("."):
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None  # no __getattr__ run
    if not isinstance(obj, type):
        raise LookupError(f"{module_name!r} has no class {qualname!r} (renamed or moved since "
                          "the value was kept): the value is computed again")
    return obj


def rebuild(path: str, kind: str, items: list[tuple[Any, Any]]) -> Any:
    """The value of class ``path`` from its fields; LookupError when this process has no
    such class of that kind with those fields."""
    cls = find(path)
    fields = [k for k, _ in items]
    if kind == "namedtuple":
        if not (issubclass(cls, tuple) and list(getattr(cls, "_fields", ())) == fields):
            raise LookupError(f"{path} is no longer a namedtuple with fields {fields}")
        return cls._make(v for _, v in items)
    if kind == "dataclass":
        if not dataclasses.is_dataclass(cls) or [f.name for f in dataclasses.fields(cls)] != fields:
            raise LookupError(f"{path} is no longer a dataclass with fields {fields}")
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        try:
            value = cls(**{k: v for k, v in items if k in init})
        except Exception as e:  # its __init__ or __post_init__ refusing what it gave
            raise LookupError(f"{path}({', '.join(sorted(init))}) refused its own fields "
                              f"({type(e).__name__}: {e})") from None
        for k, v in items:
            if k not in init:
                object.__setattr__(value, k, v)
        return value
    if kind == "mapping":
        if not issubclass(cls, Mapping):
            raise LookupError(f"{path} is no longer a mapping")
        try:
            return cls(items)
        except Exception as e:
            raise LookupError(f"{path} cannot be built from its items ({type(e).__name__}: "
                              f"{e})") from None
    raise LookupError(f"{path}: a kind {kind[:20]!r} that is not namedtuple, dataclass or "
                      "mapping")


def script_name(cls: type) -> str:
    """A class's module as the same dotted name whether its file runs as the script
    (``__main__``) or is imported: the script's path from the first ``sys.path`` entry
    that holds it, else its file name."""
    mod = cls.__module__
    if mod != "__main__":
        return mod
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return spec.name  # python -m pkg.mod
    f = getattr(main, "__file__", None)
    if not f:
        return mod
    f = os.path.realpath(f)
    for p in sys.path:
        base = os.path.realpath(p or os.getcwd()) + os.sep
        if f.startswith(base):
            rel = os.path.splitext(f[len(base):])[0]
            return rel.replace(os.sep, ".")
    return os.path.splitext(os.path.basename(f))[0]


def class_name(cls: type) -> str:
    """``module.Qualname`` of a class, the same when its file runs as the script."""
    return f"{script_name(cls)}.{cls.__qualname__}"
