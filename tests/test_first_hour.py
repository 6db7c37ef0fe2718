"""The traps of a new user's first hour: a malformed URL never goes to a local folder named after it, an option
the store does not take is refused with the name meant, and each error names the URI and says what to do.

Through the public API and real CLI processes, on local disk, ``memory://`` and the S3 server (moto on
127.0.0.1); each test asserts the message's content (the URI, the option, the advice).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

import _zygote as zygote
import taskpoint
from _faults import closed_port_url
from _servers import StoreLocation
from helpers import AcceptLoop, fs_options
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointManager, RetryPolicy, StorageUnavailable

#: What the malformed URLs of the issue were, and the fix each message proposes (None: an unknown protocol).
_MALFORMED = [("s3:/ckpts/typo", "s3://ckpts/typo"), ("s3:ckpts/typo", "s3://ckpts/typo"),
              ("gs:/bucket/run", "gs://bucket/run"), ("s4://b/k", None)]
_SRC = Path(taskpoint.__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``taskpoint ARGS`` in a process of its own running this worktree's code, in ``cwd`` (forked from a server
    that imported the store clients: tests/_zygote.py)."""
    environment = {**(env if env is not None else os.environ), "PYTHONPATH": str(_SRC)}
    return zygote.run(zygote.STORES, ["-m", "taskpoint.cli", *args], environment, cwd, timeout=120)


def _assert_refused(message: str, uri: str, fixed: str | None) -> None:
    assert repr(uri) in message
    if fixed is None:
        assert "fsspec does not know" in message and "did you mean 's3'" in message
        assert "Protocols fsspec can use here:" in message
        for protocol in ("file", "memory", "s3"):
            assert f" {protocol}," in message or f" {protocol}." in message
    else:
        # Issue 40: the fix comes first, right after the URI, and alone: no list of protocols, no install hints
        # (the clients of s3, gs and az are installed in the test environment).
        assert f"is not a valid URL: did you mean {fixed!r}?" in message and "must be followed by '//'" in message
        assert "Protocols fsspec" not in message and "pip install" not in message


def _entry_points(uri: str) -> list:
    """Every way the library takes a location: a destination, a source, a manager directory, a task root."""

    @taskpoint.task(retries=1, root=uri, preemption=False)
    def job() -> int:
        return 1

    return [lambda: Checkpoint(uri), lambda: Checkpoint("memory://first-hour/ok", uri),
            lambda: CheckpointManager(uri, preemption=False), job]


@pytest.mark.parametrize(("uri", "fixed"), _MALFORMED, ids=[u for u, _ in _MALFORMED])
def test_a_malformed_url_is_refused_everywhere_and_nothing_is_written_locally(uri, fixed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for make in _entry_points(uri):
        with pytest.raises(ValueError) as info:
            make()
        _assert_refused(str(info.value), uri, fixed)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("uri", "fixed"), _MALFORMED[:1], ids=["s3:/"])
@pytest.mark.e2e("starts a python process")
def test_taskpoint_root_that_is_a_malformed_url_is_refused_naming_the_variable(uri, fixed, tmp_path):
    """The issue's row: TASKPOINT_ROOT=s3:/ckpts/typo wrote its checkpoints to ./s3:/ckpts/typo/."""
    script = ("import taskpoint\n"
              "@taskpoint.task(retries=1)\n"
              "def job():\n"
              "    taskpoint.ctx().checkpoint.save_sync(b'progress')\n"
              "job()\n")
    env = {**os.environ, "TASKPOINT_ROOT": uri, "PYTHONPATH": str(_SRC)}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "ValueError: $TASKPOINT_ROOT=" in out.stderr
    _assert_refused(out.stderr, uri, fixed)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e("runs the CLI as a process")
def test_taskpoint_run_refuses_a_malformed_root_before_running_the_command(tmp_path):
    command = ["--", sys.executable, "-c", "open('ran', 'w')"]
    out = _cli("run", "--root", "s3:/ckpts/typo", "--run-name", "job7", *command, cwd=tmp_path)
    assert out.returncode == 2, out.stderr  # a usage error of taskpoint run
    assert out.stderr.startswith("taskpoint run: --root='s3:/ckpts/typo' is not a valid URL")
    _assert_refused(out.stderr, "s3:/ckpts/typo", "s3://ckpts/typo")
    out = _cli("run", "--run-name", "job7", *command, cwd=tmp_path, env={**os.environ, "TASKPOINT_ROOT": "s3:x"})
    assert out.returncode == 2 and "$TASKPOINT_ROOT='s3:x' is not a valid URL" in out.stderr
    out = _cli("run", "--checkpoint-path", "s4://b/k", *command, cwd=tmp_path)
    assert out.returncode == 2 and "--checkpoint-path='s4://b/k' names the protocol 's4'" in out.stderr
    assert list(tmp_path.iterdir()) == []  # the command never ran


