"""The hub's side of a study, whatever carries its messages: the shared module (one copy
per owner in V1, one module in V2), its optimizer, the owner-steps, the round barriers,
FedAvg of the owners' parts, the ledger and the checkpoints.

    hub = StudyHub(StudyConfig.load("ct-2027.toml"), checkpoints="ckpt/", store="store/")
    kind, fields, tensors = hub.handle("hospital-a", "Forward", {...}, {"x": activations})
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ._average import average
from ._config import StudyConfig
from ._flat import flat_optimizer, unflat_optimizer
from ._frames import Refusal
from ._rounds import average_digest, check_keep, keep_round, tensor_digest, write_round
from ._seeds import generator_seed, seeded
from ._turns import Turns

log = logging.getLogger(__name__)


class StudyHub(Turns):
    """One study's state on the hub; ``handle`` is thread-safe (the transport calls it
    from its threads). ``checkpoints``: a directory, written at each round barrier (to
    resume from); ``store``: a store each barrier's shared state and average are kept in
    (to export from, ``somatize fed export``), its ``keep_rounds`` latest rounds live
    (0: every round)."""

    def __init__(self, config: StudyConfig, checkpoints: str | Path | None = None,
                 resume: bool = False, store: str | Path | None = None,
                 keep_rounds: int = 0):
        self.cfg = config
        self.dir = Path(checkpoints) / config.name if checkpoints else None
        self.store, self.keep_rounds = store, check_keep(config.name, store, keep_rounds)
        self.cond = threading.Condition()
        self.compute = threading.Lock()  # one computation at a time: the global RNG is seeded
        self.round = 0
        self.trunk = config.build_module()
        self.v1 = config.schedule == "v1"
        self.copies: dict[str, torch.nn.Module] = {}
        self.opts: dict[str, Any] = {}
        if not self.v1:
            self.opts[""] = config.build_optimizer(self.trunk.parameters())
        self.ledger: list[dict] = []
        self.averaged: dict[str, torch.Tensor] = {}  # the last round's average of the parts
        self.attached: set[str] = set()
        self.checked: set[str] = set()  # whose study definition is the hub's (may evaluate)
        self.gone: dict[str, tuple[int, str]] = {}  # left out: the round, and why
        self._new_round()
        if resume:
            self._resume()

    # -- the round's state -------------------------------------------------------------
    def _new_round(self) -> None:
        self.steps = {o: 0 for o in self.cfg.owners}
        self.rows = {o: 0 for o in self.cfg.owners}
        self.pending: dict[str, tuple[int, torch.Tensor, torch.Tensor, float]] = {}
        self.arrived: dict[str, dict[str, torch.Tensor]] = {}
        self.answer: dict[int, tuple[str, dict[str, torch.Tensor], list[str]]] = {}
        self.first_arrival: float | None = None
        self.turn: tuple[str, float] | None = None
        self.last_turn: str | None = None
        self.free_since = time.monotonic()
        self.round_open: float | None = None  # when the round's first turn was asked
        self.started = False  # a turn was taken this round

    def _module(self, owner: str) -> torch.nn.Module:
        if not self.v1:
            return self.trunk
        if owner not in self.copies:
            m = copy.deepcopy(self.trunk)
            self.copies[owner] = m
            self.opts[owner] = self.cfg.build_optimizer(m.parameters())
        return self.copies[owner]

    def _opt(self, owner: str) -> Any:
        return self.opts[owner if self.v1 else ""]

    # -- messages ----------------------------------------------------------------------
    def handle(self, owner: str, kind: str, fields: dict, tensors: dict[str, torch.Tensor]
               ) -> tuple[str, dict, dict[str, torch.Tensor]]:
        """Run one message from ``owner`` (the name its certificate proves); returns the
        answer, or raises ``Refusal``."""
        if owner not in self.cfg.owners:
            raise Refusal("identity", f"{owner!r} is not an owner of study "
                                      f"{self.cfg.name!r}")
        claimed = fields.get("owner", owner)
        if claimed != owner:
            raise Refusal("identity", f"a message naming owner {claimed!r} came with "
                                      f"{owner!r}'s certificate")
        if kind == "Attach":
            return self._attach(owner, fields)
        evaluating = kind == "Forward" and not fields.get("train", True)
        if owner not in (self.checked if evaluating else self.attached):
            raise Refusal("attach", f"owner {owner!r} sent {kind} before Attach")
        with self.cond:
            if owner in self.gone:
                raise self._excluded(owner)
        if kind == "Forward":
            return self._forward(owner, fields, tensors)
        if kind == "Backward":
            return self._backward(owner, fields, tensors)
        if kind == "RoundEnd":
            return self._round_end(owner, fields, tensors)
        if kind == "Detach":
            with self.cond:
                self.attached.discard(owner)
                self.cond.notify_all()
            return "Done", {}, {}
        raise Refusal("kind", f"an owner does not send {kind}")

    def _attach(self, owner: str, fields: dict) -> tuple[str, dict, dict]:
        cfg = self.cfg
        for name, want in (("digest", cfg.digest()), ("precision", cfg.precision),
                           ("schedule", cfg.schedule)):
            got = fields.get(name)
            if got != want:
                raise Refusal(name, f"owner {owner!r} attaches to study {cfg.name!r} with "
                                    f"{name} {got!r}; the hub's is {want!r}: use the study's "
                                    "own definition")
        with self.cond:
            self.checked.add(owner)
            if fields.get("evaluate"):  # only to evaluate (validation, test): joins no round
                return "Attached", {"round": self.round, "digest": cfg.digest()}, {}
            if fields.get("round") != self.round:
                raise Refusal("round", f"owner {owner!r} attaches at round "
                                       f"{fields.get('round')!r}; study {cfg.name!r} is at "
                                       f"round {self.round}: resume from round {self.round}'s "
                                       "checkpoint")
            if owner in self.gone and self.round <= self.gone[owner][0]:
                raise self._excluded(owner)  # not at the round it was left out of
            self.gone.pop(owner, None)
            self.attached.add(owner)
            self.cond.notify_all()
        return "Attached", {"round": self.round, "digest": cfg.digest()}, {}

    def _check_round(self, owner: str, fields: dict) -> None:
        if fields.get("round") != self.round:
            raise Refusal("round", f"owner {owner!r} sent round {fields.get('round')!r}; "
                                   f"study {self.cfg.name!r} is at round {self.round}")

    def _forward(self, owner: str, fields: dict, tensors: dict) -> tuple[str, dict, dict]:
        x = tensors.get("x")
        if x is None or len(tensors) != 1 or not x.is_floating_point():
            raise Refusal("shape", "a Forward carries one floating tensor 'x' (the activation "
                                   "at the cut)")
        train = bool(fields.get("train", True))
        if not train:  # validation or test: nothing kept, no step
            with self.compute:
                m = self._module(owner)
                was = m.training
                m.eval()
                try:
                    with torch.no_grad():
                        out = m(x)
                finally:
                    m.train(was)
            return "Output", {}, {"y": self._tensor_out(out)}
        with self.cond:
            self._check_round(owner, fields)
            if fields.get("step") != self.steps[owner]:
                raise Refusal("step", f"owner {owner!r} sent step {fields.get('step')!r}; "
                                      f"the hub expects step {self.steps[owner]}")
            if owner in self.pending:
                raise Refusal("step", f"owner {owner!r} sent a Forward before the Backward "
                                      f"of step {self.pending[owner][0]}")
            if not self.v1:
                self._take_turn(owner)
            step = self.steps[owner]
            # under the lock: no round closes, and no step expires, halfway through it
            with self.compute:
                m = self._module(owner)
                m.train()
                leaf = x.detach().requires_grad_(True)
                with seeded(generator_seed(self.cfg.seed_key, owner, self.round, step)):
                    with torch.enable_grad():
                        out = m(leaf)
            y = self._tensor_out(out)
            self.pending[owner] = (step, leaf, out, time.monotonic())
        return "Output", {}, {"y": y}

    @staticmethod
    def _tensor_out(out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise Refusal("shape", f"the shared module returned a {type(out).__name__}; the "
                                   "study link carries one tensor out")
        return out.detach()

    def _backward(self, owner: str, fields: dict, tensors: dict) -> tuple[str, dict, dict]:
        with self.cond:  # the whole step under the lock: a round closes before or after it
            self._expire()  # a Backward past turn_timeout is late, whoever else is here
            if owner in self.gone:
                raise self._excluded(owner)
            got = self.pending.get(owner)
            if got is None or got[0] != fields.get("step"):
                raise Refusal("step", f"owner {owner!r} sent the Backward of step "
                                      f"{fields.get('step')!r}, which is not in flight "
                                      "(never sent, or sent twice)")
            g = tensors.get("g")
            out = got[2]
            if g is None or len(tensors) != 1 or g.shape != out.shape or g.dtype != out.dtype:
                raise Refusal("shape", f"a Backward carries one tensor 'g' of "
                                       f"{tuple(out.shape)} {out.dtype}")
            step, leaf, out, _ = self.pending.pop(owner)
            with self.compute:
                opt = self._opt(owner)
                out.backward(g)
                gx = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                opt.step()
                opt.zero_grad(set_to_none=True)
            self.steps[owner] = step + 1
            self.rows[owner] += int(leaf.shape[0]) if leaf.dim() else 1
            self.ledger.append({"round": self.round, "owner": owner, "step": step,
                                "kind": "step", "x": tensor_digest(leaf),
                                "g": tensor_digest(g)})
            if self.turn is not None and self.turn[0] == owner:
                self.turn, self.last_turn, self.free_since = None, owner, time.monotonic()
            self.cond.notify_all()
        return "Grad", {}, {"gx": gx.detach()}

    # -- the round barrier -------------------------------------------------------------
    def _round_end(self, owner: str, fields: dict, tensors: dict) -> tuple[str, dict, dict]:
        if self.cfg.averager and tensors:
            raise Refusal("parts", f"study {self.cfg.name!r} averages its parts at averager "
                                   f"{self.cfg.averager!r}: the hub takes none")
        with self.cond:
            self._check_round(owner, fields)
            if owner in self.pending:
                raise Refusal("step", f"owner {owner!r} ends the round with step "
                                      f"{self.pending[owner][0]} in flight")
            r = self.round
            self.arrived[owner] = dict(tensors)
            if self.first_arrival is None:
                self.first_arrival = time.monotonic()
            self.cond.notify_all()
            while r not in self.answer:
                self._expire()
                waiting = [o for o in self.cfg.owners
                           if o not in self.arrived and o not in self.gone]
                late = time.monotonic() - self.first_arrival > self.cfg.round_timeout
                if not waiting or late:
                    self._close_round(waiting)
                    break
                self.cond.wait(0.05)
            if r not in self.answer:
                raise Refusal("quorum", f"round {r} of study {self.cfg.name!r} did not reach "
                                        f"its quorum ({self.cfg.quorum})")
            digest, avg, taking = self.answer[r]
            if avg is None:
                raise Refusal("quorum", f"round {r} of study {self.cfg.name!r} did not reach "
                                        f"its quorum ({self.cfg.quorum})")
            said = {"owners": taking} if self.cfg.averager else {}  # what the averager waits for
            return "Average", {"round": r, "digest": digest, **said}, avg

    def _close_round(self, late: list[str]) -> None:
        r = self.round
        for o in late:
            got = self.pending.pop(o, None)
            if got is not None:
                self.ledger.append({"round": r, "owner": o, "step": got[0], "kind": "discarded",
                                    "why": "round_timeout"})
            self._exclude(o, f"not at the barrier within round_timeout "
                             f"({self.cfg.round_timeout}s) of the first owner there; the "
                             "round was averaged without it")
        taking = sorted(o for o in self.arrived if self.rows[o] > 0)
        if len(taking) < self.cfg.quorum:
            self.answer[r] = ("", None, [])  # type: ignore[assignment]
            return
        weights = {o: self.rows[o] for o in taking}
        avg = average({o: self.arrived[o] for o in taking}, weights) if self.arrived[
            taking[0]] else {}
        if self.v1:
            trunk = average({o: self._module(o).state_dict() for o in taking}, weights)
            self.trunk.load_state_dict(trunk)
            for m in self.copies.values():
                m.load_state_dict(trunk)
        digest = average_digest(avg)
        self.averaged = avg  # kept in the store with the barrier (what export reads)
        self.ledger.append({"round": r, "kind": "average", "owners": taking,
                            "rows": weights, "digest": digest})
        self.answer[r] = (digest, avg, taking)
        self.round = r + 1
        answer = self.answer
        self._new_round()
        self.answer = answer
        self._checkpoint()
        self.cond.notify_all()

    # -- checkpoints -----------------------------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The hub's state at a barrier: tensors (the trunk, V1's copies, optimizer
        tensors) and JSON (round, ledger, optimizer's other entries)."""
        tensors = {f"trunk.{k}": v for k, v in self.trunk.state_dict().items()}
        meta: dict[str, Any] = {"round": self.round, "ledger": self.ledger,
                                "gone": sorted(self.gone), "opts": {}, "copies": sorted(
                                    self.copies)}
        for o, m in self.copies.items():
            tensors.update({f"copy.{o}.{k}": v for k, v in m.state_dict().items()})
        for o, opt in self.opts.items():
            meta["opts"][o] = flat_optimizer(opt, f"opt.{o}.", tensors)
        return {k: v.detach().contiguous().clone() for k, v in tensors.items()}, meta

    def _checkpoint(self) -> None:
        if self.dir is not None:
            write_round(self.dir, self.round, *self.state())
        if self.store is not None:
            keep_round(self.store, self.cfg.name, self.round, self.trunk.state_dict(),
                       self.averaged, self.keep_rounds, averager=self.cfg.averager or "")

    def _resume(self) -> None:
        if self.dir is None or not (self.dir / "latest").exists():
            return
        from safetensors.torch import load_file

        d = self.dir / f"round-{(self.dir / 'latest').read_text().strip()}"
        tensors = load_file(str(d / "state.safetensors"))
        meta = json.loads((d / "state.json").read_text())
        self.round, self.ledger = meta["round"], meta["ledger"]
        self.trunk.load_state_dict({k[6:]: v for k, v in tensors.items()
                                    if k.startswith("trunk.")})
        for o in meta["copies"]:
            self._module(o).load_state_dict({k[len(o) + 6:]: v for k, v in tensors.items()
                                             if k.startswith(f"copy.{o}.")})
        for o, om in meta["opts"].items():
            opt = self._opt(o) if o else self.opts[""]
            opt.load_state_dict(unflat_optimizer(om, f"opt.{o}.", tensors))
        log.info("study %s resumes at round %d from %s", self.cfg.name, self.round, d)
