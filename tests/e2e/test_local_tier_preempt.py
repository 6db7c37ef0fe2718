"""The emergency step of a manager with a local tier (issue 24, item 4) when the promotion in flight at the notice
cannot finish within the grace: the emergency step goes to the remote tier without waiting for it, and the
promotion still commits whole afterwards (or, cut short by the end of the process, never).

A real S3 server behind a real proxy that throttles the promotion's upload; the notice's deadline is the moment
it arrives (no grace left), so nothing here depends on how long anything takes."""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid

import pytest

import taskpoint
from _fault_proxy import fault_proxy
from helpers import wait_until
from taskpoint import CheckpointManager, preemption
from test_local_tier import fresh  # noqa: F401  (the fixture)


def test_the_emergency_step_does_not_wait_past_the_grace_for_the_promotion_in_flight(
        fresh, s3_server, tmp_path, caplog):  # noqa: F811
    remote = f"s3://taskpoint-tests/local-tier-preempt-{uuid.uuid4().hex}"
    promoted = os.urandom(16 << 20)
    with fault_proxy(s3_server.endpoint, throttle=256 << 10) as proxy:  # 16 MiB: about a minute through it
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        with caplog.at_level(logging.WARNING, logger="taskpoint"), CheckpointManager(
                remote, storage_options=options, local_dir=tmp_path / "local", remote_every=2,
                on_preemption=lambda: b"emergency") as m:
            m.save(b"one", 1)
            m.save(promoted, 2)
            # its promotion is in flight when the notice arrives: the upload of its payload has begun
            assert wait_until(lambda: any(method in ("PUT", "POST") and "/ckpt-2/payload-" in path
                                          for method, path, *_ in list(proxy.log)), 60)
            preemption.notify(signal.SIGUSR1, deadline=time.time())  # no grace left to wait for it
            with pytest.raises(taskpoint.Preempted) as caught:
                m.save(b"never saved", 3)
            assert caught.value.step == 3
            assert m.steps(tier="remote") == [3] and m.steps(tier="local") == [1, 2]
            assert any("did not finish within its share of the grace" in r.getMessage() for r in caplog.records)
            proxy.throttle = None  # the promotion goes on in the background, and close() waits for it
    with CheckpointManager(remote, storage_options=s3_server.storage_options, preemption=False) as other:
        assert other.steps() == [2, 3]  # the promotion committed whole after the emergency step
        assert other.restore(3).read_bytes() == b"emergency"
        assert other.restore(2).read_bytes() == promoted
        assert other.verify().healthy
