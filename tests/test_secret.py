"""Who may talk to a run: a stranger without the run's secret (another local user, or
a process reaching a TensorPipe listener directly) runs nothing in it, and the run goes
on (docs/security.md)."""

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import pytest
from remote_run import HERE, env, listeners, script_of

RUNS = HERE / "secret_runs.py"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user (root only)")


def _target(tmp_path, *args, **extra):
    ready, go = tmp_path / "ready.json", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, str(RUNS), "target", str(ready), str(go), *args],
                            cwd=tmp_path, env={**env(), **extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the target never got ready"
        time.sleep(0.05)
    return proc, json.loads(ready.read_text()), go


def _stranger(tmp_path, *args, then=()):
    seen = pathlib.Path(tempfile.mkdtemp(dir="/tmp"))  # a tmp_path's parents are 0700
    os.chmod(seen, 0o777)  # the stranger writes what it saw here
    out = seen / "stranger.json"
    (seen / "only-root-reads").write_bytes(b"secret")  # what the stranger may not read
    os.chmod(seen / "only-root-reads", 0o600)
    r = subprocess.run([sys.executable, str(RUNS), *args, str(out), *then, "--as-nobody"],
                       env=env(), capture_output=True, text=True, timeout=90, cwd="/")
    assert out.exists(), r.stderr[-3000:]
    return json.loads(out.read_text()), out


def _finish(proc, go):
    go.touch()
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout, stderr


@as_root
def test_another_user_cannot_join_through_the_rendezvous_and_the_run_goes_on(tmp_path):
    # a run not isolated (isolate="off"): the rendezvous on this machine's loopback
    refused = pathlib.Path(tempfile.mkdtemp(dir="/tmp"))  # the stranger sees it: 0755
    os.chmod(refused, 0o755)
    refused /= "refused"  # the target creates it when it refused a join: the stranger stops
    proc, ready, go = _target(tmp_path, "", "off", str(refused))
    try:
        got, out = _stranger(tmp_path, "rendezvous", ready["join"], then=[str(refused)])
    finally:
        stdout, stderr = _finish(proc, go)
    assert "joined" not in got and "refused" in got, got
    assert not os.path.exists(str(out) + ".ran")
    assert "SAME True" in stdout  # the run answered the same after the attempt
    assert stderr.count("refused a join from 127.0.0.1:") == 1, stderr[-3000:]
    assert re.search(r"refused \d+ joins? from 1 address in this run", stderr), stderr[-3000:]


@as_root
@pytest.mark.parametrize("who", ["coordinator", "worker"])
def test_a_run_not_isolated_still_runs_no_python_call_of_a_stranger(tmp_path, who):
    # configure(isolate="off"): the listeners are on this machine's loopback, which
    # another user reaches; the MAC still refuses every Python call (docs/security.md)
    proc, ready, go = _target(tmp_path, "", "off")
    addr = ready["addrs"]["coordinator" if who == "coordinator" else
                          next(n for n in ready["addrs"] if n != "coordinator")]
    try:
        got, out = _stranger(tmp_path, "listener", addr)
    finally:
        stdout, stderr = _finish(proc, go)
    assert not os.path.exists(str(out) + ".ran")  # its Python call ran nothing
    assert got["python"].startswith("RuntimeError"), got  # an answer it cannot even read
    assert "SAME True" in stdout
    # 201 refused calls: said once, then counted at the end, with no traceback
    assert stderr.count("refused a call that does not carry this run's MAC") == 1, stderr
    assert "refused 201 calls from 1 address in this run" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 6, stderr[-3000:]
    # what sealing cannot cover (docs/security.md): torch's built-in operators are called
    # by name, with no pickle to seal; a stranger reaching a listener still runs them
    assert got["builtin"] == "tensor([2., 2.])"
    assert got["from_file"] == "tensor([115, 101,  99, 114, 101, 116], dtype=torch.uint8)"


def _listening_addrs(out):
    return {a for line in out.splitlines() if line.startswith("LISTENS")
            for a in line.split()[2:]}


def test_tp_socket_ifname_never_widens_a_loopback_run(tmp_path):
    wide = next(n for _, n in __import__("socket").if_nameindex() if not n.startswith("lo"))
    r = subprocess.run([sys.executable, str(script_of("loopback_only")), "loopback_only"],
                       env={**env(), "TP_SOCKET_IFNAME": wide}, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    addrs = _listening_addrs(r.stdout)
    assert addrs and addrs <= {"0100007F", "00000000000000000000000001000000"}, r.stdout
    assert f"TP_SOCKET_IFNAME={wide} is not used" in r.stderr


def _cmdlines() -> bytes:
    got = b""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for what in ("cmdline", "comm"):
            try:
                got += pathlib.Path(f"/proc/{pid}/{what}").read_bytes() + b"\n"
            except OSError:
                continue  # gone meanwhile
    return got


def test_the_secret_is_in_no_log_command_line_or_checkpoint(tmp_path):
    token = "a-token-nobody-may-see-7d1e4b9c"
    proc, ready, go = _target(tmp_path, SOMATIZE_TOKEN=token)
    try:
        key = bytes.fromhex(ready["key"])
        secrets = [token.encode(), ready["key"].encode(), key]
        seen = _cmdlines()  # every process's, the run's coordinator and worker among them
        assert str(ready["worker_pid"]).encode() and f"{ready['worker_pid']}" in os.listdir(
            "/proc")
    finally:
        stdout, stderr = _finish(proc, go)
    ckpt = pathlib.Path(ready["ckpt"]).read_bytes()
    assert len(ckpt) > 1000
    for s in secrets:
        assert s not in seen
        assert s not in stdout.encode() + stderr.encode()
        assert s not in ckpt
    assert "SAME True" in stdout


def test_junk_on_a_tensorpipe_listener_of_a_run_not_isolated_aborts_it(tmp_path):
    # what sealing cannot protect, measured (docs/security.md), and why a run is isolated:
    # TensorPipe reads a length from whoever connects and allocates it before anything of
    # ours runs. configure(isolate="off") leaves the listeners on this machine's loopback
    import socket

    proc, ready, go = _target(tmp_path, "", "off")
    gate = int(ready["join"].rsplit(":", 1)[1])
    ports = sorted(p for _, p in listeners(ready["pid"], ("tcp",)) if p != gate)
    assert len(ports) >= 5  # TensorPipe listens on many ports, each open to any peer
    died = None
    for port in ports:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(os.urandom(4096))
            time.sleep(0.3)
        time.sleep(0.3)
        if proc.poll() is not None:
            died = port
            break
    go.touch()
    _, stderr = proc.communicate(timeout=90)
    assert died is not None and proc.returncode == -6, (proc.returncode, stderr[-2000:])
    assert "std::bad_alloc" in stderr


def _digest(path) -> str:
    import hashlib

    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


@as_root
def test_another_user_reaches_no_listener_of_a_default_run(tmp_path):
    proc, ready, go = _target(tmp_path)
    victim = tmp_path / "made-by-a-stranger"  # in a directory only root enters
    try:
        assert ready["isolated"], "this machine lets root make a network namespace"
        ports = sorted({p for pid in (ready["pid"], ready["worker_pid"])
                        for _, p in listeners(pid, ("tcp", "tcp6"))})
        assert len(ports) >= 5, ports  # the gate and TensorPipe's, in both processes
        before = _digest(ready["ckpt"])
        got, out = _stranger(tmp_path, "ports", ",".join(map(str, ports)), str(victim))
    finally:
        stdout, stderr = _finish(proc, go)  # exit code 0: not aborted
    assert got["reached"] == {}, got
    assert len(got["refused"]) + len(got["skipped"]) == len(ports), got
    assert len(got["skipped"]) <= 1, got  # a port another program holds here is not tried
    assert not victim.exists() and not os.path.exists(str(victim) + ".said")
    assert _digest(ready["ckpt"]) == before
    assert "SAME True" in stdout
    assert "can be reached by every user" not in stderr and "refused a" not in stderr, stderr


def _no_namespaces(*args):
    # this process tree may not make namespaces: CAP_SYS_ADMIN out of its bounding set
    return ["setpriv", "--bounding-set=-sys_admin", sys.executable, *args]


@as_root
def test_where_no_namespace_can_be_made_the_run_says_so_once_or_refuses(tmp_path):
    code = ("import sys, torch; from models import Body, Head; "
            "from somatize import Graph; from somatize.remote import configure; "
            "configure(isolate=sys.argv[1]); g = Graph.somatize(Body().at('gpu') >> Head()); "
            "g.forward(torch.randn(2, 8)); g.forward(torch.randn(2, 8)); g.close(); "
            "print('RAN')")
    said = {}
    for mode in ("auto", "require", "off"):
        r = subprocess.run(_no_namespaces("-c", code, mode), env=env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        said[mode] = r
    auto, require, off = said["auto"], said["require"], said["off"]
    assert auto.returncode == 0 and "RAN" in auto.stdout, auto.stderr[-3000:]
    assert auto.stderr.count("can be reached by every user of this machine") == 1, auto.stderr
    assert "CAP_SYS_ADMIN" in auto.stderr and "unshare --user" in auto.stderr
    assert require.returncode != 0 and "RAN" not in require.stdout
    assert "configure(isolate='require')" in require.stderr, require.stderr[-3000:]
    assert off.returncode == 0 and "RAN" in off.stdout and "every user" not in off.stderr
