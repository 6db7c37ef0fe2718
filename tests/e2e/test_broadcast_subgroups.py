"""``restore(broadcast=True)`` where the ranks restore different steps: two pipeline stages, each with a manager of
its own, each restored by its two data-parallel replicas (4 gloo ranks under the real ``torchrun``; ranks 0 and 2
restore stage A, ranks 1 and 3 stage B). The ranks that restore the same objects split the reads between them and
exchange the bytes within a process group of their own: the store is asked for one copy of each stage's step
(counted at a proxy in front of the S3 server), and every rank's bytes are its stage's. The worker and the
torchrun job are those of tests/e2e/test_broadcast_restore.py (tests/_broadcast_job.py); every wait is bounded,
nothing asserts how long anything took.
"""

from __future__ import annotations

import hashlib
import os

import pytest

import taskpoint
from _broadcast_job import TORCHRUN, digests, phase, torchrun
from _fault_proxy import fault_proxy
from helpers import requires

#: Each stage's payload: stage A three blocks of the exchange (the last short), stage B one and a bit.
SIZES = {"a": (40 << 20) + 321, "b": (17 << 20) + 4321}
#: The stage each rank restores.
STAGE_OF_RANK = ["a", "b", "a", "b"]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun beside python"),
              requires("torch")]


def test_replicas_of_each_stage_read_its_step_once_and_exchange_it_among_themselves(s3_server):
    base = s3_server.new_location().base
    data = {stage: os.urandom(size) for stage, size in SIZES.items()}
    for stage, payload in data.items():
        with taskpoint.CheckpointManager(f"{base}/{stage}", storage_options=s3_server.storage_options) as manager:
            manager.save(payload, 1)
    directories = [f"{base}/{stage}" for stage in STAGE_OF_RANK]
    with fault_proxy(s3_server.endpoint) as shared, fault_proxy(s3_server.endpoint) as alone:
        outcomes = torchrun([phase("shared", shared, s3_server, directories, "restore", True),
                             phase("alone", alone, s3_server, directories, "restore", False)])
        served = {"shared": shared.stats()["served"], "alone": alone.stats()["served"]}
    expected = {rank: hashlib.sha256(data[stage]).hexdigest() for rank, stage in enumerate(STAGE_OF_RANK)}
    assert digests(outcomes["shared"]) == expected
    assert digests(outcomes["alone"]) == expected
    one_copy = sum(SIZES.values())
    assert one_copy <= served["shared"] <= 1.2 * one_copy, served  # each stage's step once, by its two replicas
    assert served["alone"] >= 2 * one_copy, served  # without broadcast each replica reads its stage's step itself
