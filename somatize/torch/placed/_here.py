"""A submodule placed on a worker and called as the model's code calls it: any arguments
(tensors, nested tuples, lists and dicts of tensors and plain values), any nested output,
several calls per step, a gradient to every argument that asks for one.

The module travels once (as a node of a one-node-per-module graph, on a ``Session``);
a call sends a ``Call`` (its arguments, the RNG state, the grad mode...) and comes back
with an ``Answer`` (the outputs, the advanced RNG state: ``_messages.py``); the autograd
graph here holds one ``_Remote`` node per call whose backward sends dL/d(outputs) and
receives dL/d(arguments) (a second backward, ``autograd.grad`` on the inputs and
``create_graph`` included: ``_Remote``). The weights'
gradients accumulate over there, where optimizers that mirror the ones here (group by
group, hyper-parameters sent with each step) apply them.

    link = Link(part, "encoder", module, "w") # part: the placed modules' share of a Session
    link.install()                            # module(x) now runs over there
    y = module(x, mask=m); y.sum().backward() # the encoder's weights get .grad there
    link.queue(StepMirror(0, groups))         # an optimizer step (_mirror_ops), queued
"""

from __future__ import annotations

import itertools
import logging
import pickle
from typing import Any

import torch

from .._pickling import dumps
from .._private import engine_will_run, plainly
from .._raised import Raised, rebuilt
from .._state import restore
from ._fresh import fresh, unfresh
from ._globals import SetGlobals, Watched
from ._joins import defer, waited
from ._messages import Bare, Call, Pickled, Same, pack, spread, unpack
from ._module_ops import Free, Sent
from ._ordinary import into, unsendable
from ._routing import Routing
from ._there import Backward, _applied, _backward, _call, _state, _weights
from ._tree import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)


class _Remote(torch.autograd.Function):
    """One call over there, as a node of the autograd graph here: its outputs are the
    answer's tensors; its backward sends dL/d(outputs) and answers dL/d(the arguments
    that asked for one, ``needs``). Whether the pass accumulates into the weights over
    there (``.backward()``, not ``autograd.grad`` on the inputs) is told by whether it
    runs the ``anchor``'s accumulator; under ``create_graph`` the gradients it answers are
    the outputs of a call of their own (so a second backward reaches over there too).
    What the call keeps over there is freed when this node is (``_Ticket``)."""

    @staticmethod
    def forward(ctx, link, number, needs, outs, alive, acc, anchor, uses, parent, *inputs):
        ctx.set_materialize_grads(False)
        ctx.link, ctx.number, ctx.needs, ctx.acc = link, number, needs, acc
        ctx.ticket = _Ticket(link, number)
        ctx.uses, ctx.parent = uses, parent
        if parent is not None:  # the parent's token, last: not an argument over there
            inputs = inputs[:-1]
        if uses:  # an argument used k times over there stands k times here (_node)
            at = itertools.accumulate(uses, initial=0)
            inputs = tuple(inputs[i] for i in itertools.islice(at, len(uses)))
        ctx.inputs = inputs  # (held, not saved: a later in-place write here is no error)
        ctx.mark_non_differentiable(*[t for t, a in zip(outs, alive, strict=True)
                                      if not (a and t.is_floating_point())])
        # the call's token: the backward of a create_graph answer takes it as an argument,
        # so the engine here runs that backward before this one's (they join: _joined)
        token = torch.empty(0)
        ctx.save_for_backward(token)
        return (*outs, token)

    @staticmethod
    def backward(ctx, *grads):
        back = ctx.link._backward(ctx, grads[:-1])
        if ctx.uses:  # each use's gradient apart: the engine adds them as plain autograd does
            back = [g for b, k in zip(back, ctx.uses, strict=True)
                    for g in (b + [None] * (k - len(b)) if isinstance(b, list)
                              else [b] + [None] * (k - 1))]
        if ctx.parent is not None:
            back = [*back, None]  # (the parent's token)
        return (None, None, None, None, None, None, None, None, None, *back)


