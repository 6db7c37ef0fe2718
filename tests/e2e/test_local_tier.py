"""The local tier (issue 24): steps committed to a local folder first, promoted to the remote directory in the
background, restored from whichever copy verifies; on local disk, memory:// and the S3 server as remote tier."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import taskpoint
from conftest import _location_fixture
from helpers import make_tree, object_exists, snapshot
from taskpoint import CheckpointCorruptError, CheckpointError, CheckpointManager, preemption
from taskpoint.cli import main
from taskpoint.manager import MANIFEST_NAME
from taskpoint.manager.step_commit import OrphanCommit
from taskpoint.storage import Location

TIER_REMOTES = ["local", "memory", "s3"]


@pytest.fixture(params=TIER_REMOTES, ids=TIER_REMOTES)
def remote(request: pytest.FixtureRequest) -> Iterator[object]:
    """A fresh remote tier: local disk, memory:// or the S3 server."""
    yield from _location_fixture(request)


def tiered(remote, local_dir: Path, **kwargs) -> CheckpointManager:
    return CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, local_dir=local_dir,
                             **kwargs)


def plain(remote) -> CheckpointManager:
    """A manager of the remote tier alone (what another node sees)."""
    return CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options)


def data(step: int) -> bytes:
    return f"state of step {step} ".encode() * 2000


