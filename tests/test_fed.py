"""somatize.fed in one process: FedAvg's arithmetic, the study link's frames, the seeds,
the study's definition, and the oracles (``simulate``, ``replay``) against plain
Lightning. The studies over real processes are in test_fed_study.py."""

import pickle

import lightning.pytorch as pl
import pytest
import torch
from fed_models import make_net, owner_loader, owner_seed

from somatize import Refused
from somatize.fed import (
    FrameError,
    StudyConfig,
    average,
    generator_seed,
    replay,
    schedule,
    simulate,
)
from somatize.fed._frames import decode, encode

STUDY = {"name": "unit", "owners": ["a", "b", "c"], "module": "fed_models:Trunk",
         "parts": ["stem", "head"], "schedule": "v1"}


def test_average_is_weighted_by_rows_in_a_fixed_order_and_exact():
    g = torch.Generator().manual_seed(0)
    states = {o: {"w": torch.randn(5, generator=g), "n": torch.tensor(i)}
              for i, o in enumerate("cab")}
    avg = average(states, {"a": 3, "b": 1, "c": 2})
    want = (states["a"]["w"].double() * 0.5 + states["b"]["w"].double() * (1 / 6)
            + states["c"]["w"].double() * (2 / 6)).float()
    assert torch.equal(avg["w"], want)
    assert avg["n"].item() == 2  # an integer buffer: the largest count
    again = average(dict(reversed(list(states.items()))), {"c": 2, "b": 1, "a": 3})
    assert torch.equal(again["w"], avg["w"])  # whoever averages gets the same bits
    with pytest.raises(Refused, match="other entries"):
        average({"a": {"w": torch.zeros(1)}, "b": {"v": torch.zeros(1)}}, {"a": 1, "b": 1})
    with pytest.raises(Refused, match="no positive weight"):
        average({"a": {"w": torch.zeros(1)}}, {"a": 0})


def test_frames_carry_dtype_shape_and_bytes_and_refuse_anything_else():
    x = torch.randn(3, 4)
    kind, fields, t = decode(encode("Forward", {"step": 2}, {"x": x, "i": torch.arange(3)}))
    assert (kind, fields) == ("Forward", {"step": 2})
    assert torch.equal(t["x"], x) and torch.equal(t["i"], torch.arange(3))
    assert torch.equal(decode(encode("Grad", {}, {"g": x.bfloat16()}))[2]["g"], x.bfloat16())
    for junk in (pickle.dumps({"x": x}), b"\x00" * 4096, b"SMZF\x01\xff\xff\xff\xff{}",
                 encode("Forward", {}, {"x": x})[:-1], encode("Forward", {}, {"x": x}) + b"1"):
        with pytest.raises(FrameError):
            decode(junk)
    with pytest.raises(FrameError, match="kind"):
        decode(encode("Output", {}, {}), frozenset({"Forward"}))


def test_seeds_are_one_per_owner_step_and_the_same_wherever_derived():
    s = generator_seed("ct", "a", 0, 3)
    assert s == generator_seed("ct", "a", 0, 3) and 0 <= s < 2 ** 63
    assert len({generator_seed("ct", o, r, k) for o in "ab" for r in range(3)
                for k in range(3)}) == 18
    assert generator_seed("other key", "a", 0, 3) != s


def test_a_study_definition_is_checked_and_its_digest_covers_the_shared_module():
    cfg = StudyConfig.load(STUDY)
    assert cfg.digest() == StudyConfig.load(dict(STUDY)).digest()
    assert cfg.digest() != StudyConfig.load({**STUDY, "kwargs": {"p": 0.5}}).digest()
    assert cfg.digest() != StudyConfig.load({**STUDY, "schedule": "v2"}).digest()
    with pytest.raises(Refused, match="schedule"):
        StudyConfig.load({**STUDY, "schedule": "v3"})
    with pytest.raises(Refused, match="unknown entries"):
        StudyConfig.load({**STUDY, "lerning_rate": 1})
    with pytest.raises(Refused, match="not installed here"):
        StudyConfig.load({**STUDY, "module": "no_such_pkg:Trunk"}).build_module()


def _plain_fedavg(cfg, owners, rounds):
    """FedAvg of plain Lightning fits of the whole model, one epoch per round."""
    models = {}
    for o in owners:
        torch.manual_seed(owner_seed(o))
        models[o] = make_net(cfg)
    start = models[owners[0]].state_dict()
    for m in models.values():
        m.load_state_dict(start)
    rows = {o: len(owner_loader(o).dataset) for o in owners}
    for _ in range(rounds):
        for o in owners:
            pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False,
                       ).fit(models[o], owner_loader(o))
        avg = average({o: m.state_dict() for o, m in models.items()}, rows)
        for m in models.values():
            m.load_state_dict(avg)
    return models


