"""Few round trips (issue 44 item 3): the requests a small save and a restore make, counted at the project's fault
proxy in front of moto's S3, through s3fs and through obstore (SeaweedFS, a real store, where a conditional
create decides).

A real store answers in 5-30 ms, so each request a small operation waits on is its time: a small manager save
is two PUTs (the payload, then the manifest created only where there is none: no read before, no HEAD after),
a restore of the newest step is the listing and two GETs (its restore lease written on a thread of its own, off
the restore's path), a small ``Checkpoint.save_sync`` at a name saved to before is two PUTs (the record,
then the object), and at a new name two round trips (the record's create, beside its read and the check that the
name is no folder; the object). A first save of a process at a name with a record is three (those four requests,
the create refused; the record over the version read; the object). A reader that may not write restores with one
warning that it took no lease.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

from _fault_proxy import FaultProxy, fault_proxy
from helpers import wait_until
from taskpoint import Checkpoint, CheckpointManager
from taskpoint.format.records import RECORD_SUFFIX

#: The stores: moto through s3fs and through obstore, and SeaweedFS (which enforces conditional writes).
_SERVER = {"s3": "s3_server", "s3-obstore": "s3_server", "s3-seaweed": "seaweed_server"}
_LEASE = re.compile(r".*/restore-[0-9a-f]{32}\.json")
_WRITES = ("PUT", "POST", "DELETE")
#: Bound of every poll in these tests (seconds): far past any request's answer on 127.0.0.1.
WAIT_BOUND = 60.0
#: How long the proxy holds the listing it holds before it drops the connection (the client then asks again).
STALL = 2.0


@pytest.fixture(params=["s3", "s3-obstore"])
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, str, dict[str, Any]]]:
    """A fault proxy in front of the store, a fresh directory URL on it, and the storage options through it."""
    with _proxied(request, request.param) as (proxy, url, options, _):
        yield proxy, url, options


@contextlib.contextmanager
def _proxied(request: pytest.FixtureRequest, kind: str) -> Iterator[tuple[FaultProxy, str, dict[str, Any], Any]]:
    server = request.getfixturevalue(_SERVER[kind])
    with fault_proxy(server.endpoint, stall_seconds=math.inf) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        if kind == "s3-obstore":
            options["s3_client"] = "obstore"
        yield proxy, f"s3://{server.bucket}/round-trips-{uuid.uuid4().hex}", options, server


def _names(server: Any, url: str, step: int) -> list[str]:
    """The names in a step's folder, listed straight from the store (not through the proxy)."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options)
    return sorted(path.rsplit("/", 1)[-1] for path in fs.find(f"{url}/ckpt-{step}"))


def _methods(requests: list[tuple[str, str, int | None]]) -> list[str]:
    return [f"{method} {path.rsplit('/', 1)[-1]}" for method, path, _ in requests]


def test_a_small_manager_save_is_two_puts(proxied):
    """The payload PUT, then the manifest's conditional create: no manifest GET before, no HEAD after."""
    proxy, url, options = proxied
    manager = CheckpointManager(url, storage_options=options)
    manager.save(b"x" * 100, 1)  # the first save also lists the directory once, after its commit (retention)
    since = len(proxy.log)
    manager.save(b"y" * 100, 2)
    made = proxy.requests(since)
    assert [method for method, _, _ in made] == ["PUT", "PUT"], _methods(made)
    assert made[0][1].rsplit("/", 1)[-1].startswith("payload-") and made[1][1].endswith("/ckpt-2/taskpoint.json")
    assert manager.restore().read_bytes() == b"y" * 100


@pytest.mark.parametrize("kind", ["s3", "s3-seaweed"])
def test_saving_a_step_another_writer_committed_raises_and_keeps_its_bytes(request, kind):
    """Without a read before the save, the conditional create of the manifest finds the step: FileExistsError,
    the other writer's step intact, and the payload this save stored removed."""
    with _proxied(request, kind) as (proxy, url, options, server):
        first = CheckpointManager(url, storage_options=options)
        first.save(b"the first writer's", 5)
        second = CheckpointManager(url, storage_options=options)
        since = len(proxy.log)
        with pytest.raises(FileExistsError, match="step 5 already exists"):
            second.save(b"the second writer's", 5)
        assert "GET taskpoint.json" not in _methods(proxy.requests(since))[:1]  # the save read nothing first
        assert second.restore(5).read_bytes() == b"the first writer's"
        assert len([name for name in _names(server, url, 5) if name.startswith("payload-")]) == 1
        second.save(b"overwritten", 5, overwrite=True)
        assert first.restore(5).read_bytes() == b"overwritten"


