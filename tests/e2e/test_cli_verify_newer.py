"""``taskpoint verify`` (a real process) of a step or checkpoint a newer taskpoint wrote: NEWER, exit code 4
(docs/cli.md), never DAMAGED (2); damage elsewhere in the directory still exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import taskpoint
from _newer import damage, from_the_future, steps_with_a_newer_one
from taskpoint.format.records import RECORD_SUFFIX

OK, DAMAGED, NEWER = 0, 2, 4


def verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "taskpoint", "verify", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_directory_with_a_newer_step_exits_4_and_says_upgrade(tmp_path: Path) -> None:
    root = steps_with_a_newer_one(tmp_path / "steps")
    done = verify(str(root))
    assert done.returncode == NEWER, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("step 1: healthy") and lines[2].startswith("step 3: healthy")
    assert lines[1].startswith("step 2: NEWER: ") and "upgrade taskpoint" in lines[1]
    assert "DAMAGED" not in done.stdout and "newer taskpoint" in done.stderr

    one = verify(str(root), "--step", "2")
    assert one.returncode == NEWER and "upgrade taskpoint" in one.stderr
    assert verify(str(root), "--step", "1").returncode == OK
    listed = subprocess.run([sys.executable, "-m", "taskpoint", "ls", str(root)], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == OK
    rows = [line.split()[:2] for line in listed.stdout.splitlines() if line.strip().startswith("2 ")]
    assert rows == [["2", "newer"]], listed.stdout


def test_damage_beside_a_newer_step_exits_2(tmp_path: Path) -> None:
    root = steps_with_a_newer_one(tmp_path / "steps")
    damage(root, 3)
    done = verify(str(root))
    assert done.returncode == DAMAGED
    assert "step 2: NEWER" in done.stdout and "step 3: DAMAGED" in done.stdout


def test_a_checkpoint_whose_record_is_newer_exits_4(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    taskpoint.Checkpoint(uri).save_sync(b"x" * 1000)
    assert verify(uri).returncode == OK
    from_the_future(Path(uri + RECORD_SUFFIX))
    done = verify(uri)
    assert done.returncode == NEWER and "upgrade taskpoint" in done.stderr
