"""A serving process (started by the coordinator or a standing daemon, not by hand).

    python -m somatize.remote --name gpu --rank 1 --join tcp://127.0.0.1:29500
"""

import sys

from ._isolation import enter_from_env

enter_from_env()  # the run's network namespace, before any socket or thread is made

from ._serve import main  # noqa: E402

sys.exit(main())
