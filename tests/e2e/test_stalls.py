"""Promises against time: saves stopped (real SIGSTOP) past their grace while another process sweeps, sweeps
with another grace than the writer's, and ranks that reach the commit late.

Whatever the interleaving, a committed step restores; a save that a sweep took for dead fails with
SaveStalledError and commits nothing. Graces are a few seconds so that the store's own clock ages what the
stopped save stored; the tests wait for the stop itself by polling, never for a guess of how long a save takes.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import RankProcess, WorkerProcess, wait_until
from taskpoint import CheckpointManager, SaveStalledError
from taskpoint.manager.leases import MTIME_RESOLUTION
from taskpoint.storage import Location

WORKER = Path(__file__).parents[1] / "_stall_worker.py"
#: The grace of the stalled saves and of the sweeps that judge them (seconds).
GRACE = 2.0
LOCAL_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
#: The same and SeaweedFS, a real S3 server whose conditions and listings are a production store's.
LOCAL_S3_SEAWEED = pytest.mark.parametrize("store", ["local", "s3", "s3-seaweed"], indirect=True)


def content(seed: int, files: int, size: int) -> dict[str, bytes]:
    """What ``tests/_stall_worker.py`` saves for these arguments."""
    return {f"w{i}.bin": random.Random(seed * 1000 + i).randbytes(size) for i in range(files)}


def folder(path: Path, files: dict[str, bytes]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def restored(mgr: CheckpointManager, step: int) -> dict[str, bytes]:
    out = mgr.restore(step)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


class StoppedSaver(WorkerProcess):
    """``tests/_stall_worker.py`` in a real process, stopped by its own SIGSTOP at the moment asked for."""

    def __init__(self, store: Any, **args: Any) -> None:
        super().__init__(WORKER, {"directory": store.url("ckpts"), "options": store.storage_options, "grace": GRACE,
                                  **args})

    def wait_stopped(self) -> None:
        self.wait_for("stopping", stopped=True)


def aged_past(seconds: float) -> None:
    """Let what the stopped save stored grow older than ``seconds`` on the store's own clock, as a sweep judges
    it: S3 lists times in whole seconds, which count as up to MTIME_RESOLUTION early."""
    time.sleep(seconds + MTIME_RESOLUTION + 0.5)


@LOCAL_S3_SEAWEED
def test_a_deduplicated_save_stopped_past_the_grace_fails_and_the_sweep_that_took_it_for_dead_breaks_nothing(
        store: Any, tmp_path: Path) -> None:
    """Step 1 committed; the save of step 2 (new content, 6 chunks) is SIGSTOPped after storing some chunks for
    longer than the grace while another manager runs gc() with the same grace: the gc removes those chunks (the
    lease looks dead), and the save, resumed, fails with SaveStalledError instead of committing a step that
    names them. Step 1 restores, step 2 does not exist, and saving step 2 again works."""
    one = content(1, 2, 6 << 20)
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True,
                           grace_seconds=GRACE, preemption=False) as mgr:
        mgr.save(folder(tmp_path / "one", one), 1)
    saver = StoppedSaver(store, dedup=True, files=2, size=6 << 20, seed=2, step=2, at="chunk")
    try:
        saver.wait_stopped()
        aged_past(GRACE)
        with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True,
                               grace_seconds=GRACE, preemption=False) as other:
            removed = other.gc()
        assert any("/chunks/" in uri for uri in removed), removed  # the stopped save's chunks looked abandoned
        outcome = saver.resume()
    finally:
        saver.kill()
    assert outcome["event"] == "failed" and outcome["type"] == "SaveStalledError", outcome
    assert "stalled" in outcome["message"] and "grace_seconds" in outcome["message"]
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True,
                           grace_seconds=GRACE, preemption=False) as mgr:
        assert mgr.steps() == [1]
        assert restored(mgr, 1) == one
        two = content(2, 2, 6 << 20)
        mgr.save(folder(tmp_path / "two", two), 2)
        assert restored(mgr, 2) == two


@LOCAL_S3_SEAWEED
def test_a_sweep_with_a_shorter_grace_than_the_writers_never_takes_its_live_lease(store: Any, tmp_path: Path) -> None:
    """A deduplicated save with grace_seconds=60 is stopped mid-save; a gc with grace 1 (``taskpoint gc DIR
    --grace 1`` on local disk, the same call from the library on S3), run after its chunks are older than 1 s,
    honours the lease's own grace: it removes nothing, and the save, resumed, commits a step that restores."""
    saver = StoppedSaver(store, dedup=True, files=2, size=6 << 20, seed=3, step=1, at="chunk", grace=60)
    try:
        saver.wait_stopped()
        aged_past(1)
        if store.kind == "local":
            out = subprocess.run([sys.executable, "-m", "taskpoint", "gc", store.url("ckpts"), "--grace", "1"],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert "chunks/" not in out.stdout, out.stdout
        else:
            with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True,
                                   grace_seconds=1, preemption=False) as other:
                assert other.gc() == []
        outcome = saver.resume()
    finally:
        saver.kill()
    assert outcome["event"] == "committed", outcome
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True,
                           preemption=False) as mgr:
        assert restored(mgr, 1) == content(3, 2, 6 << 20)


