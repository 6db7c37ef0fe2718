"""The ``taskpoint`` logger: one INFO record per save and load with its figures, DEBUG for retries and sweeps,
``manager.last_save``, and no storage option or credential in any record."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import fsspec
import pytest

import taskpoint
from taskpoint import Checkpoint, CheckpointManager, RetryPolicy
from taskpoint._log import TransferStats, safe_uri

SECRET_KEY = "AKIATPSECRETKEY7Q3Z"
SECRET = "tp-SECRET-do-not-log-8f3a9c"


class Capture(logging.Handler):
    """Every record the ``taskpoint`` logger emits, at DEBUG, with the thread it came from."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def transfers(self) -> list[TransferStats]:
        return [r.transfer for r in self.records if r.levelno == logging.INFO and hasattr(r, "transfer")]

    def debug(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.DEBUG]


@pytest.fixture
def captured() -> Iterator[Capture]:
    logger = logging.getLogger("taskpoint")
    handler, level = Capture(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def stored_size(url: str, options: dict) -> int:
    fs, path = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    return int(fs.size(path))


def test_the_logger_is_silent_by_default():
    logger = logging.getLogger("taskpoint")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    assert taskpoint.Checkpoint  # importing taskpoint set it up


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_checkpoint_save_and_load_log_one_record_each_with_their_figures(kind, request, tmp_path, captured):
    store = request.getfixturevalue("s3_server").new_location() if kind == "s3" else None
    base = store.url("run") if store else str(tmp_path / "store")
    options = store.storage_options if store else {}
    data = os.urandom(300_000)
    with Checkpoint(f"{base}/1/ckpt", storage_options=options) as cp:
        cp.save_sync(data)
    with Checkpoint(f"{base}/2/ckpt", f"{base}/1/ckpt", storage_options=options) as cp:
        assert cp.load_sync().read_bytes() == data
    save, load = captured.transfers()
    size = stored_size(f"{base}/1/ckpt", options)
    assert size == len(data)
    assert (save.operation, save.uri, save.kind, save.bytes) == ("save", f"{base}/1/ckpt", "bytes", size)
    assert save.step is None
    assert (load.operation, load.uri, load.kind, load.bytes) == ("load", f"{base}/1/ckpt", "bytes", size)
    for stats in (save, load):
        assert 0 < stats.blocked_seconds == stats.total_seconds < 60  # a blocking call: blocked the whole time
        assert stats.mb_per_s == pytest.approx(size / 1e6 / stats.total_seconds)
    infos = [r.getMessage() for r in captured.records if r.levelno == logging.INFO]
    assert len(infos) == 2 and f"{size} bytes" in infos[0] and "MB/s" in infos[1]


def test_directory_load_counts_the_stored_archive(tmp_path, captured):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "w.bin").write_bytes(os.urandom(200_000))
    with Checkpoint(tmp_path / "c", tmp_path / "c") as cp:
        cp.save_sync(tree)
        cp.load_sync()
    save, load = captured.transfers()
    assert save.kind == load.kind == "directory"
    assert save.bytes == load.bytes == (tmp_path / "c").stat().st_size


def test_manager_blocking_save_sets_last_save_and_logs_it(tmp_path, captured):
    with CheckpointManager(tmp_path / "m") as manager:
        assert manager.last_save is None
        manager.save(b"x" * 50_000, 3)
        stats = manager.last_save
        assert stats is not None and captured.transfers() == [stats]
        assert (stats.operation, stats.kind, stats.step, stats.uri) == ("save", "bytes", 3, f"{tmp_path}/m/ckpt-3")
        payload = next(p for p in (tmp_path / "m" / "ckpt-3").iterdir() if p.name.startswith("payload-"))
        assert stats.bytes == payload.stat().st_size == 50_000
        assert stats.blocked_seconds == stats.total_seconds
        manager.restore(3)
        load = captured.transfers()[-1]
        assert (load.operation, load.step, load.bytes, load.kind) == ("load", 3, 50_000, "bytes")


