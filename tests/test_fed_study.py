"""Studies over real processes: a hub (``somatize hub``) and each data owner's own
Lightning fit in its own process, over gRPC with mutual TLS on 127.0.0.1. One hub
serves every study of this file, and each owner's process runs its studies one after
the other (the barriers keep them in step), so the processes start once."""

import functools
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from fed_models import ROWS, make_net, owner_loader, owner_seed

from somatize import Refused, WorkerError
from somatize.fed import HubRefused, StudyConfig, load_round, replay, simulate
from somatize.fed._certs import issue, make_ca
from somatize.fed._frames import decode
from somatize.fed._link import METHOD, HubLink

ROOT = Path(__file__).resolve().parent.parent
BASE = {"module": "tests.fed_models:Trunk", "parts": ["stem", "head"], "rounds": 2}
STUDIES = {
    "one1": {"owners": ["b"], "schedule": "v1"},
    "one2": {"owners": ["c"], "schedule": "v2", "order": "round_robin"},
    "v1": {"owners": ["a", "b", "c"], "schedule": "v1"},
    "avg": {"owners": ["a", "b", "c"], "schedule": "v1", "averager": "averager"},
    "arr": {"owners": ["a", "b", "c"], "schedule": "v2", "order": "arrival",
            "kwargs": {"p": 0.5}},
    "rr": {"owners": ["a", "b", "c"], "schedule": "v2", "order": "round_robin",
           "kwargs": {"p": 0.5}, "key": "rr"},
    "rr2": {"owners": ["a", "b", "c"], "schedule": "v2", "order": "round_robin",
            "kwargs": {"p": 0.5}, "key": "rr"},
    "dropv1": {"owners": ["a", "b", "c"], "schedule": "v1", "quorum": 2,
               "turn_timeout": 3.0},
    "dropv2": {"owners": ["a", "b", "c2"], "schedule": "v2", "order": "arrival",
               "quorum": 2, "turn_timeout": 3.0, "round_timeout": 300.0},
    "res": {"owners": ["a", "b"], "schedule": "v1", "rounds": 4},
    "slowv1": {"owners": ["a", "b", "c"], "schedule": "v1", "quorum": 2, "rounds": 3,
               "round_timeout": 4.0},
    "slowv2": {"owners": ["a", "b", "c"], "schedule": "v2", "order": "arrival",
               "quorum": 2, "turn_timeout": 2.0},
    "steps": {"owners": ["a", "b", "c"], "schedule": "v1", "round_steps": 2, "rounds": 2},
}
RUNS = {  # each owner's process: its studies in order, and what happens to it; "res"
    # stops after round 2 of 4 and resumes once the hub is back (RESUME holds its address);
    # c is slow but alive in round 1 of slowv1 (late at the barrier) and slowv2 (a late
    # Backward), then lost mid-step in dropv1
    "a": ["v1", "avg", "steps", "arr", "rr", "rr2", "slowv1", "slowv2", "dropv1", "dropv2",
          "res", "--delays", "arr", "--epochs", "res:2", "--then", "res:{resume}"],
    "b": ["one1", "v1", "avg", "steps", "arr", "rr", "rr2", "slowv1", "slowv2", "dropv1",
          "dropv2", "res", "--delays", "arr", "--epochs", "res:2", "--then", "res:{resume}"],
    "c": ["one2", "v1", "avg", "steps", "arr", "rr", "rr2", "slowv1", "slowv2", "dropv1",
          "--delays", "arr", "--kill", "dropv1:1:0", "--slow", "slowv1:1:0:barrier",
          "--slow", "slowv2:1:0:backward"],
    "c2": ["dropv2", "--kill", "dropv2:1:0"],
}


def _toml(name, spec):
    lines = [f'name = "{name}"']
    for k, v in {**BASE, **spec}.items():
        if isinstance(v, dict):
            lines.append(f"{k} = {{ " + ", ".join(f"{a} = {b}" for a, b in v.items()) + " }")
        else:
            lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


