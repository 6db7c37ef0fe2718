"""Upload progress judged per piece of the body, not per request (issue 44, item 2's remainder), through the
fault proxy on the S3 server with s3fs: a single PUT of a large object whose request the store never answers is
abandoned the stall timeout after its last piece was taken, not after the stall timeout per 8 MiB of it (24 MiB:
three times as long), so it is sent again several times before the retry deadline and then named.

Nothing here asserts how long anything took: what is asserted is what the error says (the object, each try's
bound) and how many tries the proxy saw within the deadline. The deadline and the stall timeout are both scaled by
the machine's measured slowdown, so that on a busy machine, where the body takes longer to pass the proxy, their
ratio (and so the count that tells the two judgements apart) stays as it is on an idle one.
"""

from __future__ import annotations

import math
import os
import re
import time
from typing import Any

import pytest

from _fault_proxy import fault_proxy
from helpers import slowdown
from taskpoint import Checkpoint, RetryPolicy, StorageUnavailable

#: The retry deadline and the stall timeout (seconds, on an idle machine). Judged per 8 MiB, a 24 MiB PUT would be
#: given three stall timeouts per try: at most two tries before the deadline.
DEADLINE, STALL = 10.0, 2.0
#: One object of random bytes, up as one PUT (objects of known size up to 64 MiB are).
OBJECT_BYTES = 24 << 20
pytestmark = pytest.mark.timeout(300)  # the bound of every wait: a save that hangs fails the test here


def test_a_large_put_never_answered_is_sent_again_a_stall_timeout_after_its_last_byte(s3_server: Any) -> None:
    url = f"s3://{s3_server.bucket}/upload-progress-{os.getpid()}-{time.monotonic_ns()}/big"
    held: list[str] = []

    def hold(method: str, path: str) -> bool:
        if method == "PUT" and path.endswith("/big"):
            held.append(path)
            return True
        return False

    factor = slowdown()
    deadline, stall = round(DEADLINE * factor, 1), round(STALL * factor, 1)
    with fault_proxy(s3_server.endpoint, stall_seconds=math.inf) as proxy:
        proxy.hold = hold
        options = {**s3_server.storage_options, "endpoint_url": proxy.url, "s3_client": "s3fs"}
        retry = RetryPolicy(deadline=deadline, stall_timeout=stall)
        with Checkpoint(url, storage_options=options, retry=retry) as cp, pytest.raises(StorageUnavailable) as info:
            cp.save_sync(os.urandom(OBJECT_BYTES))
        proxy.hold = None
    message = str(info.value)
    assert re.search(rf"the PUT of s3://\S+/big \({OBJECT_BYTES} bytes\) made no progress before the retry deadline "
                     rf"of {deadline:g} s passed \(\d+ tries, each abandoned after at most {stall:g} s", message), \
        message
    assert len(held) >= 3, held  # each try abandoned a stall timeout after its body was taken, then sent again
    assert not [entry for entry in proxy.log if entry[0] == "POST"]  # one PUT, no multipart upload
