"""SeaweedFS, the suite's real S3 server: it enforces conditional writes, and atomically, so that the tests of
what rests on them (records, leases, the chunk epoch) prove something there; and taskpoint's record writes
racing on it never both land.

moto checks ``If-Match`` and then puts, in two steps: two writers holding the same ETag can both succeed there.
If a future SeaweedFS stopped enforcing conditions, the first tests here fail, rather than every test on
``s3-seaweed`` silently proving no more than moto does.
"""

from __future__ import annotations

import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from _servers import BUCKET, S3_KEY, S3_REGION, S3_SECRET, RunningServer, StoreLocation
from taskpoint import Checkpoint
from taskpoint.storage import Location
from taskpoint.storage.streams import VersionConflict

#: Writers racing at once on one key (more than the two of a typical clash), on each of ``KEYS`` keys at once.
#: SeaweedFS queues the losers of a clash on a lock it retries once a second: the keys race side by side so
#: that those waits overlap.
WRITERS = 6
KEYS = 8
TIMEOUT = 60
SEAWEED = pytest.mark.parametrize("store", ["s3-seaweed"], indirect=True)


@pytest.fixture
def client(seaweed_server: RunningServer) -> Any:
    """A boto3 S3 client of the SeaweedFS server: one try per call (a refusal is never retried away)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=seaweed_server.endpoint, aws_access_key_id=S3_KEY,
                        aws_secret_access_key=S3_SECRET, region_name=S3_REGION,
                        config=Config(retries={"max_attempts": 1, "mode": "standard"},
                                      max_pool_connections=WRITERS * KEYS))


def _refusal(call: Callable[[], Any]) -> str:
    """The error code with which ``call`` (a PUT) is refused; fails the test if it is accepted."""
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as refused:
        call()
    return str(refused.value.response["Error"]["Code"])


def test_seaweedfs_refuses_if_none_match_on_an_existing_key_and_if_match_on_another_etag(client):
    key = f"conditions/{uuid.uuid4().hex}"
    first = client.put_object(Bucket=BUCKET, Key=key, Body=b"first", IfNoneMatch="*")["ETag"]
    assert _refusal(lambda: client.put_object(Bucket=BUCKET, Key=key, Body=b"x", IfNoneMatch="*")) == \
        "PreconditionFailed"
    other = '"' + "0" * 32 + '"'
    assert _refusal(lambda: client.put_object(Bucket=BUCKET, Key=key, Body=b"x", IfMatch=other)) == \
        "PreconditionFailed"
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"first"  # neither refused PUT landed
    second = client.put_object(Bucket=BUCKET, Key=key, Body=b"second", IfMatch=first)["ETag"]
    assert second != first
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"second"
    assert _refusal(lambda: client.put_object(Bucket=BUCKET, Key=key, Body=b"x", IfMatch=first)) == \
        "PreconditionFailed"  # the ETag that was current a moment ago is stale now


def _race(keys: int, writers: int, attempt: Callable[[int, int], bool]) -> list[list[int]]:
    """Run ``attempt(key, writer)`` for every writer of every key at once (released together by a barrier);
    for each key, the writers that won."""
    barrier = threading.Barrier(keys * writers)
    won: list[list[int]] = [[] for _ in range(keys)]
    errors: list[BaseException] = []

    def run(key: int, writer: int) -> None:
        try:
            barrier.wait(TIMEOUT)
            if attempt(key, writer):
                won[key].append(writer)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k, w)) for k in range(keys) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert errors == []
    return won


@pytest.mark.parametrize("condition", ["If-Match", "If-None-Match"])
def test_of_writers_racing_with_the_same_condition_exactly_one_wins(client, condition):
    """The check and the PUT are one step on the server: of writers that all saw the same ETag (or no object),
    one replaces it and every other is refused, and the object holds the winner's bytes."""
    from botocore.exceptions import ClientError

    keys = [f"race/{uuid.uuid4().hex}" for _ in range(KEYS)]
    conditions = []
    for key in keys:
        if condition == "If-Match":
            conditions.append({"IfMatch": client.put_object(Bucket=BUCKET, Key=key, Body=b"base")["ETag"]})
        else:
            conditions.append({"IfNoneMatch": "*"})

    def attempt(key: int, writer: int) -> bool:
        try:
            client.put_object(Bucket=BUCKET, Key=keys[key], Body=f"writer {writer}".encode(), **conditions[key])
        except ClientError as exc:
            assert exc.response["Error"]["Code"] in ("PreconditionFailed", "ConditionalRequestConflict")
            return False
        return True

    won = _race(KEYS, WRITERS, attempt)
    assert [len(w) for w in won] == [1] * KEYS, won
    for key, (winner,) in zip(keys, won, strict=True):
        assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == f"writer {winner}".encode()


