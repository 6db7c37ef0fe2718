"""The local tier with several ranks (issue 24, item 5): each rank's local tier holds its own shard on its own
node, a remote step is committed only once every rank promoted its shard, and a restore returns one step on
every rank, each reading its shard from its local tier when its copy verifies and from the remote tier
otherwise.

Two real processes with torchrun's variables (tests/_local_tier_ranks_worker.py), a gloo process group where a
test says so, on local disk and the S3 server as the remote tier; each rank's local folder is its own (no rank
reads another's). Nothing waits on time: the ranks' outputs are read to their end.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import _zygote as zygote
from conftest import _location_fixture
from helpers import process_gone
from taskpoint import CheckpointManager

WORKER = Path(__file__).parents[1] / "_local_tier_ranks_worker.py"
WORLD = 2
pytestmark = pytest.mark.slow  # several processes per test: scheduled first
RANK_REMOTES = ["local", "s3"]
KILL_TRIALS = 2  # make test; the campaign runs CAMPAIGN_KILL_TRIALS per store
CAMPAIGN_KILL_TRIALS = 12


@pytest.fixture(params=RANK_REMOTES, ids=RANK_REMOTES)
def remote(request: pytest.FixtureRequest) -> Iterator[object]:
    """A fresh remote tier: local disk or the S3 server."""
    yield from _location_fixture(request)


def state(rank: int, step: int) -> bytes:
    """What the worker saves as ``rank``'s shard of ``step``."""
    return f"rank {rank} at step {step} ".encode() * 3000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(remote: Any, local: Path, mode: str, *, ranks: range = range(WORLD), **args: Any) -> list[zygote.Forked]:
    """The ranks ``ranks`` of one 2-rank job (torchrun's variables, and a rendezvous address for gloo), each forked
    from a server (tests/_zygote.py) that imported torch when they form a gloo group (``group``), else the store
    clients only: a rank without a group never imports torch."""
    port = _free_port()
    body = json.dumps({"remote": remote.url("ckpts"), "options": remote.storage_options, "local": str(local),
                       "mode": mode, **args})
    procs = []
    for rank in ranks:
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TORCHELASTIC_RUN_ID": f"launch-{port}", "TASKPOINT_GRACE_SECONDS": "10",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        procs.append(zygote.spawn(zygote.TORCH if args.get("group") else zygote.STORES, [str(WORKER), body], env,
                                  apart=True))
    return procs


def run(remote: Any, local: Path, mode: str, **args: Any) -> list[dict[str, Any]]:
    """Run the job to its end; each rank's last event (each must exit 0)."""
    results = []
    for rank, proc in enumerate(start(remote, local, mode, **args)):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank {rank} ended with {proc.returncode}:\n{err[-3000:]}"
        results.append(json.loads(out.splitlines()[-1]))
    return results


def remote_steps(remote: Any) -> list[int]:
    with CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, rank=0, world_size=WORLD,
                           preemption=False) as other:
        return other.steps()


def local_steps(local: Path, rank: int) -> list[int]:
    with CheckpointManager(local / f"rank-{rank}", preemption=False) as node:
        return node.steps()


def read_from(event: dict[str, Any], where: str) -> bool:
    """Whether the rank's restore read its step from ``where`` (the INFO record of the load names the copy)."""
    return any(level == "INFO" and text.startswith(f"loaded {where}/") for level, text in event["logs"])


def warnings_of(event: dict[str, Any]) -> list[str]:
    return [text for level, text in event["logs"] if level == "WARNING"]


