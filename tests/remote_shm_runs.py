"""Coordinators for tests/test_shm.py: big tensors between this process and an embedded
worker on loopback, through shared memory (somatize/remote/_shm.py), against what the
socket gives. Each runs in a process of its own (RPC starts once per process) and
asserts what it sees.

    python tests/remote_shm_runs.py shm_both_ways
"""

from __future__ import annotations

import os
import sys

import shm_there as there
import torch
from torch import nn

from somatize import Graph
from somatize.remote import Worker, _shm, runtime_for
from somatize.torch import node

MB = 1 << 20


def _graph() -> Graph:
    g = Graph.somatize(node(nn.Linear(4, 4)).at("gpu"))
    runtime_for(g, {"gpu": Worker.embedded(timeout=60)})
    g.forward(torch.randn(2, 4))
    return g


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 1024, generator=g)
    return {
        "float32": torch.randn(2 * MB // 4, generator=g),
        "bfloat16": torch.randn(MB, generator=g).to(torch.bfloat16),
        "bool": torch.rand(2 * MB, generator=g) > 0.5,
        "int64": torch.randint(-2**62, 2**62, (MB // 4,), generator=g),
        "transposed": w.t(),  # strides kept, as the socket keeps them
        "permuted": torch.randn(64, 128, 32, generator=g).permute(2, 0, 1),
        "a slice": w[:300],  # its own bytes only
        "requires_grad": torch.randn(512, 1024, generator=g, requires_grad=True),
        "parameter": nn.Parameter(torch.randn(1024, 512, generator=g)),
        "a stepped view (its clone)": w[::2],
        "columns (its whole storage)": w[:, :800],
        "a tail (its storage, at its offset)": w[100:],
        "conjugate (the socket)": torch.randn(512, 512, dtype=torch.complex64,
                                              generator=g).conj(),
        "small (the socket)": torch.randn(1000, generator=g),
        "sparse (the socket)": torch.randn(600, 600, generator=g).to_sparse(),
    }


def shm_both_ways() -> None:
    """Each case there and back: the same values, dtype, shape, strides, grad flag and
    bytes as through the socket (the same case sent with shared memory off, both ways),
    and the big dense ones through slots of this process (there) and the worker's (back)."""
    g = _graph()
    rt = runtime_for(g)
    assert _shm.enabled() and rt.call("gpu", there.slots) == 0 and _shm.sent == [0]
    for name, t in _cases().items():
        mine, theirs = _shm.sent[0], rt.call("gpu", there.sent)
        rt.call("gpu", there.switch, False)  # shared memory off both ways
        _shm.enable(False)
        socket = rt.call("gpu", there.back, t)
        _shm.enable(True)
        rt.call("gpu", there.switch, True)
        assert (_shm.sent[0], rt.call("gpu", there.sent)) == (mine, theirs), name
        looks, back, answered = rt.call("gpu", there.back, t)
        assert looks == socket[0], (name, looks, socket[0])
        assert there.looks(back) == there.looks(socket[1]), name
        dense = (lambda v: v.to_dense()) if t.layout != torch.strided else torch.Tensor.detach
        assert torch.equal(dense(back), dense(t)) and torch.equal(dense(socket[1]),
                                                                  dense(t)), name
        # through shared memory there, and back; what requires grad or is conjugate, and
        # what is small, by the socket both ways
        want = {"requires_grad": (0, 0), "conjugate (the socket)": (0, 0),
                "small (the socket)": (0, 0), "sparse (the socket)": (0, 0)}
        assert (_shm.sent[0] - mine, rt.call("gpu", there.sent) - theirs) == want.get(
            name, (1, 1)), name
        print("CASE", name, looks[3])
    print("SLOTS", len(_shm._slots), rt.call("gpu", there.slots))
    g.close()


def shm_slots_reused() -> None:
    """A slot is used again once the receiver freed what it sent; one the worker still
    holds is not written over (another is made); the pool stays small; /dev/shm gets no
    file (memfds)."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    g = _graph()
    rt = runtime_for(g)
    t = torch.randn(4 * MB // 4)
    for _ in range(20):
        assert rt.call("gpu", there.total, t) == float(t.sum())
    assert len(_shm._slots) == 1, len(_shm._slots)
    rt.call("gpu", there.hold, t)  # kept over there
    u = torch.randn(4 * MB // 4)
    assert rt.call("gpu", there.total, u) == float(u.sum())
    assert len(_shm._slots) == 2  # the held one was not written over
    assert rt.call("gpu", there.held_total) == float(t.sum())
    rt.call("gpu", there.let_go)
    for _ in range(5):
        assert rt.call("gpu", there.total, u) == float(u.sum())
    assert len(_shm._slots) == 2
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    print("NEWFILES", sorted(after - before))
    g.close()


def shm_off_in_one_worker() -> None:
    """A worker started with SOMATIZE_SHM=0 joins: the coordinator says so once and sends
    no more through shared memory (to it or any other), and what crosses is the same."""
    os.environ["SOMATIZE_FORKS"] = "off"  # each worker a child with this environment
    g = _graph()  # worker "gpu": shared memory on, both ways
    t = torch.randn(2 * MB // 4)
    assert runtime_for(g).call("gpu", there.total, t) == float(t.sum())
    assert _shm.sent == [1] and _shm.enabled()
    os.environ["SOMATIZE_SHM"] = "0"
    h = Graph.somatize(node(nn.Linear(4, 4)).at("cpu2"))
    runtime_for(h, {"cpu2": Worker.embedded(timeout=60)})
    h.forward(torch.randn(2, 4))
    assert not _shm.enabled() and runtime_for(h).call("cpu2", there.slots) == -1
    for rt in (runtime_for(g), runtime_for(h)):
        looks, back, _ = rt.call(next(iter(rt.peers)), there.back, t)
        assert torch.equal(back, t)
    assert _shm.sent == [1], _shm.sent
    print("OFF", runtime_for(g).call("gpu", there.sent))
    h.close()
    g.close()


def _net(placed: bool) -> Graph:
    torch.manual_seed(0)
    b, head = node(nn.Sequential(nn.Linear(64, 2048), nn.ReLU())), node(nn.Linear(2048, 10))
    return Graph.somatize((b.at("gpu") if placed else b) >> head)


def shm_split_exact() -> None:
    """A body on the worker trained by a Split, its 2 MB activations and their gradients
    through shared memory: every loss and weight of the whole graph here, bit for bit."""
    from torch.nn.functional import cross_entropy

    from somatize.torch import Split, Trainer, parameters

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g))
            for _ in range(4)]
    whole, far = _net(False), _net(True)
    runtime_for(far, {"gpu": Worker.embedded(timeout=60)})
    a = Trainer(whole, cross_entropy, torch.optim.AdamW(parameters(whole), lr=1e-3))
    trains = {far.roots[0]: Split(torch.optim.AdamW, lr=1e-3)}
    with Trainer(far, cross_entropy, torch.optim.AdamW(parameters(far, without=trains),
                                                       lr=1e-3), trains=trains) as b:
        losses = [(a.step(d), b.step(d)) for d in data]
        assert all(x == y for x, y in losses), losses
        theirs = b.state_dict()["nodes"]
        mine = a.state_dict()["nodes"]
        assert all(torch.equal(mine[k][n], theirs[k][n]) for k in mine for n in mine[k])
        through = runtime_for(far).call("gpu", there.sent)
    assert _shm.sent[0] >= len(data) and through >= len(data), (_shm.sent, through)
    print("OK", len(data), _shm.sent[0], through)
    far.close()


if __name__ == "__main__":
    from scenario import play

    play(globals(), sys.argv)
