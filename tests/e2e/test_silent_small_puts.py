"""A small PUT to an endpoint that accepts connections and never answers ends at the client's read timeout.

botocore adds ``Expect: 100-continue`` to every request body it can read, and aiohttp waits for the
``100 Continue`` under no client timeout: a record's PUT to such an endpoint waited out the whole retry deadline
(120 s by default) where a GET ended at the read timeout. A new ``Checkpoint``'s first save sends the record's
create-only PUT beside its read, so a user pointing taskpoint at a silent endpoint waited two minutes to hear so.
Small bodies now go without the header (``storage/_s3.py``, ``small_bodies_without_continue``)."""

from __future__ import annotations

import pytest

from helpers import SilentEndpoint
from taskpoint import Checkpoint, RetryPolicy, StorageUnavailable

pytestmark = pytest.mark.e2e("starts the S3 server")


def test_a_new_checkpoints_first_save_to_a_silent_endpoint_sends_its_small_puts_without_expect_continue(s3_store):
    silent = SilentEndpoint()
    try:
        options = {**s3_store.storage_options, "endpoint_url": silent.url,
                   "config_kwargs": {"retries": {"max_attempts": 1}, "read_timeout": 0.5}}
        # A deadline below pytest's own timeout: with the header, the PUT is held until this deadline.
        retry = RetryPolicy(attempts=2, initial_delay=0.01, deadline=90)
        with pytest.raises(StorageUnavailable, match="did not answer in time"):
            Checkpoint(s3_store.url("ckpt"), storage_options=options, retry=retry).save_sync(b"x" * 1024)
    finally:
        silent.close()
    puts = [head for head in silent.heads if head.startswith("PUT ")]
    assert puts, silent.heads  # the record's create-only PUT went out beside its read
    assert not [head for head in puts if "expect: 100-continue" in head.lower()], puts
