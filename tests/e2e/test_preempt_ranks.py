"""Preemption of a 4-rank job: every rank stops at one agreed step, the emergency step commits whole, and a
relaunch resumes from it bit-identical; background saves of 4 ranks outlive their SIGKILLed trainers.

Real processes with torchrun's variables (as tests/e2e/test_torch_dcp.py starts them), real SIGTERMs and SIGKILLs,
local disk and the S3 server; with a gloo process group (the agreement through it) and without one (through
storage). Step times are skewed per rank by a schedule drawn from a fixed seed (one rank 3x slower); the
moment of the signal is drawn from it too. Nothing here depends on timing to pass: every wait polls.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import blake3
import pytest

import _zygote as zygote
import taskpoint
from helpers import ORPHAN_EXIT_SLACK, process_gone, slowdown

WORKER = Path(__file__).parents[1] / "_preempt_ranks_worker.py"
WORLD = 4
pytestmark = pytest.mark.slow  # several processes per trial: scheduled first
STORES = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: dict[str, Any], grace: float = 20.0) -> list[zygote.Forked]:
    """One job of 4 real processes with torchrun's variables (and a rendezvous address for gloo), each forked from a
    server (tests/_zygote.py) that imported torch when they form a gloo group (``group``), else the store clients
    only: a rank without a group never imports torch."""
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TASKPOINT_GRACE_SECONDS": str(grace), "PYTHONPATH": os.pathsep.join(sys.path)}
        procs.append(zygote.spawn(zygote.TORCH if args.get("group") else zygote.STORES, [str(WORKER), json.dumps(args)],
                                  env, apart=True))
    return procs


def read_until(proc: zygote.Forked, event: str) -> dict[str, Any]:
    """The first line of ``proc`` with this event (the lines before it are skipped)."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr is not None else ""
            raise AssertionError(f"the rank ended (status {proc.wait()}) before {event!r}:\n{err[-3000:]}")
        found = json.loads(line)
        if found["event"] == event:
            return found  # type: ignore[no-any-return]


def finish(procs: list[zygote.Forked]) -> list[tuple[int, list[dict[str, Any]], str]]:
    """Every rank's exit status, its remaining events, and its stderr."""
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        results.append((proc.returncode, [json.loads(line) for line in out.splitlines() if line.strip()], err))
    return results


def schedule(rng: random.Random) -> list[float]:
    """Each rank's step-time factor: one rank 3x slower, the others between 1x and 2x."""
    factors = [round(rng.uniform(1.0, 2.0), 2) for _ in range(WORLD)]
    factors[rng.randrange(WORLD)] = 3.0
    return factors


