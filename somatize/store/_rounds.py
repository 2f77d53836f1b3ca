"""A study's rounds in the store, as ``somatize hub --store`` keeps them at each round
barrier: every averaged tensor a content-addressed value, ``artifact/fedavg/<its blob's
BLAKE3>``, and one record per round, ``artifact/fedround/<study>+<round>``, a plain-data
value naming them (``somatize.fed.export_round`` reads it back as a state_dict).

    recs, unreadable = records(store)      # RoundRecord(study, round, keep, ...)
    live(recs)                             # {("ct-2027", 3), ("ct-2027", 4)}

Which rounds are live (what ``gc`` keeps): of each study, the ``keep`` latest rounds
(``keep`` is the hub's ``--keep-rounds``, written with each record; the newest record's
says; 0 keeps every round). ``gc`` removes the records of the other rounds, then every
tensor name no live record holds, unless it was written for a round after the study's
newest record (a barrier being written); the blobs follow as blobs no name points at.
A record that cannot be read stops gc removing any round's tensors (said), since what
it holds is unknown. No torch here: ``store ls``, ``verify`` and ``gc`` read records as
plain data.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from ._entry import _PART
from ._items_care import size_text

log = logging.getLogger("somatize.store")

RECORD = "artifact/fedround/"
TENSOR = "artifact/fedavg/"
TENSOR_KIND = "fedavg"


@dataclasses.dataclass(frozen=True)
class RoundRecord:
    """What a round barrier kept: the shared module's state (``shared``) and the FedAvg of
    the owners' parts (``average``), each ``{entry: tensor name}``; ``digest``: the
    ledger's digest of that average; ``averager``: the party that averaged the parts
    instead of the hub ("" when the hub did: then ``average`` is all of it)."""

    name: str
    study: str
    round: int
    keep: int
    digest: str
    shared: Mapping[str, str]
    average: Mapping[str, str]
    averager: str = ""

    def tensors(self) -> dict[str, str]:
        """``{"shared/<entry>" or "average/<entry>": tensor name}``."""
        return {**{f"shared/{k}": v for k, v in self.shared.items()},
                **{f"average/{k}": v for k, v in self.average.items()}}


def record_name(study: str, round: int) -> str:
    """The name of ``study``'s record of ``round`` (ValueError for a study name the store
    cannot hold)."""
    if not _PART.fullmatch(study) or "+" in study:
        raise ValueError(f"study name {study!r}: a store keeps rounds of studies named "
                         "with letters, digits, '_', '.', '=' and '-'")
    return f"{RECORD}{study}+{int(round)}"


def parse_record_name(name: str) -> tuple[str, int] | None:
    """``(study, round)`` of a record's name, or None when it is not one."""
    if not name.startswith(RECORD):
        return None
    study, _, r = name[len(RECORD):].rpartition("+")
    return (study, int(r)) if study and r.isdigit() else None


def record_value(study: str, round: int, keep: int, digest: str,
                 shared: Mapping[str, str], average: Mapping[str, str],
                 averager: str = "") -> dict[str, Any]:
    """The plain data a record holds (what ``read_record`` reads)."""
    return {"study": study, "round": int(round), "keep": int(keep), "digest": digest,
            "shared": dict(shared), "average": dict(average), "averager": str(averager)}


def read_record(store: Any, name: str) -> RoundRecord | None:
    """The record kept under ``name``, or None when it is missing, damaged or not one
    (a damaged blob is said by the store and moved aside)."""
    where = parse_record_name(name)
    kept = store.get(name) if where else None
    v = kept.value if kept is not None else None
    try:
        rec = RoundRecord(name, v["study"], int(v["round"]), int(v["keep"]), str(v["digest"]),
                          dict(v["shared"]), dict(v["average"]), str(v.get("averager", "")))
    except (TypeError, KeyError, ValueError):
        return None
    names = list(rec.shared.values()) + list(rec.average.values())
    if (rec.study, rec.round) != where or not all(
            isinstance(n, str) and n.startswith(TENSOR) for n in names):
        return None
    return rec


def records(store: Any) -> tuple[list[RoundRecord], list[str]]:
    """Every round record in ``store``, by study and round, and the names of those that
    could not be read."""
    got, bad = [], []
    for name in store.names(RECORD):
        rec = read_record(store, name)
        if rec is None:
            bad.append(name)
        else:
            got.append(rec)
    return sorted(got, key=lambda r: (r.study, r.round)), bad


