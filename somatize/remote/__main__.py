"""A serving process (started by the coordinator or a standing daemon, not by hand).

    python -m somatize.remote --name gpu --rank 1 --join tcp://127.0.0.1:29500
"""

import sys

from ._serve import main

sys.exit(main())
