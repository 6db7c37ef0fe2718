"""Storage that fails: unreachable servers, missing buckets, networks cut mid-upload, killed savers.

In every case the error is raised (never reported as "no checkpoint") and the previous good checkpoint
survives.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _faults import closed_port_url, cuttable_proxy
from helpers import make_tree, object_exists
from taskpoint import Checkpoint, CheckpointError, RetryPolicy, StorageError

FAST_RETRY = RetryPolicy(attempts=2, initial_delay=0.01)


def _s3_options(base: dict, endpoint: str) -> dict:
    options = {**base, "endpoint_url": endpoint}
    options["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10}
    return options


# -- unreachable storage ---------------------------------------------------------------------------------


def test_unreachable_store_raises_storage_error_instead_of_reporting_no_checkpoint(s3_store):
    options = _s3_options(s3_store.storage_options, closed_port_url())
    cp = Checkpoint(s3_store.url("d"), s3_store.url("prev"), storage_options=options, retry=FAST_RETRY)
    with pytest.raises(StorageError, match="2 attempts") as info:
        cp.load_sync()
    assert s3_store.url("prev") in str(info.value)
    with pytest.raises(StorageError):
        cp.prev_exists()
    with pytest.raises(StorageError):
        cp.save_sync(b"x")


def test_transient_outage_during_load_is_retried_and_then_succeeds(s3_store, s3_server):
    Checkpoint(s3_store.url("prev"), storage_options=s3_store.storage_options).save_sync(b"good")
    with cuttable_proxy(s3_server.endpoint) as proxy:
        options = _s3_options(s3_store.storage_options, proxy.url)
        proxy.cut_after(0)  # the first request goes dark: every connection is reset or refused
        cp = Checkpoint(s3_store.url("d"), s3_store.url("prev"), storage_options=options,
                        retry=RetryPolicy(attempts=30, initial_delay=0.05, max_delay=0.05))
        import threading

        healer = threading.Timer(0.5, proxy.heal)  # the outage ends while load keeps retrying
        healer.start()
        try:
            assert cp.load_sync().read_bytes() == b"good"
        finally:
            healer.cancel()


@pytest.mark.parametrize("kind", ["s3", "gcs", "azure"])
def test_save_to_missing_bucket_raises_storage_error(request, kind):
    server = request.getfixturevalue({"s3": "s3_server", "gcs": "gcs_server", "azure": "azure_server"}[kind])
    scheme = {"s3": "s3", "gcs": "gs", "azure": "az"}[kind]
    dest = f"{scheme}://no-such-bucket-{os.getpid()}/run/ckpt"
    with pytest.raises(StorageError, match=r"does not exist|permission|could not"):
        Checkpoint(dest, storage_options=server.storage_options, retry=FAST_RETRY).save_sync(b"data")


def test_load_from_missing_bucket_raises_storage_error(s3_server):
    src = f"s3://no-such-bucket-{os.getpid()}/run/ckpt"
    cp = Checkpoint(f"s3://no-such-bucket-{os.getpid()}/x", src, storage_options=s3_server.storage_options)
    with pytest.raises(StorageError, match="does not exist"):
        cp.load_sync()


def test_local_destination_that_cannot_be_written_raises_and_keeps_nothing(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(StorageError, match="could not save"):
        Checkpoint(tmp_path / "a-file" / "sub" / "ckpt").save_sync(b"data")
    assert (tmp_path / "a-file").read_text() == "x"


# -- failure midway ---------------------------------------------------------------------------------------


def _s3_client(server):
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-west-2")


def test_network_cut_midway_through_multipart_upload_keeps_previous_checkpoint(s3_store, s3_server, tmp_path):
    dest = s3_store.url("ckpt")
    Checkpoint(dest, storage_options=s3_store.storage_options).save_sync(b"previous good state")
    big = make_tree(tmp_path / "big", big=40 << 20)
    with cuttable_proxy(s3_server.endpoint) as proxy:
        options = _s3_options(s3_store.storage_options, proxy.url)
        proxy.cut_after(20 << 20)  # dies after the first part is through
        with pytest.raises(StorageError):
            Checkpoint(dest, storage_options=options, retry=FAST_RETRY).save_sync(big)
        assert proxy.dark
    with Checkpoint(s3_store.url("next"), dest, storage_options=s3_store.storage_options) as nxt:
        assert nxt.load_sync().read_bytes() == b"previous good state"
    # The outage also kept the abort from reaching the server, so an unfinished upload is left ...
    key = dest.split("/", 3)[3]
    uploads = _s3_client(s3_server).list_multipart_uploads(Bucket="taskpoint-tests").get("Uploads", [])
    assert [u["Key"] for u in uploads if u["Key"] == key] == [key]
    # ... and the next successful save aborts it: no orphaned parts stay.
    Checkpoint(dest, storage_options=s3_store.storage_options).save_sync(b"after the outage")
    uploads = _s3_client(s3_server).list_multipart_uploads(Bucket="taskpoint-tests").get("Uploads", [])
    assert [u for u in uploads if u["Key"] == key] == []


class _FailingPayloadError(RuntimeError):
    pass


@pytest.mark.parametrize("at", [0, 5 << 20, 33 << 20])
def test_source_failing_midway_aborts_the_upload_and_keeps_previous(store, s3_server, tmp_path, at):
    """A payload that fails after ``at`` bytes: nothing partial is published, no multipart parts remain."""
    from taskpoint.payloads import BytesPayload

    class Failing(BytesPayload):
        def write(self, sink, codec, level):
            sink.write(bytes(at))
            raise _FailingPayloadError("disk read error in the middle of the checkpoint")

    dest = store.url("ckpt")
    Checkpoint(dest, storage_options=store.storage_options).save_sync(b"previous")
    from taskpoint.checkpoint import save_object
    from taskpoint.format.codecs import get_codec
    from taskpoint.storage import Location

    with pytest.raises(_FailingPayloadError):
        save_object(Location(dest, store.storage_options), Failing(b""), get_codec("gzip"), None)
    with Checkpoint(store.url("next"), dest, storage_options=store.storage_options) as nxt:
        assert nxt.load_sync().read_bytes() == b"previous"
    fs = store.fs()
    fs.invalidate_cache()
    parent = fs._strip_protocol(store.url())
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(parent, detail=False)) == ["ckpt", "ckpt.taskpoint.json"]
    if store.kind == "s3":
        uploads = _s3_client(s3_server).list_multipart_uploads(Bucket="taskpoint-tests").get("Uploads", [])
        assert [u for u in uploads if dest.endswith(u["Key"])] == []


# -- a saver killed at any moment -------------------------------------------------------------------------

_SAVER = textwrap.dedent(
    """
    import os, sys, json, shutil
    from pathlib import Path
    import taskpoint
    dest, work, options = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    cp = taskpoint.Checkpoint(dest, storage_options=options)
    for version in range(1, 10_000):
        tree = work / f"v{version}"
        tree.mkdir(parents=True)
        for i in range(4):
            (tree / f"part{i}.bin").write_bytes(os.urandom(1 << 20) + bytes((1 << 20)))
        (tree / "version.txt").write_text(str(version))
        cp.save_sync(tree)
        print(version, flush=True)
        shutil.rmtree(tree)
    """
)


def _kill_saver_at_random(dest: str, options: dict, work: Path, rng: random.Random) -> int:
    import json
    import signal

    proc = subprocess.Popen([sys.executable, "-c", _SAVER, dest, str(work), json.dumps(options)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        completed = int(proc.stdout.readline())  # at least one good checkpoint exists now
        for _ in range(rng.randint(0, 2)):
            completed = int(proc.stdout.readline())
        # Now kill at a random moment inside the next save.
        import time

        time.sleep(rng.uniform(0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return completed


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_sigkill_during_save_leaves_a_complete_checkpoint(request, tmp_path, kind):
    rng = random.Random(20261130)
    if kind == "local":
        dest, options = str(tmp_path / "store" / "ckpt"), {}
    else:
        server = request.getfixturevalue("s3_server")
        location = server.new_location()
        dest, options = location.url("ckpt"), server.storage_options
    for round_ in range(4):
        completed = _kill_saver_at_random(dest, options, tmp_path / f"work{round_}", rng)
        with Checkpoint(tmp_path / f"next{round_}", dest, storage_options=options) as nxt:
            loaded = nxt.load_sync()
            version = int((loaded / "version.txt").read_text())
            assert version >= completed  # the previous save, or the one killed if it got to commit
            assert sorted(os.listdir(loaded)) == ["part0.bin", "part1.bin", "part2.bin", "part3.bin", "version.txt"]
            assert all((loaded / f"part{i}.bin").stat().st_size == 2 << 20 for i in range(4))
    if kind == "local":
        leftovers = [n for n in os.listdir(tmp_path / "store") if n.endswith(".tmp")]
        # Temp files of killed saves are swept by later saves once they are old enough; none is ever loaded.
        assert all(n.startswith(".ckpt.") for n in leftovers)


def test_closed_checkpoint_refuses_io(tmp_path):
    cp = Checkpoint(tmp_path / "d", tmp_path / "d")
    cp.close()
    for call in (cp.load_sync, cp.prev_exists, lambda: cp.save_sync(b"x")):
        with pytest.raises(CheckpointError, match="closed"):
            call()
    assert not object_exists(str(tmp_path / "d"), {})