def _to(g: Any, here: torch.device) -> Any:
    # a gradient, or each use's (an argument used more than once over there)
    if isinstance(g, list):
        return [None if u is None else u.to(here) for u in g]
    return None if g is None else g.to(here)


def _held(values: dict, tensors: list, held: list) -> tuple:
    # the carried values without their tensors (the hidden states collected so far: a hook
    # over there appends, and reads no values): each stands as Same, the caller's own
    flat, spec = tree_flatten(values)
    at = {id(t): i for i, t in enumerate(tensors)}
    for k, v in enumerate(flat):
        if isinstance(v, torch.Tensor):
            i = at.get(id(v))
            if i is None:
                i = at[id(v)] = len(tensors) + len(held)
                held.append(v)
            flat[k] = Same(i)
    return spec, flat


def _values(carried: dict) -> dict:
    # each carried variable's value here, by its token (one not set here: not sent)
    values = {}
    for key, var in carried.items():
        try:
            values[key] = var.get()
        except LookupError:
            pass
    return values


class _Ticket:
    """Frees what call ``number`` keeps over there when the graph here lets it go."""

    __slots__ = ("link", "number")

    def __init__(self, link: Link, number: int):
        self.link, self.number = link, number

    def __del__(self):
        self.link.freed.append(self.number)


