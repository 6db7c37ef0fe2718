"""Private workspaces: made only when first needed, and those that killed processes left in the temp folder
are removed (same host, process gone, older than the grace period). Real processes and real SIGKILLs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from taskpoint import Checkpoint, CheckpointManager, workspace

TIMEOUT = 60


@pytest.fixture
def temp_folder(tmp_path, monkeypatch) -> Path:
    """The temp folder of this process (and of the processes the test starts)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def test_a_checkpoint_that_only_saves_makes_no_folder(temp_folder, tmp_path):
    cp = Checkpoint(tmp_path / "store" / "ckpt")
    cp.save_sync(b"state")
    cp.save_sync(b"newer state")
    assert "path=None" in repr(cp)  # the repr does not make one either
    assert list(temp_folder.iterdir()) == []
    cp.close()
    with CheckpointManager(tmp_path / "store" / "steps") as m:
        m.save(b"step", 1)
    assert list(temp_folder.iterdir()) == []


def test_the_workspace_exists_whenever_path_is_read(temp_folder, tmp_path):
    Checkpoint(tmp_path / "prev").save_sync(b"previous")
    with Checkpoint(tmp_path / "next", tmp_path / "prev") as cp:
        path = cp.path
        assert path.is_dir() and path.parent == temp_folder
        assert re.fullmatch(rf"taskpoint-{workspace.host_tag()}-{os.getpid()}-\w+", path.name)
        assert cp.load_sync() == path / "payload"
        assert str(path) in repr(cp)
    assert not path.exists()
    with Checkpoint(tmp_path / "other", tmp_path / "prev") as cp:
        assert cp.load_sync().read_bytes() == b"previous"  # a load makes it too


_LOAD_THEN_DIE = textwrap.dedent(
    """
    import os, signal, sys, taskpoint
    cp = taskpoint.Checkpoint(sys.argv[1] + "/dest", sys.argv[1] + "/src")
    cp.load_sync()
    (cp.path / "partial-extraction.bin").write_bytes(b"x" * 100_000)
    print(cp.path, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()  # "live": wait until the test closes stdin
    """
)


def _aged(path: Path) -> Path:
    old = time.time() - workspace.LEFTOVER_GRACE_SECONDS - 60
    os.utime(path, (old, old))
    return path


def test_workspaces_that_killed_loaders_left_are_removed_by_the_next_workspace(temp_folder, tmp_path):
    Checkpoint(tmp_path / "src").save_sync(os.urandom(50_000))
    killed = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _LOAD_THEN_DIE, str(tmp_path), "die"], capture_output=True,
                             text=True, timeout=TIMEOUT)
        assert out.returncode == -signal.SIGKILL, out.stderr
        killed.append(Path(out.stdout.strip()))
    assert all((p / "partial-extraction.bin").exists() for p in killed)
    live = subprocess.Popen([sys.executable, "-c", _LOAD_THEN_DIE, str(tmp_path), "live"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        old_live = _aged(Path(live.stdout.readline().strip()))
        old_dead, young_dead = _aged(killed[0]), killed[1]
        other_host = _aged(_copy_named(old_dead, temp_folder, f"taskpoint-00000000-{killed[0].name.split('-')[2]}-x"))
        by_hand = _aged(_copy_named(old_dead, temp_folder, "taskpoint-by-hand"))
        with Checkpoint(tmp_path / "mine", tmp_path / "src") as cp:
            cp.load_sync()
            mine = cp.path
            assert not old_dead.exists()
            assert young_dead.exists() and old_live.exists() and other_host.exists() and by_hand.exists()
            assert mine.exists()
    finally:
        live.stdin.close()
        live.wait(TIMEOUT)


def _copy_named(like: Path, parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir()
    for entry in like.iterdir():
        (folder / entry.name).write_bytes(entry.read_bytes())
    return folder


def test_sweep_dead_folders_is_what_the_snapshot_sweep_uses(tmp_path):
    """One implementation for workspaces and snapshots: the prefix tells them apart."""
    from taskpoint.manager import background

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(TIMEOUT)
    host = workspace.host_tag()
    snapshot = _aged(_mkdir(tmp_path / f"{background.SNAPSHOT_PREFIX}{host}-{finished.pid}-a"))
    work = _aged(_mkdir(tmp_path / f"{workspace.WORKSPACE_PREFIX}{host}-{finished.pid}-b"))
    assert workspace.sweep_dead_folders(tmp_path, workspace.WORKSPACE_PREFIX) == [work]
    assert snapshot.exists() and not work.exists()
    assert workspace.sweep_dead_folders(tmp_path, background.SNAPSHOT_PREFIX) == [snapshot]


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path