def flip(local: Path, rank: int, step: int) -> None:
    """Flip one byte in the middle of ``rank``'s local shard of ``step``."""
    (payload,) = (local / f"rank-{rank}" / f"ckpt-{step}").glob("payload-*")
    body = bytearray(payload.read_bytes())
    body[len(body) // 2] ^= 0x40
    payload.write_bytes(bytes(body))


@pytest.fixture
def six(remote: Any, tmp_path: Path) -> Path:
    """Steps 1..6 saved by 2 ranks with remote_every=3 and local_keep=2; the job's local folders."""
    local = tmp_path / "local"
    saved = run(remote, local, "save", steps=list(range(1, 7)))
    # rank 0 returns once it committed the promoted steps; rank 1 once its shards were recorded
    assert saved[0]["remote"] == [3, 6] and [event["local"] for event in saved] == [[5, 6]] * WORLD
    return local


def test_steps_one_to_six_leave_three_and_six_remote_and_each_rank_its_newest_locally(remote, six):
    assert remote_steps(remote) == [3, 6]
    assert [local_steps(six, rank) for rank in range(WORLD)] == [[5, 6]] * WORLD
    with CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, rank=0, world_size=WORLD,
                           preemption=False) as other:
        assert other.verify().healthy  # every rank's promoted shard, under one manifest
        assert [shard["rank"] for shard in other.describe(6).details["shards"]] == [0, 1]
    for rank in range(WORLD):  # each rank's remote shard is its own state, as any multi-rank step
        with CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, rank=rank,
                               world_size=WORLD, preemption=False) as other:
            assert other.restore(3).read_bytes() == state(rank, 3)
    events = run(remote, six, "restore")  # no process group: the remote steps, read from the local copies
    assert [(event["step"], event["exact"], warnings_of(event)) for event in events] == [(6, True, [])] * WORLD
    for rank, event in enumerate(events):
        assert read_from(event, str(six / f"rank-{rank}")), event["logs"]


