"""A study's rounds in a real store on disk: the hub (``StudyHub``, in this process, its
messages handed to it as the study link hands them) keeps each barrier's shared state
and FedAvg as content-addressed values and a record per round; ``export_round`` and
``somatize fed export`` read a round back as a plain state_dict; ``somatize store
ls|verify|gc`` list, check and clean the rounds. The same over real processes is
test_fed_study.py's export test."""

import shutil
import threading

import pytest
import torch
from fed_models import make_net, owner_loader, owner_seed
from torch import nn

from somatize import Refused
from somatize._cli import main
from somatize.fed import StudyConfig, average, export_round, simulate
from somatize.fed._hub import StudyHub
from somatize.store import Store
from somatize.store._rounds import TENSOR, live, record_name, records

STUDY = {"name": "kept", "owners": ["a", "b"], "module": "fed_models:Trunk",
         "parts": ["stem", "head"], "schedule": "v1"}
PARTS = ("stem", "head")


def _parts(net):
    return {f"{p}.{k}": v.detach().clone() for p in PARTS
            for k, v in net.get_submodule(p).state_dict().items()}


def _owner_round(hub, owner, net, opt, r):
    """One epoch of ``owner``'s own steps, as its fit takes them over the study link:
    the stem and head here, the trunk on the hub, only cut tensors crossing."""
    for step, (x, y) in enumerate(owner_loader(owner)):
        opt.zero_grad()
        h = net.stem(x)
        _, _, out = hub.handle(owner, "Forward", {"round": r, "step": step, "train": True},
                               {"x": h.detach()})
        cut = out["y"].requires_grad_(True)
        nn.functional.cross_entropy(net.head(cut), y).backward()
        _, _, back = hub.handle(owner, "Backward", {"step": step}, {"g": cut.grad})
        h.backward(back["gx"])
        opt.step()


def _study(store, rounds, keep=0):
    """A V1 study of two owners of unequal rows, ``rounds`` rounds, its rounds kept in
    ``store``; returns the averages each round's barrier answered, by round."""
    cfg = StudyConfig.load(STUDY)
    hub = StudyHub(cfg, store=store, keep_rounds=keep)
    nets, opts = {}, {}
    for o in cfg.owners:
        torch.manual_seed(owner_seed(o))
        nets[o] = make_net(cfg)
        opts[o] = torch.optim.SGD([*nets[o].stem.parameters(), *nets[o].head.parameters()],
                                  lr=0.1)
        hub.handle(o, "Attach", {"digest": cfg.digest(), "precision": "32-true",
                                 "schedule": "v1", "round": 0}, {})
    answered = {}
    for r in range(rounds):
        for o in cfg.owners:
            _owner_round(hub, o, nets[o], opts[o], r)
        got = {}

        def end(o, r=r, got=got):  # each owner waits at the barrier for the other
            got[o] = hub.handle(o, "RoundEnd", {"round": r}, _parts(nets[o]))

        ends = [threading.Thread(target=end, args=(o,)) for o in cfg.owners]
        for t in ends:
            t.start()
        for t in ends:
            t.join(60)
        (kind, fields, avg), other = got["a"], got["b"]
        assert kind == "Average" and fields == other[1]
        sent = {o: _parts(nets[o]) for o in cfg.owners}
        assert all(torch.equal(avg[k], v) for k, v in average(sent, {"a": 24, "b": 16}).items())
        for o in cfg.owners:
            for p in PARTS:
                nets[o].get_submodule(p).load_state_dict(
                    {k[len(p) + 1:]: v for k, v in avg.items() if k.startswith(p + ".")})
        answered[r + 1] = {**{f"trunk.{k}": v.clone() for k, v in hub.trunk.state_dict().items()},
                           **avg}
    return answered


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    d = tmp_path_factory.mktemp("rounds")
    return d, _study(d / "store", rounds=3, keep=2)


def _same(a, b):
    assert set(a) == set(b)
    assert not [k for k in a if not torch.equal(a[k], b[k])]


def _sim(rounds):
    cfg = StudyConfig.load(STUDY)
    owners = {o: ((lambda: make_net(cfg)), owner_loader(o)) for o in cfg.owners}
    return simulate(owners, cfg, rounds, seeds={o: owner_seed(o) for o in cfg.owners})