def flip_local(local_dir: Path, step: int) -> None:
    """Flip one byte in the middle of the local payload of ``step``."""
    (payload,) = (local_dir / f"ckpt-{step}").glob("payload-*")
    body = bytearray(payload.read_bytes())
    body[len(body) // 2] ^= 0x40
    payload.write_bytes(bytes(body))


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_steps_one_to_six_leave_three_and_six_remote_and_the_newest_local(remote, tmp_path, blocking):
    local_dir = tmp_path / "local"
    with tiered(remote, local_dir, remote_every=3, local_keep=2) as m:
        for step in range(1, 7):
            uri = m.save(data(step), step, metadata={"step": step}, blocking=blocking)
            assert uri.startswith(str(local_dir))
        m.wait_until_finished()
        assert m.steps(tier="remote") == [3, 6]
        assert m.steps(tier="local") == [5, 6]
        assert m.steps() == [3, 5, 6]
        assert (m.latest_step(), m.latest_step(tier="remote"), m.latest_step(tier="local")) == (6, 6, 6)
        assert m.metadata(5) == {"step": 5}  # a step on the local tier alone
        assert m.restore().read_bytes() == data(6) and m.restored_step == 6
        assert m.restore(5).read_bytes() == data(5)
    with plain(remote) as other:  # the remote steps are plain committed steps, verified as any
        assert other.steps() == [3, 6]
        assert other.verify().healthy
        assert other.restore(3).read_bytes() == data(3)
    with CheckpointManager(local_dir) as local:
        assert local.steps() == [5, 6] and local.verify().healthy


def test_a_directory_is_promoted_byte_for_byte_and_restores_from_either_tier(remote, tmp_path):
    tree = make_tree(tmp_path / "tree", big=300_000)
    with tiered(remote, tmp_path / "local") as m:
        m.save(tree, 1)
        m.wait_until_finished()
        assert snapshot(m.restore()) == snapshot(tree)
    with plain(remote) as other:
        assert snapshot(other.restore(1)) == snapshot(tree)
        assert other.describe(1).payload == CheckpointManager(tmp_path / "local").describe(1).payload


def test_a_wiped_local_dir_restores_the_newest_remote_step(remote, tmp_path):
    local_dir = tmp_path / "local"
    with tiered(remote, local_dir, remote_every=3) as m:
        with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
            m.restore()
        for step in range(1, 6):
            m.save(data(step), step)
    shutil.rmtree(local_dir)  # the node was replaced
    with tiered(remote, local_dir, remote_every=3) as m:
        assert m.steps() == [3] and m.steps(tier="local") == []
        assert m.restore().read_bytes() == data(3) and m.restored_step == 3


def test_a_flipped_byte_in_the_newest_local_step_restores_its_remote_copy_with_a_warning(remote, tmp_path, caplog):
    local_dir = tmp_path / "local"
    with tiered(remote, local_dir, remote_every=3) as m:
        for step in range(1, 7):
            m.save(data(step), step)
        m.wait_until_finished()
        flip_local(local_dir, 6)
        with caplog.at_level(logging.WARNING, logger="taskpoint"):
            assert m.restore().read_bytes() == data(6)
        assert m.restored_step == 6
        (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert "step 6" in record.message and str(local_dir) in record.message
        assert remote.url("ckpts").split("://")[-1] in record.message


def test_a_flipped_byte_in_a_step_only_local_restores_the_newest_older_step_that_verifies(remote, tmp_path, caplog):
    local_dir = tmp_path / "local"
    with tiered(remote, local_dir, remote_every=3, local_keep=3) as m:
        for step in range(1, 6):
            m.save(data(step), step)
        m.wait_until_finished()
        assert m.steps() == [3, 4, 5]
        flip_local(local_dir, 5)
        flip_local(local_dir, 3)  # its remote copy restores
        with caplog.at_level(logging.WARNING, logger="taskpoint"):
            assert m.restore().read_bytes() == data(4)
        assert m.restored_step == 4
        assert any("step 5" in r.message and "older" in r.message for r in caplog.records)
        with pytest.raises(CheckpointCorruptError, match="step 5 "):
            m.restore(5)  # a requested step is that step, or an error
        assert m.restore(5, fallback=True).read_bytes() == data(4)
        assert m.restore(3).read_bytes() == data(3)


def test_a_damaged_local_step_is_never_promoted_and_the_later_due_steps_are(remote, tmp_path, caplog):
    local_dir = tmp_path / "local"
    with CheckpointManager(local_dir) as before:  # steps left by a run killed before their promotion
        before.save(data(3), 3)
        before.save(data(6), 6)
    flip_local(local_dir, 3)
    with tiered(remote, local_dir, remote_every=3, local_keep=5) as m:
        m.save(data(9), 9)
        with pytest.raises(CheckpointCorruptError, match=r"step 3 .*not promoted"):
            m.wait_until_finished()
        assert m.steps(tier="remote") == [6, 9]  # step 6 redone, step 3 left local
    with plain(remote) as other:
        assert other.verify().healthy
        assert other.gc(grace_seconds=0) == []  # the damaged copy was removed, nothing left behind


def test_retention_is_per_tier(remote, tmp_path):
    local_dir = tmp_path / "local"
    with tiered(remote, local_dir, keep=2, keep_every=4, local_keep=3) as m:
        for step in range(1, 9):
            m.save(data(step), step)
        m.wait_until_finished()
        assert m.steps(tier="remote") == [4, 7, 8]
        assert m.steps(tier="local") == [6, 7, 8]


def test_delete_removes_a_step_from_both_tiers(remote, tmp_path):
    local_dir = tmp_path / "local"
    with tiered(remote, local_dir, remote_every=2, local_keep=5) as m:
        for step in range(1, 5):
            m.save(data(step), step)
        m.wait_until_finished()
        m.delete(2)
        assert m.steps() == [1, 3, 4] and m.steps(tier="remote") == [4]
        m.delete(3)  # local alone
        assert m.steps() == [1, 4]
        with pytest.raises(FileNotFoundError, match="step 3"):
            m.delete(3)
        with pytest.raises(CheckpointError, match="protected"):
            m.delete(4)
        m.delete(4, force=True)
        assert m.steps() == [1]


def test_gc_sweeps_the_leftovers_of_both_tiers(remote, tmp_path):
    local_dir = tmp_path / "local"
    with tiered(remote, local_dir, remote_every=2) as m:
        m.save(data(1), 1)
        m.save(data(2), 2)
        m.wait_until_finished()
        leftover = local_dir / "ckpt-3" / f"payload-{'ab' * 16}"  # a local save killed before its commit
        leftover.parent.mkdir()
        leftover.write_bytes(b"torn")
        assert [uri for uri in m.gc(grace_seconds=0) if str(local_dir) in uri] == [str(leftover)]
        assert not leftover.exists() and m.steps() == [1, 2]


def test_saving_a_step_on_either_tier_needs_overwrite(remote, tmp_path):
    local_dir = tmp_path / "local"
    with tiered(remote, local_dir, local_keep=1) as m:
        m.save(data(1), 1)
        m.save(data(2), 2)
        m.wait_until_finished()
        assert m.steps(tier="local") == [2]
        with pytest.raises(FileExistsError, match="step 1"):
            m.save(b"again", 1)  # on the remote tier alone
        m.save(b"again", 2, overwrite=True)
        m.wait_until_finished()
        assert m.restore(2).read_bytes() == b"again"
    with plain(remote) as other:
        assert other.restore(2).read_bytes() == b"again"


def test_bad_tier_arguments_are_refused_clearly(tmp_path):
    remote_dir = tmp_path / "remote"
    with pytest.raises(ValueError, match="dedup=True cannot be combined with local_dir"):
        CheckpointManager(remote_dir, local_dir=tmp_path / "local", dedup=True)
    with pytest.raises(ValueError, match=r"commit_timeout \(600.0 s\) must be shorter than grace_seconds"):
        CheckpointManager(remote_dir, local_dir=tmp_path / "local", rank=0, world_size=2, grace_seconds=1)
    with pytest.raises(ValueError, match="local_dir must be a local path"):
        CheckpointManager(remote_dir, local_dir="memory://elsewhere")
    with pytest.raises(ValueError, match="remote_every must be at least 1"):
        CheckpointManager(remote_dir, local_dir=tmp_path / "local", remote_every=0)
    with pytest.raises(TypeError, match="remote_every must be an int >= 1"):
        CheckpointManager(remote_dir, local_dir=tmp_path / "local", remote_every=None)
    with pytest.raises(ValueError, match="local_keep must be at least 1"):
        CheckpointManager(remote_dir, local_dir=tmp_path / "local", local_keep=0)
    with CheckpointManager(remote_dir) as m:
        with pytest.raises(ValueError, match="no local tier"):
            m.steps(tier="local")
        assert m.steps(tier="remote") == []
        with pytest.raises(ValueError, match="tier must be"):
            m.steps(tier="nvme")
    assert not remote_dir.exists()


# -- preemption -------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh() -> Iterator[None]:
    """No notice and no handler of ours before and after the test (the handlers of this process restored)."""
    saved = signal.getsignal(signal.SIGUSR1)
    preemption.uninstall()
    preemption.clear()
    yield
    preemption.uninstall()
    preemption.clear()
    signal.signal(signal.SIGUSR1, saved)


def test_the_emergency_step_goes_to_the_remote_tier_after_the_promotion_in_flight(fresh, tmp_path):
    local_dir, remote_dir = tmp_path / "local", tmp_path / "remote"
    state = {"n": 0}
    with CheckpointManager(remote_dir, local_dir=local_dir, remote_every=2,
                           on_preemption=lambda: b"emergency %d" % state["n"]) as m:
        m.save(os.urandom(1 << 20), 1)
        m.save(os.urandom(8 << 20), 2)  # its promotion is in flight when the notice arrives
        state["n"] = 7
        preemption.notify(signal.SIGUSR1)
        with pytest.raises(taskpoint.Preempted) as caught:
            m.save(b"never saved", 3)
        assert caught.value.step == 3
        assert m.steps(tier="remote") == [2, 3] and m.steps(tier="local") == [1, 2]
    with CheckpointManager(remote_dir, preemption=False) as other:  # what the next node sees
        assert other.restore(3).read_bytes() == b"emergency 7"
        assert other.verify().healthy


# -- the command line -------------------------------------------------------------------------------------------


def tp(capsys, *args: object) -> tuple[int, str]:
    """Run the command line in this process; exit code and stdout."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().out


def test_ls_verify_and_show_with_local_dir_say_which_tier_holds_each_step(capsys, tmp_path):
    local_dir, remote_dir = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(remote_dir, local_dir=local_dir, remote_every=2, local_keep=2, preemption=False) as m:
        for step in range(1, 6):
            m.save(data(step), step, metadata={"step": step})
    code, out = tp(capsys, "ls", remote_dir, "--local-dir", local_dir, "--json")
    assert code == 0
    rows = json.loads(out)["steps"]
    assert [(row["step"], row["tier"]) for row in rows] == [(2, "remote"), (4, "local"), (4, "remote"),
                                                            (5, "local")]
    code, out = tp(capsys, "ls", remote_dir, "--local-dir", local_dir)
    assert code == 0 and "TIER" in out
    assert [line.split()[:2] for line in out.splitlines() if line.split()[0].isdigit()] == [
        ["2", "remote"], ["4", "local"], ["4", "remote"], ["5", "local"]]
    code, out = tp(capsys, "show", remote_dir, "--local-dir", local_dir)
    assert code == 0 and "step: 5" in out and "tiers: local\n" in out
    code, out = tp(capsys, "show", remote_dir, "--local-dir", local_dir, "--step", 4)
    assert code == 0 and "tiers: local, remote" in out and str(local_dir) in out
    code, out = tp(capsys, "verify", remote_dir, "--local-dir", local_dir)
    assert code == 0
    assert [line for line in out.splitlines() if "healthy (" in line and line.startswith(("local", "remote"))] == [
        line for line in out.splitlines() if line.startswith(("local: step", "remote: step"))]
    assert sum(line.startswith("local: step") for line in out.splitlines()) == 2
    assert sum(line.startswith("remote: step") for line in out.splitlines()) == 2
    flip_local(local_dir, 5)
    code, out = tp(capsys, "verify", remote_dir, "--local-dir", local_dir)
    assert code == 2 and "local: step 5: DAMAGED" in out
    code, out = tp(capsys, "verify", remote_dir, "--local-dir", local_dir, "--step", 4)
    assert code == 0 and "local: step 4: healthy" in out and "remote: step 4: healthy" in out
    code, _ = tp(capsys, "show", remote_dir, "--local-dir", local_dir, "--step", 3)
    assert code == 3


def test_the_save_process_commits_a_dead_trainers_promotion_only_when_the_copy_matches(remote, tmp_path):
    """What the save process does for a trainer that died during a promotion (OrphanCommit.finish of a copy): the
    local manifest is written remotely for a copy of its size and digest, never for another, never over a
    manifest."""
    local_dir = tmp_path / "local"
    with CheckpointManager(local_dir) as local:
        local.save(data(4), 4)
        manifest = local._steps.manifest(4)
    assert manifest is not None
    (payload,) = (local_dir / "ckpt-4").glob("payload-*")
    target = f"{remote.url('ckpts')}/ckpt-4/{MANIFEST_NAME}"
    commit = OrphanCommit(target, remote.storage_options, None, manifest, fill=False)
    assert manifest.record.digest is not None
    digest = manifest.record.digest[1]
    Location(f"{remote.url('ckpts')}/ckpt-4/{payload.name}", remote.storage_options).write_small(payload.read_bytes())
    commit.finish(manifest.record.size, "0" * 64, time.monotonic() + 5)  # a torn copy: not committed
    assert not object_exists(target, remote.storage_options)
    commit.finish(manifest.record.size, digest, time.monotonic() + 5)
    with plain(remote) as other:
        assert other.steps() == [4] and other.restore(4).read_bytes() == data(4)
    other_manifest = dataclasses.replace(manifest, metadata={"other": True})
    OrphanCommit(target, remote.storage_options, None, other_manifest, fill=False).finish(
        manifest.record.size, digest, time.monotonic() + 5)
    with plain(remote) as other:
        assert other.metadata(4) == {}  # the manifest there was kept


def test_restore_in_place_with_a_local_tier_restores_as_restore_does(tmp_path):
    with CheckpointManager(tmp_path / "remote", local_dir=tmp_path / "local") as m:
        m.save(data(1), 1)
        m.save(data(2), 2)
        m.wait_until_finished()
        with m.restore_in_place(1) as path:
            assert path.read_bytes() == data(1) and m.restored_step == 1
        with m.restore_in_place() as path:
            assert path.read_bytes() == data(2) and m.restored_step == 2
