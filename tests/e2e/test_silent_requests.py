"""Each request to an endpoint that accepts connections and never answers ends at its client's own timeout, and
the failure says that the endpoint accepted and did not answer, on every store and client.

Measured on 127.0.0.1 against such an endpoint (tests/helpers.py, ``SilentEndpoint``), each kind of request a save
or a load sends: gcsfs ends each at its ``requests_timeout``; S3 through s3fs at botocore's read timeout (small
PUTs without ``Expect: 100-continue``, tests/e2e/test_silent_small_puts.py); obstore at its read timeout (the
location's stall timeout). Two did not, and are tested here: Azure's client waited the SDK's 60 s whatever
``read_timeout`` said (the service client taskpoint makes was made without the filesystem's timeouts), and
obstore's timed-out requests were told as "check the network" (its errors say "timed out" only in their text)."""

from __future__ import annotations

import math
import threading

import pytest

from _fault_proxy import fault_proxy
from _servers import BUCKET, azure_storage_options, gcs_storage_options
from helpers import SilentEndpoint
from taskpoint import Checkpoint, RetryPolicy, StorageUnavailable
from taskpoint.storage.location import Location

pytestmark = pytest.mark.e2e("starts a silent endpoint")

SILENT = "The endpoint accepted connections and did not answer in time"


@pytest.mark.timeout(240)
def test_an_azure_request_to_a_silent_endpoint_ends_at_the_read_timeout_it_was_given():
    silent = SilentEndpoint()
    try:
        options = {**azure_storage_options(silent.url), "connection_timeout": 1, "read_timeout": 1}
        # Below the SDK's own read timeout (60 s), above its pause before it sends a request again (15-21 s after
        # the one before failed, 1 s after it was sent): a request sent twice within it was ended by the read
        # timeout of 1 s. The save ends at the deadline (the SDK retries on): 30 s leaves 8 s above the latest
        # second send; it passed with two CPU burners beside it.
        retry = RetryPolicy(attempts=1, deadline=30)
        with pytest.raises(StorageUnavailable, match=SILENT):
            Checkpoint(f"az://{BUCKET}/ckpt", storage_options=options, retry=retry).save_sync(b"x" * 1024)
    finally:
        silent.close()
    requests = silent.requests()
    assert requests, "the client never reached the endpoint"
    again = [line for line in set(requests) if requests.count(line) > 1]
    assert again, requests  # the client gave up on a request at its read timeout and sent it again


@pytest.mark.timeout(240)
def test_an_obstore_request_to_a_silent_endpoint_is_described_as_silent(s3_server):
    silent = SilentEndpoint()
    try:
        options = {**s3_server.storage_options, "endpoint_url": silent.url, "s3_client": "obstore",
                   "config_kwargs": {"retries": {"max_attempts": 1}, "read_timeout": 1}}  # s3fs's checks
        # obstore's read timeout is the stall timeout: 1 s; the deadline is far above what two attempts take.
        retry = RetryPolicy(attempts=2, initial_delay=0.01, deadline=120, stall_timeout=1)
        with pytest.raises(StorageUnavailable, match=SILENT) as info:
            Checkpoint(f"s3://{BUCKET}/ckpt", storage_options=options, retry=retry).save_sync(b"x" * 1024)
    finally:
        silent.close()
    assert "after 2 attempts" in str(info.value)  # each ended at the client's timeout, not at the deadline
    assert silent.requests()


def _object_upload(kind: str):
    """Picks the upload of the checkpoint's object (by method and path) among a first save's requests: on Azure
    the PUT of the blob ``ckpt``; on GCS, whose uploads all go to one path, the second upload, after the
    record's create-only one."""
    if kind == "azure":
        return lambda method, path: method == "PUT" and path.endswith("/ckpt")
    uploads = 0
    lock = threading.Lock()

    def second_upload(method: str, path: str) -> bool:
        nonlocal uploads
        if method != "POST" or not path.startswith("/upload/"):
            return False
        with lock:
            uploads += 1
            return uploads == 2
    return second_upload


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["gcs", "azure"])
def test_a_small_upload_that_is_never_answered_ends_at_the_retry_deadline(kind, request):
    """The client's file sent even a small object as two requests that taskpoint's deadline could not interrupt
    (gcsfs's resumable upload, adlfs's block and block list): held, the save waited the client's timeouts times
    its retries (over 18 minutes on GCS; 324 s on Azure, whose file uploads ignored ``read_timeout``). A long
    client timeout is set here, so that nothing but the deadline can end the held request in time."""
    server = request.getfixturevalue(f"{kind}_server")
    location = server.new_location()
    with fault_proxy(server.endpoint, stall_seconds=math.inf) as proxy:
        proxy.hold = _object_upload(kind)
        options = ({**gcs_storage_options(proxy.url), "requests_timeout": 600} if kind == "gcs" else
                   {**azure_storage_options(proxy.url), "connection_timeout": 600, "read_timeout": 600})
        retry = RetryPolicy(attempts=2, initial_delay=0.01, deadline=10)
        with pytest.raises(StorageUnavailable, match=SILENT) as info:
            Checkpoint(location.url("ckpt"), storage_options=options, retry=retry).save_sync(b"x" * 1024)
        held = proxy.stats()["stall"]
    assert "retry deadline of 10 s" in str(info.value)  # the request was given the deadline, and ended at it
    assert held == 1  # the record's requests were answered; the object's one upload request was held



@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["gcs", "azure"])
def test_a_delete_that_is_never_answered_ends_at_the_retry_deadline(kind, request):
    """A delete (the manager's retention, a sweep) was the one call of an operation not given the deadline: held,
    it waited the client's timeouts times its retries (gcsfs: aiohttp's 5 minutes, six tries; Azure: the SDK's
    60 s, four tries). A long client timeout is set here, so that nothing but the deadline can end it in time."""
    server = request.getfixturevalue(f"{kind}_server")
    location = server.new_location()
    with fault_proxy(server.endpoint, stall_seconds=math.inf) as proxy:
        proxy.hold = lambda method, path: method == "DELETE"
        options = ({**gcs_storage_options(proxy.url), "requests_timeout": 600} if kind == "gcs" else
                   {**azure_storage_options(proxy.url), "connection_timeout": 600, "read_timeout": 600})
        target = Location(location.url("old"), options, RetryPolicy(attempts=2, initial_delay=0.01, deadline=10))
        with pytest.raises(StorageUnavailable, match=SILENT) as info:
            target.remove()
        held = proxy.stats()["stall"]
    assert "retry deadline of 10 s" in str(info.value)  # the delete was given the deadline, and ended at it
    assert held >= 1
