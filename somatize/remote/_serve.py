"""The serving side: a worker process holds one live graph per session and runs the
stretches it is told to run. It is dumb: nothing here knows that training exists.

    python -m somatize.remote --name gpu --rank 1 --join tcp://127.0.0.1:29500

The functions below are what the coordinator calls over RPC; each answers a value
or a ``Failed`` (never raises), so the coordinator can name the worker and the node.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import _trace
from .._trace import now_us, span

log = logging.getLogger(__name__)

_sessions: dict[str, Any] = {}  # session id -> the live graph it was provisioned with
_keeper: Any = None  # opened from --store; it belongs to whoever runs this worker
_stop = threading.Event()
_lock = threading.Lock()
# every node runs on this one thread: a math library keeps one team of threads per
# calling thread, and teams left spinning by other RPC threads would slow the next call
_compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="somatize-compute")


@dataclass(frozen=True)
class Failed:
    """What a worker answers instead of raising: the node at fault and the traceback;
    ``raised``: what a node or a call raised, as it travels (``somatize.torch._raised``),
    raised there as its own type."""

    node: str | None
    error: str  # the exception's class name
    message: str
    trace: str
    raised: Any = None


_joined: set[str] = set()  # on the coordinator: workers whose join has completed


def joined(name: str, ticket: list | None = None) -> list | None:
    """Said to the coordinator by a worker once every member knows it (join is no barrier);
    ``ticket``: where the worker's shared-memory probe is (``_shm``). Answers this
    process's ticket, or None: then neither side sends through shared memory (one of the
    two has it off, or cannot open the other's: another pid namespace or user)."""
    from . import _shm

    if _shm.enabled() and not (ticket is not None and _shm.opens(ticket)):
        _shm.enable(False)
        log.warning("worker %r %s: big tensors of this run travel through the socket "
                    "(slower; docs/workers.md)", name,
                    "has shared memory off (SOMATIZE_SHM=0, or not on loopback)"
                    if ticket is None else "and this process cannot open each other's "
                    "memory (another container, pid namespace or user?)")
    _joined.add(name)
    return _shm.ticket()


_device: str | None = None  # --device; None: the default below


def device() -> str:
    """Where what is placed here computes: --device, else this torchrun rank's LOCAL_RANK
    GPU, else cuda:0 where there is one, else cpu."""
    import torch

    if _device is not None:
        return _device
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"
    return "cpu"


def hello() -> dict:
    """Who this worker is: whether it keeps, its pid, its math threads, its device."""
    import torch

    return {"keeps": _keeper is not None, "pid": os.getpid(),
            "threads": torch.get_num_threads(), "device": device()}


def noop() -> None:
    """Nothing: what a bare round trip costs."""


def provision(session: str, blob: bytes, tensors: list,
              catalog: dict[str, str]) -> Failed | None:
    """Hold the graph pickled in ``blob`` (its tensors beside it) under ``session``
    (refusing a different catalog)."""
    with _lock:
        live = _sessions.get(session)
        if live is not None:
            have = _catalog_of(live)
            if have != catalog:
                return Failed(None, "Refused", (
                    f"this worker holds session {session} with catalog {have}; it refuses "
                    f"the different catalog {catalog}. Close the graph or trainer first "
                    "(g.close()) to provision another"), "")
            return None  # the same catalog: what lives here (and its state) stays
        try:
            import cloudpickle  # noqa: F401  (what the blob's by-value classes need)

            from ._wire import loads_apart

            graph = loads_apart(blob, tensors)
        except Exception as e:
            return Failed(None, type(e).__name__, (
                f"the graph could not be unpickled here ({e}): a class it uses must be "
                "importable on this worker (define it in __main__ to send it by value)"),
                traceback.format_exc())
        _sessions[session] = graph
    return None


def close(session: str) -> None:
    """Forget the session's graph (and every object that lived in it)."""
    with _lock:
        _sessions.pop(session, None)
        _drawn.pop(session, None)
    with _turns:
        _turn[session] = _CLOSED  # a call still waiting for its turn is answered, not run
        _turns.notify_all()