def test_a_manifest_create_whose_answer_was_cut_commits_the_step(proxied):
    """The manifest's create lands but its answer is cut: the retry meets the landed manifest, the same save's,
    and the step is committed (not refused as another writer's)."""
    proxy, url, options = proxied
    cut: list[str] = []

    def cut_first_manifest_put(method: str, path: str) -> str | None:
        if method == "PUT" and path.endswith("/ckpt-3/taskpoint.json") and not cut:
            cut.append(path)
            return "cut"
        return None

    manager = CheckpointManager(url, storage_options=options)
    proxy.choose = cut_first_manifest_put
    manager.save(b"committed once", 3)
    proxy.choose = None
    assert cut, "the proxy cut no manifest write"
    assert CheckpointManager(url, storage_options=options).restore().read_bytes() == b"committed once"


def test_restoring_the_newest_step_waits_on_the_listing_and_two_gets(proxied):
    """The listing, the manifest GET and the payload GET; the restore lease's PUT is held at the proxy forever
    and the restore returns all the same (the lease is off its path)."""
    proxy, url, options = proxied
    CheckpointManager(url, storage_options=options).save(b"z" * 100, 7)
    proxy.hold = lambda method, path: method == "PUT" and bool(_LEASE.fullmatch(path))
    reader = CheckpointManager(url, storage_options=options)
    since = len(proxy.log)
    assert reader.restore().read_bytes() == b"z" * 100
    made = proxy.requests(since)
    path = [request for request in made if not _LEASE.fullmatch(request[1])]
    assert [method for method, _, _ in path] == ["GET", "GET", "GET"], _methods(made)
    assert path[1][1].endswith("/ckpt-7/taskpoint.json") and "/ckpt-7/payload-" in path[2][1]
    leases = [(method, status) for method, p, status in made if _LEASE.fullmatch(p)]
    assert leases == [("PUT", None)], f"the restore waited on its lease: {leases}"  # one try, still unanswered


def test_a_restore_takes_its_lease_and_removes_it(proxied, s3_server):
    """Off the path, the lease is still written, and removed by the time the restore returns."""
    proxy, url, options = proxied
    manager = CheckpointManager(url, storage_options=options)
    manager.save(b"leased", 8)
    since = len(proxy.log)
    assert manager.restore().read_bytes() == b"leased"
    leases = [(method, status) for method, path, status in proxy.requests(since) if _LEASE.fullmatch(path)]
    assert leases == [("PUT", 200), ("DELETE", 204)], leases
    assert [name for name in _names(s3_server, url, 8) if name.startswith("restore-")] == []