@pytest.mark.parametrize(("uri", "fixed"), _MALFORMED, ids=[u for u, _ in _MALFORMED])
@pytest.mark.e2e("runs the CLI as a process")
def test_the_cli_refuses_a_malformed_url(uri, fixed, tmp_path):
    for args in (["ls", uri], ["push", str(tmp_path / "f"), uri]):
        (tmp_path / "f").write_bytes(b"state")
        out = _cli(*args, cwd=tmp_path)
        assert out.returncode == 1, out.stderr
        _assert_refused(out.stderr, uri, fixed)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_local_folder_that_starts_like_a_url_is_written_when_marked_as_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Checkpoint("./s3:/ckpts/typo").save_sync(b"meant")  # what the message proposes
    assert (tmp_path / "s3:" / "ckpts" / "typo").read_bytes() == b"meant"


# -- storage options -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("uri", "option", "closest"), [
    ("memory://first-hour/ckpt", "endpoint", None),
    ("memory://first-hour/ckpt", "global_stor", "global_store"),
    ("{tmp}/ckpt", "auto_mkdirs", "auto_mkdir"),
    ("gs://bucket/ckpt", "tokn", "token"),  # refused before gcsfs connects: no server needed
])
def test_an_option_the_store_does_not_take_is_refused_with_the_closest_name(uri, option, closest, tmp_path):
    uri = uri.format(tmp=tmp_path)
    with pytest.raises(ValueError) as info:
        Checkpoint(uri, storage_options={option: "value-never-shown"})
    message = str(info.value)
    assert message.startswith(f"{uri}: ") and f"takes no storage option {option!r}" in message
    assert "The options it takes:" in message and "skip_instance_cache" in message
    if closest is not None:
        assert f"did you mean {closest}?" in message
    assert "value-never-shown" not in message
    assert list(tmp_path.iterdir()) == []


def test_endpoint_instead_of_endpoint_url_is_refused_on_s3(s3_store):
    """The issue's row: s3fs took it and aiobotocore failed at the first request with a TypeError."""
    options = {k: v for k, v in s3_store.storage_options.items() if k != "endpoint_url"}
    options["endpoint"] = s3_store.storage_options["endpoint_url"]
    with pytest.raises(ValueError) as info:
        Checkpoint(s3_store.url("ckpt"), storage_options=options).save_sync(b"x")
    message = str(info.value)
    assert message.startswith(s3_store.url("ckpt")) and "s3:// (s3fs.core.S3FileSystem)" in message
    assert "takes no storage option 'endpoint' (did you mean endpoint_url=..., or " \
           "client_kwargs={'endpoint_url': ...}?)" in message


def test_an_option_is_valid_when_either_store_of_a_checkpoint_takes_it(s3_store, tmp_path):
    with Checkpoint(s3_store.url("ckpt"), storage_options=s3_store.storage_options) as cp:
        cp.save_sync(b"state")
    with Checkpoint(str(tmp_path / "next"), s3_store.url("ckpt"), storage_options=s3_store.storage_options) as cp:
        assert cp.load_sync().read_bytes() == b"state"  # endpoint_url and key mean nothing to local disk
    with pytest.raises(ValueError, match="take no storage option 'endpoint'"):
        Checkpoint(str(tmp_path / "next"), s3_store.url("ckpt"), storage_options={"endpoint": "x"})


@pytest.mark.e2e("runs the CLI as a process")
def test_the_cli_refuses_an_option_the_store_does_not_take(tmp_path):
    out = _cli("ls", "memory://first-hour/ckpt", "-o", "endpoint=http://127.0.0.1:9000", cwd=tmp_path)
    assert out.returncode == 1
    assert "taskpoint ls: memory://first-hour/ckpt: memory:// (fsspec.implementations.memory.MemoryFileSystem) " \
           "takes no storage option 'endpoint'" in out.stderr
    env = {**os.environ, "TASKPOINT_STORAGE_OPTIONS": '{"endpoint": "http://127.0.0.1:9000"}'}
    out = _cli("ls", "s3://bucket/ckpt", cwd=tmp_path, env=env)
    assert out.returncode == 1 and "did you mean endpoint_url=..." in out.stderr
    assert "TypeError" not in out.stderr


