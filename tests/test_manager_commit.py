"""A CheckpointManager commit that fails after its manifest landed must not delete the payload it names."""

from __future__ import annotations

import os
import time

import pytest

from taskpoint import CheckpointManager
from taskpoint.storage import Location

LOCAL_AND_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)


def _objects(store, step: int) -> list[str]:
    fs = store.fs()
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(fs._strip_protocol(store.url("ckpts", f"ckpt-{step}")),
                                                      detail=False))


@LOCAL_AND_S3
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, ConnectionResetError])
def test_a_manifest_write_that_landed_but_raised_keeps_the_step_restorable(store, monkeypatch, interrupt):
    """The manifest PUT reaches the store, then the caller sees an exception (the process being stopped, or a
    response lost on the way back): the step is committed, so the payload it names must still be there."""
    real_write = Location.write_small

    def lands_then_raises(self, data, **kwargs):
        real_write(self, data, **kwargs)  # the real write, on the real store
        if self.uri.endswith("/ckpt-2/taskpoint.json"):
            raise interrupt("the response to the manifest write was lost")

    monkeypatch.setattr(Location, "write_small", lands_then_raises)
    m = CheckpointManager(store.url("ckpts"), storage_options=store.storage_options)
    m.save(b"step one", 1)
    with pytest.raises(interrupt):
        m.save(b"step two", 2)
    monkeypatch.undo()
    m.close()
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options) as fresh:
        assert fresh.steps() == [1, 2]
        assert fresh.restore(2).read_bytes() == b"step two"
        assert fresh.restore(1).read_bytes() == b"step one"
        assert fresh.gc(grace_seconds=0) == []  # the payload is named: not a leftover


@LOCAL_AND_S3
def test_a_manifest_write_that_failed_leaves_the_payload_to_the_sweep(store, monkeypatch):
    """When the manifest did not land, the payload is a leftover: invisible, and removed by gc."""
    real_write = Location.write_small

    def refuses_the_manifest(self, data, **kwargs):
        if self.uri.endswith("/ckpt-1/taskpoint.json"):
            raise KeyboardInterrupt("stopped before the manifest was written")
        real_write(self, data, **kwargs)

    monkeypatch.setattr(Location, "write_small", refuses_the_manifest)
    m = CheckpointManager(store.url("ckpts"), storage_options=store.storage_options)
    with pytest.raises(KeyboardInterrupt):
        m.save(b"never committed", 1)
    monkeypatch.undo()
    m.close()
    payloads = [name for name in _objects(store, 1) if name.startswith("payload-")]
    assert len(payloads) == 1  # left for the sweep, which has a grace period
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options) as fresh:
        assert fresh.steps() == []
        assert fresh.gc() == []  # younger than the grace period: a save could still be committing it
        removed = fresh.gc(grace_seconds=0)
        assert [uri.rsplit("/", 1)[-1] for uri in removed] == payloads


def test_an_empty_step_folder_goes_once_older_than_the_grace(tmp_path):
    """A save killed just after it made its ``ckpt-N`` folder leaves the folder empty: it is not a step, and gc
    removes it once the folder itself is older than the grace (not before: a save may be about to write there)."""
    with CheckpointManager(tmp_path, preemption=False) as m:
        m.save(b"one", 1)
    empty = tmp_path / "ckpt-2"
    empty.mkdir()
    with CheckpointManager(tmp_path, preemption=False) as m:
        assert m.gc() == []
        assert empty.is_dir()  # fresh: left alone
        assert [s.state for s in m.inventory()] == ["committed", "incomplete"]
        old = time.time() - 3600
        os.utime(empty, (old, old))
        m.gc(grace_seconds=60)
        assert not empty.exists()
        assert [(s.step, s.state) for s in m.inventory()] == [(1, "committed")]
        assert m.restore().read_bytes() == b"one"