def _launch(d, studies, resume=False, averager=False):
    """``somatize hub`` of ``studies`` started (or, ``averager``, ``somatize hub
    --average-only``, the studies' averager): the process and the file its port comes to."""
    ready, me = d / f"port-{time.monotonic_ns()}", "averager" if averager else "hub"
    cmd = [sys.executable, "-m", "somatize", "hub", "--listen", "127.0.0.1:0",
           "--identity", str(d / "pki" / f"{me}.pem"), "--ca", str(d / "pki" / "ca.pem"),
           "--audit", str(d / f"{me}-audit.jsonl" if averager else d / "audit.jsonl"),
           "--ready", str(ready)]
    cmd += ["--average-only"] if averager else ["--checkpoints", str(d / "ck"), "--store",
                                                 str(d / "store")]
    for s in studies:
        cmd += ["--study", str(d / f"{s}.toml")]
    if resume:
        cmd.append("--resume")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(d / f"{me}.log", "a"),
                            stderr=subprocess.STDOUT), ready, d / f"{me}.log"


def _serving(launched):
    proc, ready, log = launched
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{log.stem} did not start within 120 s"
        time.sleep(0.1)
    return proc, f"127.0.0.1:{ready.read_text()}"


def _start_hub(d, studies, resume=False):
    return _serving(_launch(d, studies, resume))


def _owner(d, address, owner, args, log, averager):
    name = "c" if owner == "c2" else owner  # c2: a second process of another owner
    cmd = [sys.executable, str(ROOT / "tests" / "fed_runs.py"), "--hub", address,
           "--averager", averager,
           "--pki", str(d / "pki"), "--owner", owner, "--name", name, "--configs", str(d),
           "--out", str(d), *(a.format(resume=d / "resume") for a in args)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(d / f"{log}.log", "w"),
                            stderr=subprocess.STDOUT)


def _stop(p):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    d = tmp_path_factory.mktemp("fed")
    make_ca(d / "pki")
    for party in ("hub", "averager", "a", "b", "c", "c2", "x"):
        issue(d / "pki", party)
    make_ca(d / "other")
    issue(d / "other", "a")  # a stranger's certificate with an owner's name
    for name, spec in STUDIES.items():
        (d / f"{name}.toml").write_text(_toml(name, spec))
    starting = _launch(d, STUDIES), _launch(d, ["avg"], averager=True)  # side by side
    (hub, address), (averager, averager_address) = map(_serving, starting)
    owners = {o: _owner(d, address, o, args, o, averager_address) for o, args in RUNS.items()}
    lost = None
    try:
        deadline = time.monotonic() + 400
        while not all((d / f"res-{o}.pt").exists() for o in "ab"):  # round 2 of 4
            assert time.monotonic() < deadline and owners["a"].poll() is None, (
                (d / "a.log").read_text()[-3000:])
            time.sleep(0.2)
        _stop(hub)  # every party stops: the hub, and the owners' fits of res
        t0 = time.monotonic()
        try:
            HubLink(address, d / "pki" / "a.pem", d / "pki" / "ca.pem", timeout=3).call(
                "Attach", {"study": "res"})
        except WorkerError as e:
            lost = (str(e), time.monotonic() - t0)
        hub, address = _start_hub(d, STUDIES, resume=True)
        (d / "resume.tmp").write_text(address)
        (d / "resume.tmp").rename(d / "resume")
        for p in owners.values():
            p.wait(max(1.0, deadline - time.monotonic()))
        yield {"dir": d, "hub": hub, "address": address, "lost": lost,
               "rc": {o: p.returncode for o, p in owners.items()}}
    finally:
        for p in owners.values():
            _stop(p)
        _stop(hub)
        _stop(averager)


def _run(d, s, owner):
    return torch.load(d / f"{s}-{owner}.pt")


def _cfg(d, s):
    return StudyConfig.load(d / f"{s}.toml")


def _owners(cfg):
    return {o: ((lambda: make_net(cfg)), owner_loader(o)) for o in cfg.owners}


def _seeds(cfg):
    return {o: owner_seed(o) for o in cfg.owners}