def test_each_barrier_is_kept_and_exports_as_a_plain_state_dict_equal_to_the_oracle(
        kept, tmp_path, capsys):
    d, answered = kept
    cfg = StudyConfig.load(STUDY)
    for r in (1, 2, 3):
        state = export_round(d / "store", "kept", "trunk", round=r)
        assert all(type(v) is torch.Tensor for v in state.values())
        fresh = make_net(cfg)  # a plain LightningModule: strict load, every entry
        fresh.load_state_dict(state)
        _same(fresh.state_dict(), answered[r])  # the run's own averages at that barrier
        if r != 2:  # and the oracle's (round 2 by the run's own, to keep it short)
            _same(fresh.state_dict(), _sim(r).models["a"].state_dict())
    # the command: the latest round, written for torch.load(weights_only=True)
    out = tmp_path / "kept.pt"
    assert main(["fed", "export", str(d / "store"), "kept", "--shared", "trunk",
                 "--out", str(out)]) == 0
    assert f"{len(answered[3])} entries of study 'kept'" in capsys.readouterr().out
    fresh = make_net(cfg)
    fresh.load_state_dict(torch.load(out, weights_only=True))
    _same(fresh.state_dict(), answered[3])
    assert main(["fed", "export", str(d / "store"), "other", "--shared", "trunk",
                 "--out", str(out)]) == 1
    assert "keeps no round of study 'other'" in capsys.readouterr().err


def test_a_round_is_its_tensors_content_addresses_and_one_record(kept):
    d, answered = kept
    store = Store(d / "store")
    recs, bad = records(store)
    assert bad == [] and [(r.study, r.round, r.keep) for r in recs] == [
        ("kept", 1, 2), ("kept", 2, 2), ("kept", 3, 2)]
    for rec in recs:
        assert rec.name == record_name("kept", rec.round) == f"artifact/fedround/kept+{rec.round}"
        assert set(rec.shared) == {k[6:] for k in answered[rec.round] if k.startswith("trunk.")}
        for name in rec.tensors().values():
            assert store.entry(name).blob == name[len(TENSOR):]  # the name is the content's hash
        got = {**{f"trunk.{k}": store.get(n).value for k, n in rec.shared.items()},
               **{k: store.get(n).value for k, n in rec.average.items()}}
        _same(got, answered[rec.round])
    assert live(recs) == {("kept", 2), ("kept", 3)}  # --keep-rounds 2


def test_store_ls_shows_each_round_its_study_size_and_whether_gc_keeps_it(kept, capsys):
    d, _ = kept
    store = Store(d / "store")
    assert main(["store", "ls", str(d / "store")]) == 0
    lines = [ln.split("\t") for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("round\t")]
    sizes = {e.name: e.size for e in store.entries(TENSOR)}
    from somatize.store._items_care import size_text

    want = []
    for rec in records(store)[0]:  # 8 tensors: the trunk's 4, the stem's and head's 4
        size = size_text(sum(sizes[n] for n in rec.tensors().values()))
        want.append(["round", "study=kept", f"round={rec.round}", size, "tensors=8",
                     "live" if rec.round > 1 else "not live (gc removes it)",
                     f"digest={rec.digest[:12]}"])
    assert lines == want


def test_verify_names_the_study_and_round_of_a_flipped_bit(kept, tmp_path, capsys):
    d, answered = kept
    shutil.copytree(d / "store", tmp_path / "store")  # (a fresh path: nothing read is held)
    store = Store(tmp_path / "store")
    assert main(["store", "verify", str(tmp_path / "store")]) == 0
    capsys.readouterr()
    rec = {r.round: r for r in records(store)[0]}[2]
    name = rec.average["head.weight"]
    blob = store.blob_path(store.entry(name).blob)
    raw = bytearray(blob.read_bytes())
    raw[-3] ^= 0x10  # one bit of the tensor's last bytes
    blob.chmod(0o600)
    blob.write_bytes(bytes(raw))
    assert main(["store", "verify", str(tmp_path / "store")]) == 1
    err = capsys.readouterr().err
    assert (f"damaged: study 'kept' round 2: average/head.weight ({name[:40]}...): blob "
            f"{store.entry(name).blob[:16]}: its bytes do not match its name") in err
    assert "round 1:" not in err and "round 3:" not in err  # rounds 1 and 3 do not hold it
    with pytest.raises(Refused, match="study 'kept' round 2: average tensor 'head.weight'"):
        export_round(store, "kept", "trunk", round=2)
    make_net(StudyConfig.load(STUDY)).load_state_dict(
        export_round(store, "kept", "trunk", round=3))  # another round still exports


