"""taskpoint.group: the ranks' all-gather, broadcast and barrier, over storage records (ranks as
real processes, or as groups of one process where the test plays the others) and over a gloo process group
started by the real ``torchrun``; and a rank that dies: a clear error naming it, within the bound, never a hang.

Bounds are generous (the machine is shared, and each torchrun worker imports torch); nothing asserts how long
anything took. A rank that died is told from one that is late by its record's host and pid, so the tests that
need "gone" reap the dead process first (a zombie still answers ``kill(pid, 0)``, as under any launcher that
has not reaped it yet).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from taskpoint.group import RanksMissing, Record, StorageGroup, poll
from taskpoint.ranks import Ranks
from taskpoint.storage import Location

WORKER = Path(__file__).parents[1] / "_group_worker.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
WORLD = 3
#: The bound on one job of worker processes (seconds): torch imports on 2 busy cores included.
JOB_WITHIN = 240.0
#: A bound no collective of these tests reaches unless the code under test hangs (seconds).
LONG = 120.0


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TASKPOINT_RANK", "TASKPOINT_WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def _lines(out: str) -> dict[int, dict[str, Any]]:
    """Each rank's result line (the last one it printed), by rank."""
    docs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {doc["rank"]: doc for doc in docs}


def _storage_job(folder: Path, dies: int | None = None, timeout: float = LONG) -> dict[int, dict[str, Any]]:
    """WORLD worker processes agreeing through records in ``folder``; the rank ``dies`` is reaped once it ended."""
    args = json.dumps({"group": "storage", "folder": str(folder), "round": uuid.uuid4().hex, "timeout": timeout,
                       "dies": dies})
    procs = [subprocess.Popen([sys.executable, str(WORKER), args], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=_env(TASKPOINT_RANK=str(rank), TASKPOINT_WORLD_SIZE=str(WORLD)))
             for rank in range(WORLD)]
    results: dict[int, dict[str, Any]] = {}
    try:
        order = ([dies] if dies is not None else []) + [rank for rank in range(WORLD) if rank != dies]
        for rank in order:  # the rank that dies first: waited for, so reaped before the others look for it
            out, err = procs[rank].communicate(timeout=JOB_WITHIN)
            assert procs[rank].returncode == 0, err
            results.update(_lines(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    return results


def _expected(rank: int, torch: bool = False) -> dict[str, Any]:
    results = {"all_gather": [{"rank": k, "twice": 2 * k} for k in range(WORLD)],
               "broadcast": f"from rank {WORLD - 1}"}
    return {**results, "start_max": WORLD} if torch else results


def test_storage_collectives_among_processes(tmp_path: Path) -> None:
    results = _storage_job(tmp_path / "group")
    assert {rank: doc.get("results") for rank, doc in results.items()} == {r: _expected(r) for r in range(WORLD)}


def test_storage_a_rank_that_died_is_named_at_once(tmp_path: Path) -> None:
    """Rank 2 ends after the first collective: the others stop waiting for it in the second as soon as its process
    is gone (its record names this host and its pid), not at the bound of LONG seconds."""
    results = _storage_job(tmp_path / "group", dies=2)
    assert results[2]["event"] == "ending"
    for rank in (0, 1):
        doc = results[rank]
        assert doc["error"] == "RanksMissing" and doc["gone"] == [2] and doc["missing"] == [2], doc
        assert f"rank {rank} of {WORLD}: waiting for rank 2's second" in doc["message"], doc
        assert "ranks [2] missing (the processes of ranks [2] are gone)" in doc["message"], doc


def test_storage_a_silent_rank_is_named_at_the_bound(tmp_path: Path) -> None:
    group = StorageGroup(Location(str(tmp_path)), Ranks(0, 2), "this launch", timeout=0.5)
    with pytest.raises(RanksMissing) as caught:
        group.all_gather("hello", "first")
    assert caught.value.missing == [1] and caught.value.gone == []
    assert "rank 0 of 2: waiting for every rank's first" in str(caught.value)
    assert "ranks [1] missing (no answer within" in str(caught.value)


def test_storage_records_of_another_round_do_not_count(tmp_path: Path) -> None:
    folder = Location(str(tmp_path))
    StorageGroup(folder, Ranks(1, 2), "the launch before", LONG).publish("first", "old")
    rank0 = StorageGroup(folder, Ranks(0, 2), "this launch", timeout=0.5)
    with pytest.raises(RanksMissing):
        rank0.broadcast(None, "first", src=1)
    (tmp_path / "first-1.json").write_text("not json")  # damaged: as good as absent
    with pytest.raises(RanksMissing):
        rank0.broadcast(None, "first", src=1)
    StorageGroup(folder, Ranks(1, 2), "this launch", LONG).publish("first", "new")
    assert rank0.broadcast(None, "first", src=1) == "new"


def test_storage_record_format(tmp_path: Path) -> None:
    """One record format (docs/format.md): a JSON object with its format and version, the round, the rank, the world
    size, the host, the pid, the time and the value."""
    StorageGroup(Location(str(tmp_path)), Ranks(1, 3), "r", LONG).publish("vote", {"step": 4})
    doc = json.loads((tmp_path / "vote-1.json").read_bytes())
    assert set(doc) == {"format", "version", "round", "rank", "world_size", "host", "pid", "at", "value"}
    assert (doc["format"], doc["version"]) == ("taskpoint.group", 1)
    assert (doc["round"], doc["rank"], doc["world_size"], doc["pid"], doc["value"]) == ("r", 1, 3, os.getpid(),
                                                                                        {"step": 4})
    assert Record.from_bytes((tmp_path / "vote-1.json").read_bytes()) is not None
    assert Record.from_bytes(b'{"rank": 1}') is None and Record.from_bytes(None) is None


def test_poll_needs_an_answer_or_ends_at_its_bound() -> None:
    answers = iter([None, None, "yes"])
    assert poll("a test", lambda: next(answers), LONG) == "yes"
    with pytest.raises(RanksMissing) as caught:
        poll("a test", lambda: None, 0.2, missing=lambda: [3])
    assert caught.value.missing == [3] and "a test: ranks [3] missing" in str(caught.value)
    with pytest.raises(RanksMissing) as gone:
        poll("a test", lambda: None, LONG, missing=lambda: [1, 3], gone=lambda: {3})
    assert gone.value.gone == [3] and "the processes of ranks [3] are gone" in str(gone.value)


def _torch_job(dies: int | None = None) -> tuple[dict[int, dict[str, Any]], str]:
    args = json.dumps({"group": "torch", "timeout": LONG, "dies": dies})
    proc = subprocess.run([str(TORCHRUN), "--standalone", f"--nproc-per-node={WORLD}", str(WORKER), args],
                          text=True, capture_output=True, env=_env(), timeout=JOB_WITHIN)
    return _lines(proc.stdout), proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun beside python")
def test_torch_collectives_on_gloo_ranks() -> None:
    pytest.importorskip("torch")
    results, err = _torch_job()
    assert {rank: doc.get("results") for rank, doc in results.items()} == \
        {r: _expected(r, torch=True) for r in range(WORLD)}, err


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun beside python")
def test_torch_a_rank_that_died_is_a_clear_error() -> None:
    """Rank 2 ends after the first collective: the others' next one fails, naming this rank and what it waited for,
    (the process group failed, or its bound passed), and the job ends."""
    pytest.importorskip("torch")
    results, err = _torch_job(dies=2)
    assert results[2]["event"] == "ending", err
    for rank in (0, 1):
        doc = results[rank]
        assert doc["error"] in ("CheckpointError", "TimeoutError"), (doc, err)
        assert f"rank {rank} of {WORLD} gave up waiting for " in doc["message"], doc
        assert "in a test of the group" in doc["message"], doc
