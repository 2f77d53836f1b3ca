"""A study's round barriers, as the hub keeps them. On disk, for resuming:
``<dir>/<study>/round-<r>/`` holds the shared module (and V1's copies, the optimizers'
tensors) as safetensors and the round, the ledger and the optimizers' other entries as
JSON (``write_round``, ``load_round``). In the store (``somatize hub --store``), for
export: each averaged tensor a content-addressed value and a record per round naming
them (``keep_round``; ``somatize.store._rounds`` says which rounds ``gc`` keeps). A
round is exported from the store, its digests checked, as one plain state_dict of the
whole model (``export_round``, ``somatize fed export``): the FedAvg as export, loaded
without somatize.

    trunk, ledger = load_round("ckpt/", "ct-2027")
    state = export_round("store/", "ct-2027", shared="trunk")   # {"trunk.0.weight": ...}
    model.load_state_dict(state)                                # a plain LightningModule
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from blake3 import blake3

from .._errors import Refused

log = logging.getLogger(__name__)


def tensor_digest(t: torch.Tensor) -> str:
    """blake3 of a tensor's bytes (the ledger's record of what crossed)."""
    t = t.detach().contiguous()
    return blake3(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:32]


def average_digest(avg: dict[str, torch.Tensor]) -> str:
    """The digest of a round's average: its entries' names and bytes, in name order."""
    return blake3(b"".join(tensor_digest(avg[k]).encode() + k.encode()
                           for k in sorted(avg))).hexdigest()[:32]


def write_round(d: Path, round: int, tensors: dict, meta: dict) -> None:
    """The barrier before ``round``: the hub's state, to resume from."""
    from safetensors.torch import save_file

    r = d / f"round-{round}"
    r.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(r / "state.safetensors"))
    (r / "state.json").write_text(json.dumps(meta))
    (d / "latest").write_text(str(round))


def _round_dir(checkpoints: str | Path, study: str, round: int | None) -> Path:
    d = Path(checkpoints) / study
    if round is None:
        if not (d / "latest").exists():
            raise Refused(f"no checkpoint of study {study!r} under {checkpoints}: give the "
                          "directory the hub was started with (--checkpoints)")
        round = int((d / "latest").read_text())
    r = d / f"round-{round}"
    if not (r / "state.json").exists():
        have = sorted(p.name for p in d.glob("round-*"))
        raise Refused(f"study {study!r} has no barrier round-{round} under {checkpoints} "
                      f"(it has {have})")
    return r