def preempt_trials(store: Any, trials: int, seed: int, *, group: bool, one_rank: bool) -> list[str]:
    """Run ``trials`` preemptions of one job in one directory, each resumed by the next; check each; return
    one line per trial saying where it stopped."""
    if group:
        pytest.importorskip("torch")
    rng = random.Random(seed)
    directory = f"{store.base}/job"
    seen: list[str] = []
    for trial in range(trials):
        factor = schedule(rng)
        args = {"mode": "train", "directory": directory, "options": store.storage_options, "group": group,
                "every": 7, "base": 0.01, "factor": factor}
        with taskpoint.CheckpointManager(directory, storage_options=store.storage_options, preemption=False) as mgr:
            before = mgr.latest_step()
        args["ready_at"] = (before or 0) + 3
        procs = start(args)
        resumed = [read_until(p, "resumed") for p in procs]
        assert {r["step"] for r in resumed} == {before}
        pids = [read_until(p, "ready")["pid"] for p in procs]
        time.sleep(rng.uniform(0.0, 0.6))  # a random moment of the run, drawn from the seed
        targets = [rng.randrange(WORLD)] if one_rank else list(range(WORLD))
        for rank in targets:
            os.kill(pids[rank], signal.SIGTERM)
        results = finish(procs)
        for rank, (status, _, err) in enumerate(results):
            assert status == 128 + signal.SIGTERM, f"rank {rank} exited {status}:\n{err[-3000:]}"
        stops = [next(e for e in events if e["event"] == "preempted") for _, events, _ in results]
        regular = [e["step"] for _, events, _ in results for e in events if e["event"] == "saved"]
        steps = {e["step"] for e in stops}
        assert len(steps) == 1 and None not in steps, f"the ranks stopped at different steps: {stops}"
        (emergency,) = steps
        assert all(e["at"] == emergency for e in stops), stops
        assert emergency >= max(regular, default=0)
        with taskpoint.CheckpointManager(directory, storage_options=store.storage_options, preemption=False) as mgr:
            assert mgr.latest_step() == emergency
            manifest = json.loads(mgr._steps.object(emergency, "taskpoint.json").read_small() or b"{}")
            assert [s["rank"] for s in manifest["content"]["shards"]] == list(range(WORLD))
        # The relaunch resumes every rank from its own shard of the emergency step, bit-identical.
        again = finish(start({"mode": "resume", "directory": directory, "options": store.storage_options}))
        for rank, (status, events, err) in enumerate(again):
            assert status == 0, err[-3000:]
            assert events[-1]["step"] == emergency and events[-1]["sha"] == stops[rank]["sha"], (events, stops)
        seen.append(f"trial {trial}: factors {factor}, signalled {targets}, stopped at step {emergency} "
                    f"(regular saves up to {max(regular, default=None)})")
    print("\n" + "\n".join(seen))
    return seen


def _cases(bounded: list[tuple[str, bool]], trials: int, what: str) -> Any:
    """The (store, group, trials) cases of a test: one trial of each ``bounded`` pair in make test (each agreement
    and each store at least once: the agreement through a process group does not depend on the store, the one
    through storage does), and ``trials`` of every pair in make reliability's campaign."""
    ids = {True: "process-group", False: "storage"}
    cases = [pytest.param(store, group, 1, id=f"1-{ids[group]}-{store}") for store, group in bounded]
    cases += [pytest.param(store, group, trials, id=f"{trials}-{ids[group]}-{store}",
                           marks=[pytest.mark.timeout(1200), pytest.mark.campaign(what)])
              for store in ("local", "s3") for group in (True, False)]
    return pytest.mark.parametrize(("store", "group", "trials"), cases, indirect=["store"])


@_cases([("local", True), ("s3", False)], 10, "10 SIGTERMs to all 4 ranks per store and agreement (make test: 1 of "
        "each agreement)")
def test_sigterm_to_all_ranks_commits_one_emergency_step_whole_and_the_relaunch_resumes_from_it(
        store: Any, group: bool, trials: int) -> None:
    preempt_trials(store, trials=trials, seed=28 if trials == 1 else 280, group=group, one_rank=False)


@_cases([("s3", True), ("local", False)], 5, "5 SIGTERMs to one rank of 4 per store and agreement (make test: 1 of "
        "each agreement)")
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(store: Any, group: bool, trials: int) -> None:
    preempt_trials(store, trials=trials, seed=29 if trials == 1 else 290, group=group, one_rank=True)


# -- background saves of 4 ranks whose trainers are SIGKILLed ---------------------------------------------------


#: The save processes' grace (``TASKPOINT_GRACE_SECONDS``) after their trainers die, on an idle machine: what
#: their last upload and the commit need, with room. Scaled by :func:`helpers.slowdown` at each trial (at load 20
#: on 2 cores 10 s was too little: both trials ended uncommitted).
KILLED_GRACE = 10.0


