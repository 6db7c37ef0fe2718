"""A part stalled forever in a 3-rank job launched by the real ``torchrun`` (gloo), through the fault proxy on the
S3 server (issue 44, item 2): the rank whose part stalls raises at its retry deadline naming itself, the object
and the part, and leaves rank 0 a note of it; rank 0, gathering the shards, reads the note and abandons the step
with that error, long before its ``commit_timeout``; nobody hangs; step 1 stays the newest step and every rank
restores its shard of it.

The workers are tests/_stalled_rank_worker.py. Every wait is bounded; nothing asserts how long anything took.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from _fault_proxy import fault_proxy
from helpers import TORCHRUN, run_torchrun
from taskpoint import CheckpointManager

WORKER = Path(__file__).parents[1] / "_stalled_rank_worker.py"
WORLD = 3
#: The stalled rank's retry deadline and stall timeout, rank 0's commit timeout and every rank's grace (seconds):
#: the commit timeout is far longer than the stalled rank's deadline, so rank 0 stops on the rank's note.
DEADLINE, STALL, COMMIT_TIMEOUT, GRACE = 20.0, 4.0, 150.0, 200.0
#: The bound of the whole job: three workers import torch on two busy cores, then save twice.
JOB_WITHIN = 280.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400),
              pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun beside python")]


class SecondPuts:
    """Holds every PUT to a step-2 payload whose path was PUT before: the parts after the first of the one
    multipart upload (the other ranks' shards are single PUTs), and each resend of them."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.held: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, method: str, path: str) -> bool:
        if method != "PUT" or "/ckpt-2/payload-" not in path:
            return False
        with self._lock:
            if path in self.seen:
                self.held.append(path)
                return True
            self.seen.add(path)
            return False


def test_one_ranks_part_stalled_forever_ends_every_rank_and_leaves_the_previous_step(s3_server: Any,
                                                                                      tmp_path: Path) -> None:
    url = f"s3://taskpoint-tests/stalled-ranks-{os.getpid()}-{time.monotonic_ns()}/steps"
    with fault_proxy(s3_server.endpoint, stall_seconds=math.inf) as proxy:
        holder = SecondPuts()
        proxy.hold = holder
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        args = {"directory": url, "options": options, "deadline": DEADLINE, "stall": STALL,
                "commit_timeout": COMMIT_TIMEOUT, "grace": GRACE, "big_rank": 1, "big": 20 << 20,
                "workspace": str(tmp_path / "data")}
        status, out, err = run_torchrun(WORKER, WORLD, json.dumps(args), JOB_WITHIN)
        events = [json.loads(line[line.index("{"):]) for line in out.splitlines() if "{" in line]
        assert status == 0, (events, err[-3000:])
    by_rank = {e["rank"]: e for e in events if e["event"] in ("saved", "error")}
    assert sorted(by_rank) == [0, 1, 2], events
    assert sorted(e["rank"] for e in events if e["event"] == "done") == [0, 1, 2], events  # nobody hung

    stalled = by_rank[1]
    assert stalled["type"] == "StorageUnavailable", stalled
    assert re.search(r"part \d \(bytes \d+-\d+\) of s3://\S+/ckpt-2/payload-\w+ made no progress before the retry "
                     r"deadline of 20 s passed", stalled["message"]), stalled
    assert stalled["message"].endswith("[rank 1 of 3]"), stalled
    assert holder.held and len(set(holder.held)) == 1  # one object, its parts sent again and held again

    abandoned = by_rank[0]
    assert abandoned["type"] == "StepAbandonedError", abandoned
    assert re.search(r"rank 0 stopped waiting for the shards of ranks \[1\] of 3: rank 1 failed to save its shard "
                     r"\(could not save .* part \d \(bytes \d+-\d+\) of s3://\S+/ckpt-2/payload-\w+ made no progress",
                     abandoned["message"]), abandoned  # told by rank 1's note, not at its commit_timeout
    assert by_rank[2]["event"] == "saved", by_rank[2]  # its shard went up; the step was never committed

    for rank in range(WORLD):
        with CheckpointManager(url, storage_options=s3_server.storage_options, rank=rank, world_size=WORLD,
                               commit_timeout=COMMIT_TIMEOUT, grace_seconds=GRACE, preemption=False) as mgr:
            assert mgr.steps() == [1]
            assert mgr.restore().read_bytes() == f"rank={rank} step=1".encode()
