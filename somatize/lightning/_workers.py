"""The workers a fit of SomatizeStrategy asks for: what ``place=`` and ``workers=`` must
be (refused in one line otherwise), the hosts its placements name, the store its embedded
workers keep, and the fork server started with the fit for them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._errors import Refused


def placed_hosts(place: Mapping[str, str], graph_modules: list) -> set[str]:
    """The worker names ``place=`` and the GraphModules' ``.at()`` put work on."""
    hosts = set(place.values())
    for gm in graph_modules:
        hosts |= set(gm.graph.placement.workers())
    return hosts


def with_store(workers: dict | None, store: str | None, place: Mapping[str, str],
               graph_modules: list) -> dict | None:
    """``workers=``, with an embedded worker keeping ``store`` for each host the fit
    places work on that it does not name."""
    if store is None:
        return workers
    from ..remote import Worker

    hosts = placed_hosts(place, graph_modules)
    return {**{h: Worker.embedded(store=store) for h in sorted(hosts)}, **(workers or {})}


def warm_up(place: Mapping[str, str], workers: dict | None, graph_modules: list) -> None:
    """With the fit (never in the constructor), a fork server for the embedded workers:
    forked from this process where that is safe (it has torch imported: a worker starts
    in a fraction of a second), else a fresh one importing torch while Lightning sets up.
    The first batch waits only for them to join."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return  # torchrun: ranks serve
    from ..remote import Worker, fork_workers
    from ..remote._fork_here import current, fork_here
    from ..remote._forks import FORKS_ENV

    given = workers or {}
    embedded = [h for h in placed_hosts(place, graph_modules)
                if not isinstance(given.get(h), str)
                and (given.get(h) or Worker.embedded()).kind == "embedded"]
    if embedded and not os.environ.get(FORKS_ENV) and current() is None:  # none yet
        if fork_here() is None:
            fork_workers(wait=False)


def check_place(place: Any) -> None:
    """Refuse ``place=`` that is not ``{submodule path: worker name}``, in one line."""
    if place is None:
        return
    if not isinstance(place, Mapping):
        raise Refused(
            f"place= takes a dict {{submodule path: worker name}}, not a {type(place).__name__} "
            f"({place!r}): SomatizeStrategy(place={{'body': 'worker'}}); on the Hydra line "
            "'somatize.place={body: worker}'")
    for path, host in place.items():
        if not isinstance(path, str) or not (isinstance(host, str)
                                             or hasattr(host, "somatize_study")):
            raise Refused(
                f"place={{{path!r}: {host!r}}}: each entry is a submodule path and a worker "
                "name, both strings: place={'body': 'worker'}")


def check_workers(workers: Any) -> None:
    """Refuse ``workers=`` that is not ``{worker name: Worker or "host:port"}``, in one line."""
    if workers is None:
        return
    if not isinstance(workers, Mapping):
        raise Refused(
            f"workers= takes a dict {{worker name: Worker}}, not a {type(workers).__name__} "
            f"({workers!r}): workers={{'worker': Worker.at('node3:7000')}}; on the Hydra "
            "line 'somatize.workers={worker: \"node3:7000\"}'")
    from ..remote import Worker

    for name, w in workers.items():
        if not isinstance(name, str) or not isinstance(w, (str, Worker)):
            raise Refused(
                f"workers={{{name!r}: {w!r}}}: each entry is a worker name and a Worker or "
                "its address 'host:port' (quoted on the Hydra line): "
                "workers={'worker': '127.0.0.1:7000'}")
        if isinstance(w, str):
            Worker.at(w)  # refuses an address that is not 'host:port', saying so


def check_rng(rng: Any, rng_key: Any) -> tuple[str, str]:
    """``rng=`` and ``rng_key=`` of the strategy, or refused in one line naming the
    choices."""
    from ..remote._worker import RNG

    if rng not in RNG:
        raise Refused(f"SomatizeStrategy(rng={rng!r}): say one of {', '.join(map(repr, RNG))}: "
                      "'sent' (this process's RNG state travels with each call) or 'derived' "
                      "(none crosses; each call draws from a generator derived from rng_key); "
                      "on the Hydra line somatize.rng=derived")
    if not isinstance(rng_key, str) or not rng_key:
        raise Refused(f"SomatizeStrategy(rng_key={rng_key!r}): give the key derived seeds "
                      "come from as a non-empty string (a run's seed, not a secret)")
    return rng, rng_key


def refuse_unused_workers(workers: Mapping[str, Any] | None, place: Mapping[str, str],
                           graph_modules: list) -> None:
    """Refuse a ``workers=`` name that no placement uses (a typo would otherwise start an
    embedded worker for the placement's name and say nothing), the near names beside it."""
    if not workers:
        return
    used = placed_hosts(place, graph_modules)
    unused = sorted(set(workers) - used)
    if not unused:
        return
    import difflib

    pairs = []
    for name in unused:
        near = difflib.get_close_matches(name, sorted(used - set(workers)), n=1, cutoff=0.5)
        pairs.append(f"{name!r} (placement {near[0]!r}?)" if near else repr(name))
    raise Refused(
        f"workers= names {', '.join(pairs)}, which no placement uses (placed on: "
        f"{', '.join(map(repr, sorted(used))) or 'nothing'}): name each worker as place= or "
        ".at() does, e.g. place={'body': 'gpu'} with workers={'gpu': ...}")