def sigkill_trials(store: Any, trials: int, seed: int) -> dict[str, int]:
    """Kill all 4 trainers right after their background ``save()`` of a step returned; the step is then
    committed whole (every shard verifies) or not listed."""
    rng = random.Random(seed)
    outcomes = {"committed whole": 0, "not listed": 0}
    for trial in range(trials):
        directory = f"{store.base}/killed-{trial}"
        kill_step = rng.randint(1, 3)
        args = {"mode": "handed", "directory": directory, "options": store.storage_options, "kill_step": kill_step,
                "copies": rng.randint(1, 64)}
        factor = slowdown()
        grace = KILLED_GRACE * factor
        print(f"trial {trial}: this machine runs {factor:.1f}x slower than idle now: a grace of {grace:.0f} s, and "
              f"up to {grace + ORPHAN_EXIT_SLACK:.0f} s for the save processes to end")
        procs = start(args, grace=grace)
        handed = [read_until(p, "handed") for p in procs]
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(30)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for event in handed:
            helper = event["helper"]
            assert helper is not None and process_gone(helper, grace + ORPHAN_EXIT_SLACK), "a save process outlived it"
        with taskpoint.CheckpointManager(directory, storage_options=store.storage_options, preemption=False,
                                         world_size=1) as reader:
            listed = reader.steps()
        assert listed in ([*range(1, kill_step)], [*range(1, kill_step + 1)]), listed
        if kill_step in listed:
            for rank in range(WORLD):
                with taskpoint.CheckpointManager(directory, storage_options=store.storage_options, preemption=False,
                                                 rank=rank, world_size=WORLD, commit_timeout=5, grace_seconds=60) as m:
                    data = m.restore(kill_step).read_bytes()  # verified against the manifest's sha256
                    assert hashlib.sha256(data).hexdigest() == handed[rank]["sha"]
            outcomes["committed whole"] += 1
        else:
            outcomes["not listed"] += 1
    print(f"\nSIGKILL of 4 trainers after their background save returned: {outcomes}")
    return outcomes


@STORES
def test_background_saves_of_killed_ranks_commit_the_step_whole_or_not_at_all(store: Any) -> None:
    outcomes = sigkill_trials(store, trials=2, seed=4)
    assert outcomes["committed whole"] >= 1  # the save processes finish it: before, never committed


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.campaign("10 SIGKILLs of 4 trainers per store (the test above: 2)")
@STORES
def test_background_saves_of_killed_ranks_many_trials(store: Any) -> None:
    outcomes = sigkill_trials(store, trials=10, seed=44)
    assert outcomes["committed whole"] >= 5


# -- in one process: what a missing rank does ------------------------------------------------------------------