@pytest.mark.e2e("starts a save process")
def test_background_save_logs_when_it_commits_with_the_time_the_caller_was_blocked(store, tmp_path, captured):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "w.bin").write_bytes(os.urandom(4_000_000))
    with CheckpointManager(store.url("m"), storage_options=store.storage_options, async_save=True) as manager:
        called = time.perf_counter()
        manager.save(tree, 1)
        returned = time.perf_counter() - called
        manager.wait_until_finished()
        stats = manager.last_save
    assert stats is not None and stats.step == 1 and stats.kind == "directory"
    assert stats.blocked_seconds <= returned + 0.001  # what the call cost the caller, not the upload
    assert stats.blocked_seconds < stats.total_seconds
    record = next(r for r in captured.records if getattr(r, "transfer", None) == stats)
    assert record.thread != threading.get_ident()  # logged by the save itself, at its commit
    assert stats.bytes == stored_size(f"{store.url('m')}/ckpt-1/{_payload(store, 1)}", store.storage_options)


def _payload(store, step: int) -> str:
    fs, path = fsspec.core.url_to_fs(store.url("m", f"ckpt-{step}"), **store.fs_options)
    fs.invalidate_cache()
    return next(p.rsplit("/", 1)[1] for p in fs.ls(path, detail=False) if "/payload-" in p)


def test_each_retry_is_a_debug_record(captured):
    failures = [ConnectionResetError("reset by peer"), ConnectionResetError("reset by peer")]

    def flaky(deadline: object) -> str:
        if failures:
            raise failures.pop()
        return "ok"

    policy = RetryPolicy(attempts=4, initial_delay=0.001)
    assert policy.call(flaky, action="read", uri="s3://bucket/key") == "ok"
    retries = [m for m in captured.debug() if m.startswith("retrying")]
    assert len(retries) == 2
    assert "read s3://bucket/key" in retries[0] and "attempt 1 of 4" in retries[0] and "attempt 2 of 4" in retries[1]


def test_sweep_of_leftovers_is_a_debug_record(tmp_path, captured):
    with CheckpointManager(tmp_path / "m", grace_seconds=0) as manager:
        manager.save(b"one", 1)
        leftover = tmp_path / "m" / "ckpt-1" / ("payload-" + "ab" * 16)
        leftover.write_bytes(b"left by a killed save")
        manager.save(b"two", 2)
    assert not leftover.exists()
    swept = [m for m in captured.debug() if m.startswith("swept 1 leftover")]
    assert len(swept) == 1 and leftover.name in swept[0]


def test_uris_are_logged_without_user_information_or_query():
    assert safe_uri("https://user:pa55@host.example/c/ckpt?sig=TOKEN&se=1") == "https://host.example/c/ckpt"
    assert safe_uri("s3://bucket/a/b") == "s3://bucket/a/b"
    assert safe_uri("/local/path") == "/local/path"


@pytest.mark.e2e("starts the S3 server")
def test_no_record_holds_a_storage_option_or_credential(s3_server, tmp_path, captured):
    """Saves, loads, a background save, a restore and failed retries, all with a recognisable secret."""
    location = s3_server.new_location()
    options = {**location.storage_options, "key": SECRET_KEY, "secret": SECRET}  # moto accepts any key
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "w.bin").write_bytes(os.urandom(100_000))
    with Checkpoint(location.url("c"), location.url("c"), storage_options=options) as cp:
        cp.save_sync(tree)
        cp.load_sync()
    with CheckpointManager(location.url("m"), storage_options=options, async_save=True) as manager:
        manager.save(tree, 1)
        manager.wait_until_finished()
        manager.restore(1)
    # An endpoint nobody listens on: every request fails transiently and is retried.
    dead = {**options, "endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"connect_timeout": 1,
                                                                                "retries": {"max_attempts": 1}}}
    with pytest.raises(taskpoint.StorageUnavailable), \
            Checkpoint(location.url("x"), storage_options=dead, retry=RetryPolicy(2, initial_delay=0.01)) as cp:
        cp.save_sync(b"never")
    assert len(captured.transfers()) == 4 and any(m.startswith("retrying") for m in captured.debug())
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s %(transfer)s")
    for record in captured.records:
        record.__dict__.setdefault("transfer", None)
        text = formatter.format(record) + repr(record.args) + repr(record.__dict__)
        assert SECRET not in text and SECRET_KEY not in text, text
