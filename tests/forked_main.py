"""What a process forked by tests/forks.py runs: ``python tests/forked_main.py SCRIPT ARGS``
runs ``SCRIPT ARGS`` as ``python SCRIPT ARGS`` would (its ``sys.argv``, ``sys.path[0]``,
``__main__``, exit code; an exception ends it as Python does), then ends the process at
once: its non-daemon threads joined, its atexit handlers run (a coordinator's group
shut down), its streams flushed. Python's own finalization would take 0.4 s to a second
of a core after every scenario, most of it touching pages shared with the warm process."""

import atexit
import os
import runpy
import sys
import threading


def end(code) -> None:
    if code is not None and not isinstance(code, int):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():  # as the interpreter does before its atexit handlers
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        end(e.code)
    end(0)
