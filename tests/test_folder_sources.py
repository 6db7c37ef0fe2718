"""Folder-style sources (flytekit 1.x's layout: a folder's files as separate objects under a prefix) load as a
directory checkpoint; a folder or prefix as destination is refused before anything is written.

flytekit 1.x's ``SyncCheckpoint.save(folder)`` uploads the folder with fsspec's recursive ``put``; the tests
write that layout the same way, on every kind of store.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import make_tree, snapshot
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointError, UnsafeArchiveError
from taskpoint import folders as folders_module
from taskpoint.storage import Location
from taskpoint.storage.backends import Kind


def _flytekit_tree(root: Path) -> Path:
    """Files as a training loop leaves them: nested, one large, one empty."""
    (root / "model").mkdir(parents=True)
    (root / "model" / "weights.bin").write_bytes(os.urandom(3 << 20))
    (root / "model" / "config.json").write_text('{"layers": 4}')
    (root / "optimizer.pt").write_bytes(os.urandom(1000))
    (root / "empty.txt").write_bytes(b"")
    (root / "logs" / "deep" / "er").mkdir(parents=True)
    (root / "logs" / "deep" / "er" / "events.log").write_text("step 7\n")
    return root


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _upload_as_flytekit(store, local: Path, prefix: str) -> None:
    fs = store.fs()
    fs.put(str(local) + "/", fs._strip_protocol(prefix), recursive=True)
    fs.invalidate_cache()


def test_a_prefix_of_objects_loads_as_a_directory_checkpoint(store, tmp_path):
    tree = _flytekit_tree(tmp_path / "tree")
    prefix = store.url("run", "attempt-1", "checkpoint")
    _upload_as_flytekit(store, tree, prefix)
    assert Location(prefix, store.storage_options).kind() is Kind.FOLDER
    with Checkpoint(store.url("run", "attempt-2", "ckpt"), prefix, storage_options=store.storage_options) as cp:
        assert cp.prev_exists() is True
        loaded = cp.load_sync()
        assert loaded == cp.path
        assert _contents(loaded) == _contents(tree)
        assert [p.name for p in cp.path.iterdir() if p.name.startswith(".taskpoint-staging")] == []
        assert cp.load_sync() == loaded  # loaded once


def test_bytes_written_by_flytekit_load_from_their_prefix(store, tmp_path):
    # flytekit 1.x's SyncCheckpoint.write(b) uploads one object named _dst_cp under the prefix.
    fs = store.fs()
    prefix = store.url("attempt-1")
    fs.makedirs(fs._strip_protocol(prefix), exist_ok=True)  # local disk needs the folder; object stores ignore it
    fs.pipe_file(fs._strip_protocol(store.url("attempt-1", "_dst_cp")), b"step=41")
    fs.invalidate_cache()
    with Checkpoint(store.url("attempt-2"), prefix, storage_options=store.storage_options) as cp:
        assert cp.prev_exists()
        assert (cp.load_sync() / "_dst_cp").read_bytes() == b"step=41"


def test_a_local_folder_loads_with_modes_links_and_empty_folders(tmp_path):
    src = make_tree(tmp_path / "src")
    with Checkpoint(tmp_path / "dest", src) as cp:
        assert cp.prev_exists() is True
        assert snapshot(cp.load_sync()) == snapshot(src)


def test_an_empty_local_folder_loads_as_an_empty_directory_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with Checkpoint(tmp_path / "dest", tmp_path / "empty") as cp:
        assert cp.prev_exists() is True
        assert cp.load_sync() == cp.path
        assert list(cp.path.iterdir()) == []


def test_a_local_folder_with_a_link_leading_outside_is_refused_and_nothing_lands(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("fine")
    os.symlink("../../etc", src / "escape")
    workspace = tmp_path / "ws"
    with Checkpoint(tmp_path / "dest", src, workspace=workspace) as cp, \
            pytest.raises(UnsafeArchiveError, match="escape"):
        cp.load_sync()
    assert list(workspace.iterdir()) == []


def _s3_client(server):
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-west-2")


@pytest.mark.parametrize("bad", ["../outside.txt", "a/../../outside.txt", "/abs.txt", "a//b.txt", "./dot.txt"])
def test_keys_that_would_escape_the_workspace_are_unsafe_and_nothing_is_written(s3_store, s3_server, tmp_path, bad):
    prefix = s3_store.url("flyte")
    key_prefix = prefix.split("/", 3)[3]
    client = _s3_client(s3_server)
    client.put_object(Bucket="taskpoint-tests", Key=f"{key_prefix}/good.txt", Body=b"good")
    client.put_object(Bucket="taskpoint-tests", Key=f"{key_prefix}/{bad}", Body=b"evil")
    sentinel = tmp_path / "sentinel"
    workspace = sentinel / "a" / "ws"
    workspace.mkdir(parents=True)
    with Checkpoint(tmp_path / "dest", prefix, storage_options=s3_store.storage_options,
                    workspace=workspace) as cp, pytest.raises(UnsafeArchiveError):
        cp.load_sync()
    written = sorted(str(p.relative_to(sentinel)) for p in sentinel.rglob("*"))
    assert written == ["a", "a/ws"]  # nothing in the workspace, nothing beside or above it


def test_an_object_that_changes_size_after_the_listing_is_corrupt(store, tmp_path, monkeypatch):
    tree = _flytekit_tree(tmp_path / "tree")
    prefix = store.url("ckpt")
    _upload_as_flytekit(store, tree, prefix)
    real_plan = folders_module._plan

    def plan_then_rewrite(listing, root, src):  # a writer changes an object between the listing and its GET
        planned = real_plan(listing, root, src)
        fs = store.fs()
        fs.pipe_file(fs._strip_protocol(store.url("ckpt", "optimizer.pt")), b"shorter now")
        fs.invalidate_cache()
        return planned

    monkeypatch.setattr(folders_module, "_plan", plan_then_rewrite)
    workspace = tmp_path / "ws"
    with Checkpoint(tmp_path / "dest", prefix, storage_options=store.storage_options, workspace=workspace) as cp, \
            pytest.raises(CheckpointCorruptError, match=r"optimizer\.pt.*11 bytes but was listed with 1000"):
        cp.load_sync()
    assert list(workspace.iterdir()) == []  # nothing published, the staging folder removed


def test_an_object_that_vanishes_after_the_listing_is_corrupt(store, tmp_path, monkeypatch):
    tree = _flytekit_tree(tmp_path / "tree")
    prefix = store.url("ckpt")
    _upload_as_flytekit(store, tree, prefix)
    real_plan = folders_module._plan

    def plan_then_delete(listing, root, src):
        planned = real_plan(listing, root, src)
        fs = store.fs()
        fs.rm_file(fs._strip_protocol(store.url("ckpt", "model", "config.json")))
        fs.invalidate_cache()
        return planned

    monkeypatch.setattr(folders_module, "_plan", plan_then_delete)
    workspace = tmp_path / "ws"
    with Checkpoint(tmp_path / "dest", prefix, storage_options=store.storage_options, workspace=workspace) as cp, \
            pytest.raises(CheckpointCorruptError, match=r"config\.json.*vanished"):
        cp.load_sync()
    assert list(workspace.iterdir()) == []


def test_a_folder_or_prefix_destination_is_refused_before_anything_is_written(store, tmp_path):
    tree = _flytekit_tree(tmp_path / "tree")
    dest = store.url("ckpt")
    _upload_as_flytekit(store, tree, dest)
    fs = store.fs()
    before = sorted(fs.find(fs._strip_protocol(store.url())))
    with pytest.raises(CheckpointError, match=r"is a folder .*nothing was written"):
        Checkpoint(dest, storage_options=store.storage_options).save_sync(b"would shadow the folder")
    fs.invalidate_cache()
    assert sorted(fs.find(fs._strip_protocol(store.url()))) == before  # no object, no record, no temp file


def test_a_missing_source_is_still_no_checkpoint(store):
    with Checkpoint(store.url("d"), store.url("never", "saved"), storage_options=store.storage_options) as cp:
        assert cp.prev_exists() is False
        assert cp.load_sync() is None