# -- errors that say what to do -----------------------------------------------------------------------------


def _damaged(store, change) -> str:
    """A bytes checkpoint saved on ``store``, then changed by ``change(path)`` behind taskpoint's back."""
    url = store.url("ckpt")
    with Checkpoint(url, storage_options=store.storage_options) as cp:
        cp.save_sync(bytes(range(256)) * 100)  # 25600 bytes
    fs, path = fsspec.core.url_to_fs(url, **fs_options(store.storage_options))
    data = bytearray(fs.cat_file(path))
    fs.pipe_file(path, bytes(change(data)))
    return url


def _flip(data: bytearray) -> bytearray:
    data[1000] ^= 0x01
    return data


@pytest.mark.parametrize(("change", "what"), [
    (_flip, "does not match the checksum recorded when it was saved"),
    (lambda data: data[:20000], "holds an object of 20000 bytes, which its record does not list"),
], ids=["flipped-byte", "truncated"])
def test_a_damaged_bytes_checkpoint_raises_the_public_class_and_says_what_to_do(store, change, what, tmp_path):
    url = _damaged(store, change)
    with Checkpoint(str(tmp_path / "next"), url, storage_options=store.storage_options) as cp, \
            pytest.raises(CheckpointCorruptError) as info:
        cp.load_sync()
    assert type(info.value) is CheckpointCorruptError  # no private class reaches the user
    printed = "".join(traceback.format_exception(info.value))
    assert "_Unlisted" not in printed and "taskpoint.record." not in printed
    message = str(info.value)
    assert url in message and what in message
    assert "Save a new checkpoint, or load an older one" in message


@pytest.mark.e2e("runs the CLI as a process")
def test_the_cli_says_what_to_do_with_a_truncated_checkpoint(tmp_path):
    store = StoreLocation("local", str(tmp_path / "store"), {})
    url = _damaged(store, lambda data: data[:20000])
    out = _cli("pull", url, str(tmp_path / "restored"), cwd=tmp_path)
    assert out.returncode == 2, out.stderr  # damaged
    assert "holds an object of 20000 bytes" in out.stderr and "Save a new checkpoint" in out.stderr
    assert "_Unlisted" not in out.stderr


def _s3_options(s3_store, endpoint: str, **config: object) -> dict:
    """The S3 store's options at another endpoint, with botocore's own retries off (taskpoint's retry)."""
    return {**s3_store.storage_options, "endpoint_url": endpoint,
            "config_kwargs": {"retries": {"max_attempts": 1}, **config}}


def _unavailable(s3_store, options: dict, retry: RetryPolicy) -> str:
    """The message of the StorageUnavailable that a save with these options meets; it names the URI."""
    with pytest.raises(StorageUnavailable) as info:
        Checkpoint(s3_store.url("ckpt"), storage_options=options, retry=retry).save_sync(b"x")
    assert s3_store.url("ckpt") in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("client_retries", [False, True], ids=["attempts", "deadline"])
def test_a_refused_connection_is_described_as_refused(s3_store, client_retries):
    """The issue's row: nothing listening was described as "an endpoint that accepts connections and never
    answers". With botocore's own retries on, the deadline cancels the call while botocore retries the refused
    connections: the failure itself says only that no answer came, and one connection to the endpoint tells."""
    endpoint = closed_port_url()
    if client_retries:
        options = {**s3_store.storage_options, "endpoint_url": endpoint}
        retry = RetryPolicy(attempts=100, initial_delay=0.05, deadline=1.0)
    else:
        options, retry = _s3_options(s3_store, endpoint), RetryPolicy(attempts=2, initial_delay=0.01)
    message = _unavailable(s3_store, options, retry)
    assert "Nothing accepted a connection at the endpoint (connection refused)" in message
    assert "accepts connections and never answers" not in message
    assert "deadline" in message if client_retries else "2 attempts" in message


@contextlib.contextmanager
def _silent_endpoint() -> Iterator[str]:
    """An endpoint on 127.0.0.1 that accepts connections and never answers."""
    held: list[socket.socket] = []
    loop = AcceptLoop(held.append, "silent-endpoint")
    try:
        yield loop.url
    finally:
        loop.close()
        for conn in held:
            conn.close()


