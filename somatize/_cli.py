"""The ``somatize`` command: ``show`` a graph, look inside a ``store``, serve as a ``worker``.

    somatize show examples/digits_graph.py
    somatize store ls /scratch/soma
    somatize worker --name gpu --listen 127.0.0.1:7000
    somatize --version
"""

from __future__ import annotations

import sys

USAGE = """usage: somatize {show,store,worker,hub,fed} ... | --version

  show PATH|MODULE [--dot FILE] [--svg FILE] [--png FILE]
                        print a graph built by a script or module, and draw it
  store {ls,du,verify,gc,drop} PATH
                        look inside a store, check it, clean it
  worker --name NAME --listen HOST:PORT [--store PATH] [--keepalive S]
                        serve as a standing worker
  hub --study FILE --listen HOST:PORT --identity PEM --ca PEM [--checkpoints DIR]
      [--store PATH [--keep-rounds N]] [--average-only]
                        serve studies' shared modules to their data owners (or, with
                        --average-only, average the parts of the studies naming it)
  fed {ca DIR, cert DIR NAME..., export STORE STUDY --shared PATH --out FILE}
                        a study's certificate authority and its parties' certificates;
                        a round exported from the store as a plain state_dict
"""


def main(argv: list[str] | None = None) -> int:
    """Run the command; what a user's input gets wrong is one line on stderr, exit 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"somatize {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        return _run(cmd, rest)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"somatize {cmd}: {e.filename or e}: {e.strerror}: give a path that exists and "
              "that you may read", file=sys.stderr)
        return 1
    except Exception as e:
        from ._errors import SomatizeError

        if not isinstance(e, SomatizeError):
            raise
        print(f"somatize {cmd}: {e}", file=sys.stderr)
        return 1


def _run(cmd: str, rest: list[str]) -> int:
    if cmd == "show":
        from ._show import show_main

        return show_main(rest)
    if cmd == "store":
        from ._store_cli import main as store_main

        return store_main(rest)
    if cmd == "worker":
        from .worker import main as worker_main

        return worker_main(rest)
    if cmd in ("hub", "fed"):
        from .fed._cli import fed_main, hub_main

        return (hub_main if cmd == "hub" else fed_main)(rest)
    print(f"somatize: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
