"""TensorPipe membership: the rendezvous we host, and the surgery a dynamic group needs
(workers join and leave one RPC group that torch cannot restart, pytorch#46491).

    gate = rendezvous("127.0.0.1", key, timeout)  # gated (_gate); torch's tcp:// is not
    expect_closed_pipes(timeout)              # each process, right after joining
    unlist(store, name, rank)                 # a dead worker no later joiner should greet

These read TensorPipe's own keys and tokens (agent_utils.cpp, rpc/_utils.py): verified on
torch 2.13, which is why pyproject.toml asks for it.
"""

from __future__ import annotations

import importlib
import logging
import time

from .._errors import WorkerError
from . import _private

log = logging.getLogger(__name__)

_MEMBERS = "names/_ALL_WORKER_INFOS"  # TensorPipe's list of members, "name-rank," each


def rendezvous(host: str, key: bytes, timeout: float):
    """The run's rendezvous, listening on ``host`` only behind a gate that admits only
    peers holding ``key`` (``_gate``), registered as ``somatize://``; returns the gate
    (its ``store`` and ``port``)."""
    from ._gate import Gate

    gate = Gate(host, key, timeout)
    _register(gate.store)
    return gate


def join_through(host: str, port: int, key: bytes, timeout: float, who: str = "") -> str:
    """Register ``somatize://`` as the gated rendezvous at ``host:port`` (a joining
    worker); returns the init_method to hand ``init_rpc``."""
    from ._gate import GatedStore

    _register(GatedStore(host, port, key, timeout, who))
    return f"somatize://{host}:{port}"


_stores: list = []  # the store ``somatize://`` hands torch (one RPC group per process)


def joined_store():
    """The rendezvous this process joined through (``join_through``'s store)."""
    return _stores[0]


def _register(store) -> None:
    first = not _stores
    _stores[:] = [store]
    if first:
        def handler(url, **kw):
            yield _stores[0], 0, -1

        # the module, not the function torch.distributed re-exports under the same name
        rdv = importlib.import_module("torch.distributed.rendezvous")
        rdv.register_rendezvous_handler("somatize", handler)


def expect_closed_pipes(timeout: float) -> None:
    """Tell this process's agent (of a dynamic group) that peers leaving is normal.

    TensorPipe warns on stderr about every incoming pipe that closes ("encountered error
    when reading incoming request from gpu: EOF") unless the agent has left the group,
    which is the only thing that sets its ``shuttingDown_``; so each process leaves once,
    right after joining, and lists itself again. It still serves and calls as before; a
    peer that is lost is said by our errors, which name it.
    """
    agent = _private.current_agent()
    me, store = agent.get_worker_info(), agent.store
    # the token torch's joins and leaves hold, so none happens meanwhile; waited for by
    # polling, not store.wait: a member waiting must still answer the joiner
    token, mine = "RpcGroupManagementToken", f"Token_for_{me.name}_listed"
    deadline = time.monotonic() + timeout
    while store.compare_set(token, "", mine).decode() != mine:
        if time.monotonic() > deadline:
            raise WorkerError(f"{me.name!r} waited {timeout:g} s for the group's membership "
                              "token: another process holds it (a join that hung)")
        time.sleep(0.005)
    try:
        agent.join(shutdown=True)  # unlists us
        store.set(_MEMBERS, store.get(_MEMBERS).decode() + f"{me.name}-{me.id},")
    finally:
        store.set(token, "")
        store.set(mine, "Done")  # whoever waits for our token (torch's joins) goes on


def forget(name: str) -> None:
    """Take a dead member out of this agent's view, so calls to it fail at once."""
    try:
        _private.forget_member(name)
    except WorkerError:  # torch changed: said, not swallowed
        raise
    except Exception as e:  # it may never have joined
        log.debug("forgetting %r: %s", name, e)


def unlist(store, name: str, rank: int) -> None:
    """Take a dead member off the rendezvous' list: a joining worker greets everyone
    listed there, and a dead one would fail its join."""
    key = "rpc_prefix_0/" + _MEMBERS
    try:
        listed = "," + store.get(key).decode()
        store.set(key, listed.replace(f",{name}-{rank},", ",")[1:])
    except Exception as e:
        log.debug("unlisting %r: %s", name, e)