def run(session: str, stretch: Any, ticket: int | None = None) -> Any:
    """Walk ``stretch`` over the session's graph; answer with what can travel."""
    with span(f"run {', '.join(map(str, stretch.nodes))}", "call"):
        return _in_turn(session, ticket, _run, session, stretch)


def call(session: str, fn_blob: bytes, args: tuple, kw: dict, ticket: int | None = None) -> Any:
    """Run ``fn(live_graph, *args, **kw)`` against the session's graph; answer its result."""
    return _in_turn(session, ticket, _call, session, fn_blob, args, kw)


# A session's calls run in the order the coordinator sent them (its ticket numbers): each
# arrives on its own RPC thread, and two threads may reach the compute thread in either
# order. Two backwards in flight must not swap: a zero_grad riding with the first, or the
# order their gradients add up in, would change the numbers.
_turns = threading.Condition()
_turn: dict[str, int] = {}  # session -> the ticket whose turn it is, or _CLOSED
_CLOSED = -1
_TURN_WAIT_S = 60.0


def _in_turn(session: str, ticket: int | None, fn, *args: Any) -> Any:
    if ticket is None:
        return _compute.submit(fn, *args).result()
    with _turns:
        _turns.wait_for(lambda: _turn.get(session, 0) in (ticket, _CLOSED) or _stop.is_set(),
                        timeout=_TURN_WAIT_S)
        now = _turn.get(session, 0)
        if now != ticket:
            why = ("the session was closed" if now == _CLOSED
                   else "this worker is stopping" if _stop.is_set()
                   else f"call {now} before it never came within {_TURN_WAIT_S:g} s (the "
                   "calls of a run must arrive in order)" if now < ticket
                   else f"it came twice, or after call {now - 1}")
            return Failed(None, "WorkerError", f"call {ticket} of session {session} was not "
                          f"run: {why}. Close the run and start it again", "")
        done = _compute.submit(fn, *args)  # the compute thread runs them in this order
        _turn[session] = ticket + 1
        _turns.notify_all()
    return done.result()


def clock() -> float:
    """This process's clock, in microseconds (to align traces)."""
    return now_us()


def trace(lane: str | None) -> list:
    """Start recording spans in the lane ``lane`` (None: stop); answer what was recorded."""
    tracing = _trace.current()
    got = tracing.take() if tracing is not None else []
    if lane is None:
        _trace.stop()
    else:
        _trace.start(lane)
    return got


_drawn: dict[str, dict] = {}  # session -> how many of its stretches ran (_draws.seen)


def _run(session: str, stretch: Any) -> Any:
    from .._draws import refuse_drawn, seen
    from .._engine import walk
    from ._wire import resolve, travelling

    graph = _sessions.get(session)
    if graph is None:
        return Failed(None, "WorkerError", f"no session {session} here: provision it first",
                      "")
    try:
        given = {p: resolve(v) for p, v in stretch.given.items()}
        drawn = seen(_drawn.setdefault(session, {}))
        out = walk(graph, stretch.nodes, inputs=stretch.inputs, given=given,
                   given_keys=stretch.given_keys, here=stretch.host, keeper=_keeper,
                   naming=stretch.naming, training=stretch.training,
                   wanted=stretch.wanted)
        if drawn is not None:  # (a stretch looked at: its generators' states read)
            nodes = ", ".join(map(repr, stretch.nodes))
            refuse_drawn(f"node {nodes}" if len(stretch.nodes) == 1 else f"nodes {nodes}",
                         nodes, drawn)
    except BaseException as e:  # answered, never raised: the coordinator names the node
        return _failed(e, _failing_node(e))
    return travelling(graph, out, stretch)


def _call(session: str, fn_blob: bytes, args: tuple, kw: dict) -> Any:
    import cloudpickle

    graph = _sessions.get(session)
    if graph is None:
        return Failed(None, "WorkerError", f"no session {session} here: provision it first",
                      "")
    try:
        fn = cloudpickle.loads(fn_blob)
        with span(getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None),
                                                          "__name__", "call"), "call"):
            return fn(graph, *args, **kw)
    except BaseException as e:
        return _failed(e, _failing_node(e))


