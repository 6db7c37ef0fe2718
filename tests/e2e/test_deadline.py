"""The retry deadline is a value passed down: to each call of an operation, to the calls it hands to pool
threads (ranged reads of a large object), and to the operations it runs inside (a write's hooks)."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from _fault_proxy import fault_proxy
from helpers import CountingRetry, make_tree, snapshot
from taskpoint import Checkpoint, CheckpointManager, RetryPolicy, StorageUnavailable
from taskpoint.storage import Deadline, objectstores
from taskpoint.storage.deadline import NO_DEADLINE


def test_a_call_hands_its_function_the_deadline_combined_with_an_outer_one():
    seen: list[Deadline] = []
    policy = RetryPolicy(deadline=30.0)
    policy.call(seen.append, action="read", uri="s3://b/k")
    own = seen[-1]
    left = own.time_left()
    assert own.seconds == 30.0 and left is not None and 25.0 < left <= 30.0 and not own.expired

    sooner = Deadline.from_seconds(5.0)
    policy.call(seen.append, action="read", uri="s3://b/k", outer=sooner)
    assert seen[-1] == sooner  # the outer operation ends first: its deadline bounds this call's

    policy.call(seen.append, action="read", uri="s3://b/k", outer=Deadline.from_seconds(600.0))
    assert seen[-1].seconds == 30.0  # this call's own ends first

    RetryPolicy(deadline=None).call(seen.append, action="read", uri="s3://b/k")
    assert seen[-1] == NO_DEADLINE and seen[-1].time_left() is None
    RetryPolicy(deadline=None).call(seen.append, action="read", uri="s3://b/k", outer=sooner)
    assert seen[-1] == sooner


def test_an_outer_deadline_that_has_passed_stops_the_retries_of_an_inner_call():
    runs: list[Deadline] = []

    def always_reset(deadline: Deadline) -> None:
        runs.append(deadline)
        raise ConnectionResetError("reset by peer")

    passed = Deadline(time.monotonic() - 1.0, 2.0)
    with pytest.raises(StorageUnavailable, match=r"retry deadline of 2 s passed \(1 attempts"):
        RetryPolicy(attempts=50, initial_delay=0.01, deadline=60.0).call(
            always_reset, action="read", uri="s3://b/k", outer=passed)
    assert runs == [passed]


@pytest.mark.timeout(300)
def test_a_parallel_ranged_read_from_a_stalled_store_ends_at_the_deadline(s3_server, monkeypatch, tmp_path):
    """The ranges of a large object are fetched on pool threads; they are given the time left too. Without it
    each stalled range waited out botocore's read timeout on each of its retries, long after the deadline."""
    url = f"s3://taskpoint-tests/deadline-ranges-{os.getpid()}-{time.monotonic_ns()}/ckpt"
    with Checkpoint(url, storage_options=s3_server.storage_options) as cp:
        cp.save_sync(os.urandom(40 << 20))  # > 2 ranges of 8 MiB: read by the concurrent ranged reader
    with fault_proxy(s3_server.endpoint, kinds=("stall",), stall_seconds=240.0) as proxy:

        class StallingRanges(objectstores.S3Backend.range_reader):  # type: ignore[misc, name-defined]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                proxy.rate = 1.0  # the record and the object's HEAD went through; every range stalls

        monkeypatch.setattr(objectstores.S3Backend, "range_reader", StallingRanges)
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        retry = CountingRetry(attempts=20, initial_delay=0.05, max_delay=0.1, deadline=4.0)
        started = time.monotonic()
        with Checkpoint(tmp_path / "unused", url, storage_options=options, retry=retry) as cp, \
                pytest.raises(StorageUnavailable, match=r"retry deadline of 4 s passed \(1 attempts") as info:
            cp.load_sync()
        took = time.monotonic() - started
        assert proxy.stats()["stall"] >= 1  # the ranges really were sent, and never answered
    assert retry.runs.count("load the checkpoint from") == 1
    # fsspec cancelled the range at the deadline, and the error names it (tests/e2e/test_transfer_stalls.py)
    assert re.search(r"TransferStalled: .*bytes \d+-\d+ of s3://\S+/ckpt made no progress", str(info.value))
    # Generous: the stalls last 240 s, and botocore's read timeout (lowered to the deadline) with its retries
    # kept the old code here for over a minute.
    assert took < 40.0


#: The small request of step 2's background save that the proxy holds, per way of saving in the background: a
#: deduplicated save (a thread of this process) reads the sweepers' epoch; a save through the save process writes
#: the step's manifest (a PUT: the commit itself; the HEAD of the payload it held before is skipped now while the
#: upload is younger than half the grace period). Both come after ``save(blocking=False)`` has returned.
#: The retry deadline of the managers that meet a held request, which the test waits out once per case: short for
#: a test, long enough for the requests that pass on a loaded machine (at load 14 on 2 cores, building a client's
#: session alone took over 5 s; both cases passed with 8 s at load 16, and at load 21 with two CPU burners beside).
HELD_DEADLINE = 10.0
HELD = {
    "dedup-epoch-get": ({"dedup": True}, "GET", "/leases/epoch"),
    "save-commit-put": ({}, "PUT", "/ckpt-2/taskpoint.json"),
}


@pytest.mark.timeout(300)  # the bound of every wait below: a save that hangs fails the test here
@pytest.mark.parametrize("case", list(HELD))
def test_a_background_save_whose_small_request_is_held_forever_fails_at_its_deadline_and_the_next_save_commits(
        s3_server, tmp_path: Path, case: str) -> None:
    """One small request of a background save is never answered (the proxy holds it until the client gives up).
    The save fails at its retry deadline with StorageUnavailable naming the deadline; the error reaches the user
    at the next save, which then does nothing else (docs/manager.md); step 2 is not committed; the save after
    that commits, and every committed step restores."""
    options_of_manager, method, part = HELD[case]
    url = f"s3://taskpoint-tests/held-{case}-{os.getpid()}-{time.monotonic_ns()}/steps"
    data = make_tree(tmp_path / "data")
    held: list[str] = []

    def hold(request_method: str, path: str) -> bool:
        if request_method == method and part in path and not held:
            held.append(path)
            return True
        return False

    with fault_proxy(s3_server.endpoint, stall_seconds=math.inf) as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        with CheckpointManager(url, storage_options=options, retry=RetryPolicy(deadline=HELD_DEADLINE),
                               **options_of_manager) as mgr:
            mgr.save(data, 1)
            proxy.hold = hold
            mgr.save(data, 2, blocking=False)  # the held request is in its background part
            with pytest.raises(StorageUnavailable, match=rf"retry deadline of {HELD_DEADLINE:g} s passed .*"
                                                         r"\[background save of step 2\]"):
                mgr.save(data, 3)
            assert len(held) == 1 and any(entry[2] == "stall" for entry in proxy.log)
            assert mgr.steps() == [1]
            mgr.save(data, 3)
            assert mgr.steps() == [1, 3]
            for step in (1, 3):
                assert snapshot(mgr.restore(step)) == snapshot(data)
