"""The CPU each test costs: a pytest plugin, and a table of it by module.

The suite needs about 1,200 CPU-s in ``make test`` (1,077 counted here and 1,201 with the servers, the fork servers
and the xdist controller, at ``/usr/bin/time``, on 2 cores at load 8-19): 600 s of its two cores, against 765 s of
wall on a quiet machine. Wall time on a shared machine says little, so what a change to the tests saves is measured
in CPU-seconds too: this process's own (its threads
included) plus that of the processes it started and waited for (workers, the CLI, save processes, torchrun and
its ranks, and the children that tests/_zygote.py's fork servers forked for it) over each test's setup, call
and teardown. The object-store servers and the fork servers themselves (one import of a framework each, per
xdist worker) are shared by the session and are not counted. ::

    pytest -p _cpu_report --cpu-report=/tmp/cpu -n 3 ...     # one JSON line per test, a file per xdist worker
    python tests/_cpu_report.py '/tmp/cpu-*.jsonl'           # CPU-seconds by module, largest first
"""

from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time
from collections.abc import Generator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", metavar="PREFIX", default=None,
                     help="write each test's CPU-seconds to PREFIX-<xdist worker>.jsonl (tests/_cpu_report.py)")


def _cpu() -> tuple[float, float]:
    """CPU-seconds so far of this process and of its children that ended and were waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = sys.modules["_zygote"].ended_cpu() if "_zygote" in sys.modules else 0.0  # the fork server's children
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + forked


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    prefix = item.config.getoption("--cpu-report")
    if prefix is None:
        yield
        return
    (own, children), began = _cpu(), time.monotonic()
    yield
    (own_after, children_after), wall = _cpu(), time.monotonic() - began
    row = {"id": item.nodeid, "self": own_after - own, "children": children_after - children, "wall": wall}
    with open(f"{prefix}-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def by_module(pattern: str) -> list[tuple[str, int, float, float, float]]:
    """(module, tests, own CPU-s, children's CPU-s, wall seconds) from the reports ``pattern`` matches, the
    costliest first."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for path in glob.glob(pattern):
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                row = json.loads(line)
                total = totals[row["id"].split("::")[0]]
                for i, value in enumerate((1, row["self"], row["children"], row["wall"])):
                    total[i] += value
    rows = [(module, int(n), own, children, wall) for module, (n, own, children, wall) in totals.items()]
    return sorted(rows, key=lambda row: -(row[2] + row[3]))


if __name__ == "__main__":
    table = by_module(sys.argv[1])
    print(f"{sum(r[2] + r[3] for r in table):.0f} CPU-s in {sum(r[1] for r in table)} tests")
    print("| module | tests | CPU-s | own | children | wall s |\n|---|---|---|---|---|---|")
    for module, n, own, children, wall in table:
        print(f"| {module} | {n} | {own + children:.1f} | {own:.1f} | {children:.1f} | {wall:.0f} |")
