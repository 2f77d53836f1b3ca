"""The oracles of a study, in one process and plain PyTorch: ``replay`` runs the
owner-steps of a ledger in its order (each owner's ``training_step``, backward and step,
the shared module seeded per owner-step as the hub seeds it, FedAvg at each round's
barrier), and ``simulate`` runs a study's own fixed schedule the same way.

    ref = replay(ledger, {"a": (make_model, loader_a), "b": (make_model, loader_b)}, cfg)
    sim = simulate({"a": ..., "b": ...}, cfg, rounds=2)
    torch.equal(ref.trunk["0.weight"], sim.trunk["0.weight"])
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._errors import Refused
from ._average import average
from ._config import StudyConfig
from ._seeds import generator_seed, seeded

Owners = Mapping[str, tuple[Callable[[], torch.nn.Module], Iterable]]
_END = object()


@dataclasses.dataclass
class Run:
    """What a study produced: each owner's model (its own parts; the shared path holds
    the hub's module), the shared module's final state, each owner's losses, the ledger."""

    models: dict[str, torch.nn.Module]
    trunk: dict[str, torch.Tensor]
    losses: dict[str, list[float]]
    ledger: list[dict]

    def own_state(self, owner: str, path: str) -> dict[str, torch.Tensor]:
        """``owner``'s state dict without the shared module's entries."""
        pre = path + "."
        return {k: v for k, v in self.models[owner].state_dict().items()
                if not k.startswith(pre)}


class _SeededShared(torch.nn.Module):
    """The shared module as one owner's model calls it: seeded per owner-step as the hub
    seeds it, its rows counted."""

    def __init__(self, module: torch.nn.Module, key: str, owner: str):
        super().__init__()
        self.inner, self.key, self.owner = module, key, owner
        self.round = self.step = self.rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            with torch.no_grad():
                self.inner.eval()
                try:
                    return self.inner(x)
                finally:
                    self.inner.train()
        self.rows += int(x.shape[0])
        with seeded(generator_seed(self.key, self.owner, self.round, self.step)):
            return self.inner(x)


def _optimizer(model: Any) -> Any:
    got = model.configure_optimizers()
    if isinstance(got, dict):
        got = got["optimizer"]
    if isinstance(got, (list, tuple)):
        if len(got) != 1:
            raise Refused("replay() follows one optimizer per owner; configure_optimizers "
                          f"of {type(model).__name__} gives {len(got)}")
        got = got[0]
    return got


