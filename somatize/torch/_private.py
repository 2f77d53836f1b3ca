"""torch's private parts that somatize leans on, in one place (so a torch upgrade that
moves one breaks here, named, and nowhere else).

    route_calls(module, link.forward)  # module(x) calls link.forward; pickles never see it
    route_calls(module, None)          # its own call again
"""

from __future__ import annotations

from typing import Any

import torch


def route_calls(module: torch.nn.Module, fn: Any) -> None:
    """Make ``module(...)`` call ``fn(...)`` instead (``None``: its own call again).

    ``Module.__call__`` calls ``_compiled_call_impl`` when it is set (what
    ``module.compile()`` sets), and ``Module.__getstate__`` drops it: nothing of ``fn``
    reaches a pickle, a deep copy or a checkpoint, and ``type(module)`` stays."""
    if fn is None:
        module.__dict__.pop("_compiled_call_impl", None)
    else:
        module.__dict__["_compiled_call_impl"] = fn


def routed_to(module: torch.nn.Module) -> Any:
    """What ``module(...)`` is routed to (``None``: its own call)."""
    return module.__dict__.get("_compiled_call_impl")


def plainly() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called (what
    somatize's own reads and writes of the placed weights here run under)."""
    return torch._C.DisableTorchFunctionSubclass()
