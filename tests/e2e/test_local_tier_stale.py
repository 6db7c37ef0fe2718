"""Stale local copies of the local tier (issue 40, item 6): a node killed after ``save(3)`` returned and before
step 3 was promoted keeps a local step 3 that the job, resumed elsewhere, commits again with other bytes. The
remote manifest is the truth: such a copy is never restored (the remote copy is, and the stale one removed),
``taskpoint verify/ls/show --local-dir`` report it, and ``open()`` reads steps the local tier alone holds.

The killed node is a real process (SIGKILL, its promotion of step 3 held by the test so that the kill comes
before it); the remote tier is local disk or the S3 server; the command line runs as the real ``taskpoint``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import _location_fixture
from taskpoint import CheckpointManager

STALE_REMOTES = ["local", "s3"]
#: Node A: saves steps 1 and 2 (promoted), then step 3, whose promotion the test holds (bounded) until the
#: SIGKILL; prints "saved 3" once ``save(3)`` returned.
_NODE_A = textwrap.dedent("""
    import json, sys, time
    import taskpoint
    from taskpoint.manager import tiers

    remote, options, local_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    promote = tiers.LocalTier.promote

    def held(self, step, *args, **kwargs):
        if step == 3:  # the test's hold: the SIGKILL comes first (bounded, should it not)
            end = time.monotonic() + 300
            while time.monotonic() < end:
                time.sleep(0.05)
        return promote(self, step, *args, **kwargs)

    tiers.LocalTier.promote = held
    with taskpoint.CheckpointManager(remote, storage_options=options, local_dir=local_dir, preemption=False,
                                     background_process=False) as m:
        for step in (1, 2, 3):
            m.save(f"node A, step {step} ".encode() * 1000, step, metadata={"node": "A"})
            if step < 3:
                m.wait_until_finished()
        print("saved 3", flush=True)
        time.sleep(300)
""")


@pytest.fixture(params=STALE_REMOTES, ids=STALE_REMOTES)
def remote(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh remote tier: local disk or the S3 server."""
    yield from _location_fixture(request)


def state(node: str, step: int) -> bytes:
    return f"node {node}, step {step} ".encode() * 1000


def tiered(remote: Any, local_dir: Path, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, local_dir=local_dir,
                             preemption=False, **kwargs)