def test_a_rank_whose_local_dir_was_wiped_reads_the_newest_step_from_the_remote_tier(remote, six):
    for path in sorted((six / "rank-1").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    zero, one = run(remote, six, "restore", group=True)
    assert [(event["step"], event["exact"]) for event in (zero, one)] == [(6, True)] * WORLD
    assert read_from(zero, str(six / "rank-0")) and read_from(one, remote.url("ckpts")), one["logs"]
    assert warnings_of(zero) == warnings_of(one) == []


def test_a_flipped_byte_in_one_ranks_local_shard_falls_back_to_its_remote_copy_with_a_warning(remote, six):
    flip(six, 1, 6)
    zero, one = run(remote, six, "restore", group=True)
    assert [(event["step"], event["exact"]) for event in (zero, one)] == [(6, True)] * WORLD
    assert read_from(zero, str(six / "rank-0")) and warnings_of(zero) == []
    assert read_from(one, remote.url("ckpts")), one["logs"]
    (warning,) = warnings_of(one)
    assert str(six / "rank-1") in warning and "restoring its copy in" in warning, warning


def test_a_step_only_one_rank_committed_locally_is_never_restored(remote, six):
    run(remote, six, "save", steps=[7], ranks=range(1))  # not due: rank 0's local tier alone
    assert local_steps(six, 0) == [6, 7] and local_steps(six, 1) == [5, 6]
    for event in run(remote, six, "restore", group=True):
        assert (event["step"], event["exact"]) == (6, True)
    assert local_steps(six, 0) == [6]  # a resume through the group drops it on every rank: the job saves it again
    run(remote, six, "save", steps=[7], ranks=range(1))
    for event in run(remote, six, "restore"):  # without a group: the remote steps only
        assert (event["step"], event["exact"]) == (6, True)
    assert local_steps(six, 0) == [6, 7]
    run(remote, six, "save", steps=[7])  # both ranks, rank 0's copy replaced: a step of the local tiers alone
    assert [event["step"] for event in run(remote, six, "restore", group=True)] == [7, 7]
    assert [event["step"] for event in run(remote, six, "restore")] == [6, 6]  # without a group: remote steps only


def test_a_local_step_every_rank_holds_is_read_only_when_it_is_each_ranks_shard_of_the_remote_step(remote, six):
    """Every rank holds steps 7 and 8 locally, never promoted (not due); the job then moves to other nodes and
    commits its own steps 7 and 8 remotely. Back on the first nodes, a restore through the group reads step 8 from
    the remote tier on every rank (the local copies are not the committed step's shards: each is removed, with a
    WARNING), never the stale local shards, although every rank holds them."""
    run(remote, six, "save", steps=[7, 8])  # not due (remote_every=3): on the local tiers alone
    assert [local_steps(six, rank) for rank in range(WORLD)] == [[7, 8]] * WORLD
    elsewhere = six.parent / "elsewhere"
    run(remote, elsewhere, "save", steps=[7, 8], remote_every=1, tag="elsewhere")
    assert remote_steps(remote) == [3, 6, 7, 8]
    events = run(remote, six, "restore", group=True, tag="elsewhere")
    assert [(event["step"], event["exact"]) for event in events] == [(8, True)] * WORLD
    for rank, event in enumerate(events):
        assert read_from(event, remote.url("ckpts")), event["logs"]
        (warning,) = warnings_of(event)
        assert "not the committed step" in warning and str(six / f"rank-{rank}") in warning, warning
        assert 8 not in local_steps(six, rank)  # removed: it is not step 8


# -- SIGKILL of one rank -------------------------------------------------------------------------------------


def kill_trials(remote: Any, tmp_path: Path, trials: int, seed: int) -> list[int]:
    """Each trial: a 2-rank job trains (a gloo group, remote_every=2) until one rank is SIGKILLed at a random
    moment, then the other (the launcher's teardown). Then every step the remote tier lists restores on both
    ranks, and the relaunch resumes on both ranks from the newest step either tier holds for every rank.
    Returns the step each relaunch resumed from."""
    rng, local, resumed = random.Random(seed), tmp_path / "local", []
    for _ in range(trials):
        procs, helpers = start(remote, local, "train", group=True, remote_every=2, commit_timeout=10), set()
        try:
            assert procs[0].stdout is not None
            for line in procs[0].stdout:  # the first step after the restore
                event = json.loads(line)
                helpers.update(event.get("helpers", ()))
                if event["event"] == "step":
                    break
            time.sleep(rng.uniform(0.0, 2.0))
            os.kill(procs[rng.randrange(WORLD)].pid, signal.SIGKILL)
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                out, _ = proc.communicate(timeout=60)
                for line in out.splitlines():
                    with contextlib.suppress(ValueError):
                        helpers.update(json.loads(line).get("helpers", ()))
        for pid in helpers:  # an orphaned save process finishes its rank's part (within the grace), then exits
            assert process_gone(pid, 60), pid
        listed = remote_steps(remote)
        for rank in range(WORLD):
            with CheckpointManager(remote.url("ckpts"), storage_options=remote.storage_options, rank=rank,
                                   world_size=WORLD, preemption=False) as other:
                for step in listed:
                    assert other.restore(step).read_bytes() == state(rank, step), (rank, step)
        held = set.intersection(*(set(local_steps(local, rank)) for rank in range(WORLD)))
        expected = max(set(listed) | held, default=None)
        events = run(remote, local, "restore", group=True)
        assert [(event["step"], event["exact"] or expected is None) for event in events] == [(expected, True)] * 2
        resumed.append(expected or 0)
    return resumed


@pytest.mark.parametrize("remote", ["local"], indirect=True)
def test_sigkill_of_one_rank_at_random_moments_resumes_both_from_the_newest_common_step(remote, tmp_path):
    assert len(kill_trials(remote, tmp_path, KILL_TRIALS, seed=5)) == KILL_TRIALS


@pytest.mark.campaign(f"{CAMPAIGN_KILL_TRIALS} SIGKILLs of one rank of a 2-rank job with a local tier per store "
                      f"(make test: {KILL_TRIALS} on local disk)")
def test_sigkill_of_one_rank_campaign(remote, tmp_path):
    resumed = kill_trials(remote, tmp_path, CAMPAIGN_KILL_TRIALS, seed=55)
    print(f"local tier, 2 ranks, SIGKILL campaign on {remote.kind}: resumed from {resumed}")
    assert resumed[-1] > 0
