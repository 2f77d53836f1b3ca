"""Every private torch.distributed.rpc name the remote layer relies on, in one place: where
torch offers no public way (the current agent and its members, taking a dead member out of
an agent's view, the pickler RPC messages go through). A torch upgrade that drops one
breaks here, with an error naming the attribute and the installed torch;
``tests/test_private.py`` pins each name in ``NAMES`` on the installed torch.

    infos = worker_infos()          # every member this process's agent knows
    forget_member(name)             # calls to a dead member fail at once
    p = rpc_pickler()               # what every Python call and answer is pickled with
"""

from __future__ import annotations

from typing import Any

from .._errors import WorkerError

# (module or owner, attribute) pairs read below, for the pinning test
NAMES = [("torch.distributed.rpc.api", "_get_current_rpc_agent"),
         ("torch.distributed.rpc.TensorPipeAgent", "_update_group_membership"),
         ("torch.distributed.rpc.internal", "_internal_rpc_pickler")]


# what building a torch optimizer imports the first time (Optimizer.add_param_group is
# wrapped by torch._disable_dynamo): a fork server imports it once for every worker
OPTIMIZER_IMPORTS = ["torch._dynamo"]


def _need(owner: Any, where: str, attr: str, what: str) -> Any:
    try:
        return getattr(owner, attr)
    except AttributeError:
        import torch

        raise WorkerError(
            f"torch {torch.__version__} has no {where}.{attr}, which somatize's RPC group "
            f"uses for {what} (somatize/remote/_private.py): install the torch version "
            "somatize's constraints.txt names, or report it with your torch version") from None


def current_agent() -> Any:
    """This process's RPC agent (torch has no public way to reach it)."""
    from torch.distributed.rpc import api

    get = _need(api, "torch.distributed.rpc.api", "_get_current_rpc_agent",
                "the members of the group")
    return get()


def worker_infos() -> list:
    """Every member this process's agent knows (``WorkerInfo``: name and id)."""
    return current_agent().get_worker_infos()


def forget_member(name: str) -> None:
    """Take the member ``name`` out of this agent's view, as its leaving would (torch's
    ``RuntimeError`` when the agent does not know it)."""
    agent = current_agent()
    update = _need(agent, "torch.distributed.rpc.TensorPipeAgent",
                   "_update_group_membership", "forgetting a lost worker")
    update(agent.get_worker_info(name), [], {}, False)


def rpc_pickler() -> Any:
    """The pickler RPC sends every Python call and answer through (its ``serialize`` and
    ``deserialize``)."""
    from torch.distributed.rpc import internal

    return _need(internal, "torch.distributed.rpc.internal", "_internal_rpc_pickler",
                 "sealing every call and answer with the run's MAC")