def _set(model: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def replay(ledger: list[dict], owners: Owners, study: StudyConfig | Any, path: str = "trunk",
           seeds: Mapping[str, int] | None = None) -> Run:
    """Run ``ledger``'s owner-steps in its order, in plain PyTorch (see the module).
    ``owners``: ``{name: (make_model, loader)}``; ``seeds``: each owner's torch seed
    before its model is made (its RNG state is swapped in for each of its steps)."""
    cfg = study if isinstance(study, StudyConfig) else StudyConfig.load(study)
    v1 = cfg.schedule == "v1"
    trunk = cfg.build_module()
    rng, models, opts, shared, shared_opts, its, losses, idx = {}, {}, {}, {}, {}, {}, {}, {}
    for o in sorted(owners):
        make, _ = owners[o]
        if seeds is not None:
            torch.manual_seed(seeds[o])
        m = make()
        m.train()
        opts[o] = _optimizer(m)
        rng[o] = torch.get_rng_state()
        mine = copy.deepcopy(trunk) if v1 else trunk
        shared[o] = _SeededShared(mine, cfg.seed_key, o)
        _set(m, path, shared[o])
        models[o], losses[o] = m, []
    if v1:
        shared_opts = {o: cfg.build_optimizer(shared[o].inner.parameters()) for o in owners}
    else:
        one = cfg.build_optimizer(trunk.parameters())
        shared_opts = {o: one for o in owners}
    gone: set[str] = set()
    for entry in ledger:
        kind, o, r = entry["kind"], entry.get("owner"), entry["round"]
        if kind == "step":
            s = shared[o]
            if s.round != r:  # its first step of a new round
                s.round, s.step = r, 0
            torch.set_rng_state(rng[o])
            if entry["step"] != s.step:
                raise Refused(f"the ledger has owner {o!r} at step {entry['step']} of round "
                              f"{r}; its replay is at step {s.step}")
            batch = next(its[o], _END) if o in its else _END
            if batch is _END:  # a new epoch (a round may span epochs: round_steps)
                its[o], idx[o] = iter(owners[o][1]), 0
                batch = next(its[o])
            opts[o].zero_grad()
            out = models[o].training_step(batch, idx[o])
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()
            shared_opts[o].step()
            shared_opts[o].zero_grad(set_to_none=True)
            opts[o].step()
            losses[o].append(float(loss.detach()))
            rng[o] = torch.get_rng_state()
            s.step, idx[o] = s.step + 1, idx[o] + 1
        elif kind in ("excluded", "discarded"):
            if kind == "excluded":
                gone.add(o)
        elif kind == "average":
            taking = list(entry["owners"])
            rows = {t: shared[t].rows for t in taking}
            if entry.get("rows") and {t: int(n) for t, n in entry["rows"].items()} != rows:
                raise Refused(f"round {r}: the ledger's rows {entry['rows']} differ from the "
                              f"replay's {rows}: these are not the run's data")
            if cfg.parts:
                states = {t: {f"{p}.{k}": v for p in cfg.parts
                              for k, v in models[t].get_submodule(p).state_dict().items()}
                          for t in taking}
                avg = average(states, rows)
                for t in taking:
                    for p in cfg.parts:
                        pre = p + "."
                        models[t].get_submodule(p).load_state_dict(
                            {k[len(pre):]: v for k, v in avg.items() if k.startswith(pre)})
            if v1:
                tr = average({t: shared[t].inner.state_dict() for t in taking}, rows)
                trunk.load_state_dict(tr)
                for s in shared.values():
                    s.inner.load_state_dict(tr)
            for s in shared.values():
                s.rows = 0
            if not cfg.round_steps:  # a round is an epoch: the next starts the data anew
                its.clear()
    for o, m in models.items():
        _set(m, path, shared[o].inner)
    return Run(models, {k: v.clone() for k, v in trunk.state_dict().items()}, losses,
               list(ledger))


def schedule(cfg: StudyConfig, steps: Mapping[str, int], rounds: int) -> list[dict]:
    """The ledger a study's fixed order gives, ``steps`` owner-steps per owner and
    round (V1's order does not matter: owner by owner)."""
    if cfg.schedule == "v2" and cfg.order == "arrival":
        raise Refused(f"study {cfg.name!r} takes owner-steps as they arrive: that order is "
                      "what a run records; replay() its ledger")
    ledger = []
    for r in range(rounds):
        left = {o: steps[o] for o in sorted(steps)}
        done = {o: 0 for o in left}
        while any(left.values()):
            turn = [o for o in left if left[o]]
            if cfg.schedule == "v1" or cfg.order == "owner_sequential":
                turn = turn[:1] * left[turn[0]]
            for o in turn:
                ledger.append({"round": r, "owner": o, "step": done[o], "kind": "step"})
                done[o] += 1
                left[o] -= 1
        ledger.append({"round": r, "kind": "average",
                       "owners": sorted(o for o in steps if steps[o])})
    return ledger


def simulate(owners: Owners, study: StudyConfig | Any, rounds: int, path: str = "trunk",
             seeds: Mapping[str, int] | None = None) -> Run:
    """A study in one process on its fixed schedule: ``replay`` of ``schedule`` (a
    round: ``round_steps`` owner-steps of each owner, or an epoch of its loader)."""
    cfg = study if isinstance(study, StudyConfig) else StudyConfig.load(study)
    steps = {o: cfg.round_steps or len(loader) for o, (_, loader) in owners.items()}
    return replay(schedule(cfg, steps, rounds), owners, cfg, path, seeds)
