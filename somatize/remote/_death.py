"""Why a worker process ended, in words: the kernel's verdict where it can be read.

    why_exited(pid, returncode)   # "it was killed by the kernel's out-of-memory killer ..."

An exit code of -9 is SIGKILL, which the out-of-memory killer sends; the kernel log
(``/dev/kmsg``, readable by root or with CAP_SYSLOG) says whether it was that, naming
the pid. Where it cannot be read, the likely cause is said, and how to check.
"""

from __future__ import annotations

import errno
import os
import signal


def process_state(pid: int) -> str:
    """Process ``pid``'s state letter (``R``, ``S``, ``T`` stopped, ``Z`` a zombie...), or
    ``?`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def why_exited(pid: int, code: int) -> str:
    """Why process ``pid`` ended with ``code`` (a Popen returncode)."""
    if code == -signal.SIGKILL:
        verdict = _oom_verdict(pid)
        if verdict is not None:
            return (f"its process (pid {pid}) was killed by the kernel's out-of-memory "
                    f"killer (kernel log: {verdict!r}): it ran out of memory. Give it more "
                    "(or less to hold: smaller batches, fewer nodes placed there)")
        return (f"its process (pid {pid}) was killed (SIGKILL, exit code -9): most likely "
                "out of memory (the kernel's out-of-memory killer sends it; `dmesg | grep "
                f"'Killed process {pid}'` says so), else someone's kill -9")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"its process (pid {pid}) was killed by {name}"
    return f"its process (pid {pid}) exited with code {code}"


def _oom_verdict(pid: int) -> str | None:
    """The kernel log's line saying it killed ``pid`` for memory, or None (none, or the
    log cannot be read here)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        while True:
            try:
                rec = os.read(fd, 8192).decode(errors="replace")
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue  # records overwritten while we read: go on from the next
                break  # EAGAIN: no more records
            text = rec.split(";", 1)[-1].strip()
            if f"Killed process {pid} " in text or f"Killed process {pid}," in text:
                found = text[:200]
    finally:
        os.close(fd)
    return found
