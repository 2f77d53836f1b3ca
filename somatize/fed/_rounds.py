"""A study's round barriers on disk, as the hub writes them: ``<dir>/<study>/round-<r>/``
holds the shared module (and V1's copies, the optimizers' tensors) as safetensors, the
round's FedAvg of the owners' parts (``average.safetensors``, named in the ledger by its
digest), and the round, the ledger and the optimizers' other entries as JSON. A round is
read back (``load_round``), or exported as a plain state_dict of the whole model
(``export_round``, ``somatize fed export``): the FedAvg as export, loaded without somatize.

    trunk, ledger = load_round("ckpt/", "ct-2027")
    state = export_round("ckpt/", "ct-2027", shared="trunk")   # {"trunk.0.weight": ...}
    model.load_state_dict(state)                               # a plain LightningModule
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from blake3 import blake3

from .._errors import Refused


def tensor_digest(t: torch.Tensor) -> str:
    """blake3 of a tensor's bytes (the ledger's record of what crossed)."""
    t = t.detach().contiguous()
    return blake3(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:32]


def average_digest(avg: dict[str, torch.Tensor]) -> str:
    """The digest of a round's average: its entries' names and bytes, in name order."""
    return blake3(b"".join(tensor_digest(avg[k]).encode() + k.encode()
                           for k in sorted(avg))).hexdigest()[:32]


def write_round(d: Path, round: int, tensors: dict, meta: dict,
                average: dict[str, torch.Tensor] | None) -> None:
    """The barrier before ``round``: the hub's state, and the average that closed it."""
    from safetensors.torch import save_file

    r = d / f"round-{round}"
    r.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(r / "state.safetensors"))
    if average:
        save_file({k: v.detach().contiguous() for k, v in average.items()},
                  str(r / "average.safetensors"))
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


def export_round(checkpoints: str | Path, study: str, shared: str,
                 round: int | None = None) -> dict[str, Any]:
    """The model after ``round``'s barrier (the latest by default) as one plain
    state_dict: the shared module under ``shared.`` (its path in the owners' model) and
    the round's FedAvg of the owners' parts under their own names, checked against the
    ledger's digest of that average. It loads into the LightningModule with plain
    ``load_state_dict`` (``strict=False`` when the study averages only some parts)."""
    from safetensors.torch import load_file

    d = _round_dir(checkpoints, study, round)
    trunk, ledger = load_round(checkpoints, study, int(d.name[6:]))
    out = {f"{shared}.{k}": v for k, v in trunk.items()}
    averages = [e for e in ledger if e["kind"] == "average"]
    if (d / "average.safetensors").exists():
        avg = load_file(str(d / "average.safetensors"))
        if not averages or averages[-1].get("digest") != average_digest(avg):
            raise Refused(f"{d / 'average.safetensors'} is not the average the ledger names "
                          f"(digest {averages[-1].get('digest') if averages else None}): "
                          "the checkpoint was altered or mixed with another's")
        clash = sorted(k for k in avg if k in out)
        if clash:
            raise Refused(f"the study averages {clash[:3]}, under the shared module's path "
                          f"{shared!r}: give the path the owners place it at")
        out.update(avg)
    elif averages and averages[-1].get("digest") != average_digest({}):
        raise Refused(f"{d} holds no average.safetensors (a hub older than export wrote "
                      "it): only the shared module can be exported from it")
    return out