def test_a_rank_that_never_answers_ends_the_others_without_an_emergency_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 of 2 had a notice; rank 0 never publishes its step: rank 1 waits commit_timeout, then ends with
    Preempted (status 143) and no step, saying so; nothing is committed past the newest regular step."""
    from taskpoint import preemption

    directory = tmp_path / "steps"
    rank1 = taskpoint.CheckpointManager(directory, rank=1, world_size=2, commit_timeout=0.5,
                                        on_preemption=lambda: b"never saved")
    try:
        preemption.notify(signal.SIGTERM)
        assert not rank1.should_save(5)  # rank 1 publishes step 5: every rank stops at 6 at the earliest
        assert (directory / "preemption-agreement" / "rank-1.json").exists()
        assert not rank1.reached_preemption(5)  # the same step again: still not the stop
        with caplog.at_level("WARNING", logger="taskpoint"), pytest.raises(taskpoint.Preempted) as raised:
            rank1.reached_preemption(6)
        assert raised.value.code == 143 and raised.value.step is None
        assert "ranks [0] did not answer" in caplog.text and "without an emergency step" in caplog.text
        # Rank 1's failed agreement removed nothing of rank 0's, and no step was committed.
        with taskpoint.CheckpointManager(directory, world_size=1, preemption=False) as reader:
            assert reader.steps() == []
    finally:
        rank1.close()
        preemption.clear()


def test_rank_zeros_save_process_never_commits_a_step_with_a_shard_missing(tmp_path: Path) -> None:
    """The commit a save process makes for a dead rank 0 needs every rank's record of the round: with rank 1's
    missing it gives up at its deadline and the step is never listed; with it, the step commits whole."""
    from taskpoint.format.records import ObjectRecord
    from taskpoint.manager.kinds.sharded import Shards
    from taskpoint.manager.shards import ShardOrphan, save_round
    from taskpoint.manager.steps import shard_record_name
    from taskpoint.ranks import Ranks

    directory = tmp_path / "steps"
    with taskpoint.CheckpointManager(directory, rank=1, world_size=2, preemption=False) as rank1:
        rank1.save(b"rank 1's shard", 3)  # its shard and its record, as a live rank 1 stores them
    own = b"rank 0's shard"
    save_id = uuid.uuid4().hex
    (directory / "ckpt-3" / f"payload-{save_id}").write_bytes(own)  # what rank 0's save process uploaded
    orphan = ShardOrphan(str(directory / "ckpt-3"), {}, None, 3, Ranks(0, 2), save_round(None), f"payload-{save_id}",
                         ObjectRecord(kind="bytes", codec="raw", save_id=save_id, created=time.time()), {"by": 0}, None,
                         Shards)
    record = directory / "ckpt-3" / shard_record_name(1)
    kept = record.read_bytes()
    record.unlink()  # rank 1 died before its record
    orphan.finish(len(own), blake3.blake3(own).hexdigest(), time.monotonic() + 0.3)
    with taskpoint.CheckpointManager(directory, world_size=1, preemption=False) as reader:
        assert reader.steps() == []  # never listed with a shard missing
    record.write_bytes(kept)
    orphan.finish(len(own), blake3.blake3(own).hexdigest(), time.monotonic() + 60)
    for rank, shard in ((0, own), (1, b"rank 1's shard")):
        with taskpoint.CheckpointManager(directory, rank=rank, world_size=2, preemption=False) as mgr:
            assert mgr.steps() == [3]
            assert mgr.restore(3).read_bytes() == shard  # verified against the manifest's BLAKE3
            assert mgr.metadata(3) == {"by": 0}


SILENT_RANK = """
import logging, os, signal, sys, time
import torch.distributed as dist
import taskpoint
from taskpoint import preemption
dist.init_process_group("gloo")
mgr = taskpoint.CheckpointManager(sys.argv[1], commit_timeout=5, on_preemption=lambda: b"never saved")
if mgr.rank == 0:
    time.sleep(float(sys.argv[2]))  # never reaches a safe point: the collective of rank 1 is not answered
    os._exit(0)
logging.basicConfig()
preemption.notify(signal.SIGTERM)
print("first", mgr.should_save(1), flush=True)
try:
    mgr.should_save(2)
except taskpoint.Preempted as exc:
    print("preempted", exc.code, exc.step, flush=True)
    raise
