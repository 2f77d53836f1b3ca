"""A serving process (started by the coordinator or a standing daemon, not by hand).

    python -m somatize.remote --name gpu --rank 1 --join tcp://127.0.0.1:29500
"""

import logging
import os
import sys

from ._isolation import enter_from_env

enter_from_env()  # the run's network namespace, before any socket or thread is made

from ._serve import main  # noqa: E402

code = main()
# it has left the group and said what it had to: finalizing an interpreter that holds
# torch would keep the coordinator's stop waiting about 0.4 s more (as multiprocessing's
# children do, it ends here, its streams flushed)
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
