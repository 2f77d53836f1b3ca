"""Who may talk to a run: the run's key, proved by challenge and response, never sent.

    key = run_key()                       # this run's key (made once per process)
    session = prove(sock, key, "host")    # the joiner runs prove(sock, key, "joiner")
    send_frame(sock, session, seq, body); body = recv_frame(sock, session, seq)

A run's key is ``HMAC(token, "somatize run " + run id)``: the token is ``SOMATIZE_TOKEN``
(or the file named by ``SOMATIZE_TOKEN_FILE``, mode 0600), else made at random for this
run; the run id is public. A standing worker holding the same token derives the same
key from the run id it is told; an embedded worker is handed the key in its
environment (``SOMATIZE_RUN_KEY``, removed there once read), never on its command line.
Neither token nor key is ever logged or put in an argument, a config or a checkpoint.

``prove``: the joiner sends a nonce; the host answers its own nonce and its proof over
both; only once that proof checks does the joiner send its own (another label, so one
proof never stands for the other). An impostor on either side sees only nonces and a
proof it cannot reuse, and learns nothing of the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct
import threading

from .._errors import WorkerError

TOKEN_ENV, TOKEN_FILE_ENV, RUN_KEY_ENV = "SOMATIZE_TOKEN", "SOMATIZE_TOKEN_FILE", "SOMATIZE_RUN_KEY"
_NONCE = 32
_MAC = 32
MAX_FRAME = 64 << 20  # a rendezvous value is small; a bigger length is junk


class Refused(WorkerError):
    """The peer did not prove it holds the run's secret (or we could not prove it)."""


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` (each length-prefixed, so no two splits collide)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(struct.pack("!Q", len(p)))
        h.update(p)
    return h.digest()


def read_token_file(path: str) -> bytes:
    """The token kept in ``path``; refused unless only its owner may read it, and refused
    in one line when it is missing, a symbolic link or not a regular file."""
    make = (f"give {TOKEN_FILE_ENV} a copy of the worker's token file (its log names it: "
            "~/.config/somatize/worker-NAME.token), a regular file of mode 0600")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise WorkerError(f"the token file {path} does not exist: {make}") from None
    except OSError as e:
        if os.path.islink(path):
            raise WorkerError(f"the token file {path} is a symbolic link, which is not "
                              f"followed (another user could point it elsewhere): {make}, "
                              f"e.g. {os.path.realpath(path)}") from None
        raise WorkerError(f"the token file {path} cannot be opened ({e.strerror}): "
                          f"{make}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise WorkerError(f"the token file {path} is {kind}: {make}")
    with os.fdopen(fd, "rb") as f:
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise WorkerError(f"the token file {path} may be read by others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}): chmod 600 {path}")
        tok = f.read().strip()
    if len(tok) < 16:
        raise WorkerError(f"the token file {path} holds {len(tok)} bytes: a token is at "
                          "least 16 (make one with: python -c 'import secrets; "
                          "print(secrets.token_hex(32))')")
    return tok


def make_token_file(path: str) -> bytes:
    """Make a fresh token and keep it in ``path`` (mode 0600; an existing file is read)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        return read_token_file(path)
    tok = secrets.token_hex(32).encode()
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(tok + b"\n")
    return tok


def token() -> bytes | None:
    """The token this process was given (``SOMATIZE_TOKEN``, or the file named by
    ``SOMATIZE_TOKEN_FILE``), or None."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].encode()
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(os.environ[TOKEN_FILE_ENV])
    return None


def derive(tok: bytes, run_id: str) -> bytes:
    """The key of run ``run_id`` for whoever holds ``tok``."""
    return mac(tok, b"somatize run", run_id.encode())


_lock = threading.Lock()
_run: dict[str, object] = {}


def run_id() -> str:
    """This coordinator's run id (public: a standing worker derives the key from it)."""
    run_key()
    return str(_run["id"])


def run_key() -> bytes:
    """This process's run key (a coordinator's: made here once, from the token if one
    was given)."""
    with _lock:
        if "key" not in _run:
            _run["id"] = secrets.token_hex(16)
            _run["key"] = derive(token() or secrets.token_bytes(32), str(_run["id"]))
        return _run["key"]  # type: ignore[return-value]


def given_key() -> bytes:
    """The run key a serving process was handed in its environment (``RUN_KEY_ENV``,
    removed once read)."""
    with _lock:
        if "key" in _run:
            return _run["key"]  # type: ignore[return-value]
        given = os.environ.pop(RUN_KEY_ENV, None)
        if not given:
            raise WorkerError(f"this serving process was started without its run's key "
                              f"({RUN_KEY_ENV} in its environment): it is started by a "
                              "coordinator or a standing worker, not by hand")
        _run["id"], _run["key"] = "given", bytes.fromhex(given)
        return _run["key"]  # type: ignore[return-value]


def use_key(key: bytes, rid: str) -> None:
    """Make ``key`` this process's run key (a torchrun rank, a standing worker's child)."""
    with _lock:
        _run["id"], _run["key"] = rid, key


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("the peer closed the connection")
        buf += got
    return buf


def prove(sock: socket.socket, key: bytes, role: str) -> bytes:
    """Challenge and response on a fresh connection; returns the session key both ends
    now share. Raises Refused when the other side does not prove it holds ``key``."""
    # each end writes twice before it reads (its proof, then its first frame): with
    # Nagle's algorithm the second write waits for the peer's delayed ACK, 40 ms a join
    with contextlib.suppress(OSError):  # (not TCP: nothing to do)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if role == "joiner":
        mine = secrets.token_bytes(_NONCE)
        sock.sendall(mine)
        theirs, proof = _recv(sock, _NONCE), _recv(sock, _MAC)
        if not hmac.compare_digest(proof, mac(key, b"host", mine, theirs)):
            raise Refused("it did not prove it holds this run's secret")
        sock.sendall(mac(key, b"joiner", mine, theirs))
        joiner, host = mine, theirs
    else:
        joiner = _recv(sock, _NONCE)
        host = secrets.token_bytes(_NONCE)
        sock.sendall(host + mac(key, b"host", joiner, host))
        try:
            proof = _recv(sock, _MAC)
        except ConnectionError:
            raise Refused("it did not prove it holds the run's secret (it hung up)") from None
        if not hmac.compare_digest(proof, mac(key, b"joiner", joiner, host)):
            raise Refused("it did not prove it holds the run's secret")
    return mac(key, b"session", joiner, host)


def send_frame(sock: socket.socket, session: bytes, seq: int, body: bytes) -> None:
    """One message, its length and MAC (over its place in the stream too) around it."""
    sock.sendall(struct.pack("!I", len(body)) + body
                 + mac(session, struct.pack("!Q", seq), body))


def recv_frame(sock: socket.socket, session: bytes, seq: int, most: int = MAX_FRAME) -> bytes:
    """The next message; Refused when its MAC does not check (nothing of it is used)."""
    (n,) = struct.unpack("!I", _recv(sock, 4))
    if n > most:
        raise Refused(f"a frame of {n} bytes: not from a somatize peer")
    body, tag = _recv(sock, n), _recv(sock, _MAC)
    if not hmac.compare_digest(tag, mac(session, struct.pack("!Q", seq), body)):
        raise Refused("a message whose MAC does not check")
    return body
