"""Traces across processes: each worker records its own spans; the coordinator measures
each worker's clock against its own when tracing starts (the quickest of five round
trips, the offset at its midpoint: NTP's way) and shifts the worker's spans by it when
it collects them.

    offsets = begin(runtime)              # the workers start recording
    events = collect(runtime, offsets)    # their spans, on this process's clock
"""

from __future__ import annotations

from .._trace import now_us, shifted


def begin(runtime) -> dict[str, float]:
    """Start recording on every worker of ``runtime``; return each one's clock offset."""
    import torch.distributed.rpc as rpc

    from . import _serve

    offsets = {}
    for host, p in runtime.peers.items():
        best = None
        for _ in range(5):
            t0 = now_us()
            theirs = rpc.rpc_sync(p.name, _serve.clock, timeout=p.timeout)
            t1 = now_us()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, theirs - (t0 + t1) / 2)
        offsets[host] = best[1]
        rpc.rpc_sync(p.name, _serve.trace, args=(host,), timeout=p.timeout)
    return offsets


def collect(runtime, offsets: dict[str, float], end: bool = False) -> list[dict]:
    """The spans the workers recorded since the last collect, on this process's clock."""
    import torch.distributed.rpc as rpc

    from . import _serve

    events: list[dict] = []
    for host, p in runtime.peers.items():
        if host not in offsets or p.why_dead() is not None:
            continue
        got = rpc.rpc_sync(p.name, _serve.trace, args=(None if end else host,),
                           timeout=p.timeout)
        events += shifted(got, -offsets[host])
    return events
