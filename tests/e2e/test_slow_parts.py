"""A slow part is not a stalled one (issue 44, item 2): through the fault proxy on the S3 server, one part of an
upload goes up far below loopback speed for longer than the stall timeout, but it moves the whole time, faster than
the stall rule's floor. It is neither abandoned nor sent again, and the save commits.

The floor, for the stall timeout ``STALL`` here: s3fs's writer counts each piece of the body the HTTP client takes
as progress, and after the last piece the bytes still in the socket's buffers (up to the kernel's send buffer,
4 MiB here) must reach the store within ``STALL`` (4 MiB / 60 s, about 70 KB/s, at the default stall timeout).
The part below moves at :data:`RATE`, above that floor, and takes longer than ``STALL``. What is asserted is what
the proxy saw (one try of each part, every answer 200) and what the log says; the one duration checked is the
test's premise (the save outlasted ``STALL``), which a busy machine only makes truer.

s3fs only: obstore's requests are given ``STALL`` per 8 MiB whatever they move (its read timeout,
:mod:`taskpoint.storage.stalls`), so a part of 8 MiB that takes longer than ``STALL`` is below obstore's floor
(8 MiB / ``STALL``) and is abandoned, as documented; no part of it can be both slower than ``STALL`` and above it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from _fault_proxy import fault_proxy
from taskpoint import CheckpointManager, RetryPolicy

#: The stall timeout of the saves below (seconds), short so that the test stays short; the retry deadline is
#: generous: the slow part alone takes PART / RATE.
STALL, DEADLINE = 3.0, 120.0
#: The rate (bytes per second) of the slow part: its 8 MiB take about 4.2 s, longer than STALL, and the send
#: buffer's 4 MiB drain in 2.1 s, within it (the floor is 4 MiB / STALL, 1.4 MB/s).
RATE = 2e6
#: Incompressible bytes whose archive goes up in three parts of 8 MiB or less.
FOLDER_BYTES = 17 << 20
PART = 8 << 20
pytestmark = pytest.mark.timeout(300)  # the bound of every wait: a save that hangs fails the test here


class SlowParts:
    """Slows every PUT of the step's payload (its two full 8 MiB parts and the small last one) to :data:`RATE`. Not
    only the first to arrive: parts in flight arrive in any order, the proxy sees no part number, and the first was
    sometimes the small last part, which the slow rate sends well within the stall timeout (the test then tested
    nothing: 1 run in 4 on a quiet machine)."""

    def __init__(self) -> None:
        self.slowed: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, method: str, path: str) -> float | None:
        if method != "PUT" or "/ckpt-1/payload-" not in path:
            return None
        with self._lock:
            self.slowed.append(path)
        return RATE


def test_a_part_that_moves_slowly_for_longer_than_the_stall_timeout_is_kept_and_the_save_commits(
        s3_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"s3://{s3_server.bucket}/slow-parts-{uuid.uuid4().hex}/steps"
    data = tmp_path / "data"
    data.mkdir()
    (data / "weights.bin").write_bytes(os.urandom(FOLDER_BYTES))
    with fault_proxy(s3_server.endpoint, stall_seconds=math.inf) as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        slow = SlowParts()
        proxy.slow = slow
        since = len(proxy.log)
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="taskpoint"), CheckpointManager(
                url, storage_options=options, preemption=False, background_process=False,
                retry=RetryPolicy(deadline=DEADLINE, stall_timeout=STALL)) as manager:
            manager.save(data, 1)
            took = time.monotonic() - began
            parts = [(method, status) for method, path, status in proxy.requests(since)
                     if method == "PUT" and "/ckpt-1/payload-" in path]
            assert manager.steps() == [1]
            restored = manager.restore(1, tmp_path / "restored")
        assert (restored / "weights.bin").read_bytes() == (data / "weights.bin").read_bytes()
    assert slow.slowed, "the proxy slowed no part: the test tested nothing"
    assert took > STALL, f"the save took {took:.1f} s, no longer than the stall timeout: the test tested nothing"
    assert parts == [("PUT", 200)] * math.ceil(FOLDER_BYTES / PART), parts  # each part sent once, answered 200
    assert proxy.stats()["stall"] == 0 and proxy.stats()["reset"] == 0
    assert "made no progress" not in caplog.text, caplog.text
