"""Across machines: the coordinator on test host a, workers on hosts b and c (network
namespaces joined by a bridge, tests/hosts.py), every process real and every wait bounded.

    bash scripts/test.sh tests/test_hosts.py      # as root, with `ip` and `tc`
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from hosts import PREFIX, Hosts, sweep
from remote_run import ROOT, env, script_of

MB = 1 << 20


def _daemon(host, name: str, port: int, tmp_path: Path):
    """A standing worker on ``host``, listening on its address; returns it once it listens."""
    log = tmp_path / f"daemon-{name}.log"
    with open(log, "w") as out:  # keepalive every second: a cut-off run ends within ~4 s
        proc = host.popen([sys.executable, "-m", "somatize.worker", "--name", name, "--listen",
                           f"{host.addr}:{port}", "--keepalive", "1"], env=env(), stdout=out,
                          stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while "listening on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, log


def _stop(daemon) -> None:
    proc, log = daemon
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()


def _script(host, name: str, *args) -> list[str]:
    """``remote_standing_runs.<name>``, its coordinator listening on ``host``'s address, where
    the workers can reach it."""
    return [sys.executable, str(script_of(name)), name, host.addr, *map(str, args)]


def _coordinate(host, name: str, *args, tmp_path: Path, timeout: float = 60) -> str:
    r = host.run(_script(host, name, *args), timeout=timeout, env=env(), cwd=tmp_path)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout


def _gone(pid: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_the_seeds_graph_on_a_standing_worker_on_another_host_equals_one_process(
        hosts, tmp_path):
    a, b = hosts["a"], hosts["b"]
    daemon = _daemon(b, "gpu", 7000, tmp_path)
    out = _coordinate(a, "host_standing", f"{b.addr}:7000", tmp_path=tmp_path)
    assert "EQUAL" in out
    # the worker ran in host b's network namespace, not in a's or this one's
    assert out.split("NET")[1].split()[0] == f"net:[{os.stat(f'/run/netns/{b.ns}').st_ino}]"
    assert _gone(int(out.split("PID")[1].split()[0]), time.monotonic() + 30)
    assert hosts.running() == {"b": [daemon[0].pid]}  # only the daemon, which serves on
    _stop(daemon)
    assert hosts.running() == {}


def _torchrun(host, tmp_path: Path, *how: str) -> subprocess.Popen:
    run = tmp_path / host.name
    run.mkdir()
    e = {**env(), "OMP_NUM_THREADS": "1"}  # as torchrun sets it for several processes
    with open(run / "log", "w") as out:
        return host.popen([sys.executable, "-m", "torch.distributed.run", *how,
                           os.path.join(ROOT, "train.py"), "+somatize=split",
                           "trainer.max_epochs=1", "data.limit=128", "test=false",
                           f"hydra.run.dir={run / 'out'}"],
                          env=e, cwd=run, stdout=out, stderr=subprocess.STDOUT)


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same, x, y))
    return x == y


def test_torchrun_on_two_hosts_trains_what_it_trains_on_one(hosts, tmp_path):
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    node = ["--nnodes=2", "--nproc-per-node=1", f"--master-addr={a.addr}", "--master-port=29500"]
    before = b.counters()
    runs = [_torchrun(a, tmp_path, *node, "--node-rank=0"),
            _torchrun(b, tmp_path, *node, "--node-rank=1"),
            # the same command on one machine (host c, alone, on its loopback), meanwhile
            _torchrun(c, tmp_path, "--standalone", "--nproc-per-node=2")]
    for name, r in zip("abc", runs, strict=True):
        assert r.wait(timeout=120) == 0, (tmp_path / name / "log").read_text()[-4000:]
    said = (tmp_path / "a" / "log").read_text()
    assert re.search(r"module 'body' ran in process \d+ \(worker 'worker'\)", said), said[-2000:]
    # the body's training inputs alone (128 digits of 64 float32) crossed host b's link
    assert b.counters()["rx"] - before["rx"] > 128 * 64 * 4
    two, one = (torch.load(tmp_path / h / "out" / "checkpoints" / "last.ckpt",
                           weights_only=False) for h in "ac")
    assert two["global_step"] == one["global_step"] == 2
    # weights, and the optimizer's state (the body's entries merged in from the worker)
    for part in ("state_dict", "optimizer_states"):
        assert _same(two[part], one[part]), part
    # not vacuous: the four tensors' momentum buffers, the body's two from the worker
    assert len(two["optimizer_states"][0]["state"]) == 4
    assert hosts.running() == {}


def test_a_value_from_a_worker_on_b_to_one_on_c_never_crosses_the_coordinators_link(
        hosts, tmp_path):
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    daemons = [_daemon(h, f"{h.name}{i}", 7000 + i, tmp_path) for h in (b, c) for i in (1, 2)]
    ports = {f"{h.name}{i}": f"{h.addr}:{7000 + i}" for h in (b, c) for i in (1, 2)}
    before = {h.name: h.counters() for h in (a, b, c)}
    out = _coordinate(a, "four_workers", json.dumps(ports), tmp_path=tmp_path)
    moved = {h.name: {k: h.counters()[k] - before[h.name][k] for k in ("rx", "tx")}
             for h in (a, b, c)}
    value = 16 * MB
    assert moved["b"]["tx"] > 2 * value and moved["c"]["rx"] > 2 * value, moved  # B -> C, twice
    assert moved["a"]["rx"] + moved["a"]["tx"] < value / 8, moved  # the coordinator: calls only
    assert len(set(out.split("PIDS")[1].split())) == 4
    deadline = time.monotonic() + 30
    assert all(_gone(int(p), deadline) for p in out.split("PIDS")[1].split())
    for d in daemons:
        _stop(d)
    assert hosts.running() == {}


def test_a_worker_host_cut_off_mid_run_is_a_worker_error_and_nothing_stays_running(
        hosts, tmp_path):
    a, b = hosts["a"], hosts["b"]
    daemon = _daemon(b, "gpu", 7000, tmp_path)
    pid_file = tmp_path / "sleepy.pid"
    # the node sleeps 1 s and the call may take 3: only the cut makes it fail
    coordinator = a.popen(_script(a, "cut_off", pid_file, f"{b.addr}:7000"), env=env(),
                          cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        assert coordinator.poll() is None and time.monotonic() < deadline, \
            coordinator.communicate()
        time.sleep(0.02)
    b.down()
    cut = time.time()
    serving = int(pid_file.read_text())
    # the cut-off side finds its coordinator gone (keepalive: 1 s, 3 probes) and ends the run
    assert _gone(serving, time.monotonic() + 15), "the cut-off serving process still runs"
    assert "stopped answering" in daemon[1].read_text()
    out, err = coordinator.communicate(timeout=60)
    assert coordinator.returncode == 0, out + err[-4000:]
    raised, msg = float(out.split("AT")[1].split()[0]), out.split("MSG")[1]
    assert raised - cut < 3 + 0.5, raised - cut  # within the call's timeout (0.5 s to spare)
    assert "worker 'gpu'" in msg, msg
    assert hosts.running() == {"b": [daemon[0].pid]}  # the coordinator and its worker: gone
    b.up()  # and the daemon serves the next run
    out = _coordinate(a, "host_again", f"{b.addr}:7000", tmp_path=tmp_path)
    assert "EQUAL" in out
    _stop(daemon)
    assert hosts.running() == {}


def test_a_daemon_listening_beyond_loopback_says_its_runs_listeners_answer_anyone(
        hosts, tmp_path):
    b = hosts["b"]  # 0.0.0.0 inside host b: every interface there, none of this machine's
    proc = b.popen([sys.executable, "-m", "somatize.worker", "--name", "gpu", "--listen",
                    "0.0.0.0:7000"], env=env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while "listening on" not in (line := proc.stderr.readline()):
        assert line and time.monotonic() < deadline, "the daemon never listened"
    warning = proc.stderr.readline()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    proc.stderr.close()
    assert "0.0.0.0 is not loopback" in warning and "private network" in warning


def test_hosts_left_by_a_killed_run_are_swept_and_their_processes_killed(hosts):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid nobody holds: the run that made these hosts was killed
    stale = Hosts("x", tag=str(gone.pid)).up()
    sleeper = stale["x"].popen(["sleep", "60"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{sleeper.pid}/cmdline").read_bytes()[:5] != b"sleep":  # exec'd
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sorted(sweep()) == sorted([stale["x"].ns, stale.switch])
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{PREFIX}-{gone.pid}-" not in names  # gone, with their links
    assert hosts["a"].ns in names  # a live run's hosts stay


def test_a_stranger_on_another_host_cannot_join_an_opened_run_nor_run_a_call_in_it(
        hosts, tmp_path):
    # the coordinator on a listens on its network address; a stranger on c, without the
    # run's secret, tries the rendezvous, then the coordinator's TensorPipe listener
    from remote_run import HERE

    runs = str(HERE / "secret_runs.py")
    a, c = hosts["a"], hosts["c"]
    ready, go = tmp_path / "ready.json", tmp_path / "go"
    refused = tmp_path / "refused"  # the target creates it when it refused a join
    e = {k: v for k, v in env().items() if k != "SOMATIZE_TOKEN"}  # the stranger has none
    # isolate="off": its TensorPipe listeners admit anyone (by default they admit only the
    # run's hosts, tests/test_hosts_exposure.py), so that the MAC is what refuses the call
    target = a.popen([sys.executable, runs, "target", str(ready), str(go), a.addr, "off",
                      str(refused)], env=e,
                     cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert target.poll() is None and time.monotonic() < deadline, target.communicate()
            time.sleep(0.05)
        got = json.loads(ready.read_text())
        assert got["join"].startswith(f"tcp://{a.addr}:")
        seen = {}
        for how, where in (("rendezvous", got["join"]),
                           ("listener", got["addrs"]["coordinator"])):
            out = tmp_path / f"{how}.json"
            stop = [str(refused)] if how == "rendezvous" else []  # it stops once refused
            r = c.run([sys.executable, runs, how, where, str(out), *stop], timeout=90, env=e)
            assert out.exists(), r.stderr[-3000:]
            seen[how] = json.loads(out.read_text())
            assert not Path(f"{out}.ran").exists(), how  # nothing it sent was run
    finally:
        go.touch()
        stdout, stderr = target.communicate(timeout=120)
    assert "joined" not in seen["rendezvous"] and "refused" in seen["rendezvous"]
    assert seen["listener"]["python"].startswith("RuntimeError")
    assert "SAME True" in stdout, stderr[-3000:]
    assert f"refused a join from {c.addr}:" in stderr
    assert "refused a call that does not carry this run's MAC" in stderr
