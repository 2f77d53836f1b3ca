"""Every call and answer of the run carries a MAC, checked before anything in it is
unpickled.

    seal(key)       # each process of the run, before it starts RPC

torch.distributed.rpc pickles a Python call (the function, its arguments) and every
Python answer with one object, torch's internal RPC pickler (``_private.rpc_pickler()``):
its ``serialize`` makes the bytes a message carries (tensors travel beside them), and
its ``deserialize`` is what the receiving process (from C++, through
``internal.deserialize``) unpickles them with. Sealing this process wraps both: the
bytes sent are ``MAGIC + HMAC(key, bytes) + bytes``, and bytes received are unpickled
only when their MAC checks. A call from a peer outside the run (one that reached a
TensorPipe listener directly) is refused there, unpickled never, and said once; its
caller gets an error back. What this does not cover (torch's built-in operators called
by name, TensorPipe's own handshake) is in docs/security.md.
"""

from __future__ import annotations

import hmac
import logging

from . import _exposure, _private, _shm

log = logging.getLogger(__name__)

MAGIC = b"SMZ1"
SHM = b"SMZ2"  # a message some of whose tensors are in shared memory (``_shm``)
_HASH = "sha256"  # HMAC-SHA256
_N = len(MAGIC) + 32


def _refuse():
    from torch.distributed.rpc.internal import RemoteException

    return RemoteException(_REFUSAL, AttributeError)


_REFUSAL = "refused: this call does not carry the run's MAC; only processes of the run may call it"


def _refusal():
    """What a refused message unpickles to: as a call, a function answering the caller an
    error (torch's ``_run_function`` runs its ``func``, and prints nothing: a raised one it
    would print, traceback and all, once per call); as an answer, that error itself."""
    from torch.distributed.rpc.internal import RemoteException

    class Refusal(RemoteException):
        __slots__ = ()
        func, args, kwargs = staticmethod(_refuse), (), {}

    return Refusal(_REFUSAL, AttributeError)


def seal(key: bytes, local: bool = False) -> None:
    """Make this process's RPC pickler MAC what it sends and check what it receives;
    ``local``: every peer is on this host (a run on loopback), so big tensors go through
    shared memory (``_shm``)."""
    _shm.enable(local)
    p = _private.rpc_pickler()
    cls = type(p)

    def serialize(obj):
        data, tensors = cls.serialize(p, obj)
        tensors, where = _shm.carried(tensors)  # big ones through shared memory (one host)
        if where:
            data = len(where).to_bytes(4, "little") + where + data
            return SHM + hmac.digest(key, data, _HASH) + data, tensors
        return MAGIC + hmac.digest(key, data, _HASH) + data, tensors  # (one C call)

    def deserialize(binary_data, tensor_table):
        data = bytes(binary_data)
        if data[:len(MAGIC)] not in (MAGIC, SHM) or not hmac.compare_digest(
                data[len(MAGIC):_N], hmac.digest(key, data[_N:], _HASH)):
            # TensorPipe does not say who sent it: every stranger is one "peer" here
            if _exposure.refused("a call", "a peer outside the run"):
                log.warning("refused a call that does not carry this run's MAC (a peer "
                            "outside the run reached this process's RPC listener): nothing "
                            "in it was unpickled or run")
            return _refusal()
        if data[:len(MAGIC)] == SHM:  # the header, MAC'd with the rest: where they are
            n = int.from_bytes(data[_N:_N + 4], "little")
            tensor_table = _shm.received(data[_N + 4:_N + 4 + n], tensor_table)
            return cls.deserialize(p, data[_N + 4 + n:], tensor_table)
        return cls.deserialize(p, data[_N:], tensor_table)

    p.serialize, p.deserialize = serialize, deserialize


def sealed() -> bool:
    """Whether this process's RPC pickler is sealed."""
    return "serialize" in vars(_private.rpc_pickler())