def test_simulated_v1_equals_fedavg_of_plain_lightning_fits():
    cfg = StudyConfig.load(STUDY)
    owners = {o: ((lambda: make_net(cfg)), owner_loader(o)) for o in "abc"}
    ref = _plain_fedavg(cfg, list("abc"), rounds=2)
    # the owners' models start alike here (the plain FedAvg's global model)
    sim = simulate(owners, cfg, rounds=2, seeds={o: owner_seed(o) for o in "abc"})
    want = ref["a"].state_dict()
    for o in "abc":
        got = sim.own_state(o, "trunk")
        assert got and all(torch.equal(want[k], v) for k, v in got.items())
    assert all(torch.equal(want[f"trunk.{k}"], v) for k, v in sim.trunk.items())


def _plain_fedavg_steps(cfg, owners, rounds, n):
    """FedAvg of whole models trained in plain PyTorch, every ``n`` steps of each owner
    (its batches in order across epochs), weighted by the rows of the round."""
    torch.manual_seed(owner_seed(owners[0]))
    start = make_net(cfg).state_dict()
    models, opts, batches = {}, {}, {}
    for o in owners:
        models[o] = make_net(cfg)
        models[o].load_state_dict(start)
        opts[o] = models[o].configure_optimizers()
        batches[o] = [b for _ in range(rounds * n) for b in owner_loader(o)][:rounds * n]
    for r in range(rounds):
        rows = {}
        for o in owners:
            for x, y in batches[o][r * n:(r + 1) * n]:
                opts[o].zero_grad()
                models[o].training_step((x, y), 0).backward()
                opts[o].step()
                rows[o] = rows.get(o, 0) + len(x)
        avg = average({o: m.state_dict() for o, m in models.items()}, rows)
        for m in models.values():
            m.load_state_dict(avg)
    return models


def test_rounds_of_n_steps_span_epochs_and_simulate_equals_fedavg_every_n_steps():
    cfg = StudyConfig.load({**STUDY, "round_steps": 2})
    assert cfg.digest() != StudyConfig.load(STUDY).digest()
    assert StudyConfig.load(STUDY).described().get("round_steps") is None  # digests kept
    with pytest.raises(Refused, match="round_steps"):
        StudyConfig.load({**STUDY, "round_steps": -1})
    owners = {o: ((lambda: make_net(cfg)), owner_loader(o)) for o in "abc"}
    sim = simulate(owners, cfg, rounds=3, seeds={o: owner_seed(o) for o in "abc"})
    # a has 3 batches an epoch, c one: their rounds cross the epochs' ends
    assert [e["owner"] for e in sim.ledger if e["kind"] == "step"] == (
        ["a", "a", "b", "b", "c", "c"] * 3)
    want = _plain_fedavg_steps(cfg, list("abc"), rounds=3, n=2)["a"].state_dict()
    for o in "abc":
        got = sim.own_state(o, "trunk")
        assert got and all(torch.equal(want[k], v) for k, v in got.items())
    assert all(torch.equal(want[f"trunk.{k}"], v) for k, v in sim.trunk.items())
    epochs = simulate(owners, StudyConfig.load(STUDY), rounds=3,
                      seeds={o: owner_seed(o) for o in "abc"})
    assert not all(torch.equal(epochs.trunk[k], v) for k, v in sim.trunk.items())


def test_v2_depends_on_the_order_and_replay_follows_the_ledger():
    cfg = StudyConfig.load({**STUDY, "schedule": "v2", "order": "round_robin",
                            "kwargs": {"p": 0.5}})
    owners = {o: ((lambda: make_net(cfg)), owner_loader(o)) for o in "abc"}
    seeds = {o: owner_seed(o) for o in "abc"}
    rr = simulate(owners, cfg, rounds=1, seeds=seeds)
    steps = [e["owner"] for e in rr.ledger if e["kind"] == "step"]
    assert steps == ["a", "b", "c", "a", "b", "a"]
    again = replay(rr.ledger, owners, cfg, seeds=seeds)
    assert all(torch.equal(rr.trunk[k], v) for k, v in again.trunk.items())
    seq = replay(schedule(StudyConfig.load({**STUDY, "schedule": "v2",
                                            "order": "owner_sequential",
                                            "kwargs": {"p": 0.5}}),
                          {o: len(owner_loader(o)) for o in "abc"}, 1), owners, cfg, seeds=seeds)
    assert not all(torch.equal(rr.trunk[k], v) for k, v in seq.trunk.items())


