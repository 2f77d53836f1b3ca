"""Reading bytecode: the globals a function's code loads (with the attributes read off
them, and the names it reaches through ``globals()[...]`` or ``getattr(mod, "NAME")``),
the globals it writes into, and the attributes it sets. The walk in ``_reads`` follows
these.

    loaded_globals(fn.__code__)      # [("CFG", ()), ("config", ("GAIN",)), ...]
    globals_written(fn.__code__)     # {"RUNS", "LOG"}
"""

from __future__ import annotations

import dis
import types


def attrs_set(code: types.CodeType) -> set[str]:
    out = {str(op.argval) for op in dis.get_instructions(code)
           if op.opname in ("STORE_ATTR", "DELETE_ATTR")}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= attrs_set(c)
    return out


# a name the code reaches by a name it computes (``globals()[k]``, ``getattr(cfg, k)``):
# the key cannot know which, so such a read is refused unless a salt names it
DYNAMIC = "<dynamic>"
_CALLS = ("PRECALL", "CALL")


def loaded_globals(code: types.CodeType) -> list[tuple[str, tuple[str, ...]]]:
    """The globals ``code`` loads, each with the attributes read off it: ``config.GAIN``
    is ``("config", ("GAIN",))``; ``globals()["K"]`` and ``globals().get("K")`` are
    ``("K", ())``, ``getattr(config, "GAIN")`` is ``("config", ("GAIN",))``; one whose
    name is computed is ``(DYNAMIC, (what,))``."""
    out = []
    ins = [op for op in dis.get_instructions(code) if op.opname != "CACHE"]
    for i, op in enumerate(ins):
        if op.opname not in ("LOAD_GLOBAL", "LOAD_NAME"):
            continue
        chain = _chain(ins, i + 1)
        name = str(op.argval)
        if name == "globals" and not chain:
            out.append(_by_name(ins, i + 1))
        elif name == "getattr" and not chain and i + 1 < len(ins) and \
                ins[i + 1].opname == "LOAD_GLOBAL":
            held = _chain(ins, i + 2)
            j = i + 2 + len(held)
            const = ins[j] if j < len(ins) else None
            if const is not None and const.opname == "LOAD_CONST" and isinstance(
                    const.argval, str):
                out.append((str(ins[i + 1].argval), (*held, const.argval)))
            else:
                out.append((str(ins[i + 1].argval), (*held, DYNAMIC)))
        else:
            out.append((name, tuple(chain)))
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out += loaded_globals(c)
    return out


def _chain(ins: list, j: int) -> list[str]:
    chain = []
    for nxt in ins[j:]:
        if nxt.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
            break
        chain.append(str(nxt.argval))
    return chain


def _by_name(ins: list, j: int) -> tuple[str, tuple[str, ...]]:
    # globals() called: then ["K"] or .get("K") with a constant name, else computed
    while j < len(ins) and ins[j].opname in _CALLS:
        j += 1
    nxt = ins[j:j + 2]
    if len(nxt) == 2 and nxt[0].opname == "LOAD_CONST" and isinstance(nxt[0].argval, str) \
            and nxt[1].opname == "BINARY_SUBSCR":
        return (nxt[0].argval, ())
    if len(nxt) == 2 and nxt[0].opname in ("LOAD_METHOD", "LOAD_ATTR") and \
            nxt[0].argval == "get" and nxt[1].opname == "LOAD_CONST" and isinstance(
                nxt[1].argval, str):
        return (nxt[1].argval, ())
    return (DYNAMIC, ("globals()",))


# methods that change the object they are called on: a global called so is written
_MUTATORS = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "pop",
                       "popitem", "clear", "remove", "discard", "__setitem__", "write"})
_NO_PUSH = ("STORE_", "DELETE_", "POP_JUMP", "JUMP", "PRECALL", "KW_NAMES", "NOP", "RESUME",
            "CACHE", "EXTENDED_ARG", "POP_TOP", "RETURN_VALUE", "POP_EXCEPT", "RAISE",
            "RERAISE", "PRINT_EXPR", "SETUP_", "END_")


def globals_written(code: types.CodeType) -> set[str]:
    """The globals ``code`` writes into: assigned (``global n; n = ...``), an item or an
    attribute set or deleted on them (``RUNS[k] += 1``), or a mutating method called on
    them (``LOG.append``). Found by following each global along a simulated stack: only
    clear evidence counts, so a global merely read is never taken for written."""
    out: set[str] = set()
    stack: list[str | None] = []
    ins = list(dis.get_instructions(code))
    for op in ins:
        name = op.opname
        if name in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            out.add(str(op.argval))
        if name == "LOAD_METHOD" and stack and stack[-1] and str(op.argval) in _MUTATORS:
            out.add(stack[-1])
        if name in ("STORE_SUBSCR", "DELETE_SUBSCR") and len(stack) >= 2 and stack[-2]:
            out.add(stack[-2])
        if name in ("STORE_ATTR", "DELETE_ATTR") and stack and stack[-1]:
            out.add(stack[-1])
        try:
            effect = dis.stack_effect(op.opcode, op.arg if op.opcode >= dis.HAVE_ARGUMENT
                                      else None, jump=False)
        except ValueError:
            stack = []
            continue
        if name == "COPY":
            stack.append(stack[-op.arg] if len(stack) >= op.arg else None)
            continue
        if name == "SWAP":
            if len(stack) >= op.arg:
                stack[-1], stack[-op.arg] = stack[-op.arg], stack[-1]
            continue
        if name in ("LOAD_GLOBAL", "LOAD_NAME"):
            stack += [None] * (effect - 1) + [str(op.argval)]
            continue
        if name == "LOAD_METHOD":
            pops, pushes = 1, 2
        elif name.startswith("UNPACK_"):
            pops, pushes = 1, effect + 1
        elif name.startswith(_NO_PUSH):
            pops, pushes = -effect, 0
        elif effect >= 1:
            pops, pushes = 0, effect
        else:
            pops, pushes = 1 - effect, 1
        if pops > len(stack) or pops < 0:
            stack = []  # lost track (a jump's other side): start again, knowing nothing
            continue
        if pops:
            del stack[-pops:]
        stack += [None] * pushes
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= globals_written(c)
    return out