def test_gc_keeps_the_live_rounds_and_removes_the_others(kept, tmp_path, capsys):
    d, answered = kept
    shutil.copytree(d / "store", tmp_path / "store")
    store = Store(tmp_path / "store")
    recs = {r.round: r for r in records(store)[0]}
    live_names = {n for r in (2, 3) for n in recs[r].tensors().values()}
    only_1 = set(recs[1].tensors().values()) - live_names
    assert only_1  # round 1's tensors are its own (every one moved in round 2)
    # a barrier being written (its tensors kept, its record not yet): gc leaves it
    writing = store.put_addressed("fedavg", torch.full((3,), 4.0),
                                  {"study": "kept", "round": "4"})
    assert main(["store", "gc", str(tmp_path / "store"), "--dry-run"]) == 0
    assert set(store.names()) >= {recs[1].name, *only_1}  # a dry run removes nothing
    capsys.readouterr()
    assert main(["store", "gc", str(tmp_path / "store")]) == 0
    names = set(store.names())
    assert names == {recs[2].name, recs[3].name, *live_names, writing}
    used = {store.entry(n).blob for n in names}
    assert {b for b, _ in store.blobs()} == used  # round 1's blobs went with its names
    for r in (2, 3):
        fresh = make_net(StudyConfig.load(STUDY))
        fresh.load_state_dict(export_round(store, "kept", "trunk", round=r))
        _same(fresh.state_dict(), answered[r])
    with pytest.raises(Refused, match=r"keeps no round 1 of study 'kept' \(it keeps rounds "
                                      r"\[2, 3\]"):
        export_round(store, "kept", "trunk", round=1)
    assert main(["store", "verify", str(tmp_path / "store")]) == 0


def test_gc_keeps_every_round_when_the_hub_keeps_all(tmp_path):
    _study(tmp_path / "store", rounds=2, keep=0)
    store = Store(tmp_path / "store")
    before = set(store.names())
    assert store.gc() == (0, 0)
    assert set(store.names()) == before and len(records(store)[0]) == 2


def test_a_study_a_store_cannot_name_is_refused_at_the_hub(tmp_path):
    cfg = StudyConfig.load({**STUDY, "name": "ct 2027"})
    with pytest.raises(Refused, match="study 'ct 2027' cannot be kept in store"):
        StudyHub(cfg, store=tmp_path / "store")
    with pytest.raises(Refused, match="keep_rounds = -1"):
        StudyHub(StudyConfig.load(STUDY), store=tmp_path / "store", keep_rounds=-1)


def test_a_round_whose_parts_an_averager_averaged_exports_the_shared_module_only_if_asked(
        tmp_path, capsys):
    from somatize.fed._rounds import keep_round

    store = Store(tmp_path / "store")
    trunk = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(2)}
    assert keep_round(store, "split", 1, trunk, {}, averager="avg")  # the hub's record
    with pytest.raises(Refused, match=r"averaged by its averager 'avg', not the hub.*"
                                      r"shared_only=True"):
        export_round(store, "split", "trunk", round=1)
    state = export_round(store, "split", "trunk", round=1, shared_only=True)
    assert set(state) == {"trunk.weight", "trunk.bias"}
    assert torch.equal(state["trunk.weight"], trunk["weight"])
    out = tmp_path / "r1.pt"
    args = ["fed", "export", str(tmp_path / "store"), "split", "--shared", "trunk", "--out",
            str(out)]
    assert main(args) == 1 and "--shared-only" in capsys.readouterr().err
    assert not out.exists()  # nothing written on a refusal
    assert main([*args, "--shared-only"]) == 0
    assert torch.equal(torch.load(out)["trunk.bias"], trunk["bias"])
    # a hub that averages the parts itself says no averager: exported whole, as before
    assert keep_round(store, "whole", 1, trunk, {"head.w": torch.zeros(1)})
    assert set(export_round(store, "whole", "trunk", round=1)) == {
        "trunk.weight", "trunk.bias", "head.w"}
