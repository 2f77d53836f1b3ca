"""A study across machines: the hub and three data owners each on a test host of its own
(network namespaces in 198.18.0.0/15, tests/hosts.py), the owners dialing out to the
hub's one port and listening on none."""

import subprocess
import sys
import time

import pytest
import torch
from fed_models import make_net, owner_loader, owner_seed
from hosts import Hosts, HostsError
from test_fed_study import ROOT, _same

from somatize.fed import StudyConfig, load_round, simulate
from somatize.fed._certs import issue, make_ca


def _listening(host):
    r = subprocess.run(["ip", "netns", "exec", host.ns, "ss", "-ltnH"], capture_output=True,
                       text=True, timeout=30)
    return [line.split()[3].replace("[::ffff:", "").replace("]", "")  # v4-mapped v6
            for line in r.stdout.splitlines() if line.strip()]


def test_a_study_runs_with_the_hub_and_each_owner_on_its_own_host(tmp_path):
    try:
        hosts = Hosts("hub", "a", "b", "c").up()
    except HostsError as e:
        pytest.skip(f"{e} (tests/hosts.py)")
    procs = []
    try:
        hub = hosts["hub"]
        make_ca(tmp_path / "pki")
        for p in ("hub", "a", "b", "c"):
            issue(tmp_path / "pki", p)
        (tmp_path / "net.toml").write_text(
            'name = "net"\nowners = ["a", "b", "c"]\nmodule = "tests.fed_models:Trunk"\n'
            'parts = ["stem", "head"]\nrounds = 1\n')
        procs.append(hub.popen(
            [sys.executable, "-m", "somatize", "hub", "--study", str(tmp_path / "net.toml"),
             "--listen", f"{hub.addr}:7443", "--identity", str(tmp_path / "pki" / "hub.pem"),
             "--ca", str(tmp_path / "pki" / "ca.pem"), "--checkpoints", str(tmp_path / "ck"),
             "--ready", str(tmp_path / "ready")], cwd=ROOT,
            stdout=open(tmp_path / "hub.log", "w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, (
                (tmp_path / "hub.log").read_text()[-2000:])
            time.sleep(0.1)
        owners = {o: hosts[o].popen(
            [sys.executable, str(ROOT / "tests" / "fed_runs.py"), "--hub", f"{hub.addr}:7443",
             "--pki", str(tmp_path / "pki"), "--owner", o, "--configs", str(tmp_path),
             "--out", str(tmp_path), "net"], cwd=ROOT,
            stdout=open(tmp_path / f"{o}.log", "w"), stderr=subprocess.STDOUT)
            for o in "abc"}
        procs += owners.values()
        heard = set()
        while any(p.poll() is None for p in owners.values()):
            assert time.monotonic() < deadline + 240, "the owners did not finish in time"
            for o in "abc":
                heard |= {(o, a) for a in _listening(hosts[o])}
            time.sleep(0.5)
        logs = {o: (tmp_path / f"{o}.log").read_text()[-2000:] for o in "abc"}
        assert {o: p.returncode for o, p in owners.items()} == dict.fromkeys("abc", 0), logs
        assert heard == set()  # no owner listened on any port: they dial out only
        assert _listening(hub) == [f"{hub.addr}:7443"]  # the hub: its one port
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()  # (the hub stands until told: under load 17 it took over 10 s)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        hosts.close()
    cfg = StudyConfig.load(tmp_path / "net.toml")
    sim = simulate({o: ((lambda: make_net(cfg)), owner_loader(o)) for o in "abc"}, cfg,
                   rounds=1, seeds={o: owner_seed(o) for o in "abc"})
    trunk, _ = load_round(tmp_path / "ck", "net")
    _same(trunk, sim.trunk)
    for o in "abc":
        _same(torch.load(tmp_path / f"net-{o}.pt")["state"], sim.own_state(o, "trunk"))
