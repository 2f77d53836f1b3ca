"""A submodule placed on a worker and called as the model's code calls it: any arguments
(tensors, nested tuples, lists and dicts of tensors and plain values), any nested output,
several calls per step, a gradient to every argument that asks for one.

The module travels once (as a node of a one-node-per-module graph, on a ``Session``);
a call sends its arguments, the RNG state and the grad mode, and comes back with the
outputs and the advanced RNG state; the autograd graph here holds one ``_Remote`` node
per call whose backward sends dL/d(outputs) and receives dL/d(arguments). The weights'
gradients accumulate over there, where optimizers that mirror the ones here (group by
group, hyper-parameters sent with each step) apply them.

    link = Link(part, "encoder", module)      # part: the placed modules' share of a Session
    link.install()                            # module(x) now runs over there
    y = module(x, mask=m); y.sum().backward() # the encoder's weights get .grad there
    link.queue(StepMirror(0, groups))         # an optimizer step (_mirror_ops), queued
"""

from __future__ import annotations

import functools
import itertools
import logging
import pickle
from typing import Any

import torch

from ..._errors import Refused
from .._private import hook_count, plainly, route_calls, routed_to, versions
from .._raised import Raised, rebuilt
from ._fresh import fresh, unfresh
from ._messages import Same, dumps, pack, plain_args, unpack
from ._module_ops import SetModes, SetRequiresGrad, SetWeights, copy_into
from ._ordinary import Attributes, Shape, into
from ._there import _backward, _call, _moved, _run_ops, _state, _weights
from ._tree import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)


# -- run over there, against the worker's live graph (the transport's generic call) --------


# -- here: the module's stand-in ------------------------------------------------------

class _Remote(torch.autograd.Function):
    """One call over there, as a node of the autograd graph here."""

    @staticmethod
    def forward(ctx, link, call, anchor, *inputs):
        ctx.set_materialize_grads(False)
        ctx.link, ctx.call = link, call
        outs = list(link.answer)
        ctx.mark_non_differentiable(*[t for t, alive in zip(outs, link.alive, strict=True)
                                      if not (alive and t.is_floating_point())])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        back = ctx.link._backward(ctx.call, grads)
        return (None, None, None, *back)


