"""What matters in an error is in what every Python prints: Python 3.10 prints no exception notes, so the
background save's step and the save process's traceback travel in the message and in the cause. Also
``taskpoint gc`` with ``$TASKPOINT_STORAGE_OPTIONS``. Real S3 server, real save process, real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import uuid

import fsspec
import pytest

from taskpoint import CheckpointManager, StorageError
from taskpoint.manager.saver import SaveProcessTraceback


def _printed_without_notes(exc: BaseException) -> str:
    """What Python 3.10 prints for ``exc``: the traceback and chain, without notes."""
    for e in (exc, exc.__cause__, exc.__context__):
        if e is not None and hasattr(e, "__notes__"):
            del e.__notes__
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _missing_bucket(s3_store, **kwargs) -> CheckpointManager:
    return CheckpointManager(f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/ckpts",
                             storage_options=s3_store.storage_options, **kwargs)


@pytest.mark.parametrize("process", [False, True], ids=["thread", "save-process"])
def test_a_background_error_says_which_step_without_notes(s3_store, process):
    m = _missing_bucket(s3_store, background_process=process)
    m.save(b"x", 1, blocking=False)
    with pytest.raises(StorageError, match="does not exist") as info:
        m.save(b"y", 2)  # a later, unrelated call raises it
    m.close()
    assert "background save of step 1" in str(info.value)
    printed = _printed_without_notes(info.value)
    assert "background save of step 1" in printed
    if process:
        assert isinstance(info.value.__cause__, SaveProcessTraceback)
        assert "raised in taskpoint's save process" in printed
        assert "Traceback (most recent call last)" in str(info.value.__cause__)  # the child's own traceback


def test_taskpoint_gc_takes_storage_options_from_the_environment(s3_store):
    directory = s3_store.url("ckpts")
    with CheckpointManager(directory, storage_options=s3_store.storage_options) as m:
        m.save(b"kept", 1)
    fs, path = fsspec.core.url_to_fs(s3_store.url("ckpts", "ckpt-2", f"payload-{uuid.uuid4().hex}"),
                                     **s3_store.storage_options)
    fs.pipe_file(path, b"left by a killed save")  # a payload no manifest names
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    env["TASKPOINT_STORAGE_OPTIONS"] = json.dumps(s3_store.storage_options)
    out = subprocess.run([sys.executable, "-m", "taskpoint.cli", "gc", directory, "--grace", "0"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1 leftover(s) removed" in out.stdout and path.rsplit("/", 1)[-1] in out.stdout
    with CheckpointManager(directory, storage_options=s3_store.storage_options) as m:
        assert m.steps() == [1] and m.restore(1).read_bytes() == b"kept"


def test_taskpoint_gc_refuses_malformed_storage_options(tmp_path):
    env = {**os.environ, "TASKPOINT_STORAGE_OPTIONS": "{not json"}
    out = subprocess.run([sys.executable, "-m", "taskpoint.cli", "gc", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "TASKPOINT_STORAGE_OPTIONS" in out.stderr  # 1: an error (docs/cli.md)
