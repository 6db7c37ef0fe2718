"""Hostile archives and damage detection: the suite's module for them, run by pytest, reported as a row.

``tests/test_hostile_archives.py`` is written separately (crafted archives, bit flips and truncations); when
it exists, the campaign runs it in a child pytest and reports how many of its tests passed.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from ._common import REPO_ROOT, Result, child_env, tail, timed

MODULE = REPO_ROOT / "tests" / "test_hostile_archives.py"


def run(scratch: Path) -> list[Result]:
    import subprocess

    result = Result("Hostile archives and damage (tests/test_hostile_archives.py)", "local+servers")
    with timed(result):
        if not MODULE.exists():
            result.skipped = True
            result.note("not present")
            return [result]
        report = scratch / "hostile-junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(MODULE),
                               f"--junitxml={report}"], cwd=REPO_ROOT, env=child_env(), capture_output=True,
                              text=True, timeout=3600)
        if not report.exists():
            result.trial(f"pytest exited with {proc.returncode} without a report: {tail(proc.stdout + proc.stderr)}")
            return [result]
        suites = ET.parse(report).getroot()
        for case in suites.iter("testcase"):
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            if case.find("skipped") is not None:
                continue
            name = case.get("name", "?")
            result.trial(None if problem is None else f"{name}: {(problem.get('message') or '')[:300]}")
        result.note(f"pytest exit code {proc.returncode}")
    return [result]
