"""Hostile archives and damage detection: the suite's module for them, run by pytest, reported as a row.

``tests/test_hostile_archives.py`` is written separately (crafted archives, bit flips and truncations); when
it exists, the campaign runs it in a child pytest and reports how many of its tests passed (its 3000-damage
run is a ``campaign`` test: the row of :func:`.suite.campaign` runs it).
"""

from __future__ import annotations

from pathlib import Path

from ._common import REPO_ROOT, Result, timed
from .suite import pytest_row

MODULE = REPO_ROOT / "tests" / "test_hostile_archives.py"


def run(scratch: Path) -> list[Result]:
    result = Result("Hostile archives and damage (tests/test_hostile_archives.py)", "local+servers")
    with timed(result):
        if not MODULE.exists():
            result.skipped = True
            result.note("not present")
            return [result]
        pytest_row(result, [str(MODULE)], scratch)
    return [result]