"""


def test_a_rank_that_never_joins_the_collective_ends_the_others_at_the_deadline(tmp_path: Path) -> None:
    """With a process group: rank 1 had a notice, rank 0 never reaches a safe point. Rank 1 waits for the
    vote until its notice's deadline (TASKPOINT_GRACE_SECONDS), then ends with 143 and no emergency step (its
    interpreter's exit then waits for the silent rank's process group: rank 0 ends after 10 s here)."""
    pytest.importorskip("torch")
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TASKPOINT_GRACE_SECONDS": "3",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        procs.append(subprocess.Popen([sys.executable, "-c", SILENT_RANK, str(tmp_path / "steps"), "10"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out, err = procs[1].communicate(timeout=120)
    procs[0].communicate(timeout=60)
    assert procs[1].returncode == 143, err[-3000:]
    assert "first False" in out and "preempted 143 None" in out
    assert "did not answer the preemption agreement" in err and "without an emergency step" in err
    with taskpoint.CheckpointManager(tmp_path / "steps", world_size=1, preemption=False) as reader:
        assert reader.steps() == []


# -- a rank > 0 waits for rank 0 to settle the emergency step; a rank that is gone is not waited for ----------


def test_a_rank_waits_for_rank_zeros_commit_and_tells_each_outcome(tmp_path: Path) -> None:
    """await_commit (what a rank > 0 does after storing its emergency shard, so that it never exits first and
    lets a launcher tear down the others): committed once rank 0's manifest names its shard; abandoned when
    rank 0 gave up (it removes the records); rank 0 gone; and the bound."""
    from taskpoint.manager.shards import await_commit

    directory = tmp_path / "steps"
    with taskpoint.CheckpointManager(directory, rank=1, world_size=2, preemption=False) as rank1:
        rank1.save(b"rank 1's shard", 3)

        def commit() -> None:
            with taskpoint.CheckpointManager(directory, rank=0, world_size=2, preemption=False) as rank0:
                rank0.save(b"rank 0's shard", 3)

        committer = threading.Thread(target=commit)
        committer.start()
        assert await_commit(rank1._steps, 1, 3, 120, set) == "committed"
        committer.join(60)
        rank1.save(b"rank 1's shard", 4)
        assert await_commit(rank1._steps, 1, 4, 120, lambda: {0}) == "rank 0 gone"
        assert await_commit(rank1._steps, 1, 4, 0.3, set) == "timed out"
    with taskpoint.CheckpointManager(directory, rank=1, world_size=3, preemption=False) as rank1:
        rank1.save(b"rank 1's shard", 5)  # rank 2 never stores one: rank 0 abandons the step
        rank0 = taskpoint.CheckpointManager(directory, rank=0, world_size=3, preemption=False, commit_timeout=0.5)
        with pytest.raises(taskpoint.StepAbandonedError):
            rank0.save(b"rank 0's shard", 5)
        assert await_commit(rank1._steps, 1, 5, 120, set) == "abandoned"
    with taskpoint.CheckpointManager(directory, world_size=1, preemption=False) as reader:
        assert reader.steps() == [3]


GONE_RANK = """
import os, signal, sys
import taskpoint
from taskpoint import preemption
mgr = taskpoint.CheckpointManager(sys.argv[1], rank=1, world_size=2, commit_timeout=60, on_preemption=lambda: b"x")
preemption.notify(signal.SIGTERM)
assert not mgr.should_save(5)  # publishes the step it reached, then the process is gone
os._exit(0)
"""


def test_rank_zero_abandons_the_emergency_step_at_once_when_a_rank_of_its_host_is_gone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 published the step it reached and its process ended: rank 0 (commit_timeout 300 s) agrees on the
    stop, saves its shard, and abandons the step because rank 1's process is gone, not at its timeout; it ends
    with 143 and no step, saying why."""
    from taskpoint import preemption

    directory = tmp_path / "steps"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    gone = subprocess.run([sys.executable, "-c", GONE_RANK, str(directory)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert gone.returncode == 0, gone.stderr
    rank0 = taskpoint.CheckpointManager(directory, rank=0, world_size=2, commit_timeout=300,
                                        on_preemption=lambda: b"rank 0's state")
    try:
        preemption.notify(signal.SIGTERM)
        assert not rank0.should_save(5)  # rank 0 publishes step 5 too: every rank stops at 6
        with caplog.at_level("WARNING", logger="taskpoint"), pytest.raises(taskpoint.Preempted) as raised:
            rank0.save(b"regular", 6)  # the safe point at the agreed stop: the emergency save of step 6
        assert raised.value.code == 143 and raised.value.step is None
        assert "the processes of ranks [1] are gone" in caplog.text, caplog.text
        with taskpoint.CheckpointManager(directory, world_size=1, preemption=False) as reader:
            assert reader.steps() == []
    finally:
        rank0.close()
        preemption.clear()