@pytest.mark.parametrize("timeout", ["client", "deadline"])
def test_a_silent_endpoint_is_described_as_silent(s3_store, timeout):
    with _silent_endpoint() as endpoint:
        if timeout == "client":  # botocore's read timeout: the client says it connected
            options, retry = _s3_options(s3_store, endpoint, read_timeout=0.5), RetryPolicy(attempts=2,
                                                                                             initial_delay=0.01)
        else:  # taskpoint's deadline cancels the call: one connection tells it accepts
            options, retry = _s3_options(s3_store, endpoint), RetryPolicy(attempts=5, deadline=1.0)
        message = _unavailable(s3_store, options, retry)
    assert "The endpoint accepted connections and did not answer in time" in message
    assert "refused" not in message


# -- unverified loads ---------------------------------------------------------------------------------------


def _without_record(store) -> str:
    url = store.url("ckpt")
    with Checkpoint(url, storage_options=store.storage_options) as cp:
        cp.save_sync(b"written by another tool")
    fs, path = fsspec.core.url_to_fs(url + ".taskpoint.json", **fs_options(store.storage_options))
    fs.rm_file(path)
    return url


def test_a_load_without_a_record_warns_once_naming_the_uri(store, caplog, tmp_path):
    url = _without_record(store)
    with caplog.at_level(logging.WARNING, logger="taskpoint"), \
            Checkpoint(str(tmp_path / "next"), url, storage_options=store.storage_options) as cp:
        assert cp.load_sync().read_bytes() == b"written by another tool"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert url in text and "could not be verified" in text
    assert "written by Flyte or another tool, or its record was removed" in text and "verify='strict'" in text


def test_verify_strict_refuses_a_checkpoint_without_a_record(store, tmp_path):
    url = _without_record(store)
    workspace = tmp_path / "workspace"
    with Checkpoint(str(tmp_path / "next"), url, storage_options=store.storage_options, workspace=workspace,
                    verify="strict") as cp, pytest.raises(CheckpointCorruptError) as info:
        cp.load_sync()
    message = str(info.value)
    assert url in message and "could not be verified" in message and "save it again with taskpoint" in message
    assert not workspace.exists() or list(workspace.iterdir()) == []
    with Checkpoint(str(tmp_path / "other"), url, storage_options=store.storage_options, verify="strict") as cp:
        cp.save_sync(b"saved by taskpoint")
    with Checkpoint(str(tmp_path / "n"), str(tmp_path / "other"), verify="strict") as cp:
        assert cp.load_sync().read_bytes() == b"saved by taskpoint"  # a record: strict loads it


def test_verify_strict_refuses_a_folder_checkpoint(tmp_path):
    (tmp_path / "flytekit" / "model").mkdir(parents=True)
    (tmp_path / "flytekit" / "model" / "w.bin").write_bytes(b"weights")
    with Checkpoint(str(tmp_path / "next"), str(tmp_path / "flytekit"), verify="strict") as cp, \
            pytest.raises(CheckpointCorruptError, match="could not be verified"):
        cp.load_sync()


def test_verify_takes_only_its_documented_values(tmp_path):
    with pytest.raises(ValueError, match="verify must be one of 'warn', 'strict', got 'on'"):
        Checkpoint(str(tmp_path / "c"), verify="on")


@pytest.mark.e2e("runs the CLI as a process")
def test_the_cli_says_a_checkpoint_without_a_record_cannot_be_verified(tmp_path):
    url = _without_record(StoreLocation("local", str(tmp_path / "store"), {}))
    out = _cli("ls", url, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "unrecorded" in out.stdout and "a load cannot verify it" in out.stdout
    assert "saved - UTC" not in out.stdout  # the row: a time it does not know
    out = _cli("pull", url, str(tmp_path / "restored"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "restored" / "payload").read_bytes() == b"written by another tool"
    assert out.stderr.count("taskpoint: warning:") == 1
    assert url in out.stderr and "could not be verified" in out.stderr


@pytest.mark.e2e("runs the CLI as a process")
def test_the_cli_describes_a_refused_connection_as_refused(tmp_path):
    endpoint = closed_port_url()
    out = _cli("ls", "s3://taskpoint-tests/ckpt", "-o", f"endpoint_url={endpoint}",
               "-o", 'config_kwargs={"retries": {"max_attempts": 1}}', cwd=tmp_path)
    assert out.returncode == 1
    assert "s3://taskpoint-tests/ckpt" in out.stderr and "(connection refused)" in out.stderr
    assert "never answers" not in out.stderr