@LOCAL_S3_SEAWEED
def test_a_plain_save_stopped_between_its_payload_and_its_manifest_fails_once_its_payload_was_swept(
        store: Any, tmp_path: Path) -> None:
    """A plain save is SIGSTOPped after its payload landed and before its manifest, for longer than the grace,
    while another manager runs gc(): the payload, in a folder no manifest commits, is swept as a leftover, and
    the save, resumed, finds it gone and fails with SaveStalledError instead of committing a step naming it."""
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, grace_seconds=GRACE,
                           preemption=False) as mgr:
        mgr.save(b"step one", 1)
    saver = StoppedSaver(store, dedup=False, files=2, size=1 << 20, seed=4, step=2, at="payload")
    try:
        saver.wait_stopped()
        aged_past(GRACE)
        with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, grace_seconds=GRACE,
                               preemption=False) as other:
            removed = other.gc()
        assert any("/ckpt-2/payload-" in uri for uri in removed), removed
        outcome = saver.resume()
    finally:
        saver.kill()
    assert outcome["event"] == "failed" and outcome["type"] == "SaveStalledError", outcome
    assert "is gone" in outcome["message"] and "outside taskpoint" not in outcome["message"]
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, grace_seconds=GRACE,
                           preemption=False) as mgr:
        assert mgr.steps() == [1]
        assert mgr.restore(1).read_bytes() == b"step one"


@pytest.mark.parametrize("store", ["local", "memory", "s3"], indirect=True)
def test_a_sweep_that_begins_removing_while_a_manifest_is_written_makes_the_save_take_its_commit_back(
        store: Any, tmp_path: Path) -> None:
    """The narrowest window: a save passed its check of the chunk epoch, and before its manifest lands a sweep
    that took its lease for dead (grace 0) removes its chunks. The save reads the epoch again after its commit,
    sees the sweep, finds chunks gone, removes its manifest and fails: no committed step names a missing chunk.
    The window is built in one process: the sweep runs inside the manifest write."""
    url, options = store.url("ckpts"), store.storage_options
    with CheckpointManager(url, storage_options=options, dedup=True, grace_seconds=0, preemption=False) as mgr, \
            CheckpointManager(url, storage_options=options, dedup=True, grace_seconds=0, preemption=False) as other:
        real = mgr._dedup.commit
        swept: list[str] = []

        def commit(tree: Any, write: Any, undo: Any) -> None:
            def late_write() -> None:
                swept.extend(other.gc())
                write()
            real(tree, late_write, undo)

        mgr._dedup.commit = commit  # type: ignore[method-assign]
        with pytest.raises(SaveStalledError, match="removed again"):
            mgr.save(folder(tmp_path / "a", content(5, 1, 1 << 20)), 1)
        assert any("/chunks/" in uri for uri in swept), swept
        assert mgr.steps() == [] and other.steps() == []
        mgr._dedup.commit = real  # type: ignore[method-assign]
        mgr.save(folder(tmp_path / "a", content(5, 1, 1 << 20)), 1)
        assert restored(other, 1) == content(5, 1, 1 << 20)


