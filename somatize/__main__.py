"""``python -m somatize ...`` is the ``somatize`` command."""

import sys

from ._cli import main

sys.exit(main())
