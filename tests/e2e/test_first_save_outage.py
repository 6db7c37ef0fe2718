"""A first save at a new name whose record create fails under a total outage raises the write's error, and the
folder check beside the create (a HEAD and a listing, record_writes.SaveState._beside) starts no attempt after it:
it is cut short, not waited out. Counted at the project's fault proxy in front of moto's S3, through s3fs.

The outage is made deterministic: every request fails. The record's PUTs and GETs get their connections cut (a
transient failure that counts against the attempts: the write fails after ``attempts``), and the check's HEADs and
listings get 503 SlowDown, which counts against the retry deadline only (30 s here): waited out, the check would
go on sending requests for the rest of that deadline after the write had failed."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from _fault_proxy import FaultProxy, fault_proxy
from taskpoint import Checkpoint, RetryPolicy, StorageUnavailable
from taskpoint.format.records import RECORD_SUFFIX

#: The policy of the save: a deadline far past the write's own time (three attempts, pauses under 0.5 s each).
RETRY = RetryPolicy(attempts=3, initial_delay=0.05, max_delay=0.5, deadline=30.0)
#: Each client call is one HTTP request (botocore does not retry on its own) ...
S3_CLIENT = {"connect_timeout": 2, "read_timeout": 3, "retries": {"total_max_attempts": 1}}
#: ... but s3fs tries a call answered 503 SlowDown this many times (its class attribute ``retries``), and one
#: attempt of the check is a HEAD (503 without a body: not retried) and a listing: at most this many requests are
#: of the attempt that may be in flight when the write fails, and ends at its own bound. (Waited out instead, the
#: check sent 66 requests after the write had failed in one run, until the 30 s deadline.)
S3FS_TRIES = 5
ONE_CHECK = 1 + S3FS_TRIES


@pytest.fixture
def outage(s3_server: Any) -> Iterator[tuple[FaultProxy, str, dict[str, Any]]]:
    """A fault proxy in front of moto that fails every request (cut: the record's, 503 SlowDown: the others), a
    new destination on it, and the storage options through it."""
    with fault_proxy(s3_server.endpoint, stall_seconds=math.inf) as proxy:
        dest = f"s3://{s3_server.bucket}/first-save-outage-{uuid.uuid4().hex}/ckpt"
        proxy.choose = lambda _method, path: "cut" if path.endswith(RECORD_SUFFIX) else "503"
        options = {**s3_server.storage_options, "endpoint_url": proxy.url, "config_kwargs": S3_CLIENT}
        yield proxy, dest, options


def test_a_failed_first_save_stops_the_folder_check_beside_its_write(outage):
    proxy, dest, options = outage
    with pytest.raises(StorageUnavailable) as raised:
        Checkpoint(dest, storage_options=options, retry=RETRY).save_sync(b"state that must not land")
    made = [(method, path) for method, path, _fault, _status, _arrived in proxy.log]
    record = [i for i, (method, path) in enumerate(made) if method == "PUT" and path.endswith(RECORD_SUFFIX)]
    check = [i for i, (method, path) in enumerate(made) if method in ("HEAD", "GET")
             and not path.endswith(RECORD_SUFFIX)]
    # The write's error, never the check's: the record's create, after its attempts.
    assert re.search(rf"could not .*{re.escape(dest + RECORD_SUFFIX)}: storage kept failing after 3 attempts",
                     str(raised.value)), str(raised.value)
    assert len(record) >= 3, made
    assert check and check[0] < record[-1], made  # the check ran beside the create
    # After the write's last request, at most the requests of the check's attempt in flight then.
    after = [made[i] for i in check if i > record[-1]]
    assert len(after) <= ONE_CHECK, made
    assert all(method != "PUT" for method, path in made if not path.endswith(RECORD_SUFFIX)), made  # nothing landed
