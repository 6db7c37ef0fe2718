"""Rows that run tests of the suite itself in a child pytest, one trial per test that ran.

:func:`campaign` runs the tests marked ``campaign`` (the campaign-size runs of bounded tests of the suite:
30 SIGTERMs and 30 SIGKILLs of trainers on S3, 3000 random damages) with ``TASKPOINT_CAMPAIGN=1``, which
``make test`` skips; :mod:`.hostile` runs the hostile-archive module at the suite's own counts.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from ._common import REPO_ROOT, Result, child_env, tail, timed


def pytest_row(result: Result, targets: list[str], scratch: Path, **env: str) -> None:
    """Run pytest on ``targets`` (paths and options) in a child process and count each test that ran as a
    trial of ``result`` (a failure or error as a failed one, with its message); skipped tests do not count."""
    report = scratch / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets,
                           f"--junitxml={report}"], cwd=REPO_ROOT, env=child_env(**env), capture_output=True,
                          text=True, timeout=3600)
    if not report.exists():
        result.trial(f"pytest exited with {proc.returncode} without a report: {tail(proc.stdout + proc.stderr)}")
        return
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        name = case.get("name", "?")
        result.trial(None if problem is None else f"{name}: {(problem.get('message') or '')[:300]}")
    result.note(f"pytest exit code {proc.returncode}")


#: Rows of their own: promises against time (issue 21), each a module of the suite run whole, its campaign-size
#: tests included (``TASKPOINT_CAMPAIGN=1``); the ``campaign`` row leaves these modules out.
TIME_ROWS = {
    "stalls": ("Stalls (SIGSTOP past the grace), mixed graces, late ranks", ["tests/e2e/test_stalls.py"]),
}

#: Modules whose campaign-size tests another row runs at the same counts (the ``manifests`` row).
ROWED = ("tests/test_manifest_damage.py",)


def campaign(scratch: Path) -> list[Result]:
    result = Result("Campaign-size tests of the suite (pytest -m campaign)", "local+servers")
    ignored = [f"--ignore={module}" for module in (*ROWED, *(m for _, modules in TIME_ROWS.values() for m in modules))]
    with timed(result):
        pytest_row(result, ["-m", "campaign", "tests", *ignored], scratch, TASKPOINT_CAMPAIGN="1")
    return [result]


def time_row(name: str, scratch: Path) -> list[Result]:
    """One of :data:`TIME_ROWS`: every test of its modules, campaign-size ones included, one trial each."""
    title, modules = TIME_ROWS[name]
    result = Result(title, "local+s3")
    with timed(result):
        pytest_row(result, modules, scratch, TASKPOINT_CAMPAIGN="1")
    return [result]