def _failed(e: BaseException, node: Any) -> Failed:
    from ..torch._raised import caught  # how every route's exceptions travel

    return Failed(node, type(e).__name__, str(e), traceback.format_exc(), caught(e))


def stop() -> None:
    """Leave the group and exit (the main thread does it once this call has answered)."""
    _stop.set()
    with _turns:  # calls waiting for their turn are answered now
        _turns.notify_all()


def _catalog_of(graph) -> dict[str, str]:
    from .._node import kind_of

    return {n: kind_of(o) for n, o in graph.catalog.items()}


def _failing_node(e: BaseException) -> str | None:
    # the innermost somatize frame running something for a node names it (``node_id``):
    # the engine's run_node, a trainer's learn
    tb, node = e.__traceback__, None
    while tb is not None:
        f = tb.tb_frame
        if "node_id" in f.f_locals and f.f_globals.get("__name__", "").startswith("somatize."):
            node = f.f_locals["node_id"]
        tb = tb.tb_next
    return node


def _watch_stdin() -> None:
    # the coordinator (or the daemon) holds our stdin: end of file means it is gone
    try:  # the raw descriptor: a buffered read would hold a lock the exit needs
        while os.read(0, 1 << 16):
            pass
    except OSError:
        pass
    if not _stop.is_set():
        log.warning("the coordinator went away: this worker exits")
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Join the run's RPC group under ``--name`` and serve until told to stop."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m somatize.remote")
    ap.add_argument("--name", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--join", required=True, help="the rendezvous, tcp://HOST:PORT")
    ap.add_argument("--options", default="{}", help="the group's transport options (JSON)")
    ap.add_argument("--store", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None, help="where placed modules compute")
    args = ap.parse_args(argv)
    # a terminal's Ctrl-C reaches the whole process group: the coordinator stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"worker {args.name}: %(message)s")
    threading.Thread(target=_watch_stdin, daemon=True, name="somatize-stdin").start()

    import torch
    import torch.distributed.rpc as rpc

    from . import _admit, _sealed, _secret
    from ._membership import expect_closed_pipes, join_through, joined_store
    from ._settings import backend_options, loopback

    if args.threads:
        torch.set_num_threads(args.threads)
    global _device
    _device = args.device
    global _keeper
    if args.store:
        from ..store import Store, open_keeper

        _keeper = open_keeper(args.store)
        why = Store(args.store).writable()
        if why is not None:  # said once, here, not once per value not kept
            log.warning("cannot write the store %s (%s): nothing this worker runs is kept; "
                        "give this user write access to it, or start the worker with a "
                        "store of its own", args.store, why)
    import somatize.torch  # noqa: F401  (registers the tensor codec the keeper uses)

    opts = json.loads(args.options)
    key = _secret.given_key()  # from our environment, never from the command line
    host, _, port = args.join.removeprefix("tcp://").rpartition(":")
    _sealed.seal(key, loopback(host))  # on loopback: big tensors through shared memory
    init = join_through(host, int(port), key, opts.get("timeout", 60.0), args.name)
    # a run on a network: our listeners admit only its hosts, from the moment they open;
    # once we are a member, the coordinator tells us each later one (read again then: a
    # host admitted while we joined). No one else joins meanwhile: we hold the token
    hosts = None if loopback(host) else _admit.run_hosts(joined_store())
    with _admit.opening(hosts, later=lambda: _admit.run_hosts(joined_store())):
        rpc.init_rpc(args.name, rank=args.rank, world_size=None,
                     rpc_backend_options=backend_options(init, opts))
    expect_closed_pipes(opts.get("timeout", 60.0))
    from . import _shm

    theirs = rpc.rpc_sync("coordinator", joined, args=(args.name, _shm.ticket()),
                          timeout=opts.get("timeout", 60.0))
    _shm.enable(_shm.enabled() and theirs is not None and _shm.opens(theirs))
    _stop.wait()
    try:
        rpc.shutdown(graceful=True, timeout=opts.get("timeout", 60.0))
    except Exception as e:  # leaving cleanly is best effort; exiting is not
        log.warning("leaving the group failed: %s", e)
    from ._exposure import closing

    closing()  # how many calls from outside the run were refused, if any
    return 0