class Link:
    """The module here, standing in for the one placed on ``host``: calls go there."""

    def __init__(self, part: Any, name: str, module: torch.nn.Module, host: str,
                 here: torch.device | None = None):
        self.part, self.name, self.module, self.host = part, name, module, host
        # where the model's other half computes, and where the placed module computes
        self.here = torch.device(here or "cpu")
        peers = part.runtime.peers
        self.device = peers[host].device if peers.get(host) else "cpu"
        if self.here.type != "cpu" or self.device != "cpu":
            log.info("module %r computes on %s on worker %r, the rest on %s here: tensors cross "
                     "through the CPU (moved at the boundary)", name, self.device, host,
                     self.here)
        self.calls = itertools.count()
        self.ops: list = []  # steps, zero_grads, modes, writes: sent with the next call
        self.modes: tuple | None = None
        self.flags: tuple | None = None  # the parameters' requires_grad, as last sent
        self.versions: dict[str, int] = {}
        self.fitting = False
        self.stale = False  # the weights here are behind the ones over there
        self.exposed: dict[int, torch.Tensor] = {}  # id -> value when handed out as .data
        self._inflight: list = []  # backwards sent and not yet answered
        self._routes: dict[int, Any] = {}  # id(module) -> what its calls are routed to
        self.needs: dict[int, list[bool]] = {}  # per call in flight: which arguments ask dL/d
        self._children: list = []  # (path, child) of the placed module, and their hooks
        self._hooked: list[int] = []
        self._warned: set[str] = set()  # children whose late hooks were said
        self.answer: list = []
        self.alive: list[bool] = []  # per answered tensor: whether it carries a gradient

    # -- installing --------------------------------------------------------------------
    def install(self) -> None:
        """Route the module's calls to the worker; refuse its children's calls here. Both
        through ``route_calls``: no attribute of the module's own, nothing in its pickles."""
        self._children = [(path, child) for path, child in self.module.named_modules()
                          if child is not self.module]
        self._routes = {id(self.module): self.forward}
        for path, child in self._children:
            self._routes[id(child)] = functools.partial(_refuse_here, self, path, child)
        for m in self.module.modules():
            route_calls(m, self._routes[id(m)])
        self._hooked = [hook_count(child) for _, child in self._children]
        self.attributes = Attributes(self.module)
        self.shape = Shape(self.module)
        self.remember()
        self.buffered = any(True for _ in self.module.buffers())
        fresh(self)  # its weights here answer reads current

    def uninstall(self) -> None:
        unfresh(self)
        for m in self.module.modules():
            if routed_to(m) is self._routes.get(id(m)):
                route_calls(m, None)
        self._routes = {}

    def check(self) -> None:
        """Refuse, naming the module, what took the module's calls away (compile())."""
        for m in (self.module, *(c for _, c in self._children)):
            if id(m) in self._routes and routed_to(m) is not self._routes[id(m)]:
                path = next((f"{self.name}.{p}" for p, c in self._children if c is m),
                            self.name)
                raise Refused(
                    f"{path}.compile() was called in place on a module placed on worker "
                    f"{self.host!r} (inside {self.name!r}): compiled here it would run here, "
                    "on a stale copy of its weights. Compile before placing it "
                    f"(torch.compile(module) as a submodule), or leave {self.name!r} unplaced")

    # -- a call --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.catch_writes()
        self.catch_hooks()
        blob = plain_args(args, kwargs)  # distinct tensors only: no structure to pickle
        if blob is None:
            flat, spec = tree_flatten((args, kwargs))
            tensors, plain = pack(flat)
            blob = dumps((spec, plain))  # classes the script defines travel by value
        else:
            tensors = [*args, *kwargs.values()]
        grad = torch.is_grad_enabled()
        needs = [grad and t.requires_grad for t in tensors]
        sent = [_crossing(t) for t in tensors]
        modes = tuple(m.training for m in self.shape.modules)  # (current: catch_writes)
        if modes != self.modes:
            self.ops.append(SetModes(modes))
            self.modes = modes
        with plainly():
            flags = tuple(p.requires_grad for p in self.shape.params)
        if flags != self.flags:
            self.ops.append(SetRequiresGrad(flags))
            self.flags = flags
        # the math settings (threads, TF32...) as the session sends them, when changed
        self.part.follow_math([self.host])  # (ordered: they arrive before this call)
        attrs = self.attributes.changed()  # a dropout's p, track_running_stats...
        if attrs is not None:
            self.ops.append(attrs)
        call = next(self.calls)
        ops, self.ops = self.ops, []
        autocast = [(d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
                    for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        self.answer, shape, self.alive, rng, pid, kept = self._rpc(
            _call, self.name, call, sent, blob, needs, grad,
            torch.is_inference_mode_enabled(), torch.get_rng_state(), ops, autocast,
            torch.get_default_dtype(), self.device)
        here = self.here
        if here.type != "cpu":
            self.answer = [_moved(t, here) for t in self.answer]
        torch.set_rng_state(rng)  # what one piece's draws would have left it at
        self.part.add(self.name, pid)
        self.stale = self.stale or self.buffered  # its buffers may have moved over there
        outs = self.answer
        if kept:  # something over there asks for dL/d(outputs): the call is in the graph
            self.needs[call] = needs
            anchor = torch.empty(0, requires_grad=True)
            outs = _Remote.apply(self, call, anchor,
                                 *[t for t, need in zip(tensors, needs, strict=True) if need])
        if not isinstance(shape, bytes):  # one tensor (None), a tuple of them (its length)
            return outs[0] if shape is None else tuple(outs)
        out_spec, out_plain = pickle.loads(shape)
        out_plain = [tensors[p.i] if isinstance(p, Same) else p for p in out_plain]
        out, side, changed = tree_unflatten(unpack(outs, out_plain), out_spec)
        self.attributes.left(side)  # an auxiliary loss the forward set on self
        if changed is not None:  # a cache it appended to, a tensor it wrote into
            into((args, kwargs), changed, self.name)
        return out

    def _backward(self, call: int, grads: tuple) -> list:
        ops, self.ops = self.ops, []
        needs = self.needs.pop(call)
        args = (_backward, self.name, call, [None if g is None else _crossing(g) for g in grads],
                ops)
        if not any(needs):
            # nothing here waits for dL/d(arguments): the backward over there overlaps with
            # the rest of this one; the next call to the worker waits for it first
            self._inflight.append(self.part.runtime.call_async(self.host, *args))
            return []
        back = self._rpc(*args)
        return [None if g is None else _moved(g, self.here)
                for g, need in zip(back, needs, strict=True) if need]

    def _rpc(self, fn: Any, *args: Any) -> Any:
        # the worker runs calls in the order they were sent: this one goes at once, behind
        # what is in flight, whose answers are read first (their errors first)
        answer = self.part.runtime.call_async(self.host, fn, *args)
        self.settle()
        return self._raise(answer.result())

    def settle(self) -> None:
        """Wait for the backwards still in flight over there (in order)."""
        while self._inflight:
            self._raise(self._inflight.pop(0).result())

    def _raise(self, got: Any) -> Any:
        if isinstance(got, Raised):  # raised in the module over there: its own type here
            peer = self.part.runtime.peers.get(self.host)
            pid = f" (pid {peer.pid})" if peer is not None else ""
            raise rebuilt(got, f"module {self.name!r} on worker {self.host!r}{pid}")
        return got

    # -- what the optimizers here send (somatize.torch._mirror) -----------------------
    def queue(self, op: Any) -> None:
        """Send ``op`` (a typed operation: ``op.apply(placed)`` over there) with the next
        call. An op that moves the weights over there (a step) leaves the copy here stale."""
        self.ops.append(op)
        self.stale = self.stale or getattr(op, "moves_weights", False)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(live, name, *args, ops)`` over there now: what is queued goes with it,
        to be done first."""
        ops, self.ops = self.ops, []
        return self._rpc(fn, self.name, *args, ops)

    def flush(self) -> None:
        """Send what is queued (steps, zero_grads) now."""
        self.catch_writes()
        if self.ops:
            ops, self.ops = self.ops, []
            self._rpc(_run_ops, self.name, ops)

    # -- the weights here -------------------------------------------------------------------
    def pull(self) -> dict:
        """Bring the weights here up to date; return the mirrors' states by parameter name."""
        self.stale = False
        self.catch_writes()
        ops, self.ops = self.ops, []
        got = self._rpc(_state, self.name, ops)
        with plainly():
            copy_into(self.module, got["weights"])
        self.remember()
        return got["optimizers"]

    def bring(self) -> None:
        """A read here of the weights, stale since the module stepped or ran over there:
        bring them up to date first (weights only: one round trip)."""
        self.stale = False
        self.check()
        self.catch_writes()
        ops, self.ops = self.ops, []
        got = self._rpc(_weights, self.name, ops)
        with plainly():
            copy_into(self.module, got)
        self.remember()

    def catch_hooks(self) -> None:
        """A hook put on a child here since the module was sent never runs (the child runs
        over there): said once per child."""
        for k, (path, child) in enumerate(self._children):
            now = hook_count(child)
            if now > self._hooked[k] and path not in self._warned:
                self._warned.add(path)
                log.warning("a hook was registered here on %s.%s, which runs on worker %r: "
                            "it does not run (the module was sent before it was put). "
                            "Register hooks before fit, so they travel with the module and "
                            "run over there (what they record stays there), or leave %r "
                            "unplaced", self.name, path,
                            self.host, self.name)
            self._hooked[k] = now

    def remember(self) -> None:
        shape = self.shape
        shape.current()
        with plainly():  # (a placed weight's reads go through FreshParameter otherwise)
            self.seen = versions(shape.tensors)  # as self.versions, in shape's order
        self.versions = dict(zip(shape.names, self.seen, strict=True))
        self.held = dict(zip(shape.names, shape.tensors, strict=True))

    def catch_writes(self) -> None:
        """A write here since the last sync (SWA, load_state_dict), or a new tensor put
        under a weight's name: sent over there."""
        shape = self.shape
        moved = shape.current()  # the names looked up again when the structure changed
        with plainly():
            now = versions(shape.tensors)
        was = self.exposed  # handed out through .data since the last look
        if not moved and not was and now == self.seen:
            return  # the same tensors, none written since
        with plainly():
            changed = {k: t.detach().clone()
                       for k, t, v in zip(shape.names, shape.tensors, now, strict=True)
                       if v != self.versions.get(k) or self.held.get(k) is not t
                       or (id(t) in was and not torch.equal(t, was[id(t)]))}
            self.exposed = {}
        if changed:
            self.ops.append(SetWeights(changed))
            self.remember()
        else:
            self.seen = now  # each as self.versions has it


def _crossing(value: Any) -> Any:
    # what RPC sends without device maps: detached CPU tensors
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _refuse_here(link: Link, path: str, child: torch.nn.Module, *args: Any,
                 **kwargs: Any) -> Any:
    link.check()
    if link.fitting:
        raise Refused(
            f"{link.name}.{path} is part of {link.name!r}, which is placed on worker "
            f"{link.host!r}: during fit its weights here are a stale copy, so it cannot run "
            f"here. Call {link.name!r} itself (it runs over there), or read its weights after "
            "trainer.strategy.sync()")
    return child._call_impl(*args, **kwargs)  # outside fit: the copy here is current