@functools.cache
def _fedavg(d, rounds):
    """FedAvg of three plain Lightning fits (test_fed.py's oracle) after ``rounds``: the
    state every owner of study v1 (and avg) holds."""
    from test_fed import _plain_fedavg

    return _plain_fedavg(_cfg(d, "v1"), list("abc"), rounds)["a"].state_dict()


def _same(a, b):
    assert set(a) == set(b)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad}"


def test_the_owners_ran_their_studies(study):
    logs = {o: (study["dir"] / f"{o}.log").read_text()[-2000:] for o in RUNS}
    assert study["rc"] == {"a": 0, "b": 0, "c": 3, "c2": 3}, logs  # c and c2 were killed


@pytest.mark.parametrize("name", ["one1", "one2"])
def test_a_study_of_one_owner_equals_plain_lightning(study, name):
    import lightning.pytorch as pl

    d = study["dir"]
    cfg = _cfg(d, name)
    (owner,) = cfg.owners
    torch.manual_seed(owner_seed(owner))
    plain = make_net(cfg)
    pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(
        plain, owner_loader(owner))
    run = _run(d, name, owner)
    want = plain.state_dict()
    _same(run["state"], {k: v for k, v in want.items() if not k.startswith("trunk.")})
    trunk, _ = load_round(d / "ck", name)
    _same(trunk, {k[6:]: v for k, v in want.items() if k.startswith("trunk.")})


def _equals_fedavg_of_plain_fits(d, study):
    """Each of a, b and c's parts and the hub's trunk after ``study``'s 2 rounds are
    FedAvg of three plain fits, averaged by rows."""
    ref = _fedavg(d, 2)
    for o in "abc":
        _same(_run(d, study, o)["state"],
              {k: v for k, v in ref.items() if not k.startswith("trunk.")})
    trunk, ledger = load_round(d / "ck", study)
    _same(trunk, {k[6:]: v for k, v in ref.items() if k.startswith("trunk.")})
    assert [e["rows"] for e in ledger if e["kind"] == "average"] == [
        {"a": 24, "b": 16, "c": 8}] * 2


def test_v1_with_three_owners_of_unequal_rows_equals_fedavg_of_plain_fits(study):
    d = study["dir"]
    assert len({ROWS[o] for o in "abc"}) == 3
    _equals_fedavg_of_plain_fits(d, "v1")


def test_v1_with_an_averager_of_its_own_equals_fedavg_and_the_hub_never_sees_a_part(study):
    # [fedavg] averager = "averager": each owner sends its parts to that party (somatize
    # hub --average-only, its own certificate) at the barrier, with its rows and the
    # owners the hub averaged; the result is the hub's study's: FedAvg of plain fits
    d = study["dir"]
    _equals_fedavg_of_plain_fits(d, "avg")
    hub = [json.loads(line) for line in (d / "audit.jsonl").read_text().splitlines()]
    hub = [e for e in hub if e.get("fields", {}).get("study") == "avg"]
    assert {e["kind"] for e in hub} == {"Attach", "Forward", "Backward", "RoundEnd"}
    assert not [e for e in hub if e["kind"] not in ("Forward", "Backward") and e["tensors"]]
    assert {tuple(t[2][1:]) for e in hub for t in e["tensors"]} == {(128,)}  # cut tensors
    parts = {f"{p}.{k}": list(v.shape) for p in ("stem", "head")
             for k, v in make_net(_cfg(d, "avg")).get_submodule(p).state_dict().items()}
    got = [json.loads(line) for line in (d / "averager-audit.jsonl").read_text().splitlines()]
    assert sorted((e["owner"], e["kind"], e["fields"]["round"]) for e in got) == [
        (o, "RoundEnd", r) for o in "abc" for r in (0, 1)]
    for e in got:  # the parts, and nothing else
        assert {n: s for n, _, s in e["tensors"]} == parts and not e.get("refused"), e
        assert e["fields"]["owners"] == ["a", "b", "c"]
        assert e["fields"]["rows"] == {"a": 24, "b": 16, "c": 8}[e["owner"]]
    from somatize.fed import export_round  # the hub's store holds the shared module only

    with pytest.raises(Refused, match="averaged by its averager 'averager', not the hub"):
        export_round(d / "store", "avg", "trunk")  # never a partial model without a word
    shared = export_round(d / "store", "avg", "trunk", shared_only=True)
    assert shared and not [k for k in shared if not k.startswith("trunk.")]


