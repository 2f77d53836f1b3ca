"""``somatize hub ARGS...`` as a script, so that a test can fork it from its warm process
(tests/forks.py forks scripts only) instead of starting an interpreter for it.

    hub = start("hub_run.py", "--study", "s.toml", "--listen", "127.0.0.1:0", ...)
"""

import sys

from somatize._cli import main

if __name__ == "__main__":
    sys.exit(main(["hub", *sys.argv[1:]]))