def load_round(checkpoints: str | Path, study: str, round: int | None = None
               ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """A hub's checkpoint of ``study`` at a round barrier (the latest by default): the
    shared module's state and the ledger."""
    from safetensors.torch import load_file

    d = _round_dir(checkpoints, study, round)
    tensors = load_file(str(d / "state.safetensors"))
    meta = json.loads((d / "state.json").read_text())
    return {k[6:]: v for k, v in tensors.items() if k.startswith("trunk.")}, meta["ledger"]


def check_keep(study: str, store: Any, keep: int) -> int:
    """``keep`` (rounds ``gc`` keeps), once ``study`` is known to fit in ``store``'s
    names; Refused otherwise."""
    from ..store._rounds import record_name

    if store is not None:
        try:
            record_name(study, 0)
        except ValueError as e:
            raise Refused(f"study {study!r} cannot be kept in store {store}: {e}; rename "
                          "the study (name = ... in its TOML)") from None
    if not isinstance(keep, int) or keep < 0:
        raise Refused(f"study {study!r}: keep_rounds = {keep!r}; say how many latest rounds "
                      "the store keeps (0: every round)")
    return keep


def keep_round(store: Any, study: str, round: int, shared: dict[str, torch.Tensor],
               average: dict[str, torch.Tensor], keep: int = 0,
               averager: str = "") -> str | None:
    """Keep the barrier before ``round`` in ``store`` (a ``Store`` or its path): the
    shared module's state and the FedAvg of the owners' parts, each tensor under its
    content's address, then the record naming them (last: a record never names what is
    not kept). ``keep``: how many of the study's latest rounds ``gc`` keeps (0: all);
    ``averager``: the study's averager of its own, which holds the parts' average.
    Returns the record's name, or None when something could not be kept (said)."""
    import somatize.torch  # noqa: F401 (the tensor codec)

    from ..store import Store
    from ..store._rounds import TENSOR_KIND, record_name, record_value

    store = store if isinstance(store, Store) else Store(store)
    name = record_name(study, round)
    meta = {"study": study, "round": str(round)}
    names: dict[str, dict[str, str]] = {"shared": {}, "average": {}}
    for part, tensors in (("shared", shared), ("average", average)):
        for k, t in tensors.items():
            got = store.put_addressed(TENSOR_KIND, t.detach().cpu().contiguous(), meta)
            if got is None:
                log.warning("study %s: round %d is not kept in %s (its tensor %s could not "
                            "be): it cannot be exported", study, round, store.path, k)
                return None
            names[part][k] = got
    value = record_value(study, round, keep, average_digest(average), **names,
                         averager=averager)
    if not store.put(name, value, {**meta, "keep": str(keep)}):
        return None
    return name


def export_round(store: Any, study: str, shared: str, round: int | None = None,
                 shared_only: bool = False) -> dict[str, torch.Tensor]:
    """The model after ``round``'s barrier (the latest kept by default), read from
    ``store`` (a ``Store`` or its path) as one plain state_dict: the shared module under
    ``shared.`` (its path in the owners' model) and the round's FedAvg of the owners'
    parts under their own names. Each tensor is checked against its content address and
    the average against the ledger's digest of it. It loads into the LightningModule
    with plain ``load_state_dict`` (``strict=False`` when the study averages only some
    parts). A study whose parts an averager of its own averaged keeps no average in the
    hub's store: refused, unless ``shared_only`` (the shared module alone)."""
    import somatize.torch  # noqa: F401 (the tensor codec)

    from ..store import Store
    from ..store._rounds import TENSOR, read_record, record_name, records

    store = store if isinstance(store, Store) else Store(store)
    if round is None:
        have = [r.round for r in records(store)[0] if r.study == study]
        if not have:
            raise Refused(f"store {store.path} keeps no round of study {study!r}: give the "
                          "store the hub was started with (somatize hub --store)")
        round = max(have)
    rec = read_record(store, record_name(study, round))
    if rec is None:
        have = sorted(r.round for r in records(store)[0] if r.study == study)
        raise Refused(f"store {store.path} keeps no round {round} of study {study!r} (it "
                      f"keeps rounds {have}; `somatize store verify {store.path}` says "
                      "whether one is damaged)")
    if rec.averager and not shared_only:
        raise Refused(f"study {study!r} round {round}: its owners' parts were averaged by "
                      f"its averager {rec.averager!r}, not the hub, so store {store.path} "
                      "keeps the shared module only; export that alone with "
                      "shared_only=True (`somatize fed export ... --shared-only`) and load "
                      "it with strict=False beside the parts an owner keeps")
    got: dict[str, dict[str, torch.Tensor]] = {"shared": {}, "average": {}}
    for part, names in (("shared", rec.shared), ("average", rec.average)):
        for k, name in names.items():
            e = store.entry(name)
            kept = store.get(name) if e is not None and e.blob == name[len(TENSOR):] else None
            if kept is None or not isinstance(kept.value, torch.Tensor):
                raise Refused(f"study {study!r} round {round}: {part} tensor {k!r} ({name}) "
                              f"is missing or damaged in store {store.path}: export another "
                              f"round (`somatize store verify {store.path}` lists them)")
            got[part][k] = kept.value.clone()
    if average_digest(got["average"]) != rec.digest:
        raise Refused(f"study {study!r} round {round}: the average read from {store.path} "
                      f"is not the one its record names (digest {rec.digest}): the store "
                      "was altered")
    out = {f"{shared}.{k}": v for k, v in got["shared"].items()}
    clash = sorted(k for k in got["average"] if k in out)
    if clash:
        raise Refused(f"the study averages {clash[:3]}, under the shared module's path "
                      f"{shared!r}: give the path the owners place it at")
    out.update(got["average"])
    return out