class Link:
    """The module here, standing in for the one placed on ``host``: calls go there.

    What it holds, besides who it is (``part``, ``name``, ``module``, ``host``, and the
    devices ``here`` and ``device`` over there): ``routing``, where the module's calls
    go; ``sent``, what the worker was last sent of the module; ``ops``, what is queued
    for the next message (a backward nobody here waits for among them); whether the
    weights here are ``stale``, and whether a fit is on (``fitting``); ``draws``, set
    when no RNG state may cross (``Worker(rng="derived")``): what gives each call's seed
    instead."""

    stands_in = True  # (its forward, set on the module while its hooks run here, is no attribute)

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
        self.ops: list = []  # steps, zero_grads, modes, writes: sent with the next message
        self.freed: list = []  # calls whose graph here is gone: what they keep there goes
        self.routing = Routing(self)
        self.sent: Sent | None = None  # at install
        self.buffered = False  # the module has buffers (a call over there may move them)
        self.fitting = False
        self.stale = False  # the weights here are behind the ones over there
        self.draws: Any = None  # () -> the seed of the next call, when no RNG state is sent
        self.waiting: dict = {}  # call -> (pass, backwards joining its own: _joins)
        self.globals: Watched | None = None  # at install: what its code reads, as sent

    # -- installing --------------------------------------------------------------------
    def install(self) -> None:
        """Route the module's calls to the worker, its children's refused here."""
        self.routing.install()
        self.globals = Watched(self.module)
        self.sent = Sent(self.module, self.name, self._restructured)
        self.buffered = any(True for _ in self.module.buffers())
        fresh(self)  # its weights here answer reads current

    def _restructured(self) -> None:
        # a child, parameter or buffer registered here (sent with the next message)
        self.routing.reinstall()
        self.buffered = any(True for _ in self.module.buffers())
        self.globals = Watched(self.module)  # a new child's code: what it reads too
        fresh(self)

    def uninstall(self) -> None:
        unfresh(self)
        self.routing.uninstall()

    # -- a call --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.globals is not None:  # what its code reads of its globals, as here
            values = self.globals.changes(self.name, self.host)
            if values:
                self.ops.append(SetGlobals(values, self.globals.first))
        sent = self.sent
        sent.writes(self.ops)
        self.routing.hooks(self.ops)  # put on its children here since: they run there
        carried = self.routing.carried  # context variables its children's hooks read
        tree = (args, kwargs, _values(carried)) if carried else (args, kwargs)
        # distinct tensors only: no structure to pickle
        structure = None if carried else spread(args, kwargs)
        held: list = []  # tensors the carried values hold (they stay here: _held)
        if structure is None:
            flat, spec = tree_flatten((args, kwargs))
            tensors, plain = pack(flat)
            told = (spec, plain)
            if carried:
                told = (spec, plain, *_held(tree[2], tensors, held))
            try:
                structure = Pickled(dumps(told))  # the script's classes by value
            except Exception as e:
                raise unsendable(self.name, self.host, args, kwargs, e) from None
        else:
            tensors = [*args, *kwargs.values()]
        grad = torch.is_grad_enabled()
        needs = [grad and t.requires_grad for t in tensors]
        crossing = [t.detach().cpu() for t in tensors]  # (no device maps: on the CPU)
        sent.settings(self.ops)  # modes, requires_grad, a dropout's p...
        if self.freed:
            self.ops.append(Free(self._freed()))
        # the math settings (threads, TF32...) as the session sends them, when changed
        self.part.follow_math([self.host])  # (ordered: they arrive before this call)
        ops, self.ops = self.ops, []
        autocast = [(d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
                    for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        draws = self.draws  # Worker(rng="derived"): a seed of its own, no RNG state of ours
        call = Call(next(self.calls), crossing, structure, needs, grad,
                    torch.is_inference_mode_enabled(),
                    torch.get_rng_state() if draws is None else draws(), ops, autocast,
                    torch.get_default_dtype(), self.device)
        answer = self._rpc(_call, self.name, call)
        outs = answer.tensors
        here = self.here
        if here.type != "cpu":
            outs = [t.to(here) for t in outs]
        if answer.rng is not None:
            torch.set_rng_state(answer.rng)  # what one piece's draws would have left it at
        self.part.add(self.name, answer.pid)
        self.stale = self.stale or self.buffered  # its buffers may have moved over there
        if answer.kept:  # something over there asks for dL/d(outputs): the call is in the graph
            outs = self._node(call.number, needs, outs, answer.alive,
                              [t for t, need in zip(tensors, needs, strict=True) if need],
                              answer.uses)
        out = answer.structure
        if type(out) is Bare:  # one tensor, or a tuple of them
            return outs[0] if out.lone else tuple(outs)
        out_spec, out_plain = pickle.loads(out.blob)
        here = tensors + held if held else tensors
        out_plain = [here[p.i] if isinstance(p, Same) else p for p in out_plain]
        out, side, changed = tree_unflatten(unpack(outs, out_plain), out_spec)
        sent.attributes.left(side)  # an auxiliary loss the forward set on self
        if changed is not None:  # a cache it appended to, a tensor it wrote into
            into(tree, changed, self.name)
        return out

    def _node(self, number: int, needs: list, outs: list, alive: list, inputs: list,
              uses: tuple = (), parent: Any = None) -> tuple:
        # the call as a node of the graph here (its anchor tells .backward() from grad());
        # an argument the forward used k times over there is an input k times; a create_graph
        # answer's takes its parent's token (the parent: the node whose backward made it)
        anchor = torch.empty(0, requires_grad=True)
        acc = torch.autograd.graph.get_gradient_edge(anchor).node
        if uses:
            inputs = [t for t, k in zip(inputs, uses, strict=True) for _ in range(k)]
        if parent is not None:
            token, = parent.saved_tensors
            inputs = [*inputs, token]
        return _Remote.apply(self, number, needs, outs, alive, acc, anchor, uses, parent,
                             *inputs)[:-1]

    def _freed(self) -> tuple:
        freed, self.freed = self.freed, []
        return tuple(freed)

    def outgoing(self) -> list:
        """What is queued for the next message, taken, with the calls freed since."""
        if self.freed:
            self.ops.append(Free(self._freed()))
        ops, self.ops = self.ops, []
        return ops

    def _backward(self, ctx: Any, grads: tuple) -> list:
        number, needs = ctx.number, ctx.needs
        # .backward() accumulates into the weights over there; autograd.grad(out, inputs)
        # with them not among the inputs does not
        accumulate = engine_will_run(ctx.acc)
        create = torch.is_grad_enabled()  # create_graph=True: the answer is differentiable
        crossing = [None if g is None else g.detach().cpu() for g in grads]
        joined: tuple = ()
        if not create:
            joined = waited(self, number)
            parent = ctx.parent
            if (parent is not None and engine_will_run(parent)
                    and engine_will_run(parent.acc) == accumulate):
                return defer(self, ctx, crossing, joined)
        ops = self.outgoing()
        if create:
            then = next(self.calls)
            asks = [g is not None and g.requires_grad for g in grads]
            back, alive = self._rpc(_backward, self.name, number, crossing, ops, accumulate,
                                    then, asks)
            inputs = ctx.inputs
            given = [g for g, ask in zip(grads, asks, strict=True) if ask]
            there = [g for g in back if g is not None]
            if there:
                here = self.here
                there = [t.to(here) for t in there]
                live = [a for g, a in zip(back, alive, strict=True) if g is not None]
                there = iter(self._node(then, [*asks, *[True] * len(inputs)], there, live,
                                        [*given, *inputs], parent=ctx))
            back = [None if g is None else next(there) for g in back]
            return [g for g, need in zip(back, needs, strict=True) if need]
        if not any(needs):
            # nothing here waits for dL/d(arguments): the backward goes with the next
            # message (behind what was queued before it, ahead of the step queued after)
            self.ops = [*ops, Backward(self.name, number, crossing, accumulate, joined)]
            return []
        back = self._rpc(_backward, self.name, number, crossing, ops, accumulate, None, None,
                         joined)
        here = self.here
        return [_to(g, here) for g, need in zip(back, needs, strict=True) if need]

    def _rpc(self, fn: Any, *args: Any) -> Any:
        # the worker runs calls in the order they were sent, each with what was queued
        got = self.part.runtime.call(self.host, fn, *args)
        if isinstance(got, Raised):
            raise self._rebuilt(got)
        return got

    def settle(self) -> None:
        """Do over there the backwards still queued here (a trace written now has them)."""
        if any(type(op) is Backward for op in self.ops):
            self._read(_applied)

    def _rebuilt(self, got: Raised) -> BaseException:
        # raised in the module over there: its own type here
        peer = self.part.runtime.peers.get(self.host)
        pid = f" (pid {peer.pid})" if peer is not None else ""
        return rebuilt(got, f"module {self.name!r} on worker {self.host!r}{pid}")

    # -- what the optimizers here send (somatize.torch._mirror) -----------------------
    def queue(self, op: Any) -> None:
        """Send ``op`` (a typed operation: ``op.apply(placed)`` over there) with the next
        call. An op that moves the weights over there (a step) leaves the copy here stale."""
        self.ops.append(op)
        self.stale = self.stale or getattr(op, "moves_weights", False)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(live, name, *args, ops)`` over there now: what is queued goes with it,
        to be done first."""
        ops = self.outgoing()
        return self._rpc(fn, self.name, *args, ops)

    # -- the weights here -------------------------------------------------------------------
    def pull(self) -> dict:
        """Bring the weights here up to date; return the mirrors' states by parameter name."""
        self.stale = False
        got = self._read(_state)
        with plainly():
            restore(self.module, got["weights"])
        self.sent.remember()
        return got["optimizers"]

    def bring(self) -> None:
        """A read here of the weights, stale since the module stepped or ran over there:
        bring them up to date first (weights only: one round trip)."""
        self.stale = False
        self.routing.check()
        got = self._read(_weights)
        with plainly():
            restore(self.module, got)
        self.sent.remember()

    def _read(self, fn: Any) -> Any:
        # what is queued (a write here first) goes before the read
        self.sent.writes(self.ops)
        ops, self.ops = self.ops, []
        return self._rpc(fn, self.name, ops)
