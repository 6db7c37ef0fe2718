"""The reliability campaign of issue 11 (``make reliability``; ``python -m tests.reliability --quick``).

Scenarios, one module each: :mod:`.sigkill` (savers killed at random moments), :mod:`.faults` (a
fault-injecting proxy on the wire), :mod:`.roundtrip` (Hypothesis trees), :mod:`.credentials` (secrets in
errors, warnings and logs), :mod:`.resources` (leaks over many cycles), :mod:`.concurrency` (two writers
and a reader), :mod:`.hostile` (the hostile-archive module of the suite, when present), :mod:`.manifests` (a bit
of a manifest or record damaged), :mod:`.handover` (trainers killed after ``save(blocking=False)``
returned), :mod:`.suite` (the suite's ``campaign`` tests, full campaign only).
docs/reliability.md describes each and holds the table of the last full run.
"""

#: Trial counts of the full campaign (issue 11's figures; SIGKILL counts are per store and per way of saving).
FULL_COUNTS = {
    "sigkill": {"local": 50, "s3": 20, "gcs": 10, "azure": 10},
    "fault_cycles": {"s3": 100, "gcs": 100},
    "outage": {"s3": True, "gcs": True},
    "roundtrip": {"memory": 150, "local": 150, "s3": 40},
    "resource_cycles": 1000,
    "concurrency_seconds": 30.0,
    "concurrency_loads": 100,
    "manifest_damage": {"local": 1000, "s3": 100},
    "kill_after_return": {"local": 20, "s3": 20},
}
#: The bounded campaign (``--quick``, and tests/e2e/test_reliability.py in ``make test``).
QUICK_COUNTS = {
    "sigkill": {"local": 2, "s3": 1, "gcs": 1, "azure": 1},
    "fault_cycles": {"s3": 10, "gcs": 10},
    "outage": {"s3": "no-stall", "gcs": False},
    "roundtrip": {"memory": 20, "local": 20, "s3": 6},
    "resource_cycles": 100,
    "concurrency_seconds": 5.0,
    "concurrency_loads": 20,
    "manifest_damage": {"local": 100},
    "kill_after_return": {"local": 6, "s3": 6},
}
