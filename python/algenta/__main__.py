"""``python -m algenta``: the same command line as the ``algenta`` console script."""

import sys

from .cli import main

sys.exit(main())
