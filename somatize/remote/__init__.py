"""Workers: a stretch of the graph runs in another process, over torch.distributed.rpc.

    g = Graph.somatize(Body().at("gpu") >> Head())
    g.forward(x)                                        # "gpu": a local process, embedded
    g.forward(x, workers={"gpu": Worker.at("node3:7000")})   # a standing daemon there
    serve_if_worker()                                   # torchrun: ranks >= 1 serve

A worker runs the code it is sent: the graph travels pickled, and classes defined
in the script's ``__main__`` travel by value (cloudpickle); classes from modules
travel by reference, so those modules must be importable over there (an embedded
worker sees this process's ``sys.path``; a standing one needs them installed or on
its ``PYTHONPATH``). Make a worker reachable only by whom you trust.
"""

from ._forks import fork_workers
from ._group import keep_workers
from ._runtime import Runtime, release, runtime_for
from ._settings import configure
from ._torchrun import serve_if_worker
from ._worker import Worker

__all__ = ["Runtime", "Worker", "configure", "fork_workers", "keep_workers",
           "release", "runtime_for",
           "serve_if_worker"]
