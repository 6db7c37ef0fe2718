"""``python -m taskpoint``: the command line (see :mod:`taskpoint.cli`)."""

import sys

from .cli import main

sys.exit(main())
