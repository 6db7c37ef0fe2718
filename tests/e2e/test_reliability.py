"""The bounded reliability campaign of issue 11, inside ``make test``: each scenario at small counts, 0 failures.

The full campaign is ``make reliability`` (``python -m tests.reliability``); docs/reliability.md describes
the scenarios. Here every scenario runs with the ``--quick`` counts of tests/reliability/__main__.py, on the
suite's session servers (shared with the rest of the suite), except the two with real processes killed at random
moments (:data:`SUITE_COUNTS`): fewer trials here, the same code paths (``make reliability --quick`` runs the
quick counts, the full campaign its own). The hostile-archive row is left out: its module is part of the suite
itself.
"""

from __future__ import annotations

import random

import pytest

from reliability import QUICK_COUNTS, concurrency, credentials, faults, handover, resources, roundtrip, sigkill
from reliability._common import Result, Servers, table

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

#: make test's counts where they differ from ``--quick``: SIGKILLs of savers on local disk and S3 only (on GCS and
#: Azure, tests/test_backend_conformance.py checks that an upload ended midway leaves the previous object, and
#: make reliability kills savers there too), half the trainers killed the instant after save() returned, and half
#: the fault cycles on the wire (each cycle is a save and a restore through the proxy: the same paths every time).
SUITE_COUNTS = {**QUICK_COUNTS, "sigkill": {"local": 2, "s3": 1}, "kill_after_return": {"local": 3, "s3": 3},
                "fault_cycles": {"s3": 5, "gcs": 5}}


@pytest.fixture(scope="module")
def servers(request):
    """The scenarios' servers: the suite's own session servers (shared by every worker), not a second set."""
    session = {kind: request.getfixturevalue(f"{kind}_server") for kind in ("s3", "gcs", "azure")}
    with Servers(session.__getitem__) as running:
        yield running


def _check(results: list[Result]) -> None:
    text = table(results)
    print("\n" + text)
    problems = [f"{r.scenario} [{r.store}]: {e}" for r in results for e in r.errors]
    problems += [f"{r.scenario} [{r.store}]: {r.failures - len(r.errors)} more failure(s)"
                 for r in results if r.failures > len(r.errors)]
    problems += [f"{r.scenario} [{r.store}]: {'; '.join(r.notes)}" for r in results
                 if r.skipped and any(n.startswith("not run:") for n in r.notes)]
    assert not problems, "\n".join([text, *problems])
    assert all(r.trials > 0 for r in results if not r.skipped), text


def test_sigkill_during_save(servers, tmp_path):
    _check(sigkill.run(servers, SUITE_COUNTS["sigkill"], random.Random(1), tmp_path))


def test_a_trainer_killed_after_save_returned_loses_no_step(servers, tmp_path):
    _check(handover.run(servers, SUITE_COUNTS["kill_after_return"], tmp_path, size=handover.QUICK_SIZE,
                        loaded=(False,)))


def test_faults_on_the_wire(servers, tmp_path):
    kinds = {k: (v, QUICK_COUNTS["outage"].get(k, False)) for k, v in SUITE_COUNTS["fault_cycles"].items()}
    _check(faults.run(servers, kinds, random.Random(2), tmp_path))


def test_round_trips_by_property(servers, tmp_path):
    _check(roundtrip.run(servers, QUICK_COUNTS["roundtrip"], 3, tmp_path))


def test_secrets_stay_out_of_errors_warnings_and_logs(servers, tmp_path):
    _check(credentials.run(servers, tmp_path))


def test_no_resource_leaks(servers, tmp_path):
    _check(resources.run(servers, QUICK_COUNTS["resource_cycles"], tmp_path))


def test_concurrent_writers_and_a_reader(servers, tmp_path):
    _check(concurrency.run(servers, ("local",), QUICK_COUNTS["concurrency_seconds"], QUICK_COUNTS["concurrency_loads"],
                          tmp_path))


def test_concurrent_writers_and_a_reader_on_s3(servers, tmp_path):
    """Two processes saving one destination on S3 while a third loads: the record is written with a conditional
    PUT (If-Match on the ETag read), so neither writer drops the other's entry and every load is verified."""
    _check(concurrency.run(servers, ("s3",), QUICK_COUNTS["concurrency_seconds"], QUICK_COUNTS["concurrency_loads"],
                          tmp_path))
