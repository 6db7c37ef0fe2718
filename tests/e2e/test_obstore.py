"""The obstore fast path for s3:// (issue 15 item 5): how it is chosen, and what only it has to show.

The storage contract itself (atomic writes, conditional records, pinned reads, failures and errors) runs over
obstore through the ``s3-obstore`` param of the ``store``, ``remote_store`` and ``s3_store`` fixtures."""

from __future__ import annotations

import sys

import pytest

from helpers import make_tree, snapshot
from taskpoint import Checkpoint, CheckpointManager, StorageNotFound
from taskpoint.storage import Location
from taskpoint.storage._obstore import ObstoreS3Backend, store_config
from taskpoint.storage.objectstores import S3Backend


def test_the_option_chooses_obstore_and_is_kept_from_fsspec(s3_server):
    location = Location(f"s3://{s3_server.bucket}/x", {**s3_server.storage_options, "s3_client": "obstore"})
    assert type(location.backend) is ObstoreS3Backend
    assert "s3_client" not in location.fs.storage_options  # s3fs never saw taskpoint's key
    assert location.storage_options["s3_client"] == "obstore"  # kept for the locations made from it


def test_the_environment_chooses_obstore_and_the_option_wins(s3_server, monkeypatch):
    monkeypatch.setenv("TASKPOINT_S3_CLIENT", "obstore")
    uri = f"s3://{s3_server.bucket}/x"
    assert type(Location(uri, s3_server.storage_options).backend) is ObstoreS3Backend
    chosen = Location(uri, {**s3_server.storage_options, "s3_client": "s3fs"}).backend
    assert type(chosen) is S3Backend


def test_s3fs_stays_the_default(s3_server, monkeypatch):
    monkeypatch.delenv("TASKPOINT_S3_CLIENT", raising=False)
    assert type(Location(f"s3://{s3_server.bucket}/x", s3_server.storage_options).backend) is S3Backend


def test_an_unknown_client_is_a_value_error_naming_the_choices(s3_server):
    with pytest.raises(ValueError, match="s3fs, obstore"):
        Location(f"s3://{s3_server.bucket}/x", {**s3_server.storage_options, "s3_client": "boto"})


def test_the_option_is_ignored_off_s3(tmp_path):
    Checkpoint(tmp_path / "c", storage_options={"s3_client": "obstore"}).save_sync(b"local")
    assert (tmp_path / "c").exists()


def test_obstore_missing_is_an_import_error_naming_the_extra(s3_server, monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)  # what an interpreter without the package raises
    with pytest.raises(ImportError, match=r'pip install "taskpoint\[obstore\]"'):
        Location(f"s3://{s3_server.bucket}/x", {**s3_server.storage_options, "s3_client": "obstore"})


def test_s3fs_options_become_obstore_configuration():
    config = store_config({"key": "k", "secret": "s", "token": "t",
                           "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-1"},
                           "config_kwargs": {"s3": {"payload_signing_enabled": False}}}, deadline=5.0)
    assert (config["access_key_id"], config["secret_access_key"], config["session_token"]) == ("k", "s", "t")
    assert (config["endpoint"], config["region"]) == ("http://127.0.0.1:9", "eu-west-1")
    assert config["unsigned_payload"] is True
    client = config["client_options"]
    assert client["allow_http"] is True
    assert client["connect_timeout"].total_seconds() == client["timeout"].total_seconds() == 5.0  # the deadline
    assert "allow_http" not in store_config({"endpoint_url": "https://s3.example"}, None)["client_options"]
    with pytest.raises(ValueError, match="profiles"):
        store_config({"profile": "dev"}, None)


def test_saving_to_and_loading_from_a_missing_bucket_is_storage_not_found(s3_server, tmp_path):
    options = {**s3_server.storage_options, "s3_client": "obstore"}
    missing = "s3://no-such-bucket-here"
    with pytest.raises(StorageNotFound):
        Checkpoint(f"{missing}/x", storage_options=options).save_sync(b"x")
    with pytest.raises(StorageNotFound):
        Checkpoint(tmp_path / "next", f"{missing}/x", storage_options=options).load_sync()


@pytest.mark.parametrize("s3_store", ["s3-obstore"], indirect=True)  # s3fs's round trip is in test_manager.py
def test_a_manager_saves_and_restores_steps_through_obstore(s3_store, tmp_path):
    assert s3_store.storage_options["s3_client"] == "obstore"
    trees = [make_tree(tmp_path / f"t{i}", big=300_000 + i) for i in range(2)]
    with CheckpointManager(s3_store.url("steps"), storage_options=s3_store.storage_options, keep=1) as m:
        for step, tree in enumerate(trees, 1):
            m.save(tree, step)
        m.wait_until_finished()
        assert m.steps() == [2]
        restored = m.restore(2, into=tmp_path / "out")
    assert snapshot(restored) == snapshot(trees[1])
