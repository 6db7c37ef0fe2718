"""The command line (the top layer): ``taskpoint ls``, ``show``, ``verify``, ``pull``, ``push``, ``rm``, ``gc``,
``run``.

``_app`` holds the group, storage options and error reporting; ``holdings`` reads what a URI holds; each
command module registers its commands on the group when imported. See docs/cli.md.
"""

from . import run, transfers, verify, views  # noqa: F401  (they register their commands)
from ._app import cli, main

__all__ = ["cli", "main"]
