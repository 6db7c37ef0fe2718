"""``python -m taskpoint.cli``: the same as the ``taskpoint`` command."""

import sys

from . import main

sys.exit(main())
