"""The study link on gRPC with mutual TLS: the hub listens on one port, owners dial out
to it; each side proves its name with its certificate (``_certs.py``), and every message
is a frame of ``_frames.py`` (never a pickle).

    server = serve({"ct-2027": StudyHub(cfg)}, "0.0.0.0:7443", "hub.pem", "ca.pem")
    link = HubLink("hub.example.org:7443", "hospital-a.pem", "ca.pem", hub_name="hub")
    kind, fields, tensors = link.call("Forward", {...}, {"x": x}, timeout=30)
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import Refused, WorkerError
from ._certs import load_identity
from ._frames import FrameError, decode, encode

log = logging.getLogger(__name__)

METHOD = "/somatize.fed.Hub/Call"
REQUESTS = frozenset({"Attach", "Forward", "Backward", "RoundEnd", "Detach"})
MAX_MESSAGE = 1 << 30
_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]


class HubRefused(Refused):
    """The hub refused a message (``code``: what was wrong), naming what to do."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Excluded(HubRefused):
    """The hub left this owner out of ``round`` (too slow or lost: past ``round_timeout``
    at the barrier, or a step in flight past ``turn_timeout``); nothing it sent since
    was applied. It may attach again at ``rejoin`` (``round + 1``) or later, from a
    checkpoint of that round's barrier."""

    def __init__(self, message: str, round: int, rejoin: int):
        super().__init__("excluded", message)
        self.round, self.rejoin = round, rejoin


class Audit:
    """What the hub received, one JSON line per message: owner, kind, fields, each
    tensor's name, dtype and shape, and the message's bytes (the wire audit reads it)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.lock = threading.Lock()

    def write(self, entry: dict) -> None:
        if self.path is not None:
            with self.lock, self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")


def _common_name(context: Any) -> str | None:
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


def serve(hubs: Mapping[str, Any], listen: str, identity: str | Path, ca: str | Path,
          audit: str | Path | None = None, threads: int = 32) -> Any:
    """Start the hub's gRPC server for the studies ``hubs`` (``{name: StudyHub}``) on
    ``listen``; clients must present a certificate the study's ``ca`` signed. Returns the
    started ``grpc.Server`` (``.stop(grace)`` ends it); its port is ``server.port``."""
    from concurrent import futures

    import grpc

    from ._frames import Refusal

    key, cert = load_identity(identity)
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=Path(ca).read_bytes(),
                                        require_client_auth=True)
    record = Audit(audit)

    def call(request: bytes, context: Any) -> bytes:
        owner = _common_name(context)
        entry: dict[str, Any] = {"owner": owner, "bytes": len(request), "t": time.time()}
        try:
            kind, fields, tensors = decode(request, REQUESTS)
            entry.update(kind=kind, fields=fields,
                         tensors=[[n, str(t.dtype), list(t.shape)] for n, t in tensors.items()])
            hub = hubs.get(fields.get("study"))
            if hub is None:
                raise Refusal("study", f"no study {fields.get('study')!r} on this hub "
                                       f"(it serves {sorted(hubs)})")
            kind, fields, tensors = hub.handle(owner, kind, fields, tensors)
            out = encode(kind, fields, tensors)
        except FrameError as e:
            entry.update(kind="junk", refused=str(e))
            out = encode("Refused", {"code": "frame", "message": str(e)})
        except Refusal as e:
            entry["refused"] = str(e)
            out = encode("Refused", {**e.fields, "code": e.code, "message": str(e)})
        except Exception as e:  # the hub's own failure: one line, no traceback to the owner
            log.exception("study hub: a %s from %r failed", entry.get("kind"), owner)
            entry["refused"] = type(e).__name__
            out = encode("Refused", {"code": "hub", "message": f"the hub failed to run this "
                                                               f"{entry.get('kind')} "
                                                               f"({type(e).__name__})"})
        record.write(entry)
        return out

    handler = grpc.method_handlers_generic_handler("somatize.fed.Hub", {
        "Call": grpc.unary_unary_rpc_method_handler(call)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    server.port = server.add_secure_port(listen, creds)
    if not server.port:
        raise WorkerError(f"the hub could not listen on {listen}")
    server.start()
    return server


class HubLink:
    """An owner's connection to the hub: ``call`` sends one frame and returns the hub's
    answer; a refusal raises ``HubRefused``, a lost hub ``WorkerError`` naming it."""

    def __init__(self, address: str, identity: str | Path, ca: str | Path,
                 hub_name: str = "hub", timeout: float = 30.0, role: str = "study hub"):
        import grpc

        key, cert = load_identity(identity)
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca).expanduser()
                                             .read_bytes(), private_key=key,
                                             certificate_chain=cert)
        self.address, self.hub_name, self.timeout = address, hub_name, timeout
        self.role = role
        self.channel = grpc.secure_channel(
            address, creds, options=[*_OPTIONS, ("grpc.ssl_target_name_override", hub_name)])
        self.stub = self.channel.unary_unary(METHOD)
        self.sent = self.received = 0

    def call(self, kind: str, fields: Mapping, tensors: Mapping | None = None,
             timeout: float | None = None) -> tuple[str, dict, dict]:
        import grpc

        data = encode(kind, fields, tensors)
        self.sent += len(data)
        try:
            answer = self.stub(data, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise WorkerError(
                f"{self.role} {self.hub_name!r} at {self.address} lost or unreachable during "
                f"{kind} ({e.code().name}: {e.details()}). Resume from the last round's "
                "checkpoint when the hub is back") from None
        self.received += len(answer)
        kind, fields, tensors = decode(answer, frozenset({"Attached", "Output", "Grad",
                                                          "Average", "Refused", "Done"}))
        if kind == "Refused" and fields.get("code") == "excluded":
            raise Excluded(f"{self.role} {self.hub_name!r} refused: {fields.get('message')}",
                           int(fields.get("round", -1)), int(fields.get("rejoin", -1)))
        if kind == "Refused":
            raise HubRefused(fields.get("code", "?"), f"{self.role} {self.hub_name!r} refused: "
                                                      f"{fields.get('message')}")
        return kind, fields, tensors

    def close(self) -> None:
        self.channel.close()
