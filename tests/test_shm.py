"""Big tensors between the processes of a run on one host, through shared memory
(somatize/remote/_shm.py): what arrives is what the socket gives, slots are used again
only once let go, nothing is left in /dev/shm, a slot that cannot be opened is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from remote_run import coordinate

from somatize.remote import _shm


def test_big_tensors_cross_through_shared_memory_as_the_socket_gives_them(tmp_path):
    out = coordinate("shm_both_ways", cwd=tmp_path)
    assert "CASE transposed (1, 1024)" in out and "CASE a slice (1024, 1)" in out
    assert "CASE a tail (its storage, at its offset) (1024, 1)" in out


def test_a_slot_is_used_again_only_once_its_receiver_let_go(tmp_path):
    assert "NEWFILES []" in coordinate("shm_slots_reused", cwd=tmp_path)


def test_a_split_trained_through_shared_memory_is_the_whole_graph_here_bit_for_bit(tmp_path):
    assert "OK 4" in coordinate("shm_split_exact", cwd=tmp_path)


def test_a_worker_with_shared_memory_off_turns_it_off_for_the_run_saying_so(tmp_path):
    assert "OFF" in coordinate("shm_off_in_one_worker", cwd=tmp_path)


def test_only_tensors_that_fill_their_span_go_through_shared_memory():
    w = torch.zeros(64, 32)
    assert _shm._dense(w.shape, w.stride()) and _shm._dense(w.t().shape, w.t().stride())
    assert _shm._dense(w[:10].shape, w[:10].stride())
    assert not _shm._dense(w[::2].shape, w[::2].stride())
    assert not _shm._dense(w[:, :8].shape, w[:, :8].stride())
    e = torch.zeros(64, 1).expand(64, 32)
    assert not _shm._dense(e.shape, e.stride())


def test_a_slot_that_cannot_be_opened_or_is_another_is_refused_naming_the_way_out(
        monkeypatch):
    monkeypatch.setattr(_shm, "_maps", {})
    gone = [0, 2**22 + 12345, 7, 1, 4 << 20, "float32", [1 << 20], [1], False]
    with pytest.raises(RuntimeError, match=r"process 4206649, .*SOMATIZE_SHM=0"):
        _shm.received(json.dumps([gone]).encode(), [torch.empty(0)])
    monkeypatch.setattr(_shm, "_on", [True])
    monkeypatch.setattr(_shm, "_slots", [])
    t = torch.arange(1 << 18, dtype=torch.float32)
    table, header = _shm.carried([t])
    assert table[0].numel() == 0 and len(_shm._slots) == 1
    entry = json.loads(header)[0]
    assert entry[1] == os.getpid()
    assert torch.equal(_shm.received(header, table)[0], t)  # read back here, as it is
    entry[3] += 1  # another slot's id
    with pytest.raises(RuntimeError, match="not the one its message names"):
        _shm.received(json.dumps([entry]).encode(), table)


def test_a_forked_child_neither_writes_its_parents_slots_nor_lets_go_of_them(monkeypatch):
    monkeypatch.setattr(_shm, "_on", [True])
    monkeypatch.setattr(_shm, "_slots", [])
    monkeypatch.setattr(_shm, "_maps", {})
    t = torch.arange(1 << 18, dtype=torch.float32)
    table, header = _shm.carried([t])
    got = _shm.received(header, table)[0]  # held here: the slot stays in flight
    slot = _shm._slots[0]
    pid = os.fork()
    if pid == 0:  # the child: its copy of ``got`` goes; a slot it asks for is its own
        code = 0
        try:
            del got  # (no torch compute in a forked child: its math threads are gone)
            code = 3 if _shm._slots else 0
            mine = _shm._slot_for(1 << 20)
            code = code or (4 if mine is None or mine.fd == slot.fd and mine is slot else 0)
        except BaseException:
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not slot.free() and torch.equal(got, t)  # still this process's, untouched
    del got  # held here when it forked: the child's copy is over the same pages
    import gc

    gc.collect()
    assert not slot.free()  # left in flight for good: the sender makes another
    table, header = _shm.carried([t])
    assert _shm._slots[-1] is not slot
    got = _shm.received(header, table)[0]  # received after the fork: let go as usual
    assert torch.equal(got, t) and got._base is None
    del got
    gc.collect()
    assert _shm._slots[-1].free()


def test_a_message_with_sparse_and_meta_tensors_beside_a_big_one(monkeypatch):
    monkeypatch.setattr(_shm, "_on", [True])
    monkeypatch.setattr(_shm, "_slots", [])
    monkeypatch.setattr(_shm, "_maps", {})
    big = torch.randn(1024, 1024)
    sent = [torch.randn(600, 600).to_sparse(), big, torch.empty(3, device="meta")]
    table, header = _shm.carried(sent)
    assert table[0] is sent[0] and table[2] is sent[2] and table[1].numel() == 0
    assert [e[0] for e in json.loads(header)] == [1]
    assert torch.equal(_shm.received(header, table)[1], big)


def test_clear_slots_give_their_pages_back_past_keep_and_make_room_past_the_pool(
        monkeypatch):
    monkeypatch.setattr(_shm, "_on", [True])
    monkeypatch.setattr(_shm, "_slots", [])
    monkeypatch.setattr(_shm, "_maps", {})
    monkeypatch.setattr(_shm, "KEEP", 0)
    monkeypatch.setattr(_shm, "POOL", 6 << 20)
    mb = 1 << 20

    def through(t: torch.Tensor) -> bool:
        table, header = _shm.carried([t])
        if not header:
            return False
        assert torch.equal(_shm.received(header, table)[0], t)  # then let go of
        return True

    assert through(torch.ones(mb // 4))
    first = _shm._slots[0]
    assert first.free() and os.fstat(first.fd).st_blocks * 512 > mb  # its pages, kept
    assert through(torch.ones(2 * mb // 4))  # another slot: the clear one's pages go
    assert not first.resident and os.fstat(first.fd).st_blocks * 512 < mb  # only its header
    assert through(torch.full((mb // 4,), 3.0))  # used again, its pages faulted back in
    assert _shm._slots[0] is first and first.resident
    second = _shm._slots[1]
    assert through(torch.ones(4 * mb // 4))  # past the pool: the least recently used
    assert second not in _shm._slots and first in _shm._slots  # clear slot closed for room
    assert sum(s.cap for s in _shm._slots) <= 6 * mb
    held = _shm.received(*reversed(_shm.carried([torch.ones(4 * mb // 4)])))
    assert not through(torch.ones(5 * mb // 4))  # what is held is not closed: the socket
    assert first in _shm._slots  # and no clear slot was closed for room it could not make
    assert torch.equal(held[0], torch.ones(4 * mb // 4))