def taskpoint_command(remote: Any, *args: object) -> subprocess.CompletedProcess[str]:
    """The real ``taskpoint`` command (the console script beside this interpreter), the remote tier's storage
    options in its environment."""
    env = {**os.environ, "TASKPOINT_STORAGE_OPTIONS": json.dumps(remote.storage_options),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([str(Path(sys.executable).with_name("taskpoint")), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


def node_a_killed_before_promoting_step_3(remote: Any, local_dir: Path) -> None:
    """Run node A until ``save(3)`` returned, then SIGKILL it: step 3 is on its local tier alone."""
    node = subprocess.Popen([sys.executable, "-c", _NODE_A, remote.url("ckpts"), json.dumps(remote.storage_options),
                             str(local_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert node.stdout is not None
        assert node.stdout.readline().strip() == "saved 3", node.stderr.read() if node.poll() is not None else ""
    finally:
        node.kill()
        node.communicate(timeout=60)
    with CheckpointManager(local_dir, preemption=False) as local, \
            CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, preemption=False) as far:
        assert (local.steps(), far.steps()) == ([2, 3], [1, 2])


def resumed_elsewhere(remote: Any, local_dir: Path) -> None:
    """The job resumes on node B (its own local_dir) from remote step 2 and commits its own step 3."""
    with tiered(remote, local_dir) as b:
        assert b.restore().read_bytes() == state("A", 2) and b.restored_step == 2
        b.save(state("B", 3), 3, metadata={"node": "B"})
        b.wait_until_finished()
        assert b.steps(tier="remote") == [1, 2, 3]


@pytest.mark.parametrize("how", ["newest", "step 3"])
def test_a_stale_local_copy_is_never_restored_the_committed_step_is(remote, tmp_path, caplog, how):
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    node_a_killed_before_promoting_step_3(remote, node_a)
    resumed_elsewhere(remote, node_b)
    caplog.set_level(logging.WARNING, logger="taskpoint")
    with tiered(remote, node_a) as a:  # back on node A: a new manager on its local_dir
        assert a.metadata(3) == {"node": "B"}
        restored = a.restore() if how == "newest" else a.restore(3)
        assert (restored.read_bytes(), a.restored_step) == (state("B", 3), 3)
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "not the committed step" in warning and str(node_a) in warning, warning
        assert a.steps(tier="local") == [2]  # the stale copy is gone: nothing later builds on it
        a.save(state("A", 4), 4, metadata={"node": "A"})
        a.wait_until_finished()
        assert a.steps(tier="remote") == [1, 2, 3, 4]
        assert a.restore(3).read_bytes() == state("B", 3) and a.restore().read_bytes() == state("A", 4)
    with CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, preemption=False) as far:
        assert far.verify().healthy and far.restore(3).read_bytes() == state("B", 3)


@pytest.mark.slow
def test_verify_ls_and_show_with_local_dir_report_a_local_copy_that_is_not_the_committed_step(remote, tmp_path):
    node_a = tmp_path / "node-a"
    node_a_killed_before_promoting_step_3(remote, node_a)
    done = taskpoint_command(remote, "verify", remote.url("ckpts"), "--local-dir", node_a)
    assert done.returncode == 0, done.stderr  # step 3 on the local tier alone: restorable, as the tier's point is
    resumed_elsewhere(remote, tmp_path / "node-b")
    for args in ((), ("--step", 3)):
        done = taskpoint_command(remote, "verify", remote.url("ckpts"), "--local-dir", node_a, *args)
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert "local: step 3: healthy" in done.stdout and "remote: step 3: healthy" in done.stdout
        (line,) = [line for line in done.stdout.splitlines() if "not the committed step" in line]
        assert line.startswith("local: step 3: ") and remote.url("ckpts") in line, line
        assert "1 local copy" in done.stderr and "step(s) 3" in done.stderr, done.stderr
    done = taskpoint_command(remote, "verify", remote.url("ckpts"), "--local-dir", node_a, "--step", 2)
    assert done.returncode == 0, done.stderr  # a promoted copy is the committed step
    done = taskpoint_command(remote, "ls", remote.url("ckpts"), "--local-dir", node_a, "--json")
    rows = {(row["step"], row["tier"]): row for row in json.loads(done.stdout)["steps"]}
    assert [key for key, row in rows.items() if row.get("not_the_committed_step")] == [(3, "local")]
    assert rows[(2, "local")]["not_the_committed_step"] is None and "not_the_committed_step" not in rows[(3, "remote")]
    done = taskpoint_command(remote, "ls", remote.url("ckpts"), "--local-dir", node_a)
    assert [line.split()[:2] for line in done.stdout.splitlines() if "not the committed step" in line] == [
        ["3", "local"]], done.stdout
    done = taskpoint_command(remote, "show", remote.url("ckpts"), "--local-dir", node_a, "--step", 3, "--json")
    shown = json.loads(done.stdout)  # the committed step, and why the local copy is not it
    assert shown["metadata"] == {"node": "B"} and shown["tiers"] == "local, remote"
    assert shown["local_copy"].startswith("not the committed step"), shown
    with tiered(remote, node_a) as a:  # a tiered restore replaces the stale copy by reading the committed one
        assert a.restore().read_bytes() == state("B", 3)
    done = taskpoint_command(remote, "verify", remote.url("ckpts"), "--local-dir", node_a)
    assert done.returncode == 0, (done.stdout, done.stderr)


def test_open_reads_a_step_the_local_tier_alone_holds(remote, tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.bin").write_bytes(os.urandom(1 << 16))
    (folder / "notes.txt").write_text("step one")
    with tiered(remote, tmp_path / "local", remote_every=2) as m:
        m.save(folder, 1)
        m.wait_until_finished()
        assert (m.steps(tier="local"), m.steps(tier="remote")) == ([1], [])
        with m.open(1, "model.bin") as f:
            assert f.read() == (folder / "model.bin").read_bytes()
        with m.open(1, "notes.txt") as f:
            assert f.read() == b"step one"
        with pytest.raises(KeyError):
            m.open(1, "missing.txt")
        with pytest.raises(FileNotFoundError, match="step 7"):
            m.open(7, "notes.txt")
        (folder / "notes.txt").write_text("step two")
        m.save(folder, 2)
        m.wait_until_finished()
        assert m.steps(tier="remote") == [2]
        with m.open(2, "notes.txt") as f:  # on both tiers: read as the remote step, the committed one
            assert f.read() == b"step two"
