"""Every request of gcsfs has a bound of its own: where the storage options set no ``requests_timeout`` and the
retry deadline lowers none, gcsfs bounded a request by aiohttp's default alone (five minutes in all, retried five
times), so that what taskpoint's deadline cannot interrupt (a client's file upload, its discard) waited over 18
minutes for an endpoint that accepts connections and never answers (tests/e2e/test_silent_requests.py)."""

from __future__ import annotations

import pytest

from _servers import gcs_storage_options
from taskpoint import RetryPolicy
from taskpoint.storage.location import Location
from taskpoint.storage.retry import CLIENT_TIMEOUT

#: No server listens here: making a location contacts none.
NOWHERE = "http://127.0.0.1:9"


@pytest.mark.parametrize("deadline", [120.0, None], ids=["default-deadline", "no-deadline"])
def test_a_gcs_request_ends_when_its_connection_or_answer_is_silent_for_the_client_timeout(deadline):
    location = Location("gs://bucket/ckpt", gcs_storage_options(NOWHERE), RetryPolicy(deadline=deadline))
    bound = location.fs.requests_timeout
    assert (bound.sock_connect, bound.sock_read) == (CLIENT_TIMEOUT, CLIENT_TIMEOUT)
    assert bound.total is None  # a large part over a slow link that keeps moving is not cut


def test_a_gcs_requests_timeout_of_the_storage_options_or_a_short_deadline_is_kept():
    given = Location("gs://bucket/a", {**gcs_storage_options(NOWHERE), "requests_timeout": 7}, RetryPolicy())
    lowered = Location("gs://bucket/b", gcs_storage_options(NOWHERE), RetryPolicy(deadline=5))
    assert (given.fs.requests_timeout, lowered.fs.requests_timeout) == (7, 5)