@pytest.mark.parametrize("store", ["local", "memory", "s3"], indirect=True)
def test_a_sweep_reads_the_manifests_again_after_its_epoch_so_a_save_committed_meanwhile_keeps_its_chunks(
        store: Any, tmp_path: Path) -> None:
    """A sweep has read the manifests and is about to remove the chunks of a deleted step when a save commits a
    step that names those very chunks (it saves the same content again). The sweep reads the manifests again
    after rewriting the epoch and keeps them: the new step restores. The moment is built in one process: the
    save runs right after the sweep's first reading of the manifests."""
    url, options = store.url("ckpts"), store.storage_options
    data = content(6, 1, 1 << 20)
    with CheckpointManager(url, storage_options=options, dedup=True, grace_seconds=0, preemption=False) as mgr, \
            CheckpointManager(url, storage_options=options, dedup=True, grace_seconds=0, preemption=False) as other:
        mgr.save(folder(tmp_path / "a", data), 1)
        mgr.delete(1, force=True)  # its chunks are unreferenced now
        real = other._dedup._referenced
        calls = [0]

        def referenced() -> Any:
            found = real()
            calls[0] += 1
            if calls[0] == 1:
                mgr.save(folder(tmp_path / "a", data), 2)  # names the chunks the sweep is about to remove
            return found

        other._dedup._referenced = referenced  # type: ignore[method-assign]
        assert other.gc() == []
        assert calls[0] == 2
        assert restored(mgr, 2) == data


@LOCAL_S3_SEAWEED
def test_a_plain_save_stopped_in_the_middle_of_its_payload_fails_once_a_gc_swept_what_it_was_writing(
        store: Any, tmp_path: Path) -> None:
    """A plain save is SIGSTOPped in the middle of writing its payload (40 MiB of 48 written: on local disk a temp
    file in the step's folder, on S3 a multipart upload) for longer than the grace, while another manager runs
    gc(): on local disk the temp file and the step's folder go (the folder holds nothing else), on S3 the upload
    is aborted. The save, resumed, fails with SaveStalledError saying what was removed under it, never with
    "the folder does not exist"; step 1 restores, and saving step 2 again works."""
    one = content(1, 1, 1 << 20)
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, grace_seconds=GRACE,
                           preemption=False) as mgr:
        mgr.save(folder(tmp_path / "one", one), 1)
    saver = StoppedSaver(store, dedup=False, files=2, size=24 << 20, seed=5, step=2, at="writing",
                         stop_after=40 << 20)
    try:
        saver.wait_stopped()
        aged_past(GRACE)
        with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, grace_seconds=GRACE,
                               preemption=False) as other:
            removed = other.gc()
        assert any("ckpt-2" in uri for uri in removed), removed  # what the stopped save was writing
        outcome = saver.resume()
    finally:
        saver.kill()
    assert outcome["event"] == "failed" and outcome["type"] == "SaveStalledError", outcome
    what = r"temp file \S*ckpt-2/\.payload\S*\.tmp" if store.kind == "local" else r"multipart upload \S+"
    assert re.search(what + " was removed while it was being written", outcome["message"]), outcome
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, grace_seconds=GRACE,
                           preemption=False) as mgr:
        assert mgr.steps() == [1]
        assert restored(mgr, 1) == one
        two = content(6, 1, 1 << 20)
        mgr.save(folder(tmp_path / "two", two), 2)
        assert restored(mgr, 2) == two


