"""Transfers that stop moving (issue 44, item 2), through the fault proxy on the S3 server: the proxy reads a
request whole and never answers it (``FaultProxy.hold``), which is what a stalled connection to a store looks
like from the client. A part or ranged read with no answer for ``RetryPolicy.stall_timeout`` is sent again; one
that never gets an answer ends the save or restore at its retry deadline with StorageUnavailable naming the
object and the part or byte range, and the previous step stays the resume point.

No test here asserts how long anything took: the deadline and the stall timeout are short so that the tests end
soon, and what is asserted is what happened (the requests the proxy held and saw again, the error's words, the
steps that exist and what they restore). The three ranks of a job stalled on one part are in
tests/e2e/test_transfer_stalls_torchrun.py.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from _fault_proxy import FaultProxy, fault_proxy
from taskpoint import CheckpointManager, RetryPolicy, StorageUnavailable
from taskpoint.storage import Location

#: The retry deadline of the saves and restores below, and the stall timeout of one transfer (seconds): a part
#: is abandoned after STALL s without an answer, several times before the deadline. Generous for the requests
#: that pass: an 8 MiB part to moto takes well under a second, also beside two CPU burners. The tests that hold
#: a request forever wait out the deadline, and those that hold it once wait out STALL.
DEADLINE, STALL = 8.0, 2.0
#: A folder of random (incompressible) bytes: its archive goes up as a multipart upload of three 8 MiB parts,
#: and comes down as three ranged GETs.
FOLDER_BYTES = 17 << 20
pytestmark = pytest.mark.timeout(300)  # the bound of every wait: a save that hangs fails the test here


def folder(path: Path, seed: int) -> Path:
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(os.urandom(FOLDER_BYTES) if seed else b"")
    (path / "seed.txt").write_text(str(seed))
    return path


def files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


class Holder:
    """Picks the requests the proxy holds: every request of ``method`` to a path containing ``part`` after the
    first ``let_through`` of them, at most ``times`` (None: forever). Records the paths it held."""

    def __init__(self, method: str, part: str, *, let_through: int, times: int | None) -> None:
        self.method, self.part, self.let_through, self.times = method, part, let_through, times
        self.seen = 0
        self.held: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, method: str, path: str) -> bool:
        if method != self.method or self.part not in path:
            return False
        with self._lock:
            self.seen += 1
            if self.seen <= self.let_through or (self.times is not None and len(self.held) >= self.times):
                return False
            self.held.append(path)
            return True


@pytest.fixture(params=["s3fs", "obstore"])
def proxied(s3_server: Any, request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, str, dict[str, Any]]]:
    """The proxy in front of the S3 server (holding nothing yet), a fresh directory URL and options through it,
    for each S3 client (obstore abandons a request whose connection brings nothing for the stall timeout
    itself, and taskpoint names the part or range its failure is about)."""
    url = f"s3://taskpoint-tests/transfer-stalls-{os.getpid()}-{time.monotonic_ns()}/steps"
    with fault_proxy(s3_server.endpoint, stall_seconds=math.inf) as proxy:
        yield proxy, url, {**s3_server.storage_options, "endpoint_url": proxy.url, "s3_client": request.param}


def manager(url: str, options: dict[str, Any]) -> CheckpointManager:
    return CheckpointManager(url, storage_options=options, preemption=False, background_process=False,
                             retry=RetryPolicy(deadline=DEADLINE, stall_timeout=STALL))


@pytest.mark.slow
def test_a_part_stalled_forever_fails_the_save_at_its_deadline_naming_the_object_and_the_part(
        proxied: tuple[FaultProxy, str, dict[str, Any]], tmp_path: Path) -> None:
    """Step 1 commits. Step 2's payload goes up in three parts; the proxy lets the first through and holds every
    other part's request, and every resend of it, forever. The save sends the held parts again every STALL
    seconds, then raises StorageUnavailable at its retry deadline naming the part, its bytes and the object.
    Nothing is committed, the upload is aborted, step 1 restores and is the newest step."""
    proxy, url, options = proxied
    one = folder(tmp_path / "one", 1)
    with manager(url, options) as mgr:
        mgr.save(one, 1)
        holder = Holder("PUT", "/ckpt-2/payload-", let_through=1, times=None)
        proxy.hold = holder
        with pytest.raises(StorageUnavailable) as info:
            mgr.save(folder(tmp_path / "two", 2), 2)
        proxy.hold = None
        message = str(info.value)
        named = re.search(r"part (\d) \(bytes (\d+)-(\d+)\) of s3://\S+/ckpt-2/payload-\w+", message)
        assert named, message
        part, first, last = (int(named.group(i)) for i in (1, 2, 3))
        size = last - first + 1  # 8 MiB parts (s3fs), 16 MiB (obstore, for a payload of unknown size)
        # Which part is held depends on which request reaches the proxy second: parts leave together.
        assert part in (1, 2, 3) and size in (8 << 20, 16 << 20) and first == (part - 1) * size
        if options.get("s3_client") == "s3fs":  # abandoned and sent again, not waited on for the whole deadline
            tries = re.search(rf"made no progress before the retry deadline of {DEADLINE:g} s passed \((\d+) tries, "
                              rf"each abandoned after at most {STALL:g} s without an answer\)", message)
            assert tries and int(tries.group(1)) >= 2, message
        assert f"retry deadline of {DEADLINE:g} s passed" in message
        assert len(set(holder.held)) == 1 and len(holder.held) >= 2  # one object's parts, each resend held too
        assert mgr.steps() == [1]
        assert files(mgr.restore()) == files(one)
        assert mgr.restored_step == 1
    uploads = Location(url, options).unfinished_uploads()
    assert uploads == [], uploads  # the failed upload was aborted


def test_a_part_stalled_once_is_sent_again_and_the_save_commits(
        proxied: tuple[FaultProxy, str, dict[str, Any]], tmp_path: Path) -> None:
    """The proxy holds one part's request forever, once; the writer abandons it after STALL seconds without an
    answer and sends the part again, which passes: the step commits and restores exactly. Before stalled
    transfers were sent again, the held part was waited on until the retry deadline and the save failed."""
    proxy, url, options = proxied
    with manager(url, options) as mgr:
        holder = Holder("PUT", "/ckpt-1/payload-", let_through=1, times=1)
        proxy.hold = holder
        data = folder(tmp_path / "one", 1)
        mgr.save(data, 1)
        assert len(holder.held) == 1 and holder.seen >= 3  # two or three parts, one of them sent twice
        assert proxy.stats()["stall"] == 1
        assert mgr.steps() == [1]
        assert files(mgr.restore(1)) == files(data)


def held_restore(proxied: tuple[FaultProxy, str, dict[str, Any]], tmp_path: Path, times: int | None
                 ) -> tuple[Path, Holder, Callable[[], Path]]:
    """Step 1 saved; a restore of it whose ranged GETs of the payload the proxy holds (after the first) ``times``
    times (None: forever)."""
    proxy, url, options = proxied
    data = folder(tmp_path / "one", 1)
    with manager(url, options) as mgr:
        mgr.save(data, 1)
    holder = Holder("GET", "/ckpt-1/payload-", let_through=1, times=times)

    def restore() -> Path:
        proxy.hold = holder
        try:
            with manager(url, options) as mgr:
                out = mgr.restore(1, tmp_path / "restored")
                assert mgr.steps() == [1]  # the stall never touched what is committed
                return out
        finally:
            proxy.hold = None

    return data, holder, restore


def test_a_ranged_read_stalled_once_is_read_again_and_the_restore_returns_the_right_bytes(
        proxied: tuple[FaultProxy, str, dict[str, Any]], tmp_path: Path) -> None:
    """The payload (20 MiB) comes down as three ranged GETs; the proxy holds one of them forever, once. It is
    abandoned after STALL seconds and read again, and the restore returns every byte, verified."""
    data, holder, restore = held_restore(proxied, tmp_path, times=1)
    assert files(restore()) == files(data)
    assert len(holder.held) == 1 and holder.seen >= 4


@pytest.mark.slow
def test_a_ranged_read_stalled_forever_fails_the_restore_at_its_deadline_naming_its_bytes(
        proxied: tuple[FaultProxy, str, dict[str, Any]], tmp_path: Path) -> None:
    """Every ranged GET of the payload but the first is held forever: the restore raises StorageUnavailable at
    its retry deadline naming a byte range and the object; a restore without the stall then returns the step."""
    data, holder, restore = held_restore(proxied, tmp_path, times=None)
    with pytest.raises(StorageUnavailable) as info:
        restore()
    message = str(info.value)
    named = re.search(r"bytes (\d+)-(\d+) of s3://\S+/ckpt-1/payload-\w+", message)
    assert named, message
    assert int(named.group(1)) % (8 << 20) == 0 and f"retry deadline of {DEADLINE:g} s passed" in message
    assert len(holder.held) >= 2
    holder.times = 0  # hold nothing more
    assert files(restore()) == files(data)


def through(server: Any, proxy: FaultProxy) -> dict[str, Any]:
    """``server``'s storage options with its endpoint replaced by the proxy's."""
    options = server.storage_options
    if "connection_string" in options:  # azurite
        options["connection_string"] = options["connection_string"].replace(server.endpoint, proxy.url)
    else:
        options["endpoint_url"] = proxy.url
    return options


@pytest.mark.parametrize("kind", ["gcs", "azure"])
def test_a_ranged_read_stalled_once_on_gcs_or_azure_is_read_again(kind: str, request: pytest.FixtureRequest,
                                                                   tmp_path: Path) -> None:
    """GCS's ranged reads (pinned to the generation) and Azure's (pinned to the ETag) share the reader: one of
    a 17 MiB object's ranged GETs is held forever, once; it is read again after STALL seconds, and the load
    returns every byte, verified."""
    from taskpoint import Checkpoint

    server = request.getfixturevalue(f"{kind}_server")
    url = f"{'gs' if kind == 'gcs' else 'az'}://taskpoint-tests/transfer-stalls-{time.monotonic_ns()}/bigobject"
    data = os.urandom(FOLDER_BYTES)
    with Checkpoint(url, storage_options=server.storage_options) as cp:
        cp.save_sync(data)
    held: list[str] = []

    def hold(method: str, path: str) -> bool:
        # GCS reads media under /download/ (its metadata GETs end with the name too); Azure's are the blob's GETs.
        ranged = method == "GET" and path.endswith("bigobject") and (kind == "azure" or "/download/" in path)
        if ranged and not held:
            held.append(path)
            return True
        return False

    with fault_proxy(server.endpoint, stall_seconds=math.inf) as proxy:
        proxy.hold = hold
        with Checkpoint(tmp_path / "unused", url, storage_options=through(server, proxy),
                        retry=RetryPolicy(deadline=DEADLINE, stall_timeout=STALL)) as cp:
            loaded = cp.load_sync()
            assert loaded is not None and loaded.read_bytes() == data
        assert len(held) == 1 and proxy.stats()["stall"] == 1
        assert sum(entry[1] == held[0] for entry in proxy.log) >= 4  # three ranges, the held one read again
