"""FedAvg's arithmetic, one function for the run and for its oracles: the states of
several owners averaged, weighted by their rows, summed in owner-name order in float64
and cast back, so that whoever averages the same states gets the same bits.

    avg = average({"a": model_a.state_dict(), "b": model_b.state_dict()}, {"a": 60, "b": 40})
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._errors import Refused


def average(states: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
            int_buffers: str = "max") -> dict[str, torch.Tensor]:
    """The weighted average of ``states`` (``{owner: state_dict}``), ``weights`` by owner
    (rows); floats as ``sum(w_k * t_k) / sum(w_k)`` in owner-name order, in float64;
    integer tensors (BatchNorm's ``num_batches_tracked``) by ``int_buffers``: ``"max"``
    or ``"first"`` (the first owner by name)."""
    owners = sorted(states)
    if not owners:
        raise Refused("average() of no states: at least one owner must take part")
    keys = list(states[owners[0]])
    for o in owners[1:]:
        if list(states[o]) != keys:
            odd = sorted(set(states[o]) ^ set(keys))
            raise Refused(f"average(): owner {o!r}'s state has other entries than "
                          f"{owners[0]!r}'s ({odd[:5]}): they do not hold the same parts")
    missing = [o for o in owners if o not in weights or weights[o] <= 0]
    if missing:
        raise Refused(f"average(): owners {missing} have no positive weight (rows)")
    total = float(sum(float(weights[o]) for o in owners))
    out = {}
    for k in keys:
        first = states[owners[0]][k]
        for o in owners[1:]:
            t = states[o][k]
            if t.shape != first.shape or t.dtype != first.dtype:
                raise Refused(f"average(): {k!r} is {tuple(t.shape)} {t.dtype} at {o!r} but "
                              f"{tuple(first.shape)} {first.dtype} at {owners[0]!r}")
        if first.is_floating_point() or first.is_complex():
            acc = torch.zeros(first.shape, dtype=torch.float64 if first.is_floating_point()
                              else torch.complex128)
            for o in owners:  # the fixed order is what makes it exact
                acc += states[o][k].detach().cpu().to(acc.dtype) * (float(weights[o]) / total)
            out[k] = acc.to(first.dtype)
        elif int_buffers == "max":
            out[k] = torch.stack([states[o][k].detach().cpu() for o in owners]).amax(0)
        elif int_buffers == "first":
            out[k] = states[owners[0]][k].detach().cpu().clone()
        else:
            raise Refused(f"average(int_buffers={int_buffers!r}): say 'max' or 'first'")
    return out