def live(recs: list[RoundRecord]) -> set[tuple[str, int]]:
    """The rounds ``gc`` keeps: of each study, its newest record's ``keep`` latest rounds
    (all of them when ``keep`` is 0)."""
    by_study: dict[str, list[RoundRecord]] = {}
    for r in recs:
        by_study.setdefault(r.study, []).append(r)
    out = set()
    for study, rs in by_study.items():
        rs.sort(key=lambda r: r.round)
        keep = rs[-1].keep
        out |= {(study, r.round) for r in (rs[-keep:] if keep > 0 else rs)}
    return out


def doomed_names(store: Any) -> list[str]:
    """The names ``gc`` removes: the records of rounds no longer live, and the tensors
    no live record holds (see the module)."""
    recs, bad = records(store)
    keeping = live(recs)
    doomed = [r.name for r in recs if (r.study, r.round) not in keeping]
    if bad:
        log.warning("store %s: round records %s cannot be read: gc removes no round's "
                    "tensors (run `somatize store verify`, then delete the damaged ones)",
                    store.path, bad[:3])
        return doomed
    held = {n for r in recs if (r.study, r.round) in keeping for n in r.tensors().values()}
    newest: dict[str, int] = {}
    for r in recs:
        newest[r.study] = max(newest.get(r.study, -1), r.round)
    for e in store.entries(TENSOR):
        if e.name in held:
            continue
        study, r = e.meta.get("study", ""), e.meta.get("round", "")
        if study not in newest or not r.isdigit() or int(r) > newest[study]:
            continue  # a barrier being written (its record comes after its tensors)
        doomed.append(e.name)
    return doomed


def ls_lines(store: Any) -> list[str]:
    """``store ls``'s lines for the rounds kept: study, round, size, tensors, liveness."""
    recs, bad = records(store)
    keeping = live(recs)
    sizes = {e.name: e.size for e in store.entries(TENSOR)}
    lines = []
    for r in recs:
        held = r.tensors().values()
        size = sum(sizes.get(n, 0) for n in held)
        lines.append(f"round\tstudy={r.study}\tround={r.round}\t{size_text(size)}\t"
                     f"tensors={len(held)}\t"
                     f"{'live' if (r.study, r.round) in keeping else 'not live (gc removes it)'}"
                     f"\tdigest={r.digest[:12]}")
    lines += [f"round\t{n}\tdamaged (store verify says why)" for n in bad]
    return lines


def verify(store: Any, blob_problems: Mapping[str, str]) -> list[str]:
    """What is wrong with the rounds kept, each problem naming its study and round:
    a record that cannot be read, a tensor it names that is missing, that points at
    another blob than its name says, or whose blob is damaged (``blob_problems``:
    ``{blob: why}`` from checking every blob)."""
    problems = []
    for name in store.names(RECORD):
        where = parse_record_name(name)
        e = store.entry(name)
        if e is not None and e.blob in blob_problems:  # said as it is: not read, not moved
            problems.append(f"damaged: round record {name} ({where}): blob {e.blob[:16]}: "
                            f"{blob_problems[e.blob]}. Delete {store.name_path(name)} (that "
                            "round can no longer be exported)")
            continue
        rec = read_record(store, name)
        if rec is None:
            problems.append(f"damaged: round record {name} ({where or 'not a record name'}) "
                            f"cannot be read as a round of a study. Delete "
                            f"{store.name_path(name)} (that round can no longer be "
                            "exported)")
            continue
        for entry, tensor in rec.tensors().items():
            at = f"study {rec.study!r} round {rec.round}: {entry} ({tensor[:40]}...)"
            e = store.entry(tensor)
            if e is None:
                problems.append(f"missing: {at} is not in the store: this round can no "
                                "longer be exported; export another round, or delete "
                                f"{store.name_path(name)}")
            elif e.blob != tensor[len(TENSOR):]:
                problems.append(f"damaged: {at}: its name file points at blob "
                                f"{e.blob[:16]}, not the one its name is the hash of. Delete "
                                f"{store.name_path(tensor)} and {store.name_path(name)}")
            elif e.blob in blob_problems:
                problems.append(f"damaged: {at}: blob {e.blob[:16]}: {blob_problems[e.blob]}"
                                f". This round can no longer be exported; delete "
                                f"{store.name_path(name)}")
    return problems
