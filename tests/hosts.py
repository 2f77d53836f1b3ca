"""Test hosts: network namespaces joined by a bridge, each one a "machine" with its own
link and its own address in 198.18.0.0/15 (the range set aside for network benchmarks),
so that a coordinator and its workers talk over real links and no packet leaves them.

    with Hosts("a", "b") as hosts:                  # needs root, `ip` and `tc`
        b = hosts["b"]
        daemon = b.popen([sys.executable, "-m", "somatize.worker", "--name", "gpu",
                          "--listen", f"{b.addr}:7000"])
        hosts["a"].run([sys.executable, "coordinator.py"], timeout=60)
        hosts["a"].counters()["rx"]                 # bytes the coordinator's link received

    def test_it(hosts): ...           # the pytest fixture (conftest.py): hosts a, b, c

    bash scripts/hosts.sh up; bash scripts/hosts.sh exec b CMD...; bash scripts/hosts.sh down

Namespaces are named ``somahost-<tag>-<host>`` (the bridge's ``somahost-<tag>-sw``), the
tag being the pid of the process that made them, so parallel runs cannot collide and a
run killed before it cleaned up is swept by the next one (its pid is gone). Closing kills
every process left in them and deletes them; their links go with them. A process started
with ``Host.popen`` gets ``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` naming its host's
link, which TensorPipe and Gloo need on any interface but loopback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

PREFIX = "somahost"
NET = "198.18.0"  # hosts are NET.1, NET.2, ... on one /24 behind one bridge
RUN = "/run/somahost"  # each host's boot id, in RUN/<namespace>/boot_id
_STALE = re.compile(rf"^{PREFIX}-(\d+)-\w+$")


class HostsError(RuntimeError):
    """The hosts could not be made (not root, no `ip`, namespaces refused)."""


def _ip(*args: str, check: bool = True) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r.stdout


class Host:
    """One namespace: its name, its link (``iface``) and its address."""

    def __init__(self, name: str, ns: str, addr: str):
        self.name, self.ns, self.addr = name, ns, addr
        self.iface = f"veth-{name}"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this environment) with TensorPipe and Gloo on this link."""
        env = dict(os.environ if base is None else base)
        env["TP_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = self.iface
        return env

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host: in its namespace, seeing its own boot id.

        TensorPipe takes processes with one boot id for one machine and copies tensors
        between them by reading the other's memory (its ``cma`` channel), which no two
        machines can: with a boot id of its own, a host's tensors cross its link, as
        across machines. Every step execs, so the pid is the command's.
        """
        return ["ip", "netns", "exec", self.ns, "sh", "-c",
                'mount --bind "$1" /proc/sys/kernel/random/boot_id && shift && exec "$@"',
                f"host-{self.name}", f"{RUN}/{self.ns}/boot_id", *argv]

    def popen(self, argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` on this host."""
        return subprocess.Popen(self.command(argv), env=self.env(env), **kw)

    def run(self, argv: list[str], timeout: float, env: dict[str, str] | None = None,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to the end (within ``timeout``), its output as text."""
        return subprocess.run(self.command(argv), env=self.env(env), capture_output=True,
                              text=True, timeout=timeout, **kw)

    def pids(self) -> list[int]:
        """The processes running on this host."""
        return [int(p) for p in _ip("netns", "pids", self.ns).split()]

    def counters(self) -> dict[str, int]:
        """Bytes this host's link has received (``rx``) and sent (``tx``), as `ip -s link`."""
        link = json.loads(_ip("-n", self.ns, "-j", "-s", "link", "show", self.iface))[0]
        return {"rx": link["stats64"]["rx"]["bytes"], "tx": link["stats64"]["tx"]["bytes"]}

    def down(self) -> None:
        """Cut this host off: its link goes down (its address stays)."""
        _ip("-n", self.ns, "link", "set", self.iface, "down")

    def up(self) -> None:
        """Bring this host's link back."""
        _ip("-n", self.ns, "link", "set", self.iface, "up")

    def shape(self, rate: str) -> None:
        """Limit what this host sends to ``rate`` (``"1gbit"``) with a token bucket."""
        r = subprocess.run(["tc", "-n", self.ns, "qdisc", "replace", "dev", self.iface, "root",
                            "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise HostsError(f"tc on host {self.name!r} failed: {r.stderr.strip()}")


class Hosts:
    """Hosts ``names`` behind one bridge (in a namespace of its own); ``close()`` removes them.

    Args:
        names: one short name per host (``"a"``, ``"b"``); addresses follow their order.
        tag: what makes the names unique (default: this process's pid).
    """

    def __init__(self, *names: str, tag: str | None = None):
        self.tag = tag or str(os.getpid())
        self.switch = f"{PREFIX}-{self.tag}-sw"
        self.hosts = {n: Host(n, f"{PREFIX}-{self.tag}-{n}", f"{NET}.{i + 1}")
                      for i, n in enumerate(names)}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def up(self) -> Hosts:
        """Make the namespaces, the bridge and one link per host (loopback up in each)."""
        why = missing()
        if why:
            raise HostsError(why)
        sweep()
        try:
            _ip("netns", "add", self.switch)
            # no IPv6 link-local address anywhere: the only addresses are ours (and loopback)
            _ip("-n", self.switch, "link", "add", "name", "sw", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "sw", "addrgenmode", "none")
            _ip("-n", self.switch, "link", "set", "sw", "up")
            for h in self.hosts.values():
                _ip("netns", "add", h.ns)
                _name_hosts(h, self.hosts.values())
                _boot_id(h)
                _ip("-n", h.ns, "link", "set", "lo", "up")
                # made inside the namespaces: no name is ever taken in the root one
                _ip("-n", self.switch, "link", "add", "name", f"to-{h.name}", "type", "veth",
                    "peer", "name", h.iface, "netns", h.ns)
                _ip("-n", self.switch, "link", "set", f"to-{h.name}", "addrgenmode", "none")
                _ip("-n", h.ns, "link", "set", h.iface, "addrgenmode", "none")
                _ip("-n", self.switch, "link", "set", f"to-{h.name}", "master", "sw", "up")
                _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.iface)
                _ip("-n", h.ns, "link", "set", h.iface, "up")
        except BaseException:
            self.close()
            raise
        return self

    def running(self) -> dict[str, list[int]]:
        """Host name -> the processes still running there (only hosts with some)."""
        return {n: p for n, h in self.hosts.items() if (p := h.pids())}

    def close(self) -> None:
        """Kill whatever still runs on the hosts and delete them (idempotent)."""
        _remove([h.ns for h in self.hosts.values()] + [self.switch])

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.close()


def missing() -> str | None:
    """Why test hosts cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "test hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "test hosts need root (to make network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"test hosts need `{tool}` (iproute2) on the PATH"
    return None


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _remove(namespaces: list[str]) -> None:
    present = set(_namespaces())
    for ns in namespaces:
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        shutil.rmtree(f"{RUN}/{ns}", ignore_errors=True)
        if ns not in present:
            continue
        deadline = time.monotonic() + 10
        while (pids := [int(p) for p in _ip("netns", "pids", ns, check=False).split()]):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise HostsError(f"processes {pids} in namespace {ns} outlived SIGKILL")
            time.sleep(0.05)
        _ip("netns", "del", ns, check=False)


def _boot_id(me: Host) -> None:
    os.makedirs(f"{RUN}/{me.ns}", exist_ok=True)
    with open(f"{RUN}/{me.ns}/boot_id", "w") as f:
        f.write(f"{uuid.uuid4()}\n")


def _name_hosts(me: Host, hosts) -> None:
    # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: every address has a
    # name, so nobody asks a DNS server out of reach (c10d warns when a lookup fails), and
    # the machine's name is this host's address (torchrun --standalone rendezvous there)
    os.makedirs(f"/etc/netns/{me.ns}", exist_ok=True)
    with open(f"/etc/netns/{me.ns}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost\n::1 localhost\n{me.addr} {socket.gethostname()}\n")
        for h in hosts:  # the IPv4 address and its IPv6 form, which c10d asks about
            f.write(f"{h.addr} {PREFIX}-{h.name}\n::ffff:{h.addr} {PREFIX}-{h.name}\n")


def sweep() -> list[str]:
    """Remove the hosts of runs whose process is gone (killed before it cleaned up)."""
    stale = []
    for ns in _namespaces():
        m = _STALE.match(ns)
        if m and not _alive(int(m.group(1))):
            stale.append(ns)
    _remove(stale)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fixture():
    """The pytest fixture ``hosts`` (tests/conftest.py): hosts a (198.18.0.1), b (.2) and
    c (.3), removed after the test whatever happens. Skipped where they cannot be made,
    saying why; a failure under CI (``CI=true``, or ``SOMATIZE_HOSTS=required`` as
    .ci/run sets), whose runner is root and has `ip` and `tc`.
    """
    import pytest  # here: scripts/hosts.sh runs this file with a bare python3

    try:
        made = Hosts("a", "b", "c").up()
    except HostsError as e:
        if (os.environ.get("CI", "").lower() == "true"
                or os.environ.get("SOMATIZE_HOSTS") == "required"):
            pytest.fail(f"CI must be able to make test hosts (tests/hosts.py): {e}")
        pytest.skip(f"{e} (tests/hosts.py)")
    try:
        yield made
    finally:
        made.close()


USAGE = """usage: scripts/hosts.sh up [--rate 1gbit] | exec HOST CMD... | down
  up     hosts a, b, c (198.18.0.1, .2, .3) behind one bridge, each link limited to RATE
  exec   run CMD on HOST (a, b or c), with TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME set
  down   kill whatever runs on them and remove them"""


def main(argv: list[str]) -> int:
    """scripts/hosts.sh: the same hosts by hand, under the tag ``sh`` (not swept)."""
    made = Hosts("a", "b", "c", tag="sh")
    if argv[:1] == ["down"]:
        made.close()
    elif argv[:1] == ["up"]:
        made.close()  # from scratch
        try:
            made.up()
        except HostsError as e:
            print(e, file=sys.stderr)
            return 1
        if "--rate" in argv:
            for h in made.hosts.values():
                h.shape(argv[argv.index("--rate") + 1])
        for h in made.hosts.values():
            print(f"host {h.name}: {h.addr} on {h.iface} (namespace {h.ns})")
    elif argv[:1] == ["exec"] and len(argv) > 2 and argv[1] in made.hosts:
        h = made[argv[1]]
        os.execvpe("ip", h.command(argv[2:]), h.env())
    else:
        print(USAGE, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
