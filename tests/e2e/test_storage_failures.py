"""Storage that fails in ways a happy path never shows: unreadable is not absent, uploads that fail at
``close()``, objects replaced under a ranged read, endpoints that never answer.

All failures are real: a process without the permission (``setpriv`` drops root's capabilities that bypass
permission bits), a real S3 server (moto) refusing a completion, a cuttable TCP proxy, a second writer
replacing an object, a TCP server of the test's own that accepts and never answers.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import pytest

from _faults import cuttable_proxy
from helpers import CountingRetry, slowdown, write_object
from taskpoint import Checkpoint, RetryPolicy, StorageError, StorageUnavailable
from taskpoint.storage import Location, _obstore, _s3, objectstores
from taskpoint.storage.backends import Kind

T = TypeVar("T")
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _uploads(fs: Any, path: str) -> list[dict[str, Any]]:
    bucket, _, key = path.partition("/")
    answer = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    return list(answer.get("Uploads", []))


# -- 2. unreadable is not absent ------------------------------------------------------------------------------


def test_a_path_below_a_file_is_absent_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    below = Location(str(blocker / "ckpt"))
    assert below.exists() is False
    assert below.kind() is Kind.NOTHING
    assert below.list_tree() == {}
    with Checkpoint(tmp_path / "d", blocker / "ckpt") as cp:
        assert cp.prev_exists() is False
        assert cp.load_sync() is None


_NO_DAC = "-dac_override,-dac_read_search"


def _unprivileged(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with this checkout's taskpoint in a process whose permission checks are real: root
    without the capabilities that bypass them (``setpriv`` drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), so
    a folder of mode 000 gives a real EACCES. (The interpreter lives under /root, so user nobody cannot run it.)"""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capabilities that bypass permission bits")
    result = subprocess.run(
        ["setpriv", f"--bounding-set={_NO_DAC}", f"--inh-caps={_NO_DAC}", sys.executable, "-c",
         textwrap.dedent(script), *args],
        env={**os.environ, "PYTHONPATH": SRC, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0 and result.stderr.startswith("setpriv:"):
        pytest.skip(f"setpriv cannot drop capabilities here: {result.stderr.strip()}")
    return result


@pytest.fixture
def locked() -> Iterator[Callable[[Path], None]]:
    """Makes folders unreadable (mode 000) and gives them their mode back at the end."""
    done: list[Path] = []

    def lock(folder: Path) -> None:
        os.chmod(folder, 0o000)
        done.append(folder)

    yield lock
    for folder in done:
        os.chmod(folder, 0o755)


def test_an_unreadable_checkpoint_is_an_error_for_exists_prev_exists_and_listings(tmp_path, locked):
    folder = tmp_path / "locked"
    folder.mkdir()
    Checkpoint(folder / "ckpt").save_sync(b"progress")
    (folder / "steps" / "ckpt-3").mkdir(parents=True)
    locked(folder)
    result = _unprivileged("""
        import sys
        from taskpoint import Checkpoint, RetryPolicy, StorageAccessDenied
        from taskpoint.storage import Location
        folder, seen = sys.argv[1], []
        for name, check in [
            ("exists", lambda: Location(folder + "/ckpt").exists()),
            ("kind", lambda: Location(folder + "/ckpt").kind()),
            ("list_tree", lambda: Location(folder + "/steps").list_tree()),
            ("prev_exists", lambda: Checkpoint(folder + "-dest", folder + "/ckpt").prev_exists()),
            ("load", lambda: Checkpoint(folder + "-dest2", folder + "/ckpt").load_sync()),
        ]:
            try:
                print(name, "answered", check())
            except StorageAccessDenied as exc:
                print(name, "denied", "Permission denied" in str(exc))
    """, str(folder))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == [f"{name} denied True" for name in
                                              ("exists", "kind", "list_tree", "prev_exists", "load")]


def test_a_listing_with_an_unreadable_subfolder_raises_instead_of_leaving_it_out(tmp_path, locked):
    root = tmp_path / "steps"
    for step in (1, 2):
        (root / f"ckpt-{step}").mkdir(parents=True)
        (root / f"ckpt-{step}" / "taskpoint.json").write_text("{}")
    locked(root / "ckpt-2")
    result = _unprivileged("""
        import sys
        from taskpoint import StorageAccessDenied
        from taskpoint.storage import Location
        try:
            print(sorted(Location(sys.argv[1]).list_tree()))
        except StorageAccessDenied:
            print("denied")
    """, str(root))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "denied"  # fsspec's find lists ckpt-1 only, as if ckpt-2 were empty


def test_lineage_never_skips_an_unreadable_attempt_for_an_older_one(tmp_path, locked):
    from taskpoint.runtime.lineage import ActionStore

    store = ActionStore(str(tmp_path / "root"), "run", "action", None)
    Checkpoint(store.attempt_uri(1)).save_sync(b"attempt 1")
    Checkpoint(store.attempt_uri(2)).save_sync(b"attempt 2, newer")
    locked(Path(store.prefix) / "2")  # attempt 2 cannot be read
    result = _unprivileged("""
        import sys
        from taskpoint import StorageAccessDenied
        from taskpoint.runtime.lineage import ActionStore
        store = ActionStore(sys.argv[1], "run", "action", None)
        print(store.attempts())
        try:
            print(store.resume_source(3))
        except StorageAccessDenied:
            print("denied")
    """, str(tmp_path / "root"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[1,", "2]", "denied"]  # before: attempt 1's checkpoint, silently


# -- 3. a multipart upload failing at close() is aborted ------------------------------------------------------


def test_a_completion_the_server_refuses_aborts_the_upload(s3_store, tmp_path, monkeypatch):
    # Parts of 1 MiB: S3 (and moto) refuse to complete an upload whose parts, but the last, are under 5 MiB.
    monkeypatch.setattr(_s3, "UPLOAD_PART_SIZE", 1 << 20)
    monkeypatch.setattr(_obstore, "UNKNOWN_SIZE_PART", 1 << 20)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "data.bin").write_bytes(os.urandom(3 << 20))
    dest = s3_store.url("ckpt")
    with pytest.raises(StorageError, match=r"smaller than the minimum allowed|EntityTooSmall"):  # not retried
        Checkpoint(dest, storage_options=s3_store.storage_options).save_sync(tree)
    fs = s3_store.fs()
    assert _uploads(fs, fs._strip_protocol(dest)) == []  # the upload the completion failed is not left open


def test_a_part_failing_in_flight_at_close_aborts_the_upload(s3_store, s3_server, tmp_path, monkeypatch):
    import s3fs

    # One try per request below taskpoint (s3fs's and botocore's own resends off; aiohttp still resends an
    # idempotent PUT once on a fresh connection, which the dark proxy refuses), so that the cut reaches close().
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(_obstore, "CLIENT_RETRIES", 0)  # the same for obstore
    monkeypatch.setattr(_s3, "ABORT_PAUSE", 1.0)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "data.bin").write_bytes(os.urandom(20 << 20))  # parts of 8, 8 and 4 MiB; the last sent by close()
    dest = s3_store.url("ckpt")
    with cuttable_proxy(s3_server.endpoint) as proxy:
        options = {**s3_store.storage_options, "endpoint_url": proxy.url,
                   "config_kwargs": {"retries": {"total_max_attempts": 1}}}
        stop = threading.Event()

        def heal_after_the_failure() -> None:  # the network comes back shortly after it failed, as outages do
            while not stop.is_set() and not proxy.dark:
                stop.wait(0.001)
            if stop.wait(0.3):
                return
            proxy.heal()

        healer = threading.Thread(target=heal_after_the_failure, daemon=True)
        healer.start()
        proxy.cut_after(18 << 20)  # inside the parts in flight, all of which are settled in close()
        try:
            with pytest.raises(StorageError):
                Checkpoint(dest, storage_options=options, retry=RetryPolicy(attempts=1)).save_sync(tree)
        finally:
            stop.set()
            healer.join()
    fs = s3_store.fs()
    assert _uploads(fs, fs._strip_protocol(dest)) == []


# -- 9. reads pinned to the version they began with ----------------------------------------------------------


def _gated(reader: type[Any]) -> type[Any]:
    """A subclass of a backend's ranged reader that holds every range after the first until a second writer has
    replaced the object, and records the version each reader was pinned to."""

    class Gated(reader):  # type: ignore[misc, valid-type]
        first_done, replaced, opened = threading.Event(), threading.Event(), []

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.opened.append(self.version)

        def _fetch(self, start: int, end: int) -> bytes:
            if start > 0:
                assert self.replaced.wait(60)
            data: bytes = super()._fetch(start, end)
            if start == 0:
                self.first_done.set()
            return data

    return Gated


@pytest.mark.parametrize("store", ["s3", "s3-obstore", "gcs", "azure"], indirect=True)
@pytest.mark.parametrize("form", ["raw bytes", "archive"])
def test_an_object_replaced_during_a_ranged_read_loads_as_one_version(store, tmp_path, monkeypatch, form):
    size = 40 << 20  # > 2 ranges of 8 MiB: read by the concurrent ranged reader
    if form == "raw bytes":
        versions = [os.urandom(size), os.urandom(size)]
    else:  # directory archives written by taskpoint, then placed without their record (as Flyte's are)
        versions = []
        for name in ("a", "b"):
            tree = tmp_path / name
            tree.mkdir()
            (tree / "weights.bin").write_bytes(os.urandom(size))
            Checkpoint(store.url(name), storage_options=store.storage_options).save_sync(tree)
            versions.append(store.fs().cat_file(store.fs()._strip_protocol(store.url(name))))
    src = store.url("foreign")
    write_object(src, store.storage_options, versions[0])
    backend = _obstore.ObstoreS3Backend if "s3_client" in store.storage_options else _BACKENDS[store.kind]
    gated = _gated(backend.range_reader)

    def second_writer() -> None:
        gated.first_done.wait(60)
        write_object(src, store.storage_options, versions[1])
        gated.replaced.set()

    monkeypatch.setattr(backend, "range_reader", gated)
    writer = threading.Thread(target=second_writer)
    writer.start()
    try:
        with Checkpoint(store.url("d"), src, storage_options=store.storage_options) as cp:
            loaded = cp.load_sync()
            if form == "raw bytes":
                got = loaded.read_bytes()
                assert len(got) == size
                assert got == versions[1], "a mix of two versions" if got != versions[0] else "the old version"
            else:
                want = (tmp_path / "b" / "weights.bin").read_bytes()
                assert (loaded / "weights.bin").read_bytes() == want
    finally:
        gated.replaced.set()
        writer.join()
    assert len(gated.opened) == 2 and gated.opened[0] != gated.opened[1]  # restarted once, from the new version


_BACKENDS = {"s3": objectstores.S3Backend, "gcs": objectstores.GCSBackend, "azure": objectstores.AzureBackend}


@pytest.mark.parametrize("store", ["gcs", "azure"], indirect=True)
def test_a_small_object_replaced_between_its_size_and_its_bytes_loads_as_one_version(store, monkeypatch):
    """A small object is one range pinned to the version whose size was read: replaced in between (by an object
    of another size), the read starts over from the new version instead of reading the new bytes under the
    old size (which loaded as "damaged" from GCS and Azure, 22 of 370 loads of two writers and a reader)."""
    old, new = os.urandom(300_000), os.urandom(200_000)
    src = store.url("foreign")
    write_object(src, store.storage_options, old)
    backend = _BACKENDS[store.kind]
    opened: list[str | None] = []

    class ReplacedFirst(backend.range_reader):  # type: ignore[misc, name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            opened.append(self.version)

        def _fetch(self, start: int, end: int) -> bytes:
            if len(opened) == 1:
                write_object(src, store.storage_options, new)
            data: bytes = super()._fetch(start, end)
            return data

    monkeypatch.setattr(backend, "range_reader", ReplacedFirst)
    with Checkpoint(store.url("d"), src, storage_options=store.storage_options) as cp:
        assert cp.load_sync().read_bytes() == new
    assert len(opened) == 2 and opened[0] != opened[1]  # restarted once, from the new version


def test_an_object_replaced_after_its_folder_was_listed_loads_its_new_version(remote_store):
    """adlfs answers info() from the parent's cached listing: a load after a listing read the old size and
    version of an object replaced since (on Azure: a stale ETag, so every pinned range failed)."""
    src = remote_store.url("listed/obj")
    write_object(src, remote_store.storage_options, b"old" * 1000)
    with Checkpoint(remote_store.url("d1"), src, storage_options=remote_store.storage_options) as cp:
        assert cp.load_sync().read_bytes() == b"old" * 1000
        cp._src.fs.ls(cp._src.fs._parent(cp._src.path), detail=True)  # a listing, cached by the client
    # Another process replaces the object: its client, not this one, so this client's cache is untouched.
    other, path = fsspec.core.url_to_fs(src, skip_instance_cache=True, **remote_store.fs_options)
    other.pipe_file(path, b"new!" * 2000)
    with Checkpoint(remote_store.url("d2"), src, storage_options=remote_store.storage_options) as cp:
        assert cp.load_sync().read_bytes() == b"new!" * 2000


# -- 17. an overall deadline ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _silent_server() -> Iterator[tuple[str, list[socket.socket]]]:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join()
        listener.close()
        for conn in accepted:
            conn.close()


def test_the_retry_deadline_stops_new_attempts_and_names_itself():
    runs = []

    def always_reset(deadline: object) -> None:
        runs.append(1)
        raise ConnectionResetError("reset by peer")

    policy = RetryPolicy(attempts=1000, initial_delay=0.05, max_delay=0.05, deadline=0.5)
    with pytest.raises(StorageUnavailable, match=r"retry deadline of 0\.5 s") as info:
        policy.call(always_reset, action="load", uri="s3://b/k")
    assert 2 <= len(runs) < 1000
    assert f"{len(runs)} attempts" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert RetryPolicy().deadline == 120.0
    with pytest.raises(ValueError, match="deadline"):
        RetryPolicy(deadline=0)


@pytest.mark.timeout(240)
def test_an_endpoint_that_never_answers_ends_at_the_deadline(s3_store):
    with _silent_server() as (endpoint, accepted):
        # The client's own settings (botocore: 60 s read timeout, 5 attempts; s3fs: 5 tries): without the deadline
        # one attempt of the record read lasts about 25 minutes here, and the policy allows 50 attempts.
        options = {**s3_store.storage_options, "endpoint_url": endpoint}
        # 5 s on an idle machine, times its measured slowdown (at most 12x: 60 s): enough to create the client and
        # connect before the deadline comes (a fixed 5 s was not, once, in a fresh-clone run at load ~6).
        deadline = float(math.ceil(5 * slowdown()))
        retry = CountingRetry(attempts=50, initial_delay=0.05, max_delay=0.1, deadline=deadline)
        cp = Checkpoint(s3_store.url("d"), s3_store.url("prev"), storage_options=options, retry=retry)
        with pytest.raises(StorageUnavailable, match=rf"retry deadline of {deadline:g} s") as info:
            cp.load_sync()
        assert retry.runs == ["read"]  # one attempt of the record read, cancelled when the deadline came
        # s3fs: fsspec cancels the call (FSTimeoutError); obstore: its request timeout, set to the deadline.
        timed_out = "error sending request" if "s3_client" in options else "FSTimeoutError"
        assert "1 attempts" in str(info.value) and timed_out in str(info.value)
        assert accepted  # the server really was reached, and never answered
        with pytest.raises(StorageUnavailable, match=rf"retry deadline of {deadline:g} s"):
            cp.prev_exists()
