"""A store that claims conditional writes but ignores ``If-None-Match``: moto's S3 behind the project's fault proxy,
which strips the header from every request, through s3fs and through obstore.

A new ``Checkpoint``'s first save at a name on an object store sends the record's create-only write beside its
read (record.py): on such a store the create lands over the record another save wrote. The read, answered
first, shows it; the save says so and writes back what that record listed, so that no entry is lost.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from _fault_proxy import FaultProxy, fault_proxy
from helpers import wait_until
from taskpoint import Checkpoint
from taskpoint.format.records import RECORD_SUFFIX
from taskpoint.record import read_record
from taskpoint.storage import Location

#: Bound of the wait for one request to be answered before another goes (seconds): far past any answer on 127.0.0.1.
WAIT_BOUND = 60.0


def _record_after(proxy: FaultProxy, record_path: str, first: str, then: str) -> Callable[[str, str], None]:
    """A :attr:`FaultProxy.before` hook: the first ``then`` request of the record (a method) goes to the store only
    once a ``first`` request of the record has its answer, so that a test decides which of the two the store
    serves first."""
    since, held = len(proxy.log), []

    def answered() -> bool:
        return any(method == first and path.endswith(record_path) and status is not None
                   for method, path, status in proxy.requests(since))

    def before(method: str, path: str) -> None:
        if method == then and path.endswith(record_path) and not held:
            held.append(path)
            logging.getLogger(__name__).info("holding the record's %s until its %s is answered", then, first)
            assert wait_until(answered, WAIT_BOUND), f"the record's {first} was never answered"
    return before


def _record_path(dest: str, options: dict[str, Any]) -> str:
    return "/" + Location(dest, options).sibling(RECORD_SUFFIX).uri.split("://", 1)[1]


def _said_ignored(caplog: pytest.LogCaptureFixture) -> bool:
    return any("ignores conditional writes" in r.getMessage() for r in caplog.records)


def test_a_first_save_over_a_store_that_ignores_if_none_match_keeps_what_the_record_listed(s3_store, tmp_path,
                                                                                         caplog):
    dest = s3_store.url(f"ignored-{uuid.uuid4().hex}", "ckpt")
    Checkpoint(dest, storage_options=s3_store.storage_options).save_sync(b"old")
    old = read_record(Location(dest, s3_store.storage_options).sibling(RECORD_SUFFIX))
    assert old is not None and len(old.objects) == 1
    with fault_proxy(s3_store.storage_options["endpoint_url"]) as proxy:
        options = {**s3_store.storage_options, "endpoint_url": proxy.url}
        record_path = _record_path(dest, options)
        proxy.strip = ("if-none-match",)
        # The create goes to the store once the record's read, sent beside it, has its answer: the read sees the
        # record the create then replaces.
        proxy.before = _record_after(proxy, record_path, first="GET", then="PUT")
        with caplog.at_level(logging.WARNING, logger="taskpoint"):
            Checkpoint(dest, storage_options=options).save_sync(b"new")  # a new process's first save
        writes = [status for method, path, status in proxy.requests() if method == "PUT" and path == record_path]
    assert writes[:1] == [200], writes  # the create landed over the record: the store ignored the condition
    assert _said_ignored(caplog), caplog.text
    record = read_record(Location(dest, s3_store.storage_options).sibling(RECORD_SUFFIX))
    assert record is not None and len(record.objects) == 2, record
    assert old.objects[0].save_id in {o.save_id for o in record.objects}, record  # the old entry is kept
    with Checkpoint(tmp_path / "next", dest, storage_options=s3_store.storage_options) as cp:
        assert cp.load_sync().read_bytes() == b"new"  # verified against the record


def test_a_create_whose_read_sees_it_is_no_ignored_condition(s3_store, caplog):
    """At a new name on a store that honours the condition, the record's read answered after its create sees
    this save's own record: nothing is said of ignored conditions and nothing is written back."""
    dest = s3_store.url(f"honoured-{uuid.uuid4().hex}", "ckpt")
    with fault_proxy(s3_store.storage_options["endpoint_url"]) as proxy:
        options = {**s3_store.storage_options, "endpoint_url": proxy.url}
        record_path = _record_path(dest, options)
        proxy.before = _record_after(proxy, record_path, first="PUT", then="GET")
        with caplog.at_level(logging.WARNING, logger="taskpoint"):
            Checkpoint(dest, storage_options=options).save_sync(b"new")
        record_requests = [(method, status) for method, path, status in proxy.requests() if path == record_path]
    assert sorted(record_requests) == [("GET", 200), ("PUT", 200)], record_requests  # it read the save's own
    assert not _said_ignored(caplog), caplog.text
    record = read_record(Location(dest, s3_store.storage_options).sibling(RECORD_SUFFIX))
    assert record is not None and len(record.objects) == 1, record
