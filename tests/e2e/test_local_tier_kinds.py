"""Promotion of any kind's step (issue 41 item 2): a local tier promotes a step of an extra's kind (a torch state
dict's pieces, a PyTree's files) as it promotes a payload, copying the objects its manifest names and committing
the remote step with the same content; a damaged local step of such a kind is never committed remotely. On local
disk and the S3 server as remote tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from conftest import _location_fixture
from helpers import fs_options
from taskpoint import CheckpointCorruptError, CheckpointManager

REMOTES = ["local", "s3"]


@pytest.fixture(params=REMOTES, ids=REMOTES)
def remote(request: pytest.FixtureRequest) -> Iterator[object]:
    yield from _location_fixture(request)


def tiered(remote, local_dir: Path) -> CheckpointManager:
    return CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, local_dir=local_dir,
                             preemption=False)


def plain(remote) -> CheckpointManager:
    """A manager of the remote tier alone (what a replaced node sees)."""
    return CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, preemption=False)


def state(step: int):
    torch = pytest.importorskip("torch")
    from taskpoint.torch import StateDict

    return StateDict({"w": torch.arange(50_000, dtype=torch.float32) * step, "step": step})


def test_a_state_dict_step_is_promoted_with_its_kind_and_restores_from_the_remote_tier_alone(remote, tmp_path):
    from taskpoint.torch import load_state_dict_sync

    with tiered(remote, tmp_path / "local") as manager:
        manager.save(state(1), 1)
        manager.wait_until_finished()
        assert manager.steps(tier="local") == [1] and manager.steps(tier="remote") == [1]
        local = manager._tier.manifest(1)
    with plain(remote) as other:
        described = other.describe(1)
        assert described.kind == "torch.state_dict" == local.kind
        assert other.verify().healthy
        loaded = load_state_dict_sync(other)
        assert loaded["step"] == 1 and loaded["w"].equal(state(1).state["w"])
        assert other.gc(grace_seconds=0) == []  # nothing but what the manifest names was copied


def test_a_pytree_step_is_promoted_file_by_file(remote, tmp_path):
    np = pytest.importorskip("numpy")
    pytest.importorskip("jax")
    from taskpoint.jax import PyTree, load_pytree_sync

    with tiered(remote, tmp_path / "local") as manager:
        manager.save(PyTree({"w": np.arange(1000, dtype=np.float32), "b": np.ones(7, dtype=np.float32)}), 4)
        manager.wait_until_finished()
        assert manager.steps(tier="remote") == [4]
    with plain(remote) as other:
        assert other.describe(4).kind == "jax.pytree"
        tree = load_pytree_sync(other)
        assert [float(x) for x in tree["w"][:3]] == [0.0, 1.0, 2.0] and len(tree["b"]) == 7
        assert other.verify().healthy


def test_a_damaged_local_state_dict_step_is_never_committed_remotely(remote, tmp_path):
    """A byte flipped in a local state dict's file (same size; its manifest records the digests of its pieces,
    not its sha256): the copy, read back through the kind's verify, does not match, so the remote step is never
    committed and the copy is removed; the next step is promoted."""
    local_dir = tmp_path / "local"
    with CheckpointManager(local_dir, preemption=False) as before:  # a step left by a run killed before promoting
        before.save(state(3), 3)
    (file,) = (local_dir / "ckpt-3").glob("state-*.pt")
    body = bytearray(file.read_bytes())
    body[len(body) // 2] ^= 0x40
    file.write_bytes(bytes(body))
    with tiered(remote, local_dir) as manager:
        manager.save(state(4), 4)
        with pytest.raises(CheckpointCorruptError, match=r"step 3 .*damaged and was not promoted"):
            manager.wait_until_finished()
        assert manager.steps(tier="remote") == [4]
    with plain(remote) as other:
        assert other.verify().healthy
        assert other.gc(grace_seconds=0) == []  # the damaged copy was removed, nothing left behind


def test_a_dcp_step_is_written_on_the_local_tier_promoted_and_read_from_either(remote, tmp_path):
    """Writer.for_step of a tiered manager writes and commits the step on the local tier, which promotes it; a
    replaced node (an empty local folder) reads the remote copy with Reader.for_step, and the node that saved it
    reads its local copy (so a remote copy that lost its data files does not matter to it)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from taskpoint.torch import Reader, Writer

    def load(manager: CheckpointManager) -> list[float]:
        state = {"w": torch.zeros(64)}
        dcp.load(state, storage_reader=Reader.for_step(manager, 5))
        return state["w"].tolist()

    with tiered(remote, tmp_path / "local") as manager:
        dcp.save({"w": torch.arange(64.0)}, storage_writer=Writer.for_step(manager, 5))
        manager.wait_until_finished()
        assert manager.steps(tier="local") == [5] and manager.steps(tier="remote") == [5]
        assert manager.describe(5).kind == "fileset"  # the file-set kind, on both tiers
    with tiered(remote, tmp_path / "new-node") as fresh:
        assert fresh.steps(tier="local") == [] and load(fresh) == list(range(64))
        assert fresh.verify().healthy and fresh.gc(grace_seconds=0) == []
    fs, root = fsspec.core.url_to_fs(f"{remote.url('ckpts')}/ckpt-5", **fs_options(remote.storage_options))
    data = [path for path in fs.find(root) if path.endswith(".distcp")]
    assert data, fs.find(root)
    fs.rm(data)
    with tiered(remote, tmp_path / "local") as manager:
        assert load(manager) == list(range(64))


def test_writer_for_step_refuses_a_tiered_manager_of_several_ranks_when_it_is_made(tmp_path):
    """A rank's DCP load reads files other ranks wrote, which no node's local tier holds: Writer.for_step raises
    ValueError naming why, before DCP writes anything, and nothing is stored on either tier."""
    pytest.importorskip("torch")
    from taskpoint.torch import Writer

    with CheckpointManager(tmp_path / "remote", local_dir=tmp_path / "local", rank=0, world_size=3,
                           preemption=False) as manager:
        with pytest.raises(ValueError, match=r"Writer\.for_step.*local_dir and world_size 3: its ranks write one"):
            Writer.for_step(manager, 1)
        assert manager.steps() == []
    assert not any((tmp_path / "local").glob("ckpt-*")) and not any((tmp_path / "remote").glob("ckpt-*"))