def test_v2_in_arrival_order_equals_the_replay_of_its_ledger(study):
    d = study["dir"]
    cfg = _cfg(d, "arr")
    trunk, ledger = load_round(d / "ck", "arr")
    ref = replay(ledger, _owners(cfg), cfg, seeds=_seeds(cfg))
    _same(trunk, ref.trunk)
    for o in "abc":
        run = _run(d, "arr", o)
        _same(run["state"], ref.own_state(o, "trunk"))
        assert run["losses"] == ref.losses[o]
    # the order is the run's: a replay in another order gives other numbers
    other = simulate(_owners(cfg), StudyConfig.load({**cfg.described(), "order": "round_robin",
                                                     "module": cfg.module, "kwargs": {"p": 0.5},
                                                     "rounds": 2}), 2, seeds=_seeds(cfg))
    steps = [e["owner"] for e in ledger if e["kind"] == "step"]
    if steps != [e["owner"] for e in other.ledger if e["kind"] == "step"]:
        assert any(not torch.equal(trunk[k], other.trunk[k]) for k in trunk)


def test_v2_round_robin_twice_gives_the_same_result_and_its_simulation(study):
    d = study["dir"]
    t1, l1 = load_round(d / "ck", "rr")
    t2, l2 = load_round(d / "ck", "rr2")
    _same(t1, t2)
    assert [(e["owner"], e["step"]) for e in l1 if e["kind"] == "step"] == [
        ("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("a", 2)] * 2
    sim = simulate(_owners(_cfg(d, "rr")), _cfg(d, "rr"), rounds=2, seeds=_seeds(_cfg(d, "rr")))
    _same(t1, sim.trunk)
    for o in "abc":
        _same(_run(d, "rr", o)["state"], _run(d, "rr2", o)["state"])
        _same(_run(d, "rr", o)["state"], sim.own_state(o, "trunk"))


def test_v1_an_owner_lost_mid_round_is_left_out_at_quorum(study):
    d = study["dir"]
    trunk, ledger = load_round(d / "ck", "dropv1")
    lost = [e for e in ledger if e.get("owner") == "c" and e["kind"] != "step"]
    assert lost == [{"round": 1, "owner": "c", "step": 0, "kind": "discarded",
                     "why": "turn_timeout"}, {"round": 1, "owner": "c", "kind": "excluded"}]
    assert [e["owners"] for e in ledger if e["kind"] == "average"] == [["a", "b", "c"],
                                                                        ["a", "b"]]
    cfg = _cfg(d, "dropv1")
    ref = replay(ledger, _owners(cfg), cfg, seeds=_seeds(cfg))
    _same(trunk, ref.trunk)
    for o in "ab":
        _same(_run(d, "dropv1", o)["state"], ref.own_state(o, "trunk"))


def test_v2_an_owner_lost_mid_turn_has_its_step_discarded_and_replay_still_equals(study):
    d = study["dir"]
    trunk, ledger = load_round(d / "ck", "dropv2")
    lost = [e for e in ledger if e.get("owner") == "c2" and e["kind"] != "step"]
    assert lost == [{"round": 1, "owner": "c2", "step": 0, "kind": "discarded",
                     "why": "turn_timeout"}, {"round": 1, "owner": "c2", "kind": "excluded"}]
    assert [e["owners"] for e in ledger if e["kind"] == "average"] == [["a", "b", "c2"],
                                                                        ["a", "b"]]
    cfg = _cfg(d, "dropv2")
    ref = replay(ledger, _owners(cfg), cfg, seeds=_seeds(cfg))
    _same(trunk, ref.trunk)
    for o in "ab":
        _same(_run(d, "dropv2", o)["state"], ref.own_state(o, "trunk"))


def test_v1_an_owner_late_at_the_barrier_is_told_it_was_left_out_and_the_study_goes_on(study):
    # c, alive, reaches round 1's barrier after round_timeout: a and b were averaged
    # without it at quorum, and round 2 went on without it; its late RoundEnd is refused
    # (Excluded: the round it was left out of, the round it may attach at again) and its
    # fit stops there; nothing it sent after was applied (the replay of the ledger)
    d = study["dir"]
    trunk, ledger = load_round(d / "ck", "slowv1")
    assert [e for e in ledger if e.get("owner") == "c" and e["kind"] != "step"] == [
        {"round": 1, "owner": "c", "kind": "excluded"}]
    assert [e["owners"] for e in ledger if e["kind"] == "average"] == [
        ["a", "b", "c"], ["a", "b"], ["a", "b"]]
    cfg = _cfg(d, "slowv1")
    ref = replay(ledger, _owners(cfg), cfg, seeds=_seeds(cfg))
    _same(trunk, ref.trunk)
    for o in "ab":
        _same(_run(d, "slowv1", o)["state"], ref.own_state(o, "trunk"))
    late = _run(d, "slowv1", "c")
    assert (late["error"], late["round"], late["rejoin"]) == ("Excluded", 1, 2)
    assert ("owner 'c' was left out of round 1 of study 'slowv1' (not at the barrier within "
            "round_timeout (4.0s)") in late["message"]
    assert "attach at round 2 or later" in late["message"]
    assert len(late["losses"]) == 2  # its two steps; round 1's ran on the hub, unaveraged


def test_v2_a_backward_past_turn_timeout_is_refused_and_nothing_of_it_applied(study):
    # c's Forward of round 1 ran; its Backward came after turn_timeout: the step was
    # discarded (no optimizer step ran) and ledgered, c left out; the late Backward is
    # refused (Excluded), the hub went on, and the replay of the ledger equals the hub
    d = study["dir"]
    trunk, ledger = load_round(d / "ck", "slowv2")
    assert [e for e in ledger if e.get("owner") == "c" and e["kind"] != "step"] == [
        {"round": 1, "owner": "c", "step": 0, "kind": "discarded", "why": "turn_timeout"},
        {"round": 1, "owner": "c", "kind": "excluded"}]
    assert [e["owners"] for e in ledger if e["kind"] == "average"] == [["a", "b", "c"],
                                                                        ["a", "b"]]
    cfg = _cfg(d, "slowv2")
    ref = replay(ledger, _owners(cfg), cfg, seeds=_seeds(cfg))
    _same(trunk, ref.trunk)
    for o in "ab":
        _same(_run(d, "slowv2", o)["state"], ref.own_state(o, "trunk"))
        assert _run(d, "slowv2", o)["losses"] == ref.losses[o]
    late = _run(d, "slowv2", "c")
    assert (late["error"], late["round"], late["rejoin"]) == ("Excluded", 1, 2)
    assert "its step 0 had no Backward within turn_timeout (2.0s)" in late["message"]
    entries = [json.loads(line) for line in (d / "audit.jsonl").read_text().splitlines()]
    (refused,) = [e for e in entries if e.get("owner") == "c" and e.get("kind") == "Backward"
                  and e["fields"].get("study") == "slowv2" and e.get("refused")]
    assert "left out of round 1" in refused["refused"]


def test_the_wire_carries_cut_tensors_and_typed_control_only(study):
    d = study["dir"]
    entries = [json.loads(line) for line in (d / "audit.jsonl").read_text().splitlines()]
    parts = {f"{p}.{k}": list(v.shape) for p in ("stem", "head")
             for k, v in make_net(_cfg(d, "v1")).get_submodule(p).state_dict().items()}
    per_kind = {}
    for e in entries:
        if e.get("refused") or e["kind"] == "junk":
            continue
        per_kind.setdefault(e["kind"], 0)
        per_kind[e["kind"]] += 1
        shapes = {n: (dt, s) for n, dt, s in e["tensors"]}
        assert set(e["fields"]) <= {"study", "owner", "round", "step", "train", "digest",
                                    "precision", "schedule", "evaluate"}, e
        if e["kind"] in ("Forward", "Backward"):
            ((name, (dt, shape)),) = shapes.items()
            assert name == ("x" if e["kind"] == "Forward" else "g")
            assert dt == "torch.float32" and shape[1:] == [128] and shape[0] <= 8, e
        elif e["kind"] == "RoundEnd" and e["fields"]["study"] != "avg":
            assert {n: s for n, (_, s) in shapes.items()} == parts
        elif e["kind"] == "RoundEnd":
            assert not shapes, e  # the study's parts went to its averager
        else:
            assert not shapes, e  # Attach, Detach: control only
        for _, (dt, shape) in shapes.items():  # no input [n, 4], no label, no RNG state
            assert dt == "torch.float32" and shape[-1:] != [4] or shape in parts.values()
    assert per_kind["Forward"] == per_kind["Backward"] + 3  # the three discarded steps
    # bytes per step: the activation and the gradient, and the frames' headers
    steps = [e for e in entries if e.get("fields", {}).get("study") == "v1"
             and e["kind"] in ("Forward", "Backward")]
    tensor_bytes = sum(4 * s[0] * s[1] for e in steps for _, _, s in e["tensors"])
    assert tensor_bytes <= sum(e["bytes"] for e in steps) <= 1.05 * tensor_bytes


def _raw_call(address, data, key_cert=None, ca=None, timeout=10):
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key_cert[0] if key_cert else None,
        certificate_chain=key_cert[1] if key_cert else None)
    with grpc.secure_channel(address, creds, options=[
            ("grpc.ssl_target_name_override", "hub")]) as ch:
        return ch.unary_unary(METHOD)(data, timeout=timeout)


def test_strangers_junk_and_pickles_are_refused_and_the_hub_goes_on(study, tmp_path):
    from somatize.fed._certs import load_identity

    d, address = study["dir"], study["address"]
    ca = (d / "pki" / "ca.pem").read_bytes()
    attach = {"study": "v1", "owner": "a", "digest": _cfg(d, "v1").digest(),
              "precision": "32-true", "schedule": "v1", "round": 0}
    from somatize.fed._frames import encode

    for who in (None, load_identity(d / "other" / "a.pem")):  # no certificate; another CA's
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(address, encode("Attach", attach), who, ca)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    link = HubLink(address, d / "pki" / "b.pem", d / "pki" / "ca.pem")
    with pytest.raises(HubRefused, match="naming owner 'a' came with 'b'"):
        link.call("Attach", attach)
    x = HubLink(address, d / "pki" / "x.pem", d / "pki" / "ca.pem")
    with pytest.raises(HubRefused, match="'x' is not an owner"):
        x.call("Attach", {**attach, "owner": "x"})
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    a = load_identity(d / "pki" / "a.pem")
    for junk in (pickle.dumps(Evil()), os.urandom(4096)):
        kind, fields, _ = decode(_raw_call(address, junk, a, ca))
        assert (kind, fields["code"]) == ("Refused", "frame")
    time.sleep(0.5)
    assert not marker.exists()
    own = HubLink(address, d / "pki" / "a.pem", d / "pki" / "ca.pem")
    for field, value, word in (("digest", "0" * 32, "digest"),
                               ("precision", "bf16-mixed", "precision"),
                               ("round", 0, "round")):  # v1 is at round 2 now
        with pytest.raises(HubRefused, match=f"with {word}|at round") as e:
            own.call("Attach", {**attach, field: value})
        assert field in str(e.value) or "round" in str(e.value)
    assert study["hub"].poll() is None  # it went on


def test_a_lost_hub_stops_an_owner_with_an_error_naming_it_within_the_timeout(study):
    message, took = study["lost"]
    assert "study hub 'hub' at 127.0.0.1" in message and "lost or unreachable" in message
    assert took < 10


def test_every_party_stops_after_round_2_of_4_and_resumes_to_the_straight_result(study):
    d = study["dir"]
    cfg = _cfg(d, "res")
    straight = simulate(_owners(cfg), cfg, rounds=4, seeds=_seeds(cfg))
    trunk, ledger = load_round(d / "ck", "res")
    assert [e["round"] for e in ledger if e["kind"] == "average"] == [0, 1, 2, 3]
    _same(trunk, straight.trunk)
    for o in "ab":
        _same(_run(d, "res", o)["state"], straight.own_state(o, "trunk"))


def test_v1_in_rounds_of_two_steps_equals_its_simulation_at_every_barrier(study):
    # round_steps = 2: a's second round crosses its epoch's end (3 batches an epoch), c's
    # rounds span two epochs (1 batch each); the hub's checkpoint of each barrier, and each owner's
    # Lightning checkpoint of that step, hold what the simulation holds after that round
    d = study["dir"]
    cfg = _cfg(d, "steps")
    for r in (1, 2):
        sim = simulate(_owners(cfg), cfg, rounds=r, seeds=_seeds(cfg))
        trunk, ledger = load_round(d / "ck", "steps", round=r)
        _same(trunk, sim.trunk)
        assert [e["rows"] for e in ledger if e["kind"] == "average"] == [
            {"a": 16, "b": 16, "c": 16}] * r
        for o in "abc":
            ck = torch.load(d / f"ckpt-steps-{o}" / f"step={2 * r}.ckpt", weights_only=False)
            assert ck["somatize"]["study"]["round"] == r
            _same({k: v for k, v in ck["state_dict"].items() if not k.startswith("trunk.")},
                  sim.own_state(o, "trunk"))
    for o in "abc":
        _same(_run(d, "steps", o)["state"], sim.own_state(o, "trunk"))


def test_a_round_exports_as_a_plain_state_dict_that_loads_without_somatize(study, tmp_path,
                                                                          capsys):
    # somatize fed export: the shared module and the round's FedAvg of the parts, read
    # from the hub's store (--store), one plain state_dict (torch.load(weights_only=True)
    # takes tensors in plain containers only: nothing of somatize in it); it loads into
    # the LightningModule, strict, and equals FedAvg of three plain Lightning fits, at
    # the last barrier and the first (test_fed_store.py: the store's side of it)
    from somatize import Refused
    from somatize.fed import export_round

    d = study["dir"]
    cfg = _cfg(d, "v1")
    out = tmp_path / "v1.pt"
    from somatize._cli import main

    assert main(["fed", "export", str(d / "store"), "v1", "--shared", "trunk", "--out",
                 str(out)]) == 0  # the command's code, in this process
    assert "entries of study 'v1'" in capsys.readouterr().out
    assert main(["fed", "export", str(d / "store"), "nope", "--shared", "trunk", "--out",
                 str(out)]) == 1
    assert "keeps no round of study 'nope'" in capsys.readouterr().err
    last, first = make_net(cfg), make_net(cfg)  # (plain LightningModules)
    last.load_state_dict(torch.load(out, weights_only=True))
    first.load_state_dict(export_round(d / "store", "v1", "trunk", round=1))
    _same(last.state_dict(), _fedavg(d, 2))
    _same(first.state_dict(), _fedavg(d, 1))
    trunk, ledger = load_round(d / "ck", "v1")
    _same({k[6:]: v for k, v in last.state_dict().items() if k.startswith("trunk.")}, trunk)
    parts = {k: v for k, v in last.state_dict().items() if not k.startswith("trunk.")}
    _same(parts, _run(d, "v1", "a")["state"])  # what each owner loaded at the barrier
    from somatize.fed._rounds import average_digest  # the record's digest is the ledger's

    assert [e["digest"] for e in ledger if e["kind"] == "average"][-1] == average_digest(parts)
    # the stopped and resumed study's rounds: every barrier, each kept once
    from somatize.store import Store
    from somatize.store._rounds import records

    assert [r.round for r in records(Store(d / "store"))[0] if r.study == "res"] == [1, 2, 3, 4]
    with pytest.raises(Refused, match=r"keeps no round 7 of study 'v1' \(it keeps rounds "
                                      r"\[1, 2\]"):
        export_round(d / "store", "v1", "trunk", round=7)
