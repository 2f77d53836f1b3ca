"""The warm start of scenario processes (tests/forks.py): a scenario forked from the warm
process sees what the same script run by a fresh interpreter sees (arguments, working
directory, environment, import path, standard streams, ``__main__``), ends as one does
(exit code, signals, a timeout), and runs in a fresh interpreter whenever its
environment changes what the warm process's imports read."""

import json
import os
import signal
import subprocess
import time

import pytest
from forks import Forked, Forks, forkable
from scenario import command, env, own_children, scenario

SCRIPT = '''import json, os, sys
import torch


class Kept:  # pickled by reference to __main__, as a script's own class is
    pass


def main():
    import pickle
    assert pickle.loads(pickle.dumps(Kept())).__class__ is Kept
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "name": __name__,
               "main": sys.modules["__main__"].__file__, "path": sys.path[:3],
               "env": os.environ.get("SCENARIO_WORD"), "stdin": sys.stdin.read(),
               "threads": torch.get_num_threads(), "somatize": "somatize" in sys.modules,
               "pid": os.getpid()}, sys.stdout)
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("SCENARIO_EXIT", "0")))


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


def fresh(script, *args, environ, cwd):
    return subprocess.run(command(script, *args), capture_output=True, text=True, cwd=cwd,
                          env=environ, timeout=120, stdin=subprocess.DEVNULL)


def test_a_forked_scenario_sees_and_says_what_a_fresh_interpreter_does(script, tmp_path):
    warm = Forks.get(env())
    assert warm is not None
    environ = env(SCENARIO_WORD="forty-two", SCENARIO_EXIT="3")
    done = warm.run([str(script), "a", "b c"], tmp_path, environ, timeout=120)
    ref = fresh(script, "a", "b c", environ=environ, cwd=tmp_path)
    got, want = json.loads(done.stdout), json.loads(ref.stdout)
    assert got["pid"] not in (os.getpid(), warm.proc.pid)
    got.pop("pid"), want.pop("pid")
    assert got == want
    assert want["argv"] == [str(script), "a", "b c"] and want["env"] == "forty-two"
    assert want["somatize"] is False  # never imported before the script asks for it
    assert (done.returncode, done.stderr) == (ref.returncode, ref.stderr) == (3, "to stderr\n")


def test_a_forked_scenario_ends_as_a_process_does(script, tmp_path):
    warm = Forks.get(env())
    slow = tmp_path / "slow.py"
    # Python's own Ctrl-C even when the suite runs as a background job (SIGINT ignored)
    slow.write_text("import signal, time\n"
                    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                    "print('up', flush=True)\ntime.sleep(60)\n")
    ended = []
    for proc in (warm.start([str(slow)], tmp_path, env()),
                 subprocess.Popen(command(slow), cwd=tmp_path, env=env(), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)):
        assert proc.stdout.readline() == "up\n"
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        ended.append((type(proc), proc.returncode, err.splitlines()[-1]))
    assert ended == [(Forked, -signal.SIGINT, "KeyboardInterrupt"),
                     (subprocess.Popen, -signal.SIGINT, "KeyboardInterrupt")]
    proc = warm.start([str(slow)], tmp_path, env())
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([str(slow)], tmp_path, env(), timeout=2)
    assert time.monotonic() - began < 30


def test_what_the_warm_processs_imports_read_is_never_forked_otherwise(script, tmp_path):
    # OMP_NUM_THREADS is read when torch is imported: a scenario setting it otherwise gets
    # an interpreter of its own, and the threads it asked for
    argv = [str(script)]
    assert forkable(argv, env(), env())
    assert not forkable(argv, env(OMP_NUM_THREADS="1"), env())
    assert not forkable(["-m", "somatize.worker"], env(), env())
    done = scenario(script, cwd=tmp_path, environ=env(OMP_NUM_THREADS="1"))
    assert json.loads(done.stdout)["threads"] == 1


def test_a_warm_process_that_ended_is_started_again(script, tmp_path):
    first = Forks.get(env())
    first.proc.kill()
    first.proc.wait(timeout=30)
    second = Forks.get(env())
    assert second is not None and second is not first and second.proc.poll() is None
    done = second.run([str(script)], tmp_path, env(), timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["argv"] == [str(script)]


# -- embedded workers forked from the library's server (somatize.remote.fork_workers) -----

def _worker_run(tmp_path, name, environ):
    out = tmp_path / f"{name}.json"
    done = scenario("fork_runs.py", "worker", out, cwd=tmp_path, environ=environ)
    assert "closed" in done.stdout
    got = json.loads(out.read_text())
    got["seen"]["env"].pop("SOMATIZE_RUN_KEY", None)  # the run's own secret, if kept
    return got


def test_an_embedded_worker_forked_from_the_server_is_what_a_fresh_one_is(
        tmp_path, forked_workers):
    # the worker's arguments, directory, import path, environment, threads and stdin pipe
    # are a fresh worker's; only its parent differs (the server, not the coordinator)
    assert forked_workers is not None and forked_workers.alive
    forked = _worker_run(tmp_path, "forked", env())
    fresh = _worker_run(tmp_path, "fresh", own_children(env()))
    assert forked["seen"]["ppid"] == forked_workers.proc.pid
    assert fresh["seen"]["ppid"] == fresh["me"]
    assert forked["y"] == fresh["y"]
    for got in (forked, fresh):
        got["seen"].pop("ppid"), got["seen"].pop("pid"), got.pop("me")
        argv = got["seen"]["argv"]
        argv[argv.index("--join") + 1] = "tcp://..."  # each run's own rendezvous
    assert forked == fresh
    assert fresh["seen"]["argv"][:2] == ["--name", "gpu"] and fresh["seen"]["stdin"]
    assert fresh["seen"]["main"].endswith(os.path.join("somatize", "remote", "__main__.py"))


def test_a_worker_whose_environment_torch_reads_at_start_differs_is_started_afresh(
        tmp_path, forked_workers):
    got = _worker_run(tmp_path, "threads", env(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE"))
    assert got["seen"]["ppid"] == got["me"]  # the coordinator's own child
    assert got["seen"]["threads"] == 1


def test_a_worker_whose_fork_server_died_starts_afresh_and_computes_the_same(tmp_path):
    fresh = _worker_run(tmp_path, "fresh", own_children(env()))
    out = tmp_path / "gone.json"
    done = scenario("fork_runs.py", "server_gone", out, cwd=tmp_path,
                    environ=own_children(env()))
    got = json.loads(out.read_text())
    assert "closed" in done.stdout
    assert got["seen"]["ppid"] == got["me"] and got["y"] == fresh["y"]


def test_the_fork_server_forks_for_its_own_user_only(forked_workers):
    # its socket lies in a directory only its user may enter; a process of another user
    # (nobody) cannot reach it
    import stat

    path = forked_workers.path
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    if os.getuid() != 0:
        pytest.skip("switching to another user needs root (CI runs as root)")
    import socket

    child = os.fork()  # (python itself may not be this user's to run: only syscalls here)
    if child == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(path)
            os._exit(1)  # reached it
        except PermissionError:
            os._exit(0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # refused


def test_the_fork_server_refuses_what_it_cannot_run_and_serves_on(tmp_path):
    # junk, a request without streams, and `-c` (neither a module nor a script) are
    # refused with a word; a client that connects and says nothing holds up no one; a
    # script is still forked after them all
    import socket

    from somatize.remote._forks import ForkServer

    server = ForkServer.start(["json"])
    try:
        said = []
        for junk in (b"not json", json.dumps({"argv": ["x.py"], "cwd": "/", "env": {}}).encode()):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.connect(server.path)
            c.send(junk)
            c.settimeout(30)
            said.append(c.recv(200))
            c.close()
        assert said == [b"", b"refused: a request is argv, cwd, env and three streams"]
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        silent.connect(server.path)
        assert server.popen(["-c", "print(1)"], env(), str(tmp_path)) is None
        script = tmp_path / "hi.py"
        script.write_text("print('hi')\n")
        proc = server.popen([str(script)], env(), str(tmp_path), stdout=subprocess.PIPE,
                            text=True)
        assert proc.communicate(timeout=60)[0] == "hi\n" and proc.returncode == 0
        silent.close()
    finally:
        server.close()


def test_a_fork_servers_directory_is_gone_after_its_owner_is_killed(tmp_path):
    # SIGKILL leaves its owner no time to clean up: the server removes its socket's
    # directory when its stdin closes, and one killed too is swept at the next start
    import sys

    from somatize.remote._forks import ForkServer

    code = ("import time; from somatize.remote._forks import ForkServer; "
            "s = ForkServer.start(['json']); print(s.path, s.proc.pid, flush=True); "
            "time.sleep(120)")
    owners = []
    for _ in range(2):
        p = subprocess.Popen([sys.executable, "-c", code], env=env(), cwd=tmp_path,
                             stdout=subprocess.PIPE, text=True)
        path, pid = p.stdout.readline().split()
        owners.append((p, os.path.dirname(path), int(pid)))
    (first, where1, _), (second, where2, server2) = owners
    assert os.path.isdir(where1) and os.path.isdir(where2)
    first.kill()
    first.wait(timeout=10)
    deadline = time.monotonic() + 20
    while os.path.exists(where1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(where1)
    os.kill(server2, signal.SIGKILL)  # the server first, then its owner: nobody cleans up
    second.kill()
    second.wait(timeout=10)
    time.sleep(0.5)
    assert os.path.isdir(where2)
    ForkServer.start(["json"]).close()
    assert not os.path.exists(where2)


def _children() -> set[int]:
    me, out = str(os.getpid()), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    out.add(int(pid))
        except (OSError, IndexError):
            continue
    return out


def test_building_the_strategy_starts_no_process():
    # the warm start begins with the fit (a fork server, unless one is named), never
    # when a config or LightningCLI only composes a strategy
    from somatize.lightning import SomatizeStrategy

    before = _children()
    SomatizeStrategy(place={"encoder": "worker"})
    time.sleep(0.5)
    assert _children() == before
