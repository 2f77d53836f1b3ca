"""Every private torch name somatize relies on, in one place: where torch offers no public
way (a module's call routing and its own call, a GradScaler's found-inf record and scale,
the per-tensor norm and unscale kernels ``clip_grad_norm_`` and ``GradScaler.unscale_``
use, a module's hook dictionaries, and its own parameter, buffer and child dictionaries);
and cloudpickle's one (how it reduces a code object). An upgrade that drops one breaks
here, naming the attribute; tests/test_placed_optimizers.py and tests/test_private.py
pin that each exists.

    route_calls(module, link.forward)  # module(x) calls link.forward; pickles never see it
    route_calls(module, None)          # its own call again
    own_call(module, x)                # what module(x) runs when not routed
    found = scaler_found_inf(scaler, optimizer)   # GradScaler's per-optimizer record
    norms = foreach_norm(grads, 2.0)
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .._errors import SomatizeError


class TorchChanged(SomatizeError):
    """A private torch (or cloudpickle) name somatize relies on is missing from the
    installed version."""


def _need(owner: Any, attr: str, what: str, package: str = "torch") -> Any:
    try:
        return getattr(owner, attr)
    except AttributeError:
        where = getattr(owner, "__name__", type(owner).__name__)
        version = torch.__version__ if package == "torch" else _version_of(package)
        raise TorchChanged(
            f"{where}.{attr} is missing from {package} {version}: somatize reads it for "
            f"{what} (somatize/torch/_private.py). Install the {package} version somatize's "
            f"constraints.txt names, or report it with your {package} version") from None


def fp32_precision_getter() -> Any:
    """torch's C getter behind ``torch.backends.<api>.<op>.fp32_precision``
    (``(backend, op) -> str``: what an ``_FP32Precision``'s attribute calls), or None."""
    return getattr(torch._C, "_get_fp32_precision_getter", None)


def nnpack_flag() -> tuple[Any, Any] | None:
    """torch's reader and setter of NNPACK on or off (``torch.backends.nnpack`` offers a
    ``set_flags`` and no read), or None where this torch lacks them."""
    read = getattr(torch._C, "_get_nnpack_enabled", None)
    write = getattr(torch._C, "_set_nnpack_enabled", None)
    return (read, write) if read is not None and write is not None else None


def _version_of(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def scaler_found_inf(scaler: Any, optimizer: Any) -> dict:
    """GradScaler's record of one optimizer (``found_inf_per_device`` and its stage),
    created as ``unscale_`` creates it."""
    states = _need(scaler, "_per_optimizer_states", "the inf/NaN a loss scaler found")
    return states[id(optimizer)]


def scaler_found_inf_if_any(scaler: Any, optimizer: Any) -> dict:
    """GradScaler's record of one optimizer, or ``{}`` when it has none yet."""
    states = _need(scaler, "_per_optimizer_states", "the inf/NaN a loss scaler found")
    return states.get(id(optimizer), {})


def scaler_scale(scaler: Any) -> torch.Tensor:
    """GradScaler's current scale as the tensor it divides by (not ``get_scale()``'s float)."""
    return _need(scaler, "_scale", "the loss scale to unscale gradients over there")


def foreach_norm(tensors: list, norm_type: float) -> list:
    """Each tensor's norm, by the kernel ``clip_grad_norm_`` uses (bit for bit the same)."""
    return _need(torch, "_foreach_norm", "per-parameter gradient norms")(tensors, norm_type)


def foreach_mul_(tensors: list, scalar: Any) -> None:
    """Multiply each tensor in place, by the kernel ``clip_grad_norm_`` uses."""
    _need(torch, "_foreach_mul_", "clipping gradients by a coefficient")(tensors, scalar)


def unscale_(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """What ``GradScaler.unscale_`` does to each gradient, in place (``found_inf`` set)."""
    fn = _need(torch, "_amp_foreach_non_finite_check_and_unscale_", "unscaling gradients")
    fn(grads, found_inf, inv_scale)


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hook_count(module: torch.nn.Module) -> int:
    """How many forward and backward hooks ``module`` itself holds."""
    try:  # read per call of a placed module: directly, and named only when one is missing
        return (len(module._forward_hooks) + len(module._forward_pre_hooks)
                + len(module._backward_hooks) + len(module._backward_pre_hooks))
    except AttributeError:
        return sum(len(_need(module, attr, "the hooks put on a placed module's children"))
                   for attr in _HOOKS)


# the instance attribute ``Module.__call__`` calls instead of its own call when set
ROUTED_CALL = "_compiled_call_impl"


def route_calls(module: torch.nn.Module, fn: Any) -> None:
    """Make ``module(...)`` call ``fn(...)`` instead (``None``: its own call again).

    ``Module.__call__`` calls ``_compiled_call_impl`` when it is set (what
    ``module.compile()`` sets), and ``Module.__getstate__`` drops it: nothing of ``fn``
    reaches a pickle, a deep copy or a checkpoint, and ``type(module)`` stays."""
    if fn is None:
        module.__dict__.pop(ROUTED_CALL, None)
    else:
        module.__dict__[ROUTED_CALL] = fn


def routed_to(module: torch.nn.Module) -> Any:
    """What ``module(...)`` is routed to (``None``: its own call)."""
    return module.__dict__.get(ROUTED_CALL)


def own_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What ``module(*args, **kwargs)`` runs when its calls are not routed (its hooks and
    forward: ``Module._call_impl``), whether they are routed or not."""
    return _need(module, "_call_impl", "running a placed module's child here")(*args, **kwargs)


def plainly() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called (what
    somatize's own reads and writes of the placed weights here run under)."""
    return torch._C.DisableTorchFunctionSubclass()


def version(t: torch.Tensor) -> int:
    """``t``'s version counter, which every in-place write bumps (torch has no public way
    to read it): how writes here are seen without comparing values."""
    return t._version


_VERSION = operator.attrgetter("_version")


def versions(tensors: Any) -> list[int]:
    """``version`` of each of ``tensors``, at C speed (read per call of a placed module)."""
    return list(map(_VERSION, tensors))


def registered(m: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is one of ``m``'s own parameters, buffers or children (set through
    ``Module.__setattr__``, not in ``m.__dict__``)."""
    return name in m._parameters or name in m._buffers or name in m._modules


def own_tensors(m: torch.nn.Module) -> tuple[tuple, tuple]:
    """``m``'s own parameters and buffers (``None`` where one is registered as None), in
    registration order, without walking its children."""
    return tuple(m._parameters.values()), tuple(m._buffers.values())


def children(m: torch.nn.Module) -> tuple:
    """``m``'s own children (``None`` where one is registered as None), in order."""
    return tuple(m._modules.values())


def first_device(module: torch.nn.Module) -> torch.device | None:
    """The device of ``module``'s first parameter, else of its first buffer (asked at every
    batch: read from the modules' own tables, not through ``parameters()``)."""
    mods = list(module.modules())
    for m in mods:
        for t in m._parameters.values():
            if t is not None:
                return t.device
    for m in mods:
        for t in m._buffers.values():
            if t is not None:
                return t.device
    return None


def own_structure(m: torch.nn.Module) -> tuple[dict, dict, frozenset, dict]:
    """``m``'s own parameters, buffers (each by name, in registration order, ``None``
    where one is registered as None), the names of its non-persistent buffers, and its
    own children: copies, read when a placed module's structure changed."""
    return (dict(m._parameters), dict(m._buffers), frozenset(m._non_persistent_buffers_set),
            dict(m._modules))


# the dictionaries of a module that hold its forward and backward hooks
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
              "_backward_pre_hooks", "_is_full_backward_hook")


def hook_dicts(m: torch.nn.Module) -> list:
    """The dictionaries ``hook_count`` counts the entries of (their lengths, read per call
    at C speed, tell a hook put or removed)."""
    return [_need(m, attr, "the hooks put on a placed module's children") for attr in _HOOKS]


def hooks_of(m: torch.nn.Module) -> dict:
    """``m``'s own hook dictionaries (copies), by name, as ``set_hooks`` takes them."""
    return {k: (v.copy() if isinstance(v, dict) else v) for k in HOOK_DICTS
            if (v := m.__dict__.get(k, None)) is not None or k in m.__dict__}


def set_hooks(m: torch.nn.Module, hooks: dict) -> None:
    """Give ``m`` the hooks ``hooks_of`` read (of another copy of it)."""
    m.__dict__.update(hooks)


def engine_will_run(node: Any) -> bool:
    """Inside a backward: whether the running pass will run ``node`` (a leaf's gradient
    accumulator): true for ``.backward()``, false for ``autograd.grad(out, inputs)``
    where the leaf is not among the inputs (torch has no public way to ask)."""
    return _need(torch._C, "_will_engine_execute_node",
                 "telling .backward() from autograd.grad through a placed module")(node)


def graph_task() -> int:
    """Inside a backward: the running pass's number (-1 outside one)."""
    return _need(torch._C, "_current_graph_task_id",
                 "joining a placed call's backwards of one pass")()


_END = object()  # where a module's parameters end, then its buffers (in ``structure``)


def structure(modules: list) -> list:
    """Each of ``modules``' own parameters, buffers and children, by identity: equal (by
    ``operator.is_``) from one read to the next exactly when none was added, removed or
    replaced. Read per call of a placed module."""
    return [(*m._parameters.values(), _END, *m._buffers.values(), _END,
             *m._modules.values()) for m in modules]


def batchnorm_base() -> type:
    """The base class of every BatchNorm (1d/2d/3d, lazy, SyncBatchNorm): torch exports
    none publicly."""
    return _need(torch.nn.modules.batchnorm, "_BatchNorm", "finding layers that mix rows")


def code_reduce(co: Any) -> tuple:
    """How cloudpickle reduces a code object it sends by value: ``(make, args)``."""
    from cloudpickle import cloudpickle as cp

    return _need(cp, "_code_reduce", "sending code by value with its file name",
                 "cloudpickle")(co)


def rebuild_parameter() -> Any:
    """The function a ``Parameter`` pickles through (``Parameter.__reduce_ex__``'s)."""
    return _need(torch._utils, "_rebuild_parameter", "pickling a placed parameter plainly")


# what reads a tensor's metadata only (no value): a placed weight's such reads are
# served here without bringing it current
METADATA_READS = frozenset({
    torch.Tensor.grad.__get__, torch.Tensor.grad.__set__, torch.Tensor._version.__get__,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.requires_grad.__set__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.grad_fn.__get__,
    torch.Tensor.numel, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.nelement,
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.requires_grad_, torch.Tensor.__hash__, torch.Tensor.data_ptr,
    torch.Tensor.register_hook, torch.Tensor.is_contiguous, torch.Tensor.stride,
    torch.Tensor.get_device, torch.Tensor.storage_offset,
})

# a read of ``tensor.data`` (shares the storage, not the version counter)
DATA_READ = torch.Tensor.data.__get__


# the forward hooks a module runs around its forward (pre-hooks, then hooks), by attribute
FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")


def forward_hooks(m: torch.nn.Module) -> list:
    """``m``'s forward pre-hook and forward hook dictionaries (what a cached forward's key
    names of a child: they run inside it)."""
    return [_need(m, attr, "the hooks run inside a cached forward") for attr in FORWARD_HOOKS]


def global_hook_tables() -> tuple[dict, dict]:
    """torch's tables of the forward pre-hooks and hooks registered for every module (both
    empty: none), read at every placed call."""
    from torch.nn.modules import module as m  # noqa: PLC0415 - torch's own tables

    return tuple(_need(m, attr, "the hooks every module runs")
                 for attr in ("_global_forward_pre_hooks", "_global_forward_hooks"))


def global_forward_hooks() -> list:
    """The forward pre-hooks and hooks registered for every module
    (``register_module_forward_pre_hook`` / ``register_module_forward_hook``)."""
    return [h for table in global_hook_tables() for h in table.values()]
