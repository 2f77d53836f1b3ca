"""An optimizer's state as flat tensors and JSON, for the hub's checkpoint at a barrier
(safetensors holds the tensors, a JSON file the rest)."""

from __future__ import annotations

from typing import Any

import torch


def flat_optimizer(opt: torch.optim.Optimizer, prefix: str, tensors: dict) -> dict:
    """Put ``opt``'s state tensors into ``tensors`` under ``prefix + "pid.key"``; answer
    the rest (groups, non-tensor entries, which keys each parameter has) as JSON data."""
    sd = opt.state_dict()
    rest: dict[str, Any] = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{prefix}{pid}.{k}"] = v
            else:
                rest[f"{pid}.{k}"] = v
    return {"groups": sd["param_groups"], "rest": rest,
            "keys": {str(pid): list(st) for pid, st in sd["state"].items()}}


def unflat_optimizer(meta: dict, prefix: str, tensors: dict) -> dict:
    """The state_dict ``flat_optimizer`` took apart into ``meta`` and ``tensors``."""
    state = {}
    for pid, keys in meta["keys"].items():
        state[int(pid)] = {k: tensors[f"{prefix}{pid}.{k}"] if f"{prefix}{pid}.{k}" in tensors
                           else meta["rest"][f"{pid}.{k}"] for k in keys}
    return {"state": state, "param_groups": meta["groups"]}