def test_the_hydra_option_makes_this_process_an_owner_of_the_study(tmp_path):
    from hydra.utils import instantiate
    from test_hydra import config

    from somatize.fed import Shared

    (tmp_path / "s.toml").write_text('name = "s"\nowners = ["a", "b"]\n'
                                     'module = "fed_models:Trunk"\n')
    cfg = config("+somatize=splitfed", f"somatize.study.config={tmp_path / 's.toml'}",
                 "somatize.study.hub=127.0.0.1:7443", "somatize.study.owner=b",
                 "somatize.study.identity=b.pem", "somatize.study.ca=ca.pem")
    strategy = instantiate(cfg.trainer.strategy)
    assert list(strategy.shared) == ["body"] and strategy.place == {}
    (shared,) = strategy.shared.values()
    assert isinstance(shared, Shared) and shared.study.owner == "b"
    assert shared.study.config.owners == ("a", "b")


def test_an_averager_takes_parts_only_and_answers_the_one_average_once_all_are_there():
    import threading

    from somatize.fed._averager import StudyAverager
    from somatize.fed._frames import Refusal

    cfg = StudyConfig.load({**STUDY, "averager": "avg", "round_timeout": 0.3})
    assert cfg.digest() != StudyConfig.load(STUDY).digest()
    for bad in ({"averager": "a"}, {"averager": "avg", "parts": []}):
        with pytest.raises(Refused, match="averager"):
            StudyConfig.load({**STUDY, **bad})
    av = StudyAverager(cfg)
    g = torch.Generator().manual_seed(0)
    parts = {o: {"head.weight": torch.randn(3, 2, generator=g)} for o in "ab"}

    def fields(o, **kw):
        return {"study": "unit", "owner": o, "round": 0, "rows": {"a": 3, "b": 1}.get(o, 1),
                "owners": ["a", "b"], "digest": cfg.digest(), **kw}

    with pytest.raises(Refusal, match="takes RoundEnd only"):
        av.handle("a", "Forward", fields("a"), {})
    with pytest.raises(Refusal, match="with digest '0'"):
        av.handle("a", "RoundEnd", fields("a", digest="0"), parts["a"])
    with pytest.raises(Refusal, match="'x' is not an owner"):
        av.handle("x", "RoundEnd", fields("x"), parts["a"])
    got = {}
    t = threading.Thread(target=lambda: got.update(a=av.handle("a", "RoundEnd", fields("a"),
                                                               parts["a"])))
    t.start()
    got["b"] = av.handle("b", "RoundEnd", fields("b"), parts["b"])
    t.join()
    want = average(parts, {"a": 3, "b": 1})
    for o in "ab":
        kind, said, avg = got[o]
        assert kind == "Average" and torch.equal(avg["head.weight"], want["head.weight"])
    # an owner the hub averaged that never brings its parts: refused at round_timeout
    with pytest.raises(Refusal, match=r"owners \['b'\] did not bring their parts"):
        av.handle("a", "RoundEnd", fields("a", round=1), parts["a"])


def test_a_late_backward_is_refused_by_itself_and_the_owner_may_not_attach_that_round():
    # the hub in one process: b's Backward comes after turn_timeout with nobody else there
    # to notice; it is refused by name (Excluded's fields), its step discarded and
    # ledgered, nothing applied; b may not attach again in the round it was left out of
    import time

    from somatize.fed._frames import Refusal
    from somatize.fed._hub import StudyHub

    cfg = StudyConfig.load({**STUDY, "owners": ["a", "b"], "schedule": "v2",
                            "order": "arrival", "turn_timeout": 0.2})
    hub = StudyHub(cfg)
    before = {k: v.clone() for k, v in hub.trunk.state_dict().items()}
    attach = {"study": "unit", "digest": cfg.digest(), "precision": "32-true",
              "schedule": "v2", "round": 0}
    for o in "ab":
        assert hub.handle(o, "Attach", {**attach, "owner": o}, {})[0] == "Attached"
    x = torch.randn(2, 128)
    hub.handle("b", "Forward", {"owner": "b", "round": 0, "step": 0}, {"x": x})
    time.sleep(0.3)
    with pytest.raises(Refusal) as e:
        hub.handle("b", "Backward", {"owner": "b", "step": 0}, {"g": torch.ones(2, 128)})
    assert (e.value.code, e.value.fields) == ("excluded", {"round": 0, "rejoin": 1})
    assert "its step 0 had no Backward within turn_timeout (0.2s)" in str(e.value)
    assert hub.ledger == [{"round": 0, "owner": "b", "step": 0, "kind": "discarded",
                           "why": "turn_timeout"}, {"round": 0, "owner": "b", "kind": "excluded"}]
    assert all(torch.equal(before[k], v) for k, v in hub.trunk.state_dict().items())
    with pytest.raises(Refusal, match="attach at round 1 or later"):
        hub.handle("b", "Attach", {**attach, "owner": "b"}, {})
    hub.handle("a", "Forward", {"owner": "a", "round": 0, "step": 0}, {"x": x})  # goes on
    hub.handle("a", "Backward", {"owner": "a", "step": 0}, {"g": torch.ones(2, 128)})
    assert hub.ledger[-1]["kind"] == "step" and hub.ledger[-1]["owner"] == "a"
