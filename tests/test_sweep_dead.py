"""What a process of this host left behind is swept by one rule (issue 41): folders and staging segments named for
an owner that is gone, including one whose pid another process now runs (where the name holds the owner's start);
never what a running owner holds."""

from __future__ import annotations

import os
import time
from pathlib import Path

from helpers import no_such_pid
from taskpoint import workspace
from taskpoint.manager import staging


def _aged(path: Path) -> Path:
    then = time.time() - workspace.LEFTOVER_GRACE_SECONDS - 60
    os.utime(path, (then, then))
    return path


def test_a_folder_whose_pid_another_process_reuses_is_swept_and_a_running_owners_kept(tmp_path):
    prefix, host, me = "taskpoint-test-", workspace.host_tag(), os.getpid()
    start = workspace.process_start(me)
    made = {what: tmp_path / f"{prefix}{name}" for what, name in {
        "mine": f"{host}-{me}-{start}-abc",
        "reused pid": f"{host}-{me}-{start + 1}-abc",
        "mine, without its start": f"{host}-{me}-abc12345",
        "dead, without its start": f"{host}-{no_such_pid()}-abc12345",
        "other host": f"00000000-{no_such_pid()}-0-abc",
    }.items()}
    for path in made.values():
        path.mkdir()
        _aged(path)
    swept = workspace.sweep_dead_folders(tmp_path, prefix)
    assert sorted(swept) == sorted([made["reused pid"], made["dead, without its start"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        made[what].name for what in ("mine", "mine, without its start", "other host"))


def test_segments_go_by_the_same_rule_whatever_their_age(tmp_path):
    dead = tmp_path / f"{staging.SEGMENT_PREFIX}{workspace.host_tag()}-{no_such_pid()}-7-0123abcd"
    mine = tmp_path / f"{staging.SEGMENT_PREFIX}{workspace.owner_tag(os.getpid())}-4567abcd"
    for path in (dead, mine):
        path.write_bytes(b"s")  # made now: a segment has no grace
    assert staging.sweep_dead_segments(tmp_path) == [dead]
    assert [p.name for p in tmp_path.iterdir()] == [mine.name]
