"""The local tier (issue 24) under SIGKILL: the trainer or one of its save processes is killed at random moments
of saves and promotions; no tier may then list a step that does not restore, and a restart resumes from the
newest step and redoes the promotions the kill interrupted."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import _location_fixture
from helpers import ORPHAN_EXIT_SLACK, process_gone, wait_until
from taskpoint import CheckpointManager
from test_local_tier import plain, tiered

KILL_REMOTES = ["local", "s3"]


@pytest.fixture(params=KILL_REMOTES, ids=KILL_REMOTES)
def remote(request: pytest.FixtureRequest) -> Iterator[object]:
    """A fresh remote tier: local disk or the S3 server."""
    yield from _location_fixture(request)


KILL_TRIALS = 3  # make test; the campaign runs CAMPAIGN_KILL_TRIALS
CAMPAIGN_KILL_TRIALS = 24
KILL_SIZE = {"local": 4 << 20, "s3": 10 << 20}  # on S3 above the 8 MiB part size: multipart uploads get killed
_TRAINER = textwrap.dedent("""
    import json, random, sys
    import taskpoint
    remote, options, local_dir, first, size = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:])
    with taskpoint.CheckpointManager(remote, storage_options=options, local_dir=local_dir, remote_every=2,
                                     local_keep=2, keep=3, preemption=False) as m:
        print(json.dumps({"ready": True}), flush=True)
        for step in range(first, first + 40):
            m.save(random.Random(step).randbytes(size), step, blocking=step % 3 != 0)
            # the save processes: the promotions' (remote) and the local tier's background saves'
            savers = (m._background.saver, m._tier.local._background.saver)
            print(json.dumps({"step": step, "helpers": [s.pid for s in savers if s]}), flush=True)
""")


def state(step: int, size: int) -> bytes:
    return random.Random(step).randbytes(size)


class Trainer:
    """The trainer process of one trial, and the pids of the save processes it reported (the promotions' and the
    local tier's, each of which commits what it holds for a trainer that died)."""

    def __init__(self, remote, local_dir: Path, first: int, size: int) -> None:
        env = {**os.environ, "TASKPOINT_GRACE_SECONDS": "10"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, remote.url("ckpts"), json.dumps(remote.storage_options), str(local_dir),
             str(first), str(size)], stdout=subprocess.PIPE, env=env, text=True)
        self.ready = threading.Event()
        self.helpers: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            event = json.loads(line)
            self.helpers.update(event.get("helpers", ()))
            self.ready.set()
        self.ready.set()


def check_tiers(remote, local_dir: Path, size: int) -> int:
    """Every step either tier lists restores exactly; a restart resumes from the newest; a new due step promotes
    every due local step; leftovers are swept. Returns the next free step."""
    with plain(remote) as other, CheckpointManager(local_dir, preemption=False) as local:
        listed = {"remote": other.steps(), "local": local.steps()}
        for tier, manager in (("remote", other), ("local", local)):
            for step in listed[tier]:
                assert manager.restore(step).read_bytes() == state(step, size), (tier, step)
    union = sorted(set(listed["remote"]) | set(listed["local"]))
    with tiered(remote, local_dir, remote_every=2, local_keep=2, keep=3, preemption=False) as m:
        if union:
            restored = m.restore().read_bytes()
            assert (m.restored_step, restored == state(union[-1], size)) == (union[-1], True), listed
        step = (union[-1] if union else 0) + 1
        step += step % 2  # a due step: its promotion redoes any killed one
        m.save(state(step, size), step)
        m.wait_until_finished()
        due = {s for s in m.steps(tier="local") if s % 2 == 0}
        assert due <= set(m.steps(tier="remote")), m.steps(tier="remote")
    for directory, options in ((remote.url("ckpts"), remote.storage_options), (str(local_dir), {})):
        with CheckpointManager(directory, storage_options=options, grace_seconds=0, preemption=False) as swept:
            swept.gc()
            for summary in swept.inventory():
                assert summary.state == "committed" and not summary.leftovers, summary
    return step + 1


def kill_campaign(remote, tmp_path: Path, trials: int, seed: int) -> dict[str, int]:
    rng, size, local_dir = random.Random(seed), KILL_SIZE[remote.kind], tmp_path / "local"
    outcomes = {"trainer": 0, "helper": 0, "finished": 0}
    step = 1
    for _ in range(trials):
        trainer = Trainer(remote, local_dir, step, size)
        try:
            assert trainer.ready.wait(60)
            victim = "helper" if rng.random() < 0.3 else "trainer"
            if victim == "helper":  # it starts with the first promotion
                assert wait_until(lambda known=trainer.helpers: known, 60)
            time.sleep(rng.uniform(0.0, 3.0))
            pid = max(trainer.helpers) if victim == "helper" else trainer.process.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if victim == "helper":  # the trainer saves from its own process, then goes on: stop it too
                os.kill(trainer.process.pid, signal.SIGKILL)
            code = trainer.process.wait(60)
            outcomes["finished" if code == 0 else victim] += 1
            for helper in trainer.helpers:  # an orphaned save process finishes its commit, then exits
                assert process_gone(helper, ORPHAN_EXIT_SLACK), helper
        finally:
            with contextlib.suppress(ProcessLookupError):
                trainer.process.kill()
        step = check_tiers(remote, local_dir, size)
    return outcomes


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
@pytest.mark.slow
def test_sigkill_at_random_moments_never_lists_a_step_that_does_not_restore(remote, tmp_path):
    outcomes = kill_campaign(remote, tmp_path, KILL_TRIALS, seed=24)
    assert sum(outcomes.values()) == KILL_TRIALS


@pytest.mark.campaign(f"{CAMPAIGN_KILL_TRIALS} SIGKILLs of the trainer or its save process per store "
                      f"(make test: {KILL_TRIALS} on S3)")
def test_sigkill_campaign_over_saves_and_promotions(remote, tmp_path):
    outcomes = kill_campaign(remote, tmp_path, CAMPAIGN_KILL_TRIALS, seed=2424)
    print(f"local tier SIGKILL campaign on {remote.kind}: {outcomes}")
    assert outcomes["trainer"] and outcomes["helper"], outcomes