def test_an_interrupted_local_write_whose_temp_file_was_swept_says_so(tmp_path: Path) -> None:
    """On local disk, a write stopped long enough for a sweep to remove its temp file fails with
    SaveStalledError naming the temp file, not with "the folder does not exist"."""
    target = Location(str(tmp_path / "ckpt-1" / "payload-x"))
    with pytest.raises(SaveStalledError, match=r"temp file .* was removed while it was being written"), \
            target.open_write() as f:
        f.write(b"partial")
        for leftover in (tmp_path / "ckpt-1").glob(".payload-x.*.tmp"):
            leftover.unlink()  # what the sweep of a stalled writer's temp file does
    assert not (tmp_path / "ckpt-1" / "payload-x").exists()


# -- ranks that reach the commit late ------------------------------------------------------------------------


def rank_manager(store: Any, rank: int, **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("grace_seconds", 30)
    kwargs.setdefault("commit_timeout", 25)
    return CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, rank=rank, world_size=3,
                             preemption=False, **kwargs)


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@LOCAL_S3
def test_rank_zero_gathering_the_shards_keeps_them_from_a_sweep_with_a_shorter_grace(store: Any) -> None:
    """Rank 1 stored its shard, rank 0 is waiting for rank 2; a gc with grace 1 runs once rank 1's shard is older
    than that. Rank 0's lease on the folder (renewed, recording its grace of 30 s) keeps every shard; rank 2 then
    saves, rank 0 commits, and each rank restores its shard."""
    managers = [rank_manager(store, rank) for rank in range(3)]
    try:
        managers[1].save(b"shard of rank 1", 1)
        zero, outcome = in_thread(lambda: managers[0].save(b"shard of rank 0", 1))
        root = Location(store.url("ckpts"), store.storage_options)
        assert wait_until(lambda: any("/commit-" in p for p in root.list_tree("ckpt-")), 30)
        aged_past(1)
        with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, grace_seconds=1,
                               preemption=False) as sweeper:
            assert [uri for uri in sweeper.gc() if "/ckpt-1/" in uri] == []
        managers[2].save(b"shard of rank 2", 1)
        zero.join(60)
        assert not isinstance(outcome[0], BaseException), outcome
        for rank, mgr in enumerate(managers):
            assert mgr.restore(1).read_bytes() == f"shard of rank {rank}".encode()
    finally:
        for mgr in managers:
            mgr.close()