@SEAWEED
def test_taskpoint_record_writes_racing_on_one_version_land_once(store: StoreLocation):
    """taskpoint's conditional write of a record (``Location.write_versioned``, with its retries): of writers
    that read the same version, one lands and every other gets ``VersionConflict``."""
    locations = [Location(store.url(f"race-{k}.taskpoint.json"), store.storage_options) for k in range(KEYS)]
    versions = [loc.write_versioned(b"{}", None) for loc in locations]
    assert None not in versions

    def attempt(key: int, writer: int) -> bool:
        try:
            locations[key].write_versioned(f'{{"writer": {writer}}}'.encode(), versions[key])
        except VersionConflict:
            return False
        return True

    won = _race(KEYS, WRITERS, attempt)
    assert [len(w) for w in won] == [1] * KEYS, won
    for loc, (winner,) in zip(locations, won, strict=True):
        assert loc.read_small() == f'{{"writer": {winner}}}'.encode()


@SEAWEED
def test_saves_racing_on_one_record_keep_every_entry(store: StoreLocation):
    """The record protocol over those writes: savers that all read the record at once and then list their new
    object in it at once each land their entry on top of the others' (a conflict: read again, keep theirs),
    so the record lists every save and none was dropped by a writer that won without seeing it."""
    from taskpoint.format.records import RECORD_SUFFIX, ObjectRecord, Record
    from taskpoint.record import read_record
    from taskpoint.record_writes import SaveState, read_versioned

    dest = store.url("ckpt")
    record_loc = Location(dest, store.storage_options).sibling(RECORD_SUFFIX)
    Checkpoint(dest, storage_options=store.storage_options).save_sync(b"first")
    stored, version = read_versioned(record_loc)
    assert stored is not None and version is not None
    writers = 6  # within the entries a record keeps for recent saves
    entries = [ObjectRecord(kind="bytes", codec="raw", save_id=uuid.uuid4().hex, created=stored.objects[0].created
                            + 1 + i, size=100 + i, crc32=f"{i:08x}") for i in range(writers)]

    def attempt(_: int, writer: int) -> bool:
        state = SaveState(record_loc, stored, version)  # what each saver read: the same version
        state.write(lambda record: record.with_new(entries[writer], sweep=False), action="record")
        return True

    (landed,) = _race(1, writers, attempt)
    assert sorted(landed) == list(range(writers))  # each write landed, after reading the others' on a conflict
    final = read_record(record_loc)
    assert isinstance(final, Record)
    assert {e.save_id for e in entries} <= {o.save_id for o in final.objects}, final
    assert stored.objects[0].save_id in {o.save_id for o in final.objects}


@SEAWEED
def test_checkpoint_saves_and_loads_round_trip_verified(store: StoreLocation, tmp_path):
    """The plain path on a server that checks signatures and ETags: a second save (If-Match on the record's
    ETag) and a load verified against the record, with no warning."""
    dest = store.url("ckpt")
    for data in (b"one", b"two" * 1000):
        Checkpoint(dest, storage_options=store.storage_options).save_sync(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpoint(tmp_path / "next", dest, storage_options=store.storage_options) as cp:
            loaded = cp.load_sync()
            assert loaded is not None and loaded.read_bytes() == b"two" * 1000