def test_a_reader_that_may_not_write_restores_with_one_warning(proxied):
    """Every write answered 403 AccessDenied: restores return the right bytes, and one warning says that no
    lease could be taken."""
    proxy, url, options = proxied
    CheckpointManager(url, storage_options=options).save(b"read only", 9)
    proxy.choose = lambda method, path: "403" if method in _WRITES else None
    reader = CheckpointManager(url, storage_options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def told() -> list[str]:
            return [str(w.message) for w in caught if "without restore leases" in str(w.message)]

        assert reader.restore().read_bytes() == b"read only"
        assert wait_until(told, WAIT_BOUND), "no warning that the lease was refused"  # (maybe from its thread)
        assert reader.restore(9).read_bytes() == b"read only"
        assert wait_until(_no_lease_threads, WAIT_BOUND), "the second lease's thread did not end"
    assert len(told()) == 1, [str(w.message) for w in caught]
    assert proxy.stats()["403"] >= 1


def _no_lease_threads() -> bool:
    return not any(thread.name == "taskpoint-restore-lease" for thread in threading.enumerate())


def test_a_small_checkpoint_save_again_is_two_puts(proxied):
    """``Checkpoint.save_sync(1 KiB)`` at a name this checkpoint saved to before: the record's PUT, then the
    object's."""
    proxy, url, options = proxied
    checkpoint = Checkpoint(f"{url}/ckpt", storage_options=options)
    checkpoint.save_sync(b"a" * 1024)
    since = len(proxy.log)
    checkpoint.save_sync(b"b" * 1024)
    made = proxy.requests(since)
    assert [method for method, _, _ in made] == ["PUT", "PUT"], _methods(made)
    assert Checkpoint(f"{url}/other", f"{url}/ckpt", storage_options=options).load_sync().read_bytes() == b"b" * 1024


def _record_put_came(proxy: FaultProxy, since: int, record: str) -> bool:
    return any(method == "PUT" and path.endswith(record) for method, path, _ in proxy.requests(since))


def test_a_first_small_checkpoint_save_sends_the_record_with_the_folder_check(proxied):
    """``Checkpoint.save_sync(1 KiB)`` at a new name: the record's GET, its create, the destination's HEAD and the
    listing under it go together (the listing is held at the proxy until the record's PUT has come, which it
    does); then the object's PUT."""
    proxy, url, options = proxied
    checkpoint = Checkpoint(f"{url}/first", storage_options=options)
    record = f"/first{RECORD_SUFFIX}"
    held: list[str] = []

    def hold_the_listing(method: str, path: str) -> bool:
        if method == "GET" and "/" not in path.strip("/") and not held:  # the bucket's listing, once
            held.append(path)
            return True
        return False

    proxy.stall_seconds = STALL
    proxy.hold = hold_the_listing
    since = len(proxy.log)
    saving = threading.Thread(target=checkpoint.save_sync, args=(b"c" * 1024,), daemon=True)
    saving.start()
    assert wait_until(lambda: _record_put_came(proxy, since, record), WAIT_BOUND), \
        "the record's PUT waited for the folder check"
    saving.join(WAIT_BOUND)
    assert not saving.is_alive()
    answered = [(method, path) for method, path, status in proxy.requests(since) if status is not None]
    assert sorted(method for method, _ in answered[:4]) == ["GET", "GET", "HEAD", "PUT"], answered
    assert [path for _, path in answered[:4] if path.endswith(record)], answered  # the record's GET and PUT
    assert len(answered) == 5 and answered[4][0] == "PUT" and answered[4][1].endswith("/first"), answered
    assert Checkpoint(f"{url}/other", f"{url}/first", storage_options=options).load_sync().read_bytes() == b"c" * 1024


def test_a_first_small_checkpoint_save_is_two_round_trips(proxied):
    """``Checkpoint.save_sync(1 KiB)`` at a new name waits on no answer to the record's GET: with that GET held at
    the proxy, the record's create (no record was there), the folder check and then the object's PUT all go out
    and are answered. The save waits for the GET's end only after that (it is released then)."""
    proxy, url, options = proxied
    checkpoint = Checkpoint(f"{url}/new", storage_options=options)
    record = f"/new{RECORD_SUFFIX}"
    held: list[str] = []

    def hold_the_records_read(method: str, path: str) -> bool:
        if method == "GET" and path.endswith(record) and not held:
            held.append(path)
            return True
        return False

    def object_stored() -> bool:
        return any(method == "PUT" and path.endswith("/new") and status == 200
                   for method, path, status in proxy.requests(since))

    proxy.hold = hold_the_records_read
    since = len(proxy.log)
    saving = threading.Thread(target=checkpoint.save_sync, args=(b"n" * 1024,), daemon=True)
    saving.start()
    try:
        assert wait_until(object_stored, WAIT_BOUND), f"the object's PUT waited: {proxy.requests(since)}"
        before = [(method, path, status) for method, path, status in proxy.requests(since)]
    finally:
        proxy.stall_seconds = 0  # the held GET's connection closes; its retry is answered
        saving.join(WAIT_BOUND)
    assert not saving.is_alive()
    assert held, "the save sent no GET of its record"
    assert [status for method, path, status in before if method == "GET" and path.endswith(record)] == [None], before
    assert [status for method, path, status in before if method == "PUT" and path.endswith(record)] == [200], before
    assert sorted(method for method, path, _ in before if not path.endswith(record)) == \
        ["GET", "HEAD", "PUT"], before  # the listing, the HEAD, the object
    assert Checkpoint(f"{url}/other", f"{url}/new", storage_options=options).load_sync().read_bytes() == b"n" * 1024


def test_a_first_save_of_a_process_at_a_name_with_a_record_is_three_round_trips(proxied):
    """A new ``Checkpoint`` (as a new process) saving 1 KiB where a record is: the record's GET, its create (refused,
    412), the HEAD and the listing go out together; then the record over the version the GET read; then the
    object's PUT. Six requests, three waited on in a row (two more than when the GET came first: the refused
    create and the folder check)."""
    proxy, url, options = proxied
    Checkpoint(f"{url}/again", storage_options=options).save_sync(b"d" * 1024)
    record = f"/again{RECORD_SUFFIX}"
    since = len(proxy.log)
    Checkpoint(f"{url}/again", storage_options=options).save_sync(b"e" * 1024)
    made = proxy.requests(since)
    assert len(made) == 6, _methods(made)
    on_record = [(method, status) for method, path, status in made if path.endswith(record)]
    assert sorted(on_record) == [("GET", 200), ("PUT", 200), ("PUT", 412)], made
    assert on_record.index(("GET", 200)) < on_record.index(("PUT", 200)), made  # written over what the GET read
    assert on_record.index(("PUT", 412)) < on_record.index(("PUT", 200)), made
    assert sorted(method for method, path, _ in made[:-1] if not path.endswith(record)) == ["GET", "HEAD"], made
    assert made[-1][0] == "PUT" and made[-1][1].endswith("/again") and made[-1][2] == 200, made
    assert Checkpoint(f"{url}/other", f"{url}/again", storage_options=options).load_sync().read_bytes() == b"e" * 1024