@LOCAL_S3_SEAWEED
def test_rank_zero_stopped_while_it_gathers_fails_the_commit_once_the_shards_were_swept(store: Any) -> None:
    """Rank 0 (a real process) has read rank 1's record and waits for rank 2 when it is SIGSTOPped for longer
    than the grace; a gc takes the folder for abandoned (rank 0's lease is stale) and removes the shards. Rank 2
    saves, rank 0 resumes and has every record, checks the shards before writing the manifest, and raises
    SaveStalledError naming the shard that is gone (not "deleted outside taskpoint"); step 1 never appears,
    and step 2 saved by all three commits and restores. On a loaded machine the stop can land before rank 0's
    first listing read rank 1's record, which the gc then removes too: rank 0 then never holds every record
    and abandons the step (StepAbandonedError naming rank 1), the other way of committing nothing."""
    grace = {"grace_seconds": GRACE, "commit_timeout": GRACE - 0.1}
    ones = [rank_manager(store, rank, **grace) for rank in (1, 2)]
    zero = None
    try:
        ones[0].save(b"shard of rank 1", 1)
        zero = RankProcess("steps", {"directory": store.url("ckpts"), "options": store.storage_options,
                                     "grace": GRACE, "commit_timeout": GRACE - 0.1, "steps": [[1, 100, True]]}, 0, 3)
        root = Location(store.url("ckpts"), store.storage_options)
        # Rank 0's lease and its own shard are stored: it is gathering, and lists the folder every 0.05 s.
        assert wait_until(lambda: sum("/payload-" in p for p in root.list_tree("ckpt-")) == 2, 30)
        time.sleep(0.5)
        os.kill(zero.process.pid, signal.SIGSTOP)
        aged_past(GRACE)
        with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, grace_seconds=GRACE,
                               preemption=False) as sweeper:
            assert sum("/ckpt-1/payload-" in uri for uri in sweeper.gc()) == 2
        ones[1].save(b"shard of rank 2", 1)
        os.kill(zero.process.pid, signal.SIGCONT)
        error = zero.wait_for("error", step=1)
        assert error["type"] in ("SaveStalledError", "StepAbandonedError"), error
        # Abandoned: rank 0 gave up (its commit_timeout passed while it was stopped) missing a record: rank 1's (swept
        # before a listing showed it), rank 2's (stored meanwhile, not yet listed; rank 0 had read rank 1's before
        # the stop: seen once on a loaded machine), or both. Either way it names a real rank and commits nothing.
        assert re.search(r"is gone" if error["type"] == "SaveStalledError" else r"ranks \[(1|2|1, 2)\] of 3",
                         error["message"]), error
        assert "outside taskpoint" not in error["message"]
        assert zero.finish(60) == 3
        ones.insert(0, rank_manager(store, 0, **grace))
        threads = [in_thread(lambda mgr=mgr, rank=rank: mgr.save(f"{rank}".encode(), 2))
                   for rank, mgr in enumerate(ones)]
        for thread, result in threads:
            thread.join(60)
            assert not isinstance(result[0], BaseException), result
        assert ones[0].steps() == [2]
        assert [mgr.restore(2).read_bytes() for mgr in ones] == [b"0", b"1", b"2"]
    finally:
        if zero is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(zero.process.pid, signal.SIGCONT)
            zero.kill()
        for mgr in ones:
            mgr.close()


# -- the campaign: random stalls against random sweeps ---------------------------------------------------------

STALL_TRIALS = 20


@pytest.mark.campaign(f"{STALL_TRIALS} stalled saves per store, random stall lengths and sweeps")
@LOCAL_S3_SEAWEED
def test_stalled_saves_against_sweeps_never_commit_a_step_that_does_not_restore(store: Any, tmp_path: Path) -> None:
    """Each trial: a plain or deduplicated save is stopped (SIGSTOP) at one of its moments for 0.3x to 2x the
    grace, while another process's gc runs with the writer's grace or a shorter one. The save either commits a
    step that restores exactly, or fails with SaveStalledError; every committed step restores."""
    rng = random.Random(2112)
    outcomes = {"committed": 0, "SaveStalledError": 0}
    expected: dict[int, dict[str, bytes]] = {}
    for trial in range(1, STALL_TRIALS + 1):
        dedup = rng.random() < 0.5
        files, size = 2, (3 << 20) if dedup else (256 << 10)
        saver = StoppedSaver(store, dedup=dedup, files=files, size=size, seed=trial, step=trial,
                             at="chunk" if dedup else "payload")
        try:
            saver.wait_stopped()
            time.sleep(rng.uniform(0.3, 2.0) * GRACE)
            with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True,
                                   grace_seconds=rng.choice([GRACE, 1.0]), preemption=False) as other:
                other.gc()
            outcome = saver.resume()
        finally:
            saver.kill()
        kind = outcome["event"] if outcome["event"] == "committed" else outcome["type"]
        assert kind in outcomes, outcome
        outcomes[kind] += 1
        if kind == "committed":
            expected[trial] = content(trial, files, size)
        with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, dedup=True,
                               grace_seconds=GRACE, preemption=False) as mgr:
            assert mgr.steps() == sorted(expected), (trial, outcome)
            for step, files_saved in expected.items():
                out = mgr.restore(step)
                got = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else None
                assert got == files_saved, (trial, step)
    print(f"stall campaign on {store.kind}: {outcomes}")
    assert outcomes["committed"] and outcomes["SaveStalledError"], outcomes
